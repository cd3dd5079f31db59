"""`titan-pipe schedule` against a real Prefect server on 127.0.0.1, and its bad-input paths."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from titan_pipe.cli import app

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


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/health did not answer in {timeout} s")


@pytest.fixture()
def prefect_server(tmp_path):
    home = tempfile.mkdtemp(prefix="prefect-server-")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": "", "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL")
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start",
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_health(url, proc, timeout=150)
        yield url, home
    finally:
        _stop(proc)
        log.close()


def test_schedule_registers_a_cron_deployment_on_a_real_server(prefect_server, tmp_path):
    url, home = prefect_server
    env = {**os.environ, "PREFECT_HOME": home, "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen([TITAN, "schedule", str(TINY), "--cron", "0 2 * * *", "--name", "nightly-ci"],
                             env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    assert r.exit_code == 1 and "--cron 'every night' is not a cron expression" in r.output
    r = CliRunner().invoke(app, ["schedule", str(TINY), "--cron", "0 2 * * *", "--timezone", "Mars/Olympus"])
    assert r.exit_code == 1 and "is not an IANA time zone" in r.output
    bad = tmp_path / "flow.yaml"
    bad.write_text("name: x\ntrain: {steps: 0}\n")
    r = CliRunner().invoke(app, ["schedule", str(bad), "--cron", "0 2 * * *"])
    assert r.exit_code == 2 and "train.steps" in r.output
