"""Export for deployment: the unified model as ONNX graphs (prefill + fixed-capacity KV-cache decode)
checked against Ascend ATC's operator list, and the ATC command (run when ``atc`` is on PATH).

export (export_model; writes the export record, titan_pipe.records.export_record), graphs (the graphs, built
from the node recipes of titan_pipe.graphs.onnx_nodes), weights (which stored tensor becomes which
initializer), data_file (weights streamed, cast and hashed into the one external-data file),
files (checks, hashing), atc (the ATC invocation), atc_ops + data/atc_onnx_ops.json (the supported
operator list). The loop that drives the graphs is the core's titan_pipe.graphs.generation.
"""
