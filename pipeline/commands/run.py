"""`titan-pipe run` (the whole flow under Prefect, with a live per-stage summary) and `titan-pipe schedule`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from titan_pipe.io import faults
from titan_pipe.commands.common import handle_errors
from titan_pipe.processes.run_lock import run_lock

STAGE_HELP = "train | convert | export | evaluate"

# Prefect settings titan-pipe needs on a cluster (set only where the user has not): no usage
# telemetry (nodes are often offline: it logs an ERROR each run), and time for the temporary
# server's first start (database migrations; 20 s, Prefect's default, is too short on small hosts).
PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def prefect_env() -> None:
    for k, v in PREFECT_DEFAULTS.items():
        os.environ.setdefault(k, v)


class LiveSummary:
    """Prints one line per stage event as it happens and keeps them for the closing table."""

    STYLE = {"running": "cyan", "done": "green", "cached": "blue", "reused": "blue", "skipped": "dim", "failed": "red"}

    def __init__(self, console: Console, figures):
        """``figures(output)``: a finished stage's one line (titan_pipe.flows.stages.figures)."""
        self.console, self.figures = console, figures
        self.rows: dict[str, tuple[str, float, str]] = {}

    def __call__(self, ev) -> None:
        figures = ev.message if ev.status != "failed" else "the error is below"  # said once, last
        if ev.output is not None:
            figures = self.figures(ev.output) or figures
        self.rows[ev.stage] = (ev.status, ev.duration_s, figures)
        style = self.STYLE.get(ev.status, "white")
        took = f" in {ev.duration_s:.1f}s" if ev.duration_s else ""
        self.console.print(
            f"[bold]{ev.stage:>8}[/bold] [{style}]{ev.status}[/{style}]{took}" + (f" — {figures}" if figures else ""),
            highlight=False,
        )

    def table(self) -> Table:
        t = Table(title="titan-pipe run")
        for col in ("stage", "status", "time", "summary"):
            t.add_column(col)
        for stage, (status, took, figures) in self.rows.items():
            style = self.STYLE.get(status, "white")
            t.add_row(stage, f"[{style}]{status}[/{style}]", f"{took:.1f}s" if took else "-", figures)
        return t


def _serve_until_stopped(plan, flow_path: Path) -> None:
    """Serve until a signal: Prefect's runner stops on Ctrl-C or SIGTERM and returns; the command
    then exits 128+signal with one line (the schedule is paused), as every interrupted command does."""
    import logging
    import signal

    from titan_pipe.errors import Interrupted
    from titan_pipe.flows.schedule import serve_flow

    got: list[int] = []

    def stop(signum, _frame):
        got.append(signum)
        # the runner's tasks are cancelled on the way out; asyncio would log each as a traceback
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise Interrupted(signum, "the schedule is paused; `titan-pipe schedule` again resumes it")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        serve_flow(plan, flow_path=flow_path)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    raise Interrupted(
        got[0] if got else signal.SIGINT, "the schedule is paused; `titan-pipe schedule` again resumes it"
    )


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def run(
        flow: Path = typer.Argument(..., help="flow.yaml of the run"),
        from_stage: Optional[str] = typer.Option(None, "--from", help=f"re-run from this stage on ({STAGE_HELP})"),
        only: Optional[str] = typer.Option(None, "--only", help=f"run this one stage ({STAGE_HELP})"),
        force: bool = typer.Option(False, "--force", help="run every stage even if its inputs are unchanged"),
    ):
        """Run train -> convert -> export -> evaluate as a Prefect flow; unchanged stages are not re-run."""
        from titan_pipe.config import load_flow
        from titan_pipe.errors import UserError
        from titan_pipe.flows import cache

        cfg = load_flow(flow)  # bad config: exit 2, before any run dir or Prefect run exists
        try:
            actions = cache.plan_actions(from_stage=from_stage, only=only, force=force)
        except UserError as e:
            raise typer.BadParameter(str(e)) from None
        cache.check_reusable(actions, cfg.run_dir().resolve())
        if actions["train"] != cache.REUSE and actions["train"] != cache.SKIP:
            from titan_pipe.training.preflight import check_before_launch

            check_before_launch(cfg, flow_path=flow)  # before Prefect starts: what training would meet

        prefect_env()
        from titan_pipe.flows.prefect_api import check_api_reachable
        from titan_pipe.flows.server import temporary_server
        from titan_pipe.flows.logs import console_without_repeats
        from titan_pipe.flows.stages import figures
        from titan_pipe.flows.train_to_deploy import listening, train_to_deploy

        check_api_reachable()  # one line with the fix, before any stage or Prefect run starts

        console = Console(stderr=True)
        live = LiveSummary(console, figures)
        failed: BaseException | None = None
        result: dict = {}
        # held here, before Prefect starts, so a second writer fails at once (run_pipeline re-enters it)
        with (
            faults.writing(cfg.run_dir(), what="the run dir"),
            run_lock(cfg.run_dir().resolve(), what=f"titan-pipe run {flow}"),
            listening(live),
            temporary_server(),
            console_without_repeats(),
        ):
            try:
                result = train_to_deploy(flow_path=str(flow.resolve()), from_stage=from_stage, only=only, force=force)
            except BaseException as e:  # noqa: BLE001 - shown after the table; handle_errors maps it
                failed = e
        console.print(live.table())
        passed = result.get("passed")
        if failed is None:
            verdict = "PASS" if passed else "not evaluated (stage not selected)" if passed is None else "FAIL"
            console.print(f"verdict: [bold]{verdict}[/bold] — run dir {result.get('run_dir')}", highlight=False)
            return
        if isinstance(failed, (UserError, KeyboardInterrupt, typer.Exit)):
            raise failed
        fault = faults.as_fault(failed, path=cfg.run_dir(), what="the run dir")
        if fault is not None:
            raise fault from None
        hint = ""
        if "ephemeral Prefect API server" in str(failed):
            hint = (
                "; start a server (`prefect server start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api) "
                "or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
            )
        console.print(
            f"[red]error[/red] {escape(f'{type(failed).__name__}: {failed}{hint}')}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(1)

    @app.command()
    @handle_errors
    def schedule(
        flow: Path = typer.Argument(..., help="flow.yaml to run on the schedule"),
        cron: str = typer.Option(..., "--cron", help='cron expression, e.g. "0 2 * * *" (02:00 daily)'),
        name: Optional[str] = typer.Option(None, "--name", help="deployment name (default: the flow's name)"),
        timezone: Optional[str] = typer.Option(None, "--timezone", help="IANA zone of the cron, e.g. Asia/Shanghai"),
        stage: Optional[str] = typer.Option(None, "--stage", help=f"deploy one stage's flow alone ({STAGE_HELP})"),
        pool: Optional[str] = typer.Option(
            None,
            "--pool",
            help="register on this Prefect work pool (created as "
            "a process pool if missing) and return; a worker polling it "
            "(`prefect worker start --pool NAME`) runs each scheduled run. "
            "Without it the schedule is served from this command until stopped",
        ),
    ):
        """A Prefect deployment of the flow on a cron schedule (in the Prefect UI), on a work pool or served here."""
        from titan_pipe.config import load_flow
        from titan_pipe.errors import UserError
        from titan_pipe.flows.schedule import deploy_to_pool, plan_deployment

        cfg = load_flow(flow)
        prefect_env()
        try:  # a bad option: one line and exit 2 (as bad options exit), before any server is asked
            plan = plan_deployment(
                flow_path=flow.resolve(), cfg=cfg, cron=cron, name=name, timezone=timezone, stage=stage, pool=pool
            )
        except UserError as e:
            e.exit_code = 2
            raise
        console = Console(stderr=True)
        if pool is None:
            _serve_until_stopped(plan, flow.resolve())
        deployment_id = deploy_to_pool(plan, flow_path=flow.resolve())
        console.print(
            f"deployment [bold]{plan.flow_name}/{plan.name}[/bold] ({deployment_id}) on work pool "
            f"[bold]{pool}[/bold], cron '{plan.cron}'" + (f" {plan.timezone}" if plan.timezone else ""),
            highlight=False,
        )
        console.print(
            f"runs start when a worker polls the pool: prefect worker start --pool {pool}   "
            f"(now: prefect deployment run '{plan.flow_name}/{plan.name}')",
            highlight=False,
            soft_wrap=True,
        )
