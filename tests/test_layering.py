"""The layering of docs/architecture.md, checked on every import of every source file (top-level
and lazy ones inside functions): stages import the core, never each other and never the CLI or
flows; flows may import stages but not the CLI; the core imports no stage. No exceptions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Source folder -> import name (pyproject's package-dir).
FOLDERS = {
    "pipeline": "titan_pipe",
    "training": "titan_pipe.training",
    "convert": "titan_pipe.convert",
    "evaluate": "titan_pipe.evaluate",
    "flows": "titan_pipe.flows",
}
STAGES = ("training", "convert", "evaluate")
# (importing layer, imported layer) pairs that must not occur.
FORBIDDEN = {
    *((a, b) for a in STAGES for b in STAGES if a != b),
    *((s, "cli") for s in STAGES),
    *((s, "flows") for s in STAGES),
    ("flows", "cli"),
    *(("core", x) for x in (*STAGES, "flows", "cli")),
}


def layer(module: str) -> str | None:
    """Which layer a titan_pipe module belongs to (None: not ours)."""
    parts = module.split(".")
    if parts[0] != "titan_pipe":
        return None
    if len(parts) == 1:
        return "core"
    if parts[1] in ("cli", "commands"):
        return "cli"
    return parts[1] if parts[1] in (*STAGES, "flows") else "core"


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    base = FOLDERS[rel.parts[0]].split(".")
    inner = list(rel.parts[1:])
    inner[-1] = inner[-1].removesuffix(".py")
    if inner[-1] == "__init__":
        inner.pop()
    return ".".join(base + inner)


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import statement anywhere in ``tree``, relative ones resolved,
    ``from pkg import name`` counted as both pkg and pkg.name (name may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def violations(path: Path, source: str, module: str) -> list[str]:
    own = layer(module)
    out = []
    for line, target in imported_modules(ast.parse(source), module, path.name == "__init__.py"):
        theirs = layer(target)
        if theirs is not None and (own, theirs) in FORBIDDEN:
            out.append(f"{path.relative_to(REPO)}:{line}: {own} imports {target} ({theirs})")
    return out


def source_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_no_layering_violations():
    files = source_files()
    assert len(files) > 80, "the scan found too few source files; check FOLDERS"
    bad = [v for p in files for v in violations(p, p.read_text(), module_name(p))]
    assert not bad, "layering violations (docs/architecture.md):\n" + "\n".join(bad)


def test_the_scan_sees_lazy_relative_and_dynamic_imports(tmp_path):
    src = (
        "import titan_pipe.model.args\n"
        "def f():\n    from titan_pipe.convert.api import convert_checkpoint\n"
        "def g():\n    from .. import commands\n"
        "def h():\n    import importlib\n    importlib.import_module('titan_pipe.evaluate.api')\n"
    )
    path = REPO / "training" / "fake.py"
    found = violations(path, src, "titan_pipe.training.fake")
    assert [v.split(": ", 1)[1] for v in found] == [
        "training imports titan_pipe.convert.api (convert)",
        "training imports titan_pipe.convert.api.convert_checkpoint (convert)",
        "training imports titan_pipe.commands (cli)",
        "training imports titan_pipe.evaluate.api (evaluate)",
    ]
    assert layer("titan_pipe.records.checkpoint_format") == "core" and layer("titan_pipe.commands.run") == "cli"
    assert layer("titan_pipe.model.transformer") == "core" and layer("titan_pipe.tokens.corpus") == "core"
    assert violations(
        REPO / "pipeline" / "config.py", "from titan_pipe.training.trainer import x\n", "titan_pipe.config"
    ) == [
        "pipeline/config.py:1: core imports titan_pipe.training.trainer (training)",
        "pipeline/config.py:1: core imports titan_pipe.training.trainer.x (training)",
    ]


@pytest.mark.parametrize(
    "own, target",
    [
        ("convert", "titan_pipe.training.parallelize"),
        ("evaluate", "titan_pipe.training.sharded_forward"),
        ("evaluate", "titan_pipe.convert.onnx.graphs"),
        ("convert", "titan_pipe.evaluate.metrics"),
    ],
)
def test_no_stage_imports_another_stage(own, target):
    """Each stage-to-stage rule catches an import, top-level or lazy, absolute or relative."""
    module = f"titan_pipe.{own}.fake"
    path = REPO / own / "fake.py"
    theirs = target.split(".")[1]
    relative = "." + target.removeprefix("titan_pipe")  # from ..training.x import y
    for src in (f"import {target}\n", f"def f():\n    from {target} import x\n", f"from {relative} import y\n"):
        found = violations(path, src, module)
        assert found and all(f": {own} imports titan_pipe.{theirs}" in v for v in found), (src, found)
    assert not violations(path, "from titan_pipe.model.transformer import build_model\n", module)


def test_the_model_package_imports_its_own_modules_at_the_top_only():
    """pipeline/model/ (titan_pipe.model) has no import of a titan_pipe module inside a function: its
    modules' dependencies are their top-level imports (a name needed for annotations only sits under
    ``if TYPE_CHECKING:``), so an import cycle shows at load, not at the first call."""
    lazy = []
    for path in sorted((REPO / "pipeline" / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    names = (
                        [a.name for a in inner.names]
                        if isinstance(inner, ast.Import)
                        else [inner.module or ""]
                        if isinstance(inner, ast.ImportFrom)
                        else []
                    )
                    lazy += [f"{path.name}:{inner.lineno} {n}" for n in names if n.startswith("titan_pipe")]
    assert not lazy, lazy


def test_safetensors_is_read_and_written_in_one_module():
    """Every safetensors read and write goes through titan_pipe.io.safetensors_io (the header, ranged,
    mapped and whole reads, the streaming writer): no other source file imports the library."""
    found = []
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "safetensors_io.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom) and not node.level
                    else []
                )
                found += [f"{path.relative_to(REPO)}:{node.lineno}" for n in names if n.split(".")[0] == "safetensors"]
    assert not found, found


def test_every_package_folder_is_in_the_wheel():
    """Each folder with an __init__.py under the mapped source folders is listed in pyproject's
    packages (an editable install finds an unlisted one, a wheel would leave it out)."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            name = ".".join((package, *rel.parts)) if rel.parts else package
            owner = next((p for p, f in tool["package-dir"].items() if (REPO / f) == init.parent), package)
            found.add(name if owner == package else owner)
    assert found <= listed, sorted(found - listed)
