"""CLI commands of this stage (to be filled in)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    return None
