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


# The default suite (`python -m pytest -q`) stays under ~20 minutes on CI's 2 cores; these checks run
# in CI's second job (`python -m pytest -q -m slow`, .ci/run), each named with what it costs there.
SLOW_FIXTURES = {"world8": "the 8-rank training launch (tests/test_training_parallel.py), ~5 min"}
SLOW_TESTS = {
    # test id (a prefix: every parameter of a function) -> why it is slow
    "tests/test_families.py::test_evaluate_reference_generates_like_transformers[qwen2]": "streamed greedy, ~70 s",
    "tests/test_families.py::test_evaluate_reference_generates_like_transformers[qwen3]": "streamed greedy, ~100 s",
    # Gemma 3's stays in the default suite (its sliding layers cover the window Mistral's would)
    "tests/test_families.py::test_evaluate_reference_generates_like_transformers[mistral]": "streamed greedy, ~85 s",
    "tests/test_families.py::test_init_writes_a_valid_example_of_every_flavour": "every flavour's flow, ~35 s",
    "tests/test_faults_os.py::test_run_stops_in_seconds_whatever_receives_the_signal[ctrl-c-to-the-group-2]": "~45 s",
    "tests/test_faults_os.py::test_run_stops_in_seconds_whatever_receives_the_signal[sigterm-to-every-process-2]": "~55 s",
    "tests/test_flows_schedule.py::test_a_worker_runs_the_pool_deployment_through_every_stage_to_pass": "~90 s",
    "tests/test_flows_schedule.py::test_a_served_schedule_fires_and_its_run_completes": "~40 s",
    "tests/test_flows_pipeline.py::test_changing_one_export_setting_reruns_export_and_evaluate_only": "~30 s",
    "tests/test_flows_pipeline.py::test_killed_rank_is_retried_and_resumes_to_the_same_weights": "~30 s",
    "tests/test_device_check.py::test_device_check_dry_run": "the device script's CPU dry run, ~30 s",
    "tests/test_device_check.py::test_device_check_fails_when_a_requested_phase_cannot_run": "~15 s",
    "tests/test_evaluate_e2e.py::test_layer_streamed_sharded_forward_equals_resident": "~35 s",
    "tests/test_evaluate_streamed.py::test_session_budget_keeps_what_fits_and_never_more": "~30 s",
    "tests/test_evaluate_stored_linear.py::test_streamed_reference_uses_the_files_pages_and_gives_them_back": "~27 s",
    "tests/test_data_interop.py::test_megatron_built_dataset_trains_at_dp2_tp2_and_resumes_bit_exactly": "~35 s",
    "tests/test_training_kernels.py::test_compiled_loss_equals_eager[all-labels-inductor]": "inductor compile, ~23 s",
}


@pytest.hookimpl(tryfirst=True)  # before -m 'not slow' deselects by mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if set(SLOW_FIXTURES) & set(item.fixturenames) or any(item.nodeid.startswith(t) for t in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
