"""Shared test setup: Prefect runs against a throw-away home with analytics off."""
import os
import tempfile

_prefect_home = tempfile.mkdtemp(prefix="titan-pipe-prefect-")
os.environ.setdefault("PREFECT_HOME", _prefect_home)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
