"""`--flow` for stage commands: run one library call as a Prefect flow run so it is tracked in the UI."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def run_tracked(stage: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Call ``fn(**kwargs)`` inside a Prefect flow run named ``titan-pipe-<stage>-cli``; returns its result.

    For stage CLIs (``titan-pipe convert ... --flow``): without the option they call the library
    function directly, with it they call ``run_tracked("convert", convert_checkpoint, src=..., ...)``.
    Exceptions propagate unchanged, so the CLI's error mapping still applies. Prefect starts a
    temporary server when PREFECT_API_URL is not set (10-30 s).
    """
    from prefect import flow

    from titan_pipe.flows.logs import run_logger

    def body(**kw: Any) -> T:
        run_logger().info(f"{stage}: {getattr(fn, '__name__', fn)}({', '.join(f'{k}={v}' for k, v in kw.items())})")
        return fn(**kw)

    tracked = flow(name=f"titan-pipe-{stage}-cli", validate_parameters=False, log_prints=True,
                   persist_result=False)(body)
    return tracked(**kwargs)
