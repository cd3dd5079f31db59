"""Prefect's temporary API server, started here (not on Prefect's first call) so it dies with the
command and outlives the signals sent to it.

Without PREFECT_API_URL, Prefect starts a temporary server process on first use and stops it at
interpreter exit, which never comes after SIGKILL (the server was left running), and in the
command's process group, where Ctrl-C or a service stop killed it before the command's last reports
(1-3 minutes of retries, then a ConnectError). ``temporary_server`` starts Prefect's app in a process
of its own (flows/server_process.py) and points this command's Prefect settings at it for the block.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

from titan_pipe.processes import procs
from titan_pipe.errors import UserError


def _ephemeral() -> bool:
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def _drain_to_api(timeout: float = 30.0) -> None:
    """Send the logs and events Prefect still queues for the server while it is up: drained only at
    interpreter exit, they would meet a stopped server ("Error logging to API", then retries)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # a failed send is Prefect's to report; it must not mask the run's result
            worker.drain_all(timeout=timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"no answer from {url}/health in {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """Close its stdin (its stop), wait; kill what does not end in 10 s."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """A Prefect API server of this command's own for the block, when no API URL is set; else nothing.

    It runs in its own session and ignores SIGINT/SIGTERM/SIGHUP (flows/server_process.py), so
    Ctrl-C to the command's process group or SIGTERM to every process leaves it serving while the
    command sends its last reports; then the command stops it. Whatever ends this process, the
    server goes with it (end of file on its stdin, and a titan_pipe.processes.procs watch)."""
    if not _ephemeral():
        yield
        return
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        get_current_settings,
        temporary_settings,
    )

    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    env.pop("PREFECT_API_URL", None)
    print(
        "starting Prefect's temporary server (10-30 s; export PREFECT_API_URL to use a running one)",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_pipe.flows.server_process", str(port)],
        env=env,
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    watcher = procs.watch(proc.pid)
    try:
        try:
            _wait_healthy(url, proc, float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
        except RuntimeError as e:
            raise UserError(
                f"Prefect's temporary API server did not start ({e}); start a server (`prefect server "
                "start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api) or raise "
                "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
            ) from None
        print(f"Prefect's temporary server is up ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield
            finally:
                if proc.poll() is None:
                    _drain_to_api()
    finally:
        _stop(proc)
        watcher.close()
