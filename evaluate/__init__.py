"""The evaluate stage: numerical consistency of checkpoint, unified model, ONNX and .om, per layer,
per operator and per dtype, written as report.json/.md/.html.

Entry point: ``titan_pipe.evaluate.api.evaluate_model``.
"""
