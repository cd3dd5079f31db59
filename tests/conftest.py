"""Shared test setup: Prefect runs against a throw-away home with analytics off."""

import os
import tempfile

_prefect_home = tempfile.mkdtemp(prefix="titan-pipe-prefect-")
os.environ.setdefault("PREFECT_HOME", _prefect_home)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402

pytest_plugins = ["extras_guard"]  # a skip for want of an installed package fails (tests/extras_guard.py)


@pytest.fixture(scope="session", autouse=True)
def _prefect_logging_bound_to_the_session():
    """prefect.main sets Prefect's logging up once per process, binding its console handler to the
    sys.stderr of that moment: import it before any test, so the first import never happens inside
    a CliRunner (whose stream closes after its invoke: every later flow run would fail with "I/O
    operation on closed file", whichever order the test files run in)."""
    import prefect.main  # noqa: F401


@pytest.fixture(scope="session")
def prefect_harness():
    """ONE temporary Prefect server + database for the whole session (~30 s); flow tests request it."""
    # prefect.main sets Prefect's logging up once per process, binding its console handler to the
    # sys.stderr of that moment: import it here, not first inside a CliRunner (whose stream closes
    # after its invoke: later flow runs would then fail with "I/O operation on closed file").
    import prefect.main  # noqa: F401
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
        # pytest has closed the stream Prefect's console handler writes to by session teardown;
        # without this, "Stopping temporary server" ends the run with a logging traceback.
        import logging

        logging.getLogger("prefect").setLevel(logging.WARNING)
