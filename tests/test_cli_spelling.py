"""Each CLI option is spelled once outside the tests: a flag literal ("--out") is written in one place
of the commands (an option object shared by the commands that take it, or a section's field), so a
rename is one edit and two commands cannot drift apart. The few flags whose meaning differs by command
are listed with why."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"""["'](--[a-z][a-z0-9-]*)["']""")
# the same spelling, a different option: each is the command's own and says so in its help
DIFFERENT_MEANINGS = {
    "--from": "run: the first stage; init: the released model to start from",
    "--force": "run: every stage runs; init and plan --write: replace the file",
    "--workers": "data prepare's option and its bound check's message name the same flag",
}


def _commands() -> list[Path]:
    return [REPO / "pipeline" / "cli.py", *sorted((REPO / "pipeline" / "commands").glob("*.py"))]


def test_each_flag_literal_is_written_once_in_the_commands():
    counts = Counter(m for p in _commands() for m in FLAG.findall(p.read_text()))
    twice = {flag: n for flag, n in counts.items() if n > 1 and flag not in DIFFERENT_MEANINGS}
    assert not twice, twice
    assert counts["--out"] == 1 and counts["--overwrite"] == 1 and counts["--flow"] == 1


def test_every_command_that_writes_a_directory_takes_the_one_out_option():
    from typer.main import get_command

    from titan_pipe.cli import app

    root = get_command(app)
    paths = [("convert",), ("export",), ("evaluate",), ("data", "prepare"), ("data", "merge")]
    for path in paths:
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        out = next(p for p in cmd.params if "--out" in p.opts)
        assert out.opts == ["-o", "--out"] and out.required, path
