"""Export for deployment: the unified model as ONNX graphs (prefill + KV-cache decode) checked
against Ascend ATC's operator list, and the ATC command (run when ``atc`` is on PATH).

export.py (export_model), graphs.py (the graph wrappers), files.py (external data, hashing),
atc.py (the ATC invocation), atc_ops.py + data/atc_onnx_ops.json (the supported operator list).
"""
