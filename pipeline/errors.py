"""Errors a user can fix. Only the CLI turns them into messages and exit codes."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (file, value) with the fix in the message. The CLI prints it and exits 1."""

    exit_code = 1


class StageFailed(UserError):
    """A stage ran and failed (training crashed, a verdict failed)."""


class RankRefused(StageFailed):
    """A training rank stopped on an error it named itself (bad data, a diverged loss): the same
    inputs meet it again, so the flow does not retry it (a crash without such a line is retried)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP reached a command: it stops its children, removes its temporary
    outputs and exits 128+signal. A KeyboardInterrupt, so nothing treats it as a failure to retry
    (Prefect does not retry an interrupted task; flows/train_to_deploy.retryable refuses too)."""

    def __init__(self, signum: int = 2, hint: str = ""):
        super().__init__(signum, hint)
        self.signum, self.hint = signum, hint

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        import signal

        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        return f"interrupted by {name}" + (f"; {self.hint}" if self.hint else "")

    @classmethod
    def of(cls, exc: KeyboardInterrupt, hint: str = "") -> "Interrupted":
        """``exc`` as an Interrupted carrying its signal (SIGINT for a plain Ctrl-C) and ``hint``."""
        return cls(getattr(exc, "signum", 2), hint or getattr(exc, "hint", ""))
