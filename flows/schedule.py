"""`titan-pipe schedule`: serve a flow as a Prefect deployment on a cron schedule (planned as data, then served)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from titan_pipe import limits
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


CRON_ALIASES = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def check_cron(cron: str) -> None:
    """Five fields (minute hour day-of-month month day-of-week) or an @alias. Prefect's parser
    also takes 6 and 7 fields (seconds, years), which would silently fire on another schedule
    than a crontab line of the same text."""
    fields = cron.split()
    if len(fields) != 5 and not (len(fields) == 1 and fields[0].lower() in CRON_ALIASES):
        raise UserError(f"--cron {limits.shown(cron)} is not a cron expression of five fields (it has "
                        f"{len(fields)}); use five fields "
                        "'minute hour day-of-month month day-of-week', e.g. '0 2 * * *' for 02:00 daily "
                        f"(or one of {', '.join(CRON_ALIASES)})")


def plan_deployment(*, flow_path: Path, cfg: FlowConfig, cron: str, name: str | None = None,
                    timezone: str | None = None, stage: str | None = None,
                    workdir: Path | None = None) -> DeploymentPlan:
    """Check the cron and timezone and fix the deployment's parameters (absolute flow.yaml, work dir)."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    from titan_pipe.flows.cache import STAGES

    check_cron(cron)
    try:
        CronSchedule(cron=cron, timezone=timezone)  # Prefect's own validation of both
    except ValidationError as e:
        bad_zone = any("timezone" in str(err.get("loc", "")) for err in e.errors())
        if bad_zone:
            raise UserError(f"--timezone {limits.shown(timezone)} is not an IANA time zone; e.g. UTC or Asia/Shanghai") from None
        raise UserError(f"--cron {limits.shown(cron)} is not a cron expression; use five fields "
                        "'minute hour day-of-month month day-of-week', e.g. '0 2 * * *' for 02:00 daily") from None
    if stage is not None and stage not in STAGES:
        raise UserError(f"--stage {stage!r} is not a stage; use one of {', '.join(STAGES)}")
    flow_name = "train-to-deploy" if stage is None else f"titan-pipe-{stage}"
    return DeploymentPlan(flow_name=flow_name, name=name or (cfg.name if stage is None else f"{cfg.name}-{stage}"),
                          cron=cron, timezone=timezone,
                          parameters={"flow_path": str(flow_path), "workdir": str(workdir or Path.cwd())},
                          tags=("titan-pipe", cfg.name) + ((stage,) if stage else ()))


def serve_flow(*, flow_path: Path, cfg: FlowConfig, cron: str, name: str | None = None,
               timezone: str | None = None, stage: str | None = None) -> None:
    """Create the deployment and serve it: a runner in this process starts each scheduled run (blocks)."""
    plan = plan_deployment(flow_path=flow_path, cfg=cfg, cron=cron, name=name, timezone=timezone, stage=stage)
    from titan_pipe.flows.prefect_api import check_api_reachable

    check_api_reachable()
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.deployments.runner import EntrypointType

    from titan_pipe.flows.train_to_deploy import STAGE_FLOWS, train_to_deploy

    target = train_to_deploy if stage is None else STAGE_FLOWS[stage]
    if not os.environ.get("PREFECT_API_URL"):
        from rich.console import Console

        Console(stderr=True).print("[yellow]note[/yellow] PREFECT_API_URL is not set: the deployment lives on a "
                                   "temporary server that stops with this command; start `prefect server start` "
                                   "and export PREFECT_API_URL=http://127.0.0.1:4200/api to see it in the UI")
    # A module entrypoint: the runner re-imports the flow from the installed package, wherever it runs.
    target.serve(name=plan.name, schedule=CronSchedule(cron=plan.cron, timezone=plan.timezone),
                 parameters=plan.parameters, tags=list(plan.tags),
                 description=f"titan-pipe {plan.flow_name} of {flow_path} on '{plan.cron}'",
                 entrypoint_type=EntrypointType.MODULE_PATH)
