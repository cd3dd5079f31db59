"""Is the Prefect API this process would talk to reachable? Asked before a flow run or a served
deployment starts, so a dead PREFECT_API_URL is one line with the fix, not Prefect's traceback."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from titan_pipe.errors import UserError

HEALTH_TIMEOUT_S = 5.0
HEALTH_BODY_BYTES = 256  # read of what answers /health: Prefect's is 4 bytes


def configured_api_url() -> str | None:
    """PREFECT_API_URL as the environment sets it now, else as the active Prefect profile does;
    None: Prefect starts a temporary server of its own."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def check_api_reachable(url: str | None = None, *, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """UserError unless ``url`` (default: the configured API) answers ``/health``; None passes
    (no API configured: the temporary server is Prefect's to start)."""
    url = configured_api_url() if url is None else url
    if not url:
        return
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            body = r.read(HEALTH_BODY_BYTES + 1)
            if r.status == 200 and body.strip() == b"true":
                return
            why = f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = str(getattr(e, "reason", e))[:120]
    else:  # something answers, but not as Prefect's API does: GET /health is the JSON `true`
        shown = body[:HEALTH_BODY_BYTES].decode("utf-8", "replace").strip().replace("\n", " ")
        raise UserError(
            f"PREFECT_API_URL {url} answers, but is not a Prefect API (GET /health gave HTTP {r.status} "
            f"{shown[:60]!r}, Prefect's gives true); point PREFECT_API_URL at the server's /api (e.g. "
            "http://127.0.0.1:4200/api), or `unset PREFECT_API_URL` to let Prefect start a temporary one"
        )
    raise UserError(
        f"Prefect API {url} (PREFECT_API_URL) is unreachable ({why}); start it with "
        "`prefect server start`, or `unset PREFECT_API_URL` to let Prefect start a temporary server"
    )
