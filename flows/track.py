"""`--flow` for stage commands: run one library call as a Prefect flow run so it is tracked in the UI."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")


def run_tracked(stage: str, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Call ``fn(**kwargs)`` inside a Prefect flow run named ``titan-pipe-<stage>-cli``; returns its result.

    For stage CLIs (``titan-pipe convert ... --flow``): without the option they call the library
    function directly, with it they call ``run_tracked("convert", convert_checkpoint, src=..., ...)``.
    A UserError fails the flow run with its one-line message and is raised again for the CLI
    to map; other exceptions propagate unchanged. Prefect starts a
    temporary server when PREFECT_API_URL is not set (10-30 s).
    """
    from prefect import flow
    from prefect.states import Failed

    from titan_pipe.errors import UserError
    from titan_pipe.flows.logs import quiet_user_error_tracebacks, run_logger
    from titan_pipe.flows.prefect_api import check_api_reachable
    from titan_pipe.flows.server import temporary_server

    check_api_reachable()  # a dead PREFECT_API_URL: one line, before the stage runs
    quiet_user_error_tracebacks()
    user_errors: list[UserError] = []

    def body(**kw: Any) -> T:
        run_logger().info(f"{stage}: {getattr(fn, '__name__', fn)}({', '.join(f'{k}={v}' for k, v in kw.items())})")
        try:
            return fn(**kw)
        except UserError as e:
            # Bad input is the user's to fix: mark the run failed with the one-line message, not
            # the traceback Prefect would log for an exception escaping the flow.
            user_errors.append(e)
            run_logger().error(str(e))
            return Failed(message=str(e))

    tracked = flow(name=f"titan-pipe-{stage}-cli", validate_parameters=False, log_prints=True, persist_result=False)(
        body
    )
    with temporary_server():  # dies with this command, however it ends
        state = tracked(**kwargs, return_state=True)
    if user_errors:
        raise user_errors[0]
    return state.result()
