"""CLI commands of the training stage (filled in by the trainer)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    return None
