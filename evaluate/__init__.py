"""The evaluate stage: numerical consistency of checkpoint, unified model, ONNX and .om, per layer,
per operator and per dtype, written as report.json/.md/.html.

Entry point: ``evaluate_model`` (titan_pipe.evaluate.api), imported on first use.
"""


def __getattr__(name: str):
    if name == "evaluate_model":
        from titan_pipe.evaluate.api import evaluate_model

        return evaluate_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
