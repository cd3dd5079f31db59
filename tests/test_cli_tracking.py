"""`--flow` on a stage command: the same library call, tracked as a Prefect flow run.

The commands run in real processes: Prefect's console log handlers bind to the stream they first
see, and CliRunner's captured streams are closed after each invocation, which would break every
later Prefect log line of the test session.
"""

import os
import subprocess
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from safetensors.torch import load_file

from convert_writers import model_args, native_state, write_hf


def _titan_pipe(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_pipe.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_convert_with_flow_is_tracked_and_gives_the_same_bytes(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    args = model_args()
    src = write_hf(native_state(args), args, tmp_path / "hf")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}  # the session's test server
    plain = _titan_pipe("convert", str(src), "-o", str(tmp_path / "plain"), env=env)
    assert plain.returncode == 0, plain.stderr
    tracked = _titan_pipe("convert", str(src), "-o", str(tmp_path / "tracked"), "--flow", env=env)
    assert tracked.returncode == 0, tracked.stderr
    a = load_file(tmp_path / "plain" / "model.safetensors")
    b = load_file(tmp_path / "tracked" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["titan-pipe-convert-cli"])))
    assert len(runs) == 1 and runs[0].state.is_completed()


def test_bad_input_under_flow_is_one_line_and_a_failed_run(tmp_path):
    # Its own temporary Prefect server: nothing else is needed from the session.
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    r = _titan_pipe("convert", str(tmp_path / "nope"), "-o", str(tmp_path / "x"), "--flow", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"error {tmp_path / 'nope'}: does not exist" in out
    assert "Finished in state Failed" in out and "Traceback" not in out
    assert not (tmp_path / "x").exists()


_FLOW_WITH_A_TASK = """
from prefect import flow, task, get_run_logger
from titan_pipe.flows.server import temporary_server

@task
def step():
    for i in range(50):
        get_run_logger().info("step line %d", i)

@flow
def tracked():
    step()

with temporary_server():
    tracked()
print("server stopped", flush=True)
"""


def test_a_temporary_server_gets_every_log_before_it_stops(tmp_path):
    """Without PREFECT_API_URL, --flow and `run` start Prefect's temporary server for the command; the
    run's queued log lines are sent before it stops, not at exit to a stopped server (which printed
    "Error logging to API" and retried for up to a minute after the run's summary)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_ENABLED": "true",
    }  # as users run it (the test session turns it off)
    env.pop("PREFECT_API_URL", None)
    p = subprocess.run([sys.executable, "-c", _FLOW_WITH_A_TASK], capture_output=True, text=True, env=env, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "server stopped" in out, out[-2000:]
    assert "Error logging to API" not in out, out[-2000:]
