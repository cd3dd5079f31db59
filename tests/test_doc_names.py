"""Every dotted ``titan_pipe.…`` name in the docs, the README and the sources' docstrings and comments
resolves to a module or an attribute: a renamed or moved module cannot leave a doc pointing nowhere."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"titan_pipe(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_module_name_in_docs_and_sources_resolves():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    files += [
        p for d in ("pipeline", "training", "convert", "evaluate", "flows") for p in sorted((REPO / d).rglob("*.py"))
    ]
    found: dict[str, Path] = {}
    for f in files:
        for m in NAME.finditer(f.read_text(encoding="utf-8")):
            found.setdefault(m.group(0).rstrip("."), f)
    assert len(found) > 100  # the docs do name the code
    broken = {n: str(f.relative_to(REPO)) for n, f in found.items() if not _resolves(n)}
    assert not broken, broken
