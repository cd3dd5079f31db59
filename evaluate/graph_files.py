"""What an ONNX graph handed to evaluate may make us read: files inside its dir, nothing else.

An ONNX graph names its external-data files in the graph itself (``location`` of each external
tensor); it comes from whoever made the export. Each name goes through titan_pipe.io.paths.resolve_inside
before ONNX Runtime (or anything else) opens a file, so a graph cannot make evaluate read
``../../secret`` into a tensor. (The export record's names are checked by
titan_pipe.records.export_record.ExportRecord.load.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError
from titan_pipe.io.paths import resolve_inside

if TYPE_CHECKING:
    import onnx

_FIX = "re-export the graph with `titan-pipe export` (its external data stays beside the graph)"


def check_external_data(onnx_path: Path) -> "onnx.ModelProto":
    """The graph's structure (``load_external_data=False``: no weights loaded), once every
    external-data file it names is checked to lie inside its directory; UserError otherwise."""
    import onnx

    onnx_path = Path(onnx_path)
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise UserError(
            f"{onnx_path}: not an ONNX model ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}); "
            "pass the model.onnx written by `titan-pipe export`"
        ) from None
    for location, tensor in external_locations(model).items():
        resolve_inside(
            onnx_path.parent, location, source=onnx_path, what=f"external data location of tensor {tensor!r}", fix=_FIX
        )
    return model


def external_locations(model: "onnx.ModelProto") -> dict[str, str]:
    """{external-data location (as the graph names it): the first tensor stored there}."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors

    found: dict[str, str] = {}
    for t in _get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            found.setdefault(ExternalDataInfo(t).location, t.name)
    return found
