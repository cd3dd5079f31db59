"""`titan-pipe schedule` against a real Prefect server on 127.0.0.1: a deployment on a work pool whose
run a real process worker starts and takes through all four stages to PASS, a served schedule that
fires, and the bad-input paths. Loopback only; every server, worker and runner is stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.flows import cache
from titan_pipe.flows.server import _wait_healthy as wait_healthy

from flow_helpers import small_flow

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny" / "flow.yaml"
TITAN = str(Path(sys.executable).with_name("titan-pipe"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process group we started: SIGINT (Prefect shuts down cleanly), then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("server")
    home = tempfile.mkdtemp(prefix="prefect-server-")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": home,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": "",
        "PREFECT_UI_ENABLED": "false",
        # the scheduler service creates the runs of a cron; every 5 s instead of 60 keeps the test short
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    }
    env.pop("PREFECT_API_URL")
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_healthy(url, proc, 150)  # the library's own wait (flows/server.py)
        yield url, home
    finally:
        _stop(proc)
        log.close()


def test_schedule_registers_a_cron_deployment_on_a_real_server(prefect_server, tmp_path):
    url, home = prefect_server
    env = {**os.environ, "PREFECT_HOME": home, "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(
        [TITAN, "schedule", str(TINY), "--cron", "0 2 * * *", "--name", "nightly-ci"],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        deployment = None
        deadline = time.monotonic() + 120
        with temporary_settings(updates={PREFECT_API_URL: url}):
            with get_client(sync_client=True) as client:
                while time.monotonic() < deadline and deployment is None:
                    assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                    try:
                        deployment = client.read_deployment_by_name("train-to-deploy/nightly-ci")
                    except Exception:  # noqa: BLE001 - not registered yet
                        time.sleep(1)
        assert deployment is not None, (tmp_path / "serve.log").read_text()[-3000:]
        crons = [s.schedule.cron for s in deployment.schedules]
        assert crons == ["0 2 * * *"]
        assert deployment.schedules[0].active
        assert deployment.parameters["flow_path"] == str(TINY.resolve())
        assert deployment.parameters["workdir"] == str(tmp_path)
        assert deployment.entrypoint == "titan_pipe.flows.train_to_deploy.train_to_deploy"
        assert "titan-pipe" in deployment.tags
    finally:
        _stop(serve)
        log.close()


def test_schedule_rejects_bad_cron_and_bad_config_before_serving(tmp_path):
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "every night"])
    assert r.exit_code == 2 and "--cron 'every night' is not a cron expression" in r.output
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "0 2 * * *", "--timezone", "Mars/Olympus"])
    assert r.exit_code == 2 and "is not an IANA time zone" in r.output
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "0 2 30 2 *"])  # February 30th
    assert r.exit_code == 2 and "never fires" in r.output
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "0 2 * * *", "--pool", "a b/../c"])
    assert r.exit_code == 2 and "is not a work pool name" in r.output
    bad = tmp_path / "flow.yaml"
    bad.write_text("name: x\ntrain: {steps: 0}\n")
    r = CliRunner().invoke(app, ["schedule", str(bad), "--cron", "0 2 * * *"])
    assert r.exit_code == 2 and "train.steps" in r.output


def _client_env(url: str, home: str) -> dict:
    return {
        **os.environ,
        "PREFECT_HOME": home,
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    }


def _wait_for_run(
    url: str, deployment_name: str, logs: list[Path], procs: list[subprocess.Popen], timeout: float, trigger: bool
):
    """The deployment's first flow run once it is final (triggered here through the API when
    ``trigger``, else the schedule's own); fails with the logs' tails when a process dies or time runs out."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file())

    deadline = time.monotonic() + timeout
    with temporary_settings(updates={PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        deployment = None
        while deployment is None:
            assert time.monotonic() < deadline, "deployment never registered\n" + tails()
            try:
                deployment = client.read_deployment_by_name(deployment_name)
            except Exception:  # noqa: BLE001 - not registered yet
                time.sleep(1)
        if trigger:
            client.create_flow_run_from_deployment(deployment.id)
        while True:
            for p in procs:
                assert p.poll() is None, f"{p.args} exited with {p.returncode}\n" + tails()
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
            )
            final = [r for r in runs if r.state is not None and r.state.is_final()]
            if final:
                return deployment, final[0], tails()
            assert time.monotonic() < deadline, f"no run of {deployment_name} ended in {timeout} s\n" + tails()
            time.sleep(2)


@pytest.fixture(scope="module")
def pool_run(prefect_server, tmp_path_factory):
    """`schedule --pool` registers the deployment; a real process worker polls the pool and runs the
    whole flow of a run triggered through the API (what `prefect deployment run` and the UI do)."""
    url, home = prefect_server
    tmp = tmp_path_factory.mktemp("pool")
    flow = small_flow(tmp, "pooled")
    env = _client_env(url, home)
    r = subprocess.run(
        [TITAN, "schedule", str(flow), "--cron", "0 2 * * *", "--name", "nightly-pool", "--pool", "ci-pool"],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "work pool ci-pool" in r.stderr and "prefect worker start --pool ci-pool" in r.stderr
    log_path = tmp / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("prefect")),
                "worker",
                "start",
                "--pool",
                "ci-pool",
                "--type",
                "process",
            ],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deployment, run, tails = _wait_for_run(
                url, "train-to-deploy/nightly-pool", [log_path], [worker], timeout=600, trigger=True
            )
        finally:
            _stop(worker)
    return flow, tmp / "runs" / "pooled", deployment, run, tails


@pytest.mark.distributed
def test_a_worker_runs_the_pool_deployment_through_every_stage_to_pass(pool_run):
    flow, run_dir, deployment, run, tails = pool_run
    assert deployment.work_pool_name == "ci-pool"
    assert [s.schedule.cron for s in deployment.schedules] == ["0 2 * * *"]
    assert deployment.parameters == {"flow_path": str(flow.resolve()), "workdir": str(flow.parent)}
    assert run.state.is_completed(), f"{run.state.type}: {run.state.message}\n{tails}"
    records = {s: cache.read_record(run_dir, s) for s in cache.STAGES}
    assert all(records.values()), {s: bool(r) for s, r in records.items()}
    assert records["evaluate"].result["passed"] is True
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["passed"] is True


@pytest.mark.distributed
def test_a_served_schedule_fires_and_its_run_completes(pool_run, prefect_server, tmp_path):
    """`schedule` without --pool serves the deployment; its every-minute cron fires within a minute
    and the run (the same flow.yaml as the pool's: every stage cached) completes."""
    url, home = prefect_server
    flow, run_dir = pool_run[0], pool_run[1]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(
            [TITAN, "schedule", str(flow), "--cron", "* * * * *", "--name", "every-minute"],
            env=_client_env(url, home),
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _, run, tails = _wait_for_run(
                url, "train-to-deploy/every-minute", [log_path], [serve], timeout=240, trigger=False
            )
            t0 = time.monotonic()
            os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C in the terminal that serves it
            serve.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            _stop(serve)
    assert run.state.is_completed(), f"{run.state.type}: {run.state.message}\n{tails}"
    out = log_path.read_text(errors="replace")
    assert serve.returncode == 130 and took < 15, (serve.returncode, took, out[-2000:])
    errors = [ln for ln in out.splitlines() if ln.startswith("error ")]
    assert errors == ["error interrupted by SIGINT; the schedule is paused; `titan-pipe schedule` again resumes it"], (
        out[-2000:]
    )
    assert "Traceback" not in out
    assert run.expected_start_time.second == 0  # the cron's minute, not an API-triggered run
    assert cache.read_record(run_dir, "evaluate").result["passed"] is True


def test_schedule_without_a_server_says_how_to_start_one(tmp_path, monkeypatch):
    # no API configured anywhere (a session's test harness may have set one in Prefect's settings)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setattr("titan_pipe.flows.prefect_api.configured_api_url", lambda: None)
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "0 2 * * *"])
    assert r.exit_code == 1, r.output
    assert "a schedule needs a Prefect server" in r.output and "prefect server start" in r.output
    assert "Traceback" not in r.output


def test_every_flow_takes_json_parameters_prefect_validates():
    """What a worker does before each deployment run: validate the JSON parameters against the flow's
    signature (a pydantic object in it made every scheduled run fail)."""
    from titan_pipe.flows.train_to_deploy import STAGE_FLOWS, train_to_deploy

    params = {"flow_path": "/x/flow.yaml", "workdir": "/x"}
    assert train_to_deploy.validate_parameters({**params, "only": "export", "force": True})["force"] is True
    for fl in STAGE_FLOWS.values():
        assert fl.validate_parameters(dict(params))["flow_path"] == "/x/flow.yaml"
