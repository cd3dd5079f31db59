"""The environment that arms the crash-on-purpose shim (tests/fault_site/sitecustomize.py)."""

from __future__ import annotations

import os
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "fault_site"


def fault_env(spec: str, base: dict | None = None) -> dict[str, str]:
    """``base`` (os.environ) with TITAN_PIPE_FAULT=``spec`` and the shim first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["TITAN_PIPE_FAULT"] = spec
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM), env.get("PYTHONPATH", "")) if p)
    return env


def arm(monkeypatch, spec: str) -> None:
    """The same, in this process's environment (for a CLI run in-process that starts torchrun)."""
    for k, v in fault_env(spec).items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
