"""A pytest plugin (loaded by conftest.py): a test skipped for want of a package that IS installed fails.

The test extra installs every package the suite's skips mention; a skip naming one of them while it
is installed means the test did not run what it claims (a stub module in sys.modules once hid the
real megatron-core from five interop tests for months). Each such skip, at collection
(``importorskip`` at module level) or in a test, becomes a failure naming the package.
"""

from __future__ import annotations

import importlib.metadata

import pytest

# distribution -> the module names a skip reason would mention
WATCHED = {
    "megatron-core": ("megatron-core", "megatron"),
    "transformers": ("transformers",),
    "onnxruntime": ("onnxruntime",),
    "mindstudio-probe": ("mindstudio-probe", "msprobe"),
    "pyarrow": ("pyarrow",),
    "tensorboard": ("tensorboard",),
}


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def hidden_package(reason: str) -> str | None:
    """The installed distribution a skip reason blames, if any."""
    text = reason.lower()
    for dist, names in WATCHED.items():
        if any(f"'{n}'" in text or f"{n} " in text or f"{n}:" in text for n in names) and _installed(dist):
            return dist
    return None


def _reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail(report, dist: str) -> None:
    reason = _reason(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped ({reason}) although {dist} is installed: the test did not run what it claims "
        "(a stub in sys.modules, a broken import?); fix the import rather than skipping"
    )


def _check(outcome) -> None:
    report = outcome.get_result()
    dist = hidden_package(_reason(report.longrepr)) if report.skipped else None
    if dist is not None:
        _fail(report, dist)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _check((yield))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    _check((yield))
