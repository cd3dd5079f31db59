"""Prefect's API server for one titan-pipe command, as a process that outlives the signals sent to
that command (started by titan_pipe.flows.server, never by hand).

  python -m titan_pipe.flows.server_process PORT      (stdin: a pipe only the starting command holds)

A terminal's Ctrl-C goes to the command's whole process group, and a systemd or cgroup stop sends
SIGTERM to every process of the service: Prefect's own temporary server died first either way, and
the command then spent 1-3 minutes retrying its last reports against it before failing with a
ConnectError. This process ignores SIGINT, SIGTERM and SIGHUP and serves Prefect's app (uvicorn in a
thread, so uvicorn installs no signal handlers of its own) until its stdin reaches end of file: the
command closed it after its last report, or died in any way (SIGKILL included), so it never outlives
the command either.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def serve(port: int) -> None:
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            "prefect.server.api.server:create_app",
            factory=True,
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="on",
        )
    )
    thread = threading.Thread(target=server.run, name="prefect-api", daemon=True)
    thread.start()
    try:
        while sys.stdin.buffer.read(4096):  # nothing is ever sent: end of file is the stop
            pass
    except OSError:
        pass
    server.should_exit = True
    thread.join(timeout=10)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    serve(int(argv[0]))
    sys.stdout.flush()
    os._exit(0)  # uvicorn's thread may still hold the loop: nothing else to wait for


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
