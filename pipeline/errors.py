"""Errors a user can fix. Only the CLI turns them into messages and exit codes."""
from __future__ import annotations


class UserError(Exception):
    """Bad input (file, value) with the fix in the message. The CLI prints it and exits 1."""

    exit_code = 1


class StageFailed(UserError):
    """A stage ran and failed (training crashed, a verdict failed)."""
