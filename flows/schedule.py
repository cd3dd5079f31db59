"""`titan-pipe schedule`: a flow as a Prefect deployment on a cron schedule (planned as data, then
registered on a work pool or served from this process).

A schedule needs a Prefect server that outlives the command: the server's scheduler creates the
runs, and a worker polling the pool (``--pool``) or the runner of ``serve`` starts them. Prefect's
temporary server stops with the command, so without ``PREFECT_API_URL`` nothing is registered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError


@dataclass(frozen=True)
class DeploymentPlan:
    flow_name: str  # the Prefect flow served: train-to-deploy or titan-pipe-<stage>
    name: str  # deployment name
    cron: str
    timezone: str | None
    parameters: dict
    tags: tuple[str, ...]
    pool: str | None = None  # a work pool: a worker polling it runs each scheduled run; None: served here


POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NO_SERVER = (
    "a schedule needs a Prefect server that keeps running (the temporary one stops with this command, "
    "and its runs with it): start one with `prefect server start` (UI at http://127.0.0.1:4200), then "
    "`export PREFECT_API_URL=http://127.0.0.1:4200/api` and schedule again"
)

CRON_ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def check_cron(cron: str) -> None:
    """Five fields (minute hour day-of-month month day-of-week) or an @alias. Prefect's parser
    also takes 6 and 7 fields (seconds, years), which would silently fire on another schedule
    than a crontab line of the same text."""
    fields = cron.split()
    if len(fields) != 5 and not (len(fields) == 1 and fields[0].lower() in CRON_ALIASES):
        raise UserError(
            f"--cron {limits.shown(cron)} is not a cron expression of five fields (it has "
            f"{len(fields)}); use five fields "
            "'minute hour day-of-month month day-of-week', e.g. '0 2 * * *' for 02:00 daily "
            f"(or one of {', '.join(CRON_ALIASES)})"
        )


def check_fires(cron: str, timezone: str | None) -> None:
    """Refuse a well-formed cron that names no real date ('0 2 30 2 *': February 30th): Prefect
    accepts it and its scheduler then fails to find a next run, each time, in the server's log."""
    import asyncio

    from prefect.server.schemas.schedules import CronSchedule as ServerCron

    try:
        dates = asyncio.run(ServerCron(cron=cron, timezone=timezone).get_dates(n=1))
    except Exception:  # noqa: BLE001 - croniter's "failed to find next date" and its kin
        dates = []
    if not dates:
        raise UserError(
            f"--cron {limits.shown(cron)} never fires (no date matches it, e.g. February 30th); "
            "check the day-of-month and month fields"
        )


def plan_deployment(
    *,
    flow_path: Path,
    cfg: FlowConfig,
    cron: str,
    name: str | None = None,
    timezone: str | None = None,
    stage: str | None = None,
    workdir: Path | None = None,
    pool: str | None = None,
) -> DeploymentPlan:
    """Check the cron and timezone and fix the deployment's parameters (absolute flow.yaml, work dir)."""
    if name is not None and not POOL_NAME.fullmatch(name):  # before Prefect is imported: a plain refusal
        raise UserError(
            f"--name {limits.shown(name)} is not a deployment name; use letters, digits, '-', '_' "
            "and '.' (1-100 characters, no '/'), e.g. nightly-llama"
        )
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    from titan_pipe.flows.cache import STAGES

    check_cron(cron)
    try:
        CronSchedule(cron=cron, timezone=timezone)  # Prefect's own validation of both
    except ValidationError as e:
        bad_zone = any("timezone" in str(err.get("loc", "")) for err in e.errors())
        if bad_zone:
            raise UserError(
                f"--timezone {limits.shown(timezone)} is not an IANA time zone; e.g. UTC or Asia/Shanghai"
            ) from None
        raise UserError(
            f"--cron {limits.shown(cron)} is not a cron expression; use five fields "
            "'minute hour day-of-month month day-of-week', e.g. '0 2 * * *' for 02:00 daily"
        ) from None
    check_fires(cron, timezone)
    if stage is not None and stage not in STAGES:
        raise UserError(f"--stage {limits.shown(stage)} is not a stage; use one of {', '.join(STAGES)}")
    if pool is not None and not POOL_NAME.fullmatch(pool):
        raise UserError(
            f"--pool {limits.shown(pool)} is not a work pool name; use letters, digits, '-', '_' "
            "and '.' (1-100 characters), e.g. ascend-node0"
        )
    flow_name = "train-to-deploy" if stage is None else f"titan-pipe-{stage}"
    return DeploymentPlan(
        flow_name=flow_name,
        name=name or (cfg.name if stage is None else f"{cfg.name}-{stage}"),
        cron=cron,
        timezone=timezone,
        parameters={"flow_path": str(flow_path), "workdir": str(workdir or Path.cwd())},
        tags=("titan-pipe", cfg.name) + ((stage,) if stage else ()),
        pool=pool,
    )


def require_server() -> str:
    """The configured API URL, reachable; UserError naming how to start one when none is set."""
    from titan_pipe.flows.prefect_api import check_api_reachable, configured_api_url

    url = configured_api_url()
    if not url:
        raise UserError(NO_SERVER)
    check_api_reachable(url)
    return url


def _deployment(plan: DeploymentPlan, flow_path: Path):
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.deployments.runner import EntrypointType

    from titan_pipe.flows.train_to_deploy import STAGE_FLOWS, train_to_deploy

    target = (
        train_to_deploy
        if plan.flow_name == "train-to-deploy"
        else STAGE_FLOWS[plan.flow_name.removeprefix("titan-pipe-")]
    )
    # A module entrypoint: whoever runs it (this process's runner, a worker on any host) imports the
    # flow from the installed package; nothing of this checkout is copied or pulled.
    return target.to_deployment(
        name=plan.name,
        schedule=CronSchedule(cron=plan.cron, timezone=plan.timezone),
        parameters=plan.parameters,
        tags=list(plan.tags),
        description=f"titan-pipe {plan.flow_name} of {flow_path} on '{plan.cron}'"
        + (f" ({plan.timezone})" if plan.timezone else ""),
        work_pool_name=plan.pool,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def ensure_pool(name: str) -> bool:
    """Create the work pool as a process pool when the server has none of that name; True if created.
    An existing pool (of any type: process, kubernetes, ...) is used as it is."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:  # created meanwhile by another scheduler
            return False
        return True


def deploy_to_pool(plan: DeploymentPlan, *, flow_path: Path) -> str:
    """Register the deployment on its work pool (created as a process pool if missing) and return its
    id; returns at once. Each scheduled run waits for a worker polling that pool."""
    assert plan.pool is not None
    require_server()
    ensure_pool(plan.pool)
    return str(_deployment(plan, flow_path).apply())


def serve_flow(plan: DeploymentPlan, *, flow_path: Path) -> None:
    """Register the deployment and serve it: a runner in this process starts each scheduled run
    (blocks until stopped; stopping pauses the schedule)."""
    require_server()
    from prefect import serve

    serve(_deployment(plan, flow_path), print_starting_message=True)
