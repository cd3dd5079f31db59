"""The convert stage: any checkpoint -> one unified safetensors model (or a reshard), and the export
to ONNX + ATC (titan_pipe.convert.onnx).

Entry points: ``convert_checkpoint`` (titan_pipe.convert.api), ``export_model``
(titan_pipe.convert.onnx.export). Imported on first use, so importing one reader pulls no ONNX.
"""

_ENTRY_POINTS = {"convert_checkpoint": "titan_pipe.convert.api", "export_model": "titan_pipe.convert.onnx.export"}


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        import importlib

        return getattr(importlib.import_module(_ENTRY_POINTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
