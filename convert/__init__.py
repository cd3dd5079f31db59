"""The convert stage: any checkpoint -> one unified safetensors model (or a reshard), and the export
to ONNX + ATC (titan_pipe.convert.onnx).

Entry points: ``titan_pipe.convert.api.convert_checkpoint``, ``titan_pipe.convert.onnx.export.export_model``.
"""
