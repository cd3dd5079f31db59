"""The suite fails when a test is skipped for want of a package that is installed (tests/extras_guard.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from extras_guard import hidden_package

TESTS = Path(__file__).resolve().parent


def _pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "extras_guard",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_inner.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_megatron_stub_in_sys_modules_fails_the_run(tmp_path):
    """A helper that leaves a stub `megatron` package behind (what hid the interop tests) turns the
    interop test's skip into a failure naming megatron-core."""
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    r = _pytest(
        tmp_path,
        (
            "import sys, types\n"
            "from test_data_prepare import import_megatron_indexed\n"
            "def test_stub_then_interop():\n"
            "    for part in ('megatron', 'megatron.core'):\n"
            "        sys.modules[part] = types.ModuleType(part)\n"
            "    import_megatron_indexed()\n"
        ),
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed" in r.stdout and "although megatron-core is installed" in r.stdout


def test_a_skip_for_a_missing_package_still_skips(tmp_path):
    r = _pytest(tmp_path, "import pytest\ndef test_x():\n    pytest.importorskip('no_such_package_titan_pipe')\n")
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout + r.stderr


def test_which_reasons_blame_an_installed_package():
    pytest.importorskip("transformers")
    assert hidden_package("could not import 'transformers': boom") == "transformers"
    pytest.importorskip("megatron.core")
    assert hidden_package("megatron-core is not installed (the [test] extra)") == "megatron-core"
    assert hidden_package("megatron-core not usable here: ImportError") == "megatron-core"
    assert hidden_package("CUDA is present here") is None
    assert hidden_package("cannot mount a tmpfs here") is None
