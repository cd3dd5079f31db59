"""Per-layer tensors of an .om, the way msit gets them: an ACL dump of every operator's output,
converted to .npy, mapped back to the ONNX graph's per-layer values (export.json layer_outputs).

The dump (CANN "dump" config, what ``msit debug compare`` and ais_bench ``--dump`` use):
  acl.json  {"dump": {"dump_path": DIR, "dump_mode": "output", "dump_list": [{"model_name": NAME}]}}
  DIR/{time}/{device_id}/{model_name}/{model_id}/{data_index}/{op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}
Raw dump files are converted with msaccucmp (``msaccucmp.py convert -d DIR -out NPY``; CANN's
toolkit/tools/operator_cmp/compare, also shipped in mindstudio-probe) into
  {op_type}.{op_name}.{task_id}.{stream_id}.{timestamp}.output.{index}.npy
``op_name`` is the .om operator's name with '/', '\\', '.' and ' ' written as '_'. ATC keeps an
ONNX node's name for the operator that computes it; a fused operator lists the ONNX nodes it
replaced under ``_datadump_original_op_names`` in the model json (``atc --mode=1 --om=M.om
--json=M.json``), and its output is the last replaced node's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

_NPY = re.compile(
    r"^(?P<op_type>[^.]+)\.(?P<op_name>.+)\.(?P<task>\d+)\.(?P<stream>\d+)\.(?P<ts>\d+)"
    r"\.output\.(?P<index>\d+)\.npy$"
)


def safe_name(name: str) -> str:
    """An operator name as it appears in a dump file name."""
    return re.sub(r"[/\\. ]", "_", name)


def acl_dump_config(dump_dir: Path, model_name: str) -> dict:
    """The acl.json that makes the runtime dump every operator output of ``model_name`` into ``dump_dir``."""
    return {"dump": {"dump_path": str(dump_dir), "dump_mode": "output", "dump_list": [{"model_name": model_name}]}}


@dataclass(frozen=True)
class DumpFile:
    path: Path
    op_type: str
    op_name: str  # as written in the file name
    index: int  # output index
    timestamp: int


def scan_dump(root: Path) -> list[DumpFile]:
    """Every converted output tensor under ``root`` (any depth), in timestamp order."""
    found = []
    for p in Path(root).rglob("*.npy"):
        m = _NPY.match(p.name)
        if m:
            found.append(DumpFile(p, m["op_type"], m["op_name"], int(m["index"]), int(m["ts"])))
    return sorted(found, key=lambda f: (f.timestamp, f.path.name))


def read_fusion_json(path: Path) -> dict[str, list[str]]:
    """{om operator name: [ONNX node names it replaced]} from ``atc --mode=1 --json`` output."""
    model = json.loads(Path(path).read_text())
    out: dict[str, list[str]] = {}
    for graph in model.get("graph", []):
        for op in graph.get("op", []):
            for attr in op.get("attr", []):
                if attr.get("key") == "_datadump_original_op_names":
                    out[op["name"]] = list(attr.get("value", {}).get("list", {}).get("s", []))
    return out


@dataclass(frozen=True)
class LayerDump:
    """Per layer i: the dump file holding value ``names[i]`` (None when the dump has none) and why."""

    files: list[DumpFile | None]
    notes: list[str]


def map_values_to_dump(
    model: onnx.ModelProto, names: list[str | None], dump: list[DumpFile], fusion: dict[str, list[str]] | None = None
) -> LayerDump:
    """The dump file of each ONNX value in ``names`` (per-layer values of the graph the .om was built from).

    A value is found under its producing node's name and output index; else under the fused
    operator that lists that node last among the nodes it replaced (its output 0). The last dump of
    an operator wins (one inference per dump directory is assumed).
    """
    producer = {o: (n, i) for n in model.graph.node for i, o in enumerate(n.output)}
    by_op: dict[tuple[str, int], DumpFile] = {}
    for f in dump:
        by_op[f.op_name, f.index] = f
    fused_last = {safe_name(orig[-1]): safe_name(om) for om, orig in (fusion or {}).items() if orig}
    files, notes = [], []
    for name in names:
        if name is None or name not in producer:
            files.append(None)
            notes.append(f"{name!r} is not computed by the graph" if name else "no value for this layer")
            continue
        node, idx = producer[name]
        key = safe_name(node.name)
        if (key, idx) in by_op:
            files.append(by_op[key, idx])
            notes.append(f"{name} <- {by_op[key, idx].path.name}")
        elif key in fused_last and (fused_last[key], 0) in by_op:
            f = by_op[fused_last[key], 0]
            files.append(f)
            notes.append(f"{name} <- {f.path.name} (fused operator ending in {node.name})")
        else:
            files.append(None)
            notes.append(f"{name}: no dump of operator {node.name!r} (fused away without a record, or not dumped)")
    return LayerDump(files, notes)


def load_layer(f: DumpFile | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """A dumped tensor reshaped to the value's (B, T, dim) (dumps may be flattened or padded to ND)."""
    if f is None:
        return None
    a = np.load(f.path)
    return a.reshape(shape) if a.size == int(np.prod(shape)) else None


def msaccucmp_script() -> Path | None:
    """CANN's msaccucmp.py (ASCEND_TOOLKIT_HOME), else the copy inside mindstudio-probe."""
    import importlib.util
    import os

    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    if home and (Path(home) / "tools/operator_cmp/compare/msaccucmp.py").is_file():
        return Path(home) / "tools/operator_cmp/compare/msaccucmp.py"
    spec = importlib.util.find_spec("msprobe")
    if spec and spec.origin and (Path(spec.origin).parent / "msaccucmp" / "msaccucmp.py").is_file():
        return Path(spec.origin).parent / "msaccucmp" / "msaccucmp.py"
    return None


def msaccucmp_convert(raw_dir: Path, npy_dir: Path) -> None:
    """Raw ACL dump files under ``raw_dir`` -> ``npy_dir/*.output.{i}.npy`` (msaccucmp convert)."""
    import sys

    from titan_pipe.processes import procs
    from titan_pipe.errors import StageFailed

    script = msaccucmp_script()
    if script is None:
        raise StageFailed("converting the .om dump needs msaccucmp.py (CANN toolkit or `pip install mindstudio-probe`)")
    npy_dir.mkdir(parents=True, exist_ok=True)
    for leaf in sorted({p.parent for p in Path(raw_dir).rglob("*") if p.is_file()}):
        proc = procs.run(
            [sys.executable, str(script), "convert", "-d", str(leaf), "-out", str(npy_dir)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise StageFailed(f"msaccucmp convert of {leaf} failed: {(proc.stdout + proc.stderr).strip()[-400:]}")
