"""evaluate_model on the debug model: unified dir vs its ONNX export, fault injection, dtypes, bad inputs."""
import csv
import json
from pathlib import Path

import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import save_file
from typer.testing import CliRunner

pytest.importorskip("onnxruntime")

from titan_pipe.cli import app  # noqa: E402
from titan_pipe.config import EvaluateConfig  # noqa: E402
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.errors import UserError  # noqa: E402
from titan_pipe.evaluate.api import evaluate_model  # noqa: E402
from titan_pipe.evaluate.metrics import CSV_COLUMNS  # noqa: E402
from titan_pipe.model_args import resolve_args
from titan_pipe.names import native_to_hf, to_hf_config
from titan_pipe.training.model import build_model

FAST = EvaluateConfig(operators=False, batches=1, batch_size=2, seq_len=32, prompts=1, new_tokens=4)


def write_unified(model, args, out: Path) -> Path:
    """A unified dir as `titan-pipe convert` writes it: HF names + config.json."""
    out.mkdir(parents=True)
    save_file({native_to_hf(k): v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(to_hf_config(args)))
    return out


def debug_model(seed=0, **overrides):
    args = resolve_args("debug", **overrides)
    model = build_model(args, seed=seed)
    with torch.no_grad():  # non-trivial norms, so a swapped or dropped norm weight shows
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model, args


def export(model_dir: Path, out: Path, dtype="float32") -> Path:
    return export_model(model_dir=model_dir, out_dir=out, dtype=dtype, kv_cache=False, expose_hidden=True,
                        run_atc=False).onnx


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    model, args = debug_model()
    md = write_unified(model, args, root / "model")
    return {"root": root, "model": model, "args": args, "model_dir": md,
            "onnx32": export(md, root / "onnx32"), "onnx16": export(md, root / "onnx16", "float16")}


def test_float32_export_passes_and_report_parses(art, tmp_path):
    settings = EvaluateConfig(batches=1, batch_size=2, seq_len=32, prompts=2, new_tokens=6)
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx32"], settings=settings)
    assert r.passed, r.summary["verdict"]
    st = r.summary["comparisons"]
    assert st["torch_vs_onnx"] == "pass" and st["operators"] == "pass" and st["task"] == "pass"
    assert st["om"] == "skipped: no Ascend runtime"
    assert st["npu_fused"] == "skipped: no NPU"
    assert st["sharded_vs_unified"] == "skipped: no --checkpoint given"
    rep = json.loads(r.report_json.read_text())
    assert rep["schema"] == "titan-pipe/evaluate-report" and rep["schema_version"] == 1
    onnx_cmp = next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in onnx_cmp["rows"]] == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "logits"]
    logits = onnx_cmp["rows"][-1]["metrics"]
    assert logits["kl"] < 1e-6 and logits["top1"] == 1.0 and logits["max_abs"] < 1e-4
    task = next(c for c in rep["comparisons"] if c["id"] == "task")
    assert all(g["identical"] for g in task["details"]["generation"].values())
    with open(tmp_path / "rep" / "tensors.csv") as f:
        header = next(csv.reader(f))
    assert set(CSV_COLUMNS) <= set(header)
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "data:image/png;base64," in html and "PASS" in html
    assert (tmp_path / "rep" / "layer_error.png").stat().st_size > 1000
    assert (tmp_path / "rep" / "logits_error.png").stat().st_size > 1000
    assert "PASS" in (tmp_path / "rep" / "report.md").read_text()
    ops = rep["operators"]
    assert any(o["dtype"] == "bfloat16" and o["status"].startswith("skipped: ORT has no bfloat16") for o in ops)


def test_perturbed_onnx_weight_fails_at_that_layer(art, tmp_path):
    m = onnx.load(str(art["onnx32"]))
    init = next(i for i in m.graph.initializer if i.name == "layers.2.w2")
    w = numpy_helper.to_array(init).copy()
    w[5, 7] += 0.05  # one weight of layer 2's down projection
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(m, str(bad))
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=bad, settings=FAST)
    assert not r.passed
    assert r.summary["first_failing_layer"]["layer"] == 2
    rows = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")["rows"]
    assert [row["status"] for row in rows[:2]] == ["pass", "pass"]
    assert "layer 2" in r.summary["verdict"]


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of q/k in the other RoPE convention (Meta interleaved pairs instead of rotate-half)."""
    hd = w.shape[0] // n_heads
    return w.view(n_heads, hd // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()


def test_rope_convention_mismatch_fails_at_layer_0(art, tmp_path):
    model, args = debug_model()
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.copy_(_to_interleaved(layer.attention.wq.weight, args.n_heads))
            layer.attention.wk.weight.copy_(_to_interleaved(layer.attention.wk.weight, args.kv_heads))
    wrong_dir = write_unified(model, args, tmp_path / "interleaved")
    onnx_path = export(wrong_dir, tmp_path / "onnx")
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=onnx_path, settings=FAST)
    assert not r.passed
    assert r.summary["first_failing_layer"]["layer"] == 0


def test_float16_export_passes_fp16_thresholds_and_fails_fp32(art, tmp_path):
    r16 = evaluate_model(out_dir=tmp_path / "a", model_dir=art["model_dir"], onnx=art["onnx16"], settings=FAST)
    assert r16.passed, r16.summary["verdict"]
    rep = json.loads(r16.report_json.read_text())
    assert next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")["dtype"] == "float16"
    r32 = evaluate_model(out_dir=tmp_path / "b", model_dir=art["model_dir"], onnx=art["onnx16"],
                         settings=FAST.model_copy(update={"dtype": "float32"}))
    assert not r32.passed
    assert r32.summary["comparisons"]["torch_vs_onnx"] == "fail"


def test_flow_thresholds_override_changes_the_verdict(art, tmp_path):
    strict = FAST.model_copy(update={"thresholds": {"float16": {"rel_euclidean_max": 1e-6}}})
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx16"], settings=strict)
    assert not r.passed and "rel_euclidean_max" in r.summary["verdict"]


def test_mismatched_config_and_graph_is_a_clear_error(art, tmp_path):
    model, args = debug_model(n_layers=2)
    other = write_unified(model, args, tmp_path / "two_layers")
    with pytest.raises(UserError, match=r"does not match .*config\.json.*2 hidden|n_layers 2"):
        evaluate_model(out_dir=tmp_path / "rep", model_dir=other, onnx=art["onnx32"], settings=FAST)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "needs a reference"),
    ({"model_dir": "missing"}, "--model-dir .*missing: does not exist"),
    ({"onnx": "nope.onnx", "model_dir": None}, "--onnx .*nope.onnx: does not exist"),
])
def test_missing_inputs(art, tmp_path, kwargs, message):
    kw = {k: (tmp_path / v if isinstance(v, str) else v) for k, v in kwargs.items()}
    if "onnx" in kw:
        kw["model_dir"] = art["model_dir"]
    with pytest.raises(UserError, match=message):
        evaluate_model(out_dir=tmp_path / "rep", settings=FAST, **kw)


def test_onnx_dir_instead_of_file(art, tmp_path):
    with pytest.raises(UserError, match="expected a file; pass OUT_DIR/model.onnx"):
        evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx32"].parent, settings=FAST)


def test_cli_exit_codes(art, tmp_path):
    runner = CliRunner()
    flow = tmp_path / "flow.yaml"
    flow.write_text("evaluate: {prompts: 0, batch_size: 2, operators: true}\n")
    common = ["evaluate", "--model-dir", str(art["model_dir"]), "--no-operators", "--batches", "1",
              "--config", str(flow)]
    ok = runner.invoke(app, common + ["--onnx", str(art["onnx32"]), "-o", str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output
    assert "PASS" in ok.output
    bad = runner.invoke(app, common + ["--onnx", str(art["onnx16"]), "--dtype", "float32", "-o", str(tmp_path / "bad")])
    assert bad.exit_code == 1 and "FAIL" in bad.output
    assert (tmp_path / "bad" / "report.json").is_file()  # a failed verdict still writes its report
    missing = runner.invoke(app, common + ["--onnx", str(tmp_path / "x.onnx"), "-o", str(tmp_path / "m")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    assert "Traceback" not in missing.output
    flow.write_text("evaluate: {thresholds: {float32: {cosine: 0.5}}}\n")
    typo = runner.invoke(app, common + ["--onnx", str(art["onnx32"]), "-o", str(tmp_path / "t")])
    assert typo.exit_code == 2 and "float32.cosine: unknown threshold key" in typo.output


def test_checkpoint_without_manifest_is_refused(art, tmp_path):
    (tmp_path / "step-000001").mkdir()
    with pytest.raises(UserError, match="no manifest.json"):
        evaluate_model(out_dir=tmp_path / "rep", checkpoint=tmp_path / "step-000001", model_dir=art["model_dir"],
                       settings=FAST)


def test_graph_without_hidden_outputs(art, tmp_path):
    """A deployment export has no hidden.{i}: per-layer rows come from a debug re-export whose
    logits equal the graph's; without it (debug_export false) only the logits are compared."""
    plain = export_model(model_dir=art["model_dir"], out_dir=tmp_path / "plain", kv_cache=False,
                         run_atc=False).onnx
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=plain, settings=FAST)
    assert r.passed
    c = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in c["rows"]] == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "logits"]
    assert "debug re-export" in c["details"]["layers"]
    off = FAST.model_copy(update={"debug_export": False})
    r = evaluate_model(out_dir=tmp_path / "rep2", model_dir=art["model_dir"], onnx=plain, settings=off)
    c = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in c["rows"]] == ["logits"]
    assert "expose-hidden" in c["details"]["layers"]


def test_om_without_ascend_runtime_is_skipped_not_passed(art, tmp_path):
    om = tmp_path / "model.om"
    om.write_bytes(b"not run here")
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], om=om, settings=FAST)
    assert r.summary["comparisons"]["om"].startswith("skipped: no Ascend runtime")


def test_report_dir_that_is_not_a_report_is_refused(art, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "flow.yaml").write_text("name: x\n")
    with pytest.raises(UserError, match="not \\(only\\) an earlier titan-pipe report"):
        evaluate_model(out_dir=run_dir, model_dir=art["model_dir"], settings=FAST)
    assert (run_dir / "flow.yaml").is_file()
    # an earlier report is replaced
    rep = tmp_path / "rep"
    evaluate_model(out_dir=rep, model_dir=art["model_dir"], settings=FAST)
    first = json.loads((rep / "report.json").read_text())["created"]
    evaluate_model(out_dir=rep, model_dir=art["model_dir"], settings=FAST)
    assert json.loads((rep / "report.json").read_text())["created"] >= first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rep")]  # no temp dirs left


def test_too_little_held_out_text_is_a_clear_error(art, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(UserError, match="short.txt: .* held-out tokens, but 1 batches x 2 x 32 need 64"):
        evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], data=short, settings=FAST)


def test_kv_cache_decode_graph_is_checked_on_its_own(art, tmp_path):
    """decode.onnx is what generation runs: a fault only there fails onnx_kv_decode, not the prefill rows."""
    out = tmp_path / "kv"
    export_model(model_dir=art["model_dir"], out_dir=out, kv_cache=True, expose_hidden=True, run_atc=False)
    settings = FAST.model_copy(update={"prompts": 2, "new_tokens": 5})
    good = evaluate_model(out_dir=tmp_path / "good", model_dir=art["model_dir"], onnx=out / "model.onnx",
                          settings=settings)
    assert good.passed and good.summary["comparisons"]["onnx_kv_decode"] == "pass"
    gen = json.loads(good.report_json.read_text())["comparisons"][-1]["details"]["generation"]
    assert any("KV-cache" in k and v["identical"] for k, v in gen.items())
    m = onnx.load(str(out / "decode.onnx"))
    init = next(i for i in m.graph.initializer if i.name == "layers.1.w2")
    w = numpy_helper.to_array(init).copy()
    w[3, 4] += 0.05
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(m, str(out / "decode.onnx"))
    bad = evaluate_model(out_dir=tmp_path / "bad", model_dir=art["model_dir"], onnx=out / "model.onnx",
                         settings=settings)
    st = bad.summary["comparisons"]
    assert not bad.passed and st["onnx_kv_decode"] == "fail" and st["torch_vs_onnx"] == "pass"


def test_nothing_compared_is_not_a_pass(art, tmp_path):
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], settings=FAST)
    assert not r.passed and "nothing was compared" in r.summary["verdict"]
