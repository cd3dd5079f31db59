"""What an export dir handed to evaluate may make us read: files inside that dir, nothing else.

An ONNX graph names its external-data files in the graph itself (``location`` of each external
tensor), and ``export.json`` names the graphs and files of the export; both come from whoever made
the export. Each name goes through titan_pipe.paths.resolve_inside before ONNX Runtime (or
anything else) opens a file, so a graph cannot make evaluate read ``../../secret`` into a tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError
from titan_pipe.paths import resolve_inside
from titan_pipe.values import read_json

if TYPE_CHECKING:
    import onnx

EXPORT_RECORD = "export.json"
_FIX = "re-export the graph with `titan-pipe export` (its external data stays beside the graph)"


def check_external_data(onnx_path: Path) -> "onnx.ModelProto":
    """The graph's structure (``load_external_data=False``: no weights loaded), once every
    external-data file it names is checked to lie inside its directory; UserError otherwise."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors

    onnx_path = Path(onnx_path)
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise UserError(f"{onnx_path}: not an ONNX model ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
                        "pass the model.onnx written by `titan-pipe export`") from None
    checked = set()
    for t in _get_all_tensors(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = ExternalDataInfo(t).location
        if location not in checked:
            resolve_inside(onnx_path.parent, location, source=onnx_path,
                           what=f"external data location of tensor {t.name!r}", fix=_FIX)
            checked.add(location)
    return model


def read_export_record(onnx_dir: Path) -> dict | None:
    """``onnx_dir/export.json`` with every graph and file it names checked to lie inside ``onnx_dir``;
    None when the dir has no record (a graph exported elsewhere)."""
    path = Path(onnx_dir) / EXPORT_RECORD
    if not path.is_file():
        return None
    record = read_json(path, what="the record `titan-pipe export` writes", fix="re-export or delete it")
    for section in ("graphs", "files"):
        names = record.get(section) or {}
        if not isinstance(names, dict):
            raise UserError(f"{path}: {section!r} must be an object keyed by file name, got {type(names).__name__}")
        for name in names:
            resolve_inside(onnx_dir, name, source=path, what=f"{section} entry", fix=_FIX)
    return record
