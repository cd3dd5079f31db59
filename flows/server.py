"""Prefect's temporary API server, started here (not on Prefect's first call) so it dies with the command.

Without PREFECT_API_URL, Prefect starts a temporary server process on first use and stops it at
interpreter exit, which never comes after SIGKILL: the server was left running. ``temporary_server``
starts that same server (Prefect's own singleton, which every later client call reuses) and puts it
under a titan_pipe.procs watch: whatever ends this process, the server goes with it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from titan_pipe import procs
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


@contextlib.contextmanager
def temporary_server() -> Iterator[None]:
    """Start (and watch) Prefect's temporary server for the block when no API URL is set; else nothing."""
    if not _ephemeral():
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    import sys
    import time

    server = SubprocessASGIServer()
    print("starting Prefect's temporary server (10-30 s; export PREFECT_API_URL to use a running one)",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        server.start()
    except RuntimeError as e:
        server.stop()
        raise UserError(f"Prefect's temporary API server did not start ({str(e).splitlines()[0][:200]}); start a "
                        "server (`prefect server start`, then export PREFECT_API_URL=http://127.0.0.1:4200/api) or "
                        "raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") from None
    print(f"Prefect's temporary server is up ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    watcher = procs.watch(server.server_process.pid) if server.server_process is not None else None
    try:
        yield
    finally:
        _drain_to_api()
        server.stop()
        if watcher is not None:
            watcher.close()
