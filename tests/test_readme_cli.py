"""README's CLI section names every command and every option `--help` has (a newcomer reads the
README, not each --help)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import typer

from titan_pipe.cli import app

README = Path(__file__).resolve().parents[1] / "README.md"


def _commands(group: click.Group, prefix: str = ""):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix}{name} ")
        else:
            yield prefix + name, cmd


def test_readme_cli_lists_every_command_and_option():
    block = README.read_text().split("## CLI", 1)[1].split("```", 2)[1]
    root = typer.main.get_command(app)
    missing = []
    for name, cmd in _commands(root):
        if f"titan-pipe {name} " not in block:
            missing.append(f"command {name}")
            continue
        entry = block.split(f"titan-pipe {name} ", 1)[1].split("\ntitan-pipe ", 1)[0]
        for param in cmd.params:
            flags = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("-") and o != "--help"]
            if flags and not any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", entry) for f in flags):
                missing.append(f"{name} {'/'.join(flags)}")
    assert not missing, missing
