"""ONNX file chores for export: check, infer shapes, hash.

Everything here works on paths, so a graph past 2 GB is never loaded with its weights.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from titan_pipe.io.hashing import file_digest


def check_and_infer(onnx_path: Path) -> onnx.ModelProto:
    """onnx.checker full check, then shape inference written back into the file.

    Returns the graph structure (weights not loaded), with the inferred value_info.
    """
    path = str(onnx_path)
    onnx.checker.check_model(path, full_check=True)
    onnx.shape_inference.infer_shapes_path(path, path, strict_mode=True, data_prop=True)
    return onnx.load(path, load_external_data=False)


def file_table(root: Path, *, algorithm: str, known: dict[str, str | None] | None = None) -> dict[str, dict]:
    """{relative path: {bytes, algorithm, digest}} for every file under ``root``, digests by ``algorithm``
    (titan_pipe.io.hashing.DIGESTS); ``known`` gives digests already computed while the file was written
    (the weights), so those bytes are not read again; a None there means "not hashed" (null)."""
    known = known or {}
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            digest = known[rel] if rel in known else file_digest(p, algorithm=algorithm)
            table[rel] = {"bytes": p.stat().st_size, "algorithm": algorithm, "digest": digest}
    return table
