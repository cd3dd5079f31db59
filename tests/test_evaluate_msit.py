"""Our msit / msprobe columns against the tools' own metric functions, on tensors evaluate dumped.

msit `debug compare` runs CANN's msaccucmp, which msprobe ships as ``msprobe/msaccucmp``; msprobe's
own `compare` has ``msprobe.core.compare.algorithm``. mindstudio-probe is in the test extra (CI runs
this); where it does not import, the test is skipped with the import error. Their functions round their results
for printing (msaccucmp to 6 decimals, msprobe to 12); the test replaces that rounding by the
identity so the formulas themselves are compared, to 1e-6 relative. msaccucmp's command line also
casts both tensors to float32 before its formulas; the test feeds float64, the precision we compute in.
"""

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from titan_pipe.config import ExportConfig
from titan_pipe.config import EvaluateConfig  # noqa: E402
from titan_pipe.convert.onnx.export import export_model  # noqa: E402
from titan_pipe.evaluate.api import evaluate_model  # noqa: E402

MSIT_COLUMNS = {  # msaccucmp algorithm -> our report key
    "CosineSimilarity": "cosine",
    "MaxAbsoluteError": "max_abs",
    "MeanAbsoluteError": "mean_abs",
    "MaxRelativeError": "max_rel",
    "MeanRelativeError": "mean_rel",
    "AccumulatedRelativeError": "acc_rel",
    "RelativeEuclideanDistance": "rel_euclidean",
    "RootMeanSquareError": "rmse",
    "KullbackLeiblerDivergence": "msit_kl",
}
MSPROBE_COLUMNS = {  # msprobe algorithm module -> our report key
    "alg_cosine_similarity": "cosine",
    "alg_euclidean_distance": "euc_dist",
    "alg_max_absolute_error": "max_abs",
    "alg_max_relative_error": "msprobe_max_rel",
    "alg_one_thousand_error": "err_ratio_1e3",
    "alg_five_thousand_error": "err_ratio_5e3",
}


def _tools(monkeypatch):
    """(msaccucmp algorithm modules by column, msprobe algorithm modules by name), rounding disabled."""
    try:
        import msprobe
        import msprobe.core.compare.algorithm.builtin_algorithm as probe_algs  # noqa: F401
    except Exception as e:  # any import failure means "not usable here"; say which
        pytest.skip(f"mindstudio-probe does not import here: {e!r}")
    monkeypatch.syspath_prepend(str(Path(msprobe.__file__).parent / "msaccucmp"))  # msaccucmp's own layout
    from algorithm_manager.algorithm_parameter import AlgorithmParameter
    from cmp_utils import utils as cmp_utils

    monkeypatch.setattr(cmp_utils, "format_value", float)
    msit = {
        col: importlib.import_module(f"algorithm_manager.builtin_algorithm.alg_{col}")
        for col in [*MSIT_COLUMNS, "StandardDeviation"]
    }
    probe = {}
    for name in MSPROBE_COLUMNS:
        mod = importlib.import_module(f"msprobe.core.compare.algorithm.builtin_algorithm.{name}")
        if hasattr(mod, "format_value"):
            monkeypatch.setattr(mod, "format_value", float)
        probe[name] = mod
    cu = sys.modules["msprobe.core.compare.utils"]
    monkeypatch.setattr(cu, "format_value", float)
    return msit, probe, AlgorithmParameter


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """An fp32 and an fp16 export evaluated with --dump (errors of 1e-7 and 1e-3 relative)."""
    from test_evaluate_model import debug_model, write_unified

    root = tmp_path_factory.mktemp("msit")
    model, args = debug_model()
    md = write_unified(model, args, root / "model")
    settings = EvaluateConfig(operators=False, batches=1, batch_size=2, seq_len=16, prompts=0, dump=True)
    out = {}
    for dt in ("float32", "float16"):
        onnx = export_model(md, root / f"onnx-{dt}", ExportConfig(dtype=dt, kv_cache=False, atc=False)).onnx
        r = evaluate_model(out_dir=root / f"rep-{dt}", model_dir=md, onnx=onnx, settings=settings)
        out[dt] = r.report_json.parent
    return out


def _rel_close(ours: float, theirs: float) -> bool:
    return math.isclose(ours, theirs, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_our_columns_equal_msit_and_msprobe_functions(dumped, monkeypatch, dtype):
    msit, probe, AlgorithmParameter = _tools(monkeypatch)
    rep_dir = dumped[dtype]
    rep = json.loads((rep_dir / "report.json").read_text())
    rows = {r["tensor"]: r for c in rep["comparisons"] if c["id"] == "torch_vs_onnx" for r in c["rows"]}
    assert {"hidden.0", "mlp_out.2", "logits"} <= set(rows) and rep["dump"]
    checked = 0
    for tensor in ("attn_out.0", "hidden.0", "mlp_out.2", "hidden.3", "logits"):
        golden = np.load(rep_dir / "dump" / "torch_vs_onnx" / "golden" / f"{tensor}.npy")
        cand = np.load(rep_dir / "dump" / "torch_vs_onnx" / "candidate" / f"{tensor}.npy")
        assert golden.dtype == np.float32  # each side in its own dtype
        if tensor in ("mlp_out.2", "logits"):
            assert cand.dtype == np.dtype(dtype)
        m = rows[tensor]["metrics"]
        args = AlgorithmParameter()
        args.shape_type, args.my_output_dump_file, args.ground_truth_dump_file = 1, "candidate", "golden"
        c64, g64 = cand.astype(np.float64).ravel(), golden.astype(np.float64).ravel()
        for col, key in MSIT_COLUMNS.items():
            theirs, _ = msit[col].compare(c64, g64, args)
            assert _rel_close(m[key], float(theirs)), (tensor, col, m[key], theirs)
            checked += 1
        std, _ = msit["StandardDeviation"].compare(c64, g64, args)
        z = [0.0 if abs(v) < 1e-3 else v for v in (m["cand_mean"], m["cand_std"], m["ref_mean"], m["ref_std"])]
        assert std == "(%.3f;%.3f),(%.3f;%.3f)" % tuple(z), (tensor, std)
        for name, key in MSPROBE_COLUMNS.items():  # msprobe: NPU side first, in the dumped dtypes
            theirs, _ = probe[name].compare(cand.copy(), golden.copy())
            assert _rel_close(m[key], float(theirs)), (tensor, name, m[key], theirs)
            checked += 1
    assert checked == 5 * (len(MSIT_COLUMNS) + len(MSPROBE_COLUMNS))
    if dtype == "float16":  # not a vacuous agreement: real float16 rounding differences
        assert 1e-5 < rows["hidden.0"]["metrics"]["rel_euclidean"] < 0.05


def test_csv_carries_their_column_names(dumped):
    import csv

    with open(dumped["float32"] / "tensors.csv") as f:
        header = next(csv.reader(f))
    for col in [
        *MSIT_COLUMNS,
        "StandardDeviation",
        "EucDist",
        "MaxRelativeErr",
        "One Thousandth Err Ratio",
        "Five Thousandths Err Ratio",
    ]:
        assert col in header
