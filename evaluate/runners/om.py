"""The ATC .om on an Ascend runtime through ais_bench (importable only on Ascend hosts)."""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from titan_pipe.errors import UserError
from titan_pipe.evaluate.runners.ort import OnnxGraph, as_tensor
from titan_pipe.evaluate.runners.outputs import Outputs
from titan_pipe.graphs.graph_io import LOGITS


def ascend_runtime() -> str | None:
    """'ais_bench' or 'acl' when that Python package is importable here, else None."""
    for name in ("ais_bench", "acl"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


class OmRunner:
    """The .om model through ais_bench's InferSession (outputs named as in the ONNX graph).

    ``dtype`` is known after the first run (the dtype of the logits the chip returns: ATC's
    precision_mode decides it). Static .om files run in ais_bench's "static" mode; gear-compiled
    ones (``--dynamic_dims``) in "dymdims", which accepts only the compiled (batch, seq) gears.

    With ``graph`` (the ONNX graph the .om was compiled from, its per-layer values found), every
    run also dumps the operators' outputs through an ACL dump config and maps them to layers
    (evaluate/om_dump.py). Not executed on a machine without an Ascend runtime.
    """

    def __init__(self, om_path: Path, *, device_id: int = 0, graph: "OnnxGraph | None" = None, dim: int | None = None):
        om_path = Path(om_path)
        if not om_path.is_file():
            raise UserError(f"{om_path}: .om file not found; run `titan-pipe export` on a host with ATC")
        if ascend_runtime() != "ais_bench":
            raise RuntimeError("OmRunner needs the ais_bench package (pyACL alone is not driven here)")
        from ais_bench.infer.interface import InferSession  # Ascend hosts only

        from titan_pipe.evaluate.om_dump import acl_dump_config

        self.graph = graph if graph is not None and graph.taps is not None and dim else None
        self.dim = dim
        acl_json = None
        if self.graph is not None:
            self.dump_root = Path(tempfile.mkdtemp(prefix="titan-eval-om-dump-"))
            acl_json = self.dump_root / "acl.json"
            acl_json.write_text(json.dumps(acl_dump_config(self.dump_root / "raw", om_path.stem)))
        self.session = InferSession(device_id, str(om_path), acl_json_path=str(acl_json) if acl_json else None)
        self.path, self.label, self.dtype = om_path, f"om ({om_path.name})", "float16"
        self.out_names = [o.name for o in self.session.get_outputs()]
        in_shape = list(self.session.get_inputs()[0].shape)
        self.mode = "static" if all(int(d) > 0 for d in in_shape) else "dymdims"
        self.layers_note = ""

    def run(self, tokens: torch.Tensor) -> Outputs:
        res = self.session.infer([tokens.cpu().numpy().astype(np.int64)], mode=self.mode)
        by_name = dict(zip(self.out_names, res))
        logits = np.asarray(by_name.get(LOGITS, res[0]))
        self.dtype = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}.get(logits.dtype, "float16")
        out = Outputs(torch.from_numpy(logits))
        if self.graph is not None:
            out = self._dumped_layers(out, tuple(tokens.shape))
        return out

    def _dumped_layers(self, out: Outputs, bt: tuple[int, int]) -> Outputs:
        """This run's dump, converted to .npy by msaccucmp, mapped onto the graph's per-layer values."""
        import shutil

        from titan_pipe.evaluate.om_dump import load_layer, map_values_to_dump, msaccucmp_convert, scan_dump

        raw = self.dump_root / "raw"
        npy = self.dump_root / "npy"
        shutil.rmtree(npy, ignore_errors=True)
        msaccucmp_convert(raw, npy)
        shutil.rmtree(raw, ignore_errors=True)  # the next run's dump starts empty
        dump = scan_dump(npy)
        t = self.graph.taps
        shape = (*bt, self.dim)
        lists = []
        for names in (t.layer, t.attn, t.mlp):
            mapped = map_values_to_dump(self.graph.structure, list(names), dump)
            self.layers_note = "; ".join(mapped.notes[:3])
            lists.append([_opt_tensor(load_layer(f, shape)) for f in mapped.files])
        hidden = lists[0] if all(h is not None for h in lists[0]) else []
        return Outputs(out.logits, hidden, lists[1], lists[2])


def _opt_tensor(a):
    return None if a is None else as_tensor(a)
