"""Export for deployment: the unified model as ONNX graphs (prefill + fixed-capacity KV-cache decode)
checked against Ascend ATC's operator list, and the ATC command (run when ``atc`` is on PATH).

export.py (export_model), graphs.py (the graphs, built node by node), weights.py (which stored tensor
becomes which initializer), data_file.py (weights streamed, cast and hashed into the one external-data
file), generate.py (the reference generation loop), files.py (checks,
hashing), atc.py (the ATC invocation), atc_ops.py + data/atc_onnx_ops.json (the supported operator list).
"""
