"""ONNX file chores for export: gather external data into one file, check, infer shapes, hash.

Everything here works on paths, so a graph past 2 GB is never loaded with its weights.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

from titan_pipe.atomic import atomic_file
from titan_pipe.hashing import sha256_file

_ALIGN = 4096  # page-aligned tensors, so a runtime can mmap them


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def gather_external_data(onnx_path: Path) -> Path | None:
    """Rewrite ``onnx_path`` so all its external tensors live in one ``<name>.data`` file beside it.

    The TorchScript exporter writes one file per tensor for graphs past 2 GB; this streams each
    into the single data file (one tensor's bytes in flight at a time), points the initializer at
    its offset, and deletes the per-tensor file. Returns the data file, or None if the graph had
    no external data.
    """
    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    if not has_external_data(model):
        return None
    base = onnx_path.parent
    data_name = onnx_path.name + ".data"
    data_path = base / data_name
    sources: list[Path] = []
    with atomic_file(data_path) as tmp, open(tmp, "wb") as out:
        for t in model.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = ExternalDataInfo(t)
            src = base / info.location
            if src.resolve() == data_path.resolve():
                raise ValueError(f"{onnx_path}: tensor {t.name} already points at {data_name}")
            pad = (-out.tell()) % _ALIGN
            out.write(b"\0" * pad)
            offset = out.tell()
            with open(src, "rb") as fh:
                fh.seek(info.offset or 0)
                length = info.length if info.length is not None else src.stat().st_size - (info.offset or 0)
                _copy_exact(fh, out, length, src)
            _point_at(t, data_name, offset, length)
            sources.append(src)
    onnx.save(model, str(onnx_path))
    for src in set(sources):
        if src.exists() and src != data_path:
            src.unlink()
    return data_path


def share_external_data(primary: Path, secondary: Path) -> int:
    """Point ``secondary``'s external tensors at ``primary``'s data file where they are the same tensor.

    Prefill and decode graphs carry the same weights under the same initializer names, so the
    decode graph can read the prefill graph's ``.data`` file instead of a second copy on disk.
    A tensor is shared only if name, dtype, dims and byte length all agree; the secondary's own
    data file is deleted once nothing in it is referenced. Returns the bytes no longer duplicated.
    """
    primary, secondary = Path(primary), Path(secondary)
    if primary.parent != secondary.parent:
        raise ValueError(f"{primary} and {secondary} must share a directory")
    p_model = onnx.load(str(primary), load_external_data=False)
    s_model = onnx.load(str(secondary), load_external_data=False)
    known = {}
    for t in p_model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            known[t.name] = (t.data_type, tuple(t.dims), ExternalDataInfo(t))
    saved, kept, dropped = 0, set(), set()
    for t in s_model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = ExternalDataInfo(t)
        match = known.get(t.name)
        if match is None or match[:2] != (t.data_type, tuple(t.dims)) or match[2].length != info.length:
            kept.add(info.location)
            continue
        _point_at(t, match[2].location, match[2].offset, match[2].length)
        dropped.add(info.location)
        saved += info.length or 0
    onnx.save(s_model, str(secondary))
    primary_files = {i.location for _, _, i in known.values()}
    for location in dropped - kept - primary_files:
        f = secondary.parent / location
        if f.exists():
            f.unlink()
    return saved


def _point_at(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = k, v


def _copy_exact(src, dst, length: int, name: Path, chunk: int = 64 * 1024**2) -> None:
    left = length
    while left > 0:
        buf = src.read(min(chunk, left))
        if not buf:
            raise ValueError(f"{name}: ends {left} bytes early")
        dst.write(buf)
        left -= len(buf)


def check_and_infer(onnx_path: Path) -> onnx.ModelProto:
    """onnx.checker full check, then shape inference written back into the file.

    Returns the graph structure (weights not loaded), with the inferred value_info.
    """
    path = str(onnx_path)
    onnx.checker.check_model(path, full_check=True)
    onnx.shape_inference.infer_shapes_path(path, path, strict_mode=True, data_prop=True)
    return onnx.load(path, load_external_data=False)


def file_table(root: Path) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} for every file under ``root``."""
    return {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(root.rglob("*")) if p.is_file()}


def move_files(src_dir: Path, dst_dir: Path) -> None:
    for p in src_dir.iterdir():
        shutil.move(str(p), str(dst_dir / p.name))
