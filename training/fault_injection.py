"""A crash on purpose, for the restart and resume tests: the real trainer under torchrun, one rank
killed at a chosen step or mid-checkpoint. Read from the environment only (never from flow.yaml),
so a production run never carries it; named apart from titan_pipe.faults (operating-system faults
reported as one line)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from titan_pipe.errors import UserError


@dataclass(frozen=True)
class InjectedFault:
    """Test-only fault injection, read from the environment (never from flow.yaml):
    ``TITAN_PIPE_FAULT=STEP:RANK:PHASE`` makes rank RANK exit 1 at step STEP, after backward
    (PHASE ``step``) or while writing that step's checkpoint, after its shard files and before the
    manifest (PHASE ``checkpoint``, which forces a save at STEP). Used by the restart/resume tests.
    """

    step: int | None = None
    rank: int = 0
    during: str = "step"

    ENV = "TITAN_PIPE_FAULT"

    @classmethod
    def from_env(cls, environ=None) -> "InjectedFault":
        spec = (os.environ if environ is None else environ).get(cls.ENV, "")
        if not spec:
            return cls()
        try:
            step, rank, during = spec.split(":")
            fault = cls(int(step), int(rank), during)
        except ValueError:
            raise UserError(f"{cls.ENV}={spec!r}: expected STEP:RANK:PHASE, e.g. 4:1:checkpoint") from None
        if during not in ("step", "checkpoint"):
            raise UserError(f"{cls.ENV}={spec!r}: PHASE must be step or checkpoint")
        return fault

    def due(self, step: int, rank: int, during: str) -> bool:
        return self.step == step and self.rank == rank and self.during == during

    @staticmethod
    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
