"""evaluate_model on the debug model: unified dir vs its ONNX export, fault injection, dtypes, bad inputs."""

import csv
import json
from pathlib import Path

import onnx
import pytest
import torch
import numpy as np
from onnx import numpy_helper
from safetensors.torch import save_file
from typer.testing import CliRunner

pytest.importorskip("onnxruntime")

from titan_pipe.config import ExportConfig
from titan_pipe.cli import app  # noqa: E402
from titan_pipe.config import EvaluateConfig  # noqa: E402
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.errors import UserError  # noqa: E402
from titan_pipe.evaluate.api import evaluate_model  # noqa: E402
from titan_pipe.evaluate.metrics import CSV_COLUMNS  # noqa: E402
from titan_pipe.model.args import resolve_args
from titan_pipe.model.names import native_to_hf
from titan_pipe.model.hf_config import to_hf_config
from titan_pipe.model.transformer import build_model

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
    """A deployment export: no extra outputs; per-layer values are named in export.json."""
    return export_model(model_dir, out, ExportConfig(dtype=dtype, kv_cache=False, atc=False)).onnx


LAYER_ROWS = [f"{k}.{i}" for i in range(4) for k in ("attn_out", "mlp_out", "hidden")]
# evaluate.max_memory for each mode on the debug model: everything loaded, or one layer at a time
# (its largest piece needs < 1 MB, the whole evaluation ~5 MB)
MODES = pytest.mark.parametrize("memory", ["auto", "2MB"], ids=["whole", "streamed"])


def ran_in(report_json: Path, memory: str) -> None:
    mode = json.loads(report_json.read_text())["memory"]["mode"]
    assert mode == ("whole" if memory == "auto" else "streamed"), mode


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    model, args = debug_model()
    md = write_unified(model, args, root / "model")
    return {
        "root": root,
        "model": model,
        "args": args,
        "model_dir": md,
        "onnx32": export(md, root / "onnx32"),
        "onnx16": export(md, root / "onnx16", "float16"),
    }


def test_float32_export_passes_and_report_parses(art, tmp_path):
    settings = EvaluateConfig(batches=1, batch_size=2, seq_len=32, prompts=2, new_tokens=6)
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx32"], settings=settings)
    assert r.passed, r.summary.verdict
    st = r.summary.comparisons
    assert st["torch_vs_onnx"] == "pass" and st["operators"] == "pass" and st["task"] == "pass"
    assert st["om"] == "skipped: no Ascend runtime"
    assert st["npu_fused"] == "skipped: no NPU"
    assert st["sharded_vs_unified"] == "skipped: no --checkpoint given"
    rep = json.loads(r.report_json.read_text())
    assert rep["schema"] == "titan-pipe/evaluate-report" and rep["schema_version"] == 1
    onnx_cmp = next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in onnx_cmp["rows"]] == LAYER_ROWS + ["logits"]
    assert "export.json" in onnx_cmp["details"]["layers"] and "bit for bit" in onnx_cmp["details"]["layers"]
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


@MODES
def test_perturbed_onnx_weight_fails_at_that_layer(art, tmp_path, memory):
    m = onnx.load(str(art["onnx32"]))
    init = next(i for i in m.graph.initializer if i.name == "layers.2.w2")
    w = numpy_helper.to_array(init).copy()
    w[5, 7] += 0.05  # one weight of layer 2's down projection
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "model.onnx"
    onnx.save(m, str(bad))
    (tmp_path / "export.json").write_bytes((art["onnx32"].parent / "export.json").read_bytes())
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        model_dir=art["model_dir"],
        onnx=bad,
        settings=FAST.model_copy(update={"max_memory": memory}),
    )
    ran_in(r.report_json, memory)
    assert not r.passed
    assert r.summary.first_failing_layer["layer"] == 2
    rows = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")["rows"]
    assert all(row["status"] == "pass" for row in rows if row["layer"] in (0, 1))
    assert {row["tensor"]: row["status"] for row in rows}["attn_out.2"] == "pass"  # before the fault
    assert "layer 2" in r.summary.verdict


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
    assert r.summary.first_failing_layer["layer"] == 0


def test_float16_export_passes_fp16_thresholds_and_fails_fp32(art, tmp_path):
    r16 = evaluate_model(out_dir=tmp_path / "a", model_dir=art["model_dir"], onnx=art["onnx16"], settings=FAST)
    assert r16.passed, r16.summary.verdict
    rep = json.loads(r16.report_json.read_text())
    c16 = next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")
    assert c16["dtype"] == "float16"
    # per-layer rows from the float16 graph's own values, each above float32 noise, within fp16 bounds
    assert [row["tensor"] for row in c16["rows"]] == LAYER_ROWS + ["logits"]
    assert "export.json" in c16["details"]["layers"]
    hidden = [row["metrics"]["rel_euclidean"] for row in c16["rows"] if row["tensor"].startswith("hidden.")]
    assert all(1e-5 < x < 0.05 for x in hidden), hidden
    r32 = evaluate_model(
        out_dir=tmp_path / "b",
        model_dir=art["model_dir"],
        onnx=art["onnx16"],
        settings=FAST.model_copy(update={"dtype": "float32"}),
    )
    assert not r32.passed
    assert r32.summary.comparisons["torch_vs_onnx"] == "fail"


def test_flow_thresholds_override_changes_the_verdict(art, tmp_path):
    strict = FAST.model_copy(update={"thresholds": {"float16": {"rel_euclidean_max": 1e-6}}})
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx16"], settings=strict)
    assert not r.passed and "rel_euclidean_max" in r.summary.verdict


def test_mismatched_config_and_graph_is_a_clear_error(art, tmp_path):
    model, args = debug_model(n_layers=2)
    other = write_unified(model, args, tmp_path / "two_layers")
    with pytest.raises(UserError, match=r"does not match .*config\.json.*2 hidden|n_layers 2"):
        evaluate_model(out_dir=tmp_path / "rep", model_dir=other, onnx=art["onnx32"], settings=FAST)
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "needs a reference"),
        ({"model_dir": "missing"}, "--model-dir .*missing: does not exist"),
        ({"onnx": "nope.onnx", "model_dir": None}, "--onnx .*nope.onnx: does not exist"),
    ],
)
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
    common = [
        "evaluate",
        "--model-dir",
        str(art["model_dir"]),
        "--no-operators",
        "--batches",
        "1",
        "--config",
        str(flow),
    ]
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
        evaluate_model(
            out_dir=tmp_path / "rep", checkpoint=tmp_path / "step-000001", model_dir=art["model_dir"], settings=FAST
        )


def test_layer_outputs_out_of_graph_order_fall_back_to_the_structure(art, tmp_path):
    """An export.json whose layer_outputs name real values in another order was an IndexError (67
    lines) in the piece-wise runner: now the record is set aside, in words, and the graph's own
    residual chain gives the layers (the verdict as before)."""
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in art["onnx32"].parent.glob("model.onnx*"):
        (edited / f.name).write_bytes(f.read_bytes())
    record = json.loads((art["onnx32"].parent / "export.json").read_text())
    outs = record["graphs"]["model.onnx"]["layer_outputs"]
    outs[0], outs[2] = outs[2], outs[0]
    (edited / "export.json").write_text(json.dumps(record))
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=edited / "model.onnx", settings=FAST)
    assert r.passed, r.summary.verdict
    c = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in c["rows"]] == LAYER_ROWS + ["logits"]
    assert "computes it before layer" in c["details"]["layers"] and "residual" in c["details"]["layers"]


def test_a_graph_of_another_ffn_width_is_named_as_another_model(art, tmp_path):
    """A graph exported from a model of another FFN width was reported as a layer-0 divergence."""
    from titan_pipe.errors import UserError

    wide, wide_args = debug_model(ffn_hidden_dim=256)
    onnx_path = export(write_unified(wide, wide_args, tmp_path / "wide"), tmp_path / "wide_onnx")
    with pytest.raises(UserError) as e:
        evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=onnx_path, settings=FAST)
    msg = str(e.value)
    assert "does not match" in msg and "'layers.0.w1' is [256, 64] in the graph vs [192, 64]" in msg, msg
    assert not (tmp_path / "rep").exists()


def test_graph_without_export_json_falls_back_to_its_structure(art, tmp_path):
    """A graph titan-pipe did not describe (no export.json beside it): the residual Add chain gives
    the per-layer values; a graph whose chain does not split into the model's layers says why."""
    alone = tmp_path / "alone" / "model.onnx"
    alone.parent.mkdir()
    for f in art["onnx32"].parent.glob("model.onnx*"):  # the graph and its external data, no export.json
        (alone.parent / f.name).write_bytes(f.read_bytes())
    last = json.loads((art["onnx32"].parent / "export.json").read_text())["graphs"]["model.onnx"]["layer_outputs"][-1]
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=alone, settings=FAST)
    assert r.passed, r.summary.verdict
    c = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in c["rows"]] == LAYER_ROWS + ["logits"]
    assert "no export.json" in c["details"]["layers"] and "residual" in c["details"]["layers"]
    # an extra Add on the residual stream: 9 links for 4 layers, so no per-layer rows, and it says so
    m = onnx.load(str(alone))
    producer = next(n for n in m.graph.node if last in n.output)
    zero = numpy_helper.from_array(np.zeros((), dtype=np.float32), "zero_extra")
    m.graph.initializer.append(zero)
    for n in m.graph.node:
        n.input[:] = [last + "x" if i == last else i for i in n.input]
    m.graph.node.insert(
        list(m.graph.node).index(producer) + 1, onnx.helper.make_node("Add", [last, "zero_extra"], [last + "x"])
    )
    odd = tmp_path / "odd" / "model.onnx"
    odd.parent.mkdir()
    onnx.save(m, str(odd))
    r = evaluate_model(out_dir=tmp_path / "rep2", model_dir=art["model_dir"], onnx=odd, settings=FAST)
    c = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [row["tensor"] for row in c["rows"]] == ["logits"]
    assert "9 links, not 2 x 4 layers" in c["details"]["layers"]


def _scaled_copy(src: Path, dst: Path, graph: str, layer: int, factor: float = 1.5) -> str:
    """Copy an export dir and multiply one 2-D weight of ``layer`` inside ``graph`` by ``factor``
    (the other graph and every other file untouched). Returns the initializer's name."""
    import re
    import shutil

    shutil.copytree(src, dst)
    m = onnx.load(str(dst / graph))  # with its weights, wherever they are stored
    pat = re.compile(rf"(^|[./_])layers[./_]{layer}[./_]")
    cands = [i for i in m.graph.initializer if pat.search(i.name) and len(i.dims) == 2]
    init = next((i for i in cands if "w2" in i.name or "down" in i.name), cands[0])
    w = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((w * factor).astype(w.dtype), init.name))
    onnx.save(m, str(dst / graph))  # weights inline: the other graph keeps its own (shared) data file
    return init.name


@pytest.fixture(scope="module")
def kv_export(art):
    out = art["root"] / "kv"
    export_model(art["model_dir"], out, ExportConfig(kv_cache=True, atc=False))
    return out


KV = FAST.model_copy(update={"prompts": 2, "new_tokens": 4})


def test_honest_kv_export_passes_with_per_layer_rows_of_both_graphs(art, kv_export, tmp_path):
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=kv_export / "model.onnx", settings=KV)
    assert r.passed, r.summary.verdict
    rep = json.loads(r.report_json.read_text())
    for cid in ("torch_vs_onnx", "onnx_kv_decode"):
        c = next(c for c in rep["comparisons"] if c["id"] == cid)
        assert [row["tensor"] for row in c["rows"]] == LAYER_ROWS + ["logits"], cid
    dec = next(c for c in rep["comparisons"] if c["id"] == "onnx_kv_decode")
    assert dec["rows"][0]["shape"] == [2, 3, 64]  # 3 decode steps of 2 prompts
    assert "decode.onnx" in dec["details"]["layers"] and "export.json" in dec["details"]["layers"]
    html = (tmp_path / "rep" / "report.html").read_text()
    assert "alt='layer_error.png'" in html  # the per-layer plot of the deployed graphs


@MODES
@pytest.mark.parametrize("graph, cid", [("model.onnx", "torch_vs_onnx"), ("decode.onnx", "onnx_kv_decode")])
@pytest.mark.parametrize("layer", [1, 3])
def test_scaled_weight_in_deployed_graph_is_named_at_its_layer(art, kv_export, tmp_path, graph, cid, layer, memory):
    bad = tmp_path / "bad"
    name = _scaled_copy(kv_export, bad, graph, layer)
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        model_dir=art["model_dir"],
        onnx=bad / "model.onnx",
        settings=KV.model_copy(update={"max_memory": memory}),
    )
    ran_in(r.report_json, memory)
    assert not r.passed
    first = r.summary.first_failing_layer
    assert (first["comparison"], first["layer"]) == (cid, layer), (name, first)
    assert f"first divergence at layer {layer} ({cid}" in r.summary.verdict
    rows = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == cid)["rows"]
    assert all(row["status"] == "pass" for row in rows if row["layer"] is not None and row["layer"] < layer)
    if graph == "decode.onnx":  # the prefill graph is untouched and still passes
        assert r.summary.comparisons["torch_vs_onnx"] == "pass"
    assert (tmp_path / "rep" / "layer_error.png").stat().st_size > 1000
    if (graph, layer, memory) == ("model.onnx", 3, "auto"):  # and through the CLI: exit 1, the layer named
        res = CliRunner().invoke(
            app,
            [
                "evaluate",
                "--model-dir",
                str(art["model_dir"]),
                "--onnx",
                str(bad / "model.onnx"),
                "--no-operators",
                "--batches",
                "1",
                "-o",
                str(tmp_path / "cli"),
            ],
        )
        assert res.exit_code == 1 and "first divergence at layer 3" in " ".join(res.output.split()), res.output


def test_om_without_ascend_runtime_is_skipped_not_passed(art, tmp_path):
    om = tmp_path / "model.om"
    om.write_bytes(b"not run here")
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], om=om, settings=FAST)
    assert r.summary.comparisons["om"].startswith("skipped: no Ascend runtime")


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


@MODES
def test_kv_cache_decode_graph_is_checked_on_its_own(art, kv_export, tmp_path, memory):
    """decode.onnx is what generation runs: a fault only there fails onnx_kv_decode, not the prefill rows."""
    kv = KV.model_copy(update={"max_memory": memory})
    good = evaluate_model(
        out_dir=tmp_path / "good", model_dir=art["model_dir"], onnx=kv_export / "model.onnx", settings=kv
    )
    ran_in(good.report_json, memory)
    assert good.passed and good.summary.comparisons["onnx_kv_decode"] == "pass"
    gen = json.loads(good.report_json.read_text())["comparisons"][-1]["details"]["generation"]
    assert any("KV-cache" in k and v["identical"] for k, v in gen.items())
    out = tmp_path / "kv"
    import shutil

    shutil.copytree(kv_export, out)
    m = onnx.load(str(out / "decode.onnx"))
    init = next(i for i in m.graph.initializer if i.name == "layers.1.w2")
    w = numpy_helper.to_array(init).copy()
    w[3, 4] += 0.05
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(m, str(out / "decode.onnx"))
    bad = evaluate_model(out_dir=tmp_path / "bad", model_dir=art["model_dir"], onnx=out / "model.onnx", settings=kv)
    st = bad.summary.comparisons
    assert not bad.passed and st["onnx_kv_decode"] == "fail" and st["torch_vs_onnx"] == "pass"
    assert bad.summary.first_failing_layer["layer"] == 1


def test_model_without_tokenizer_runs_on_random_ids_and_a_tokenizer_is_kept(art, tmp_path):
    """No tokenizer and no --data: seeded random ids inside the vocab (labelled); a model dir whose
    provenance says it was trained with the byte tokenizer keeps using it."""
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=art["onnx32"], settings=FAST)
    data = json.loads(r.report_json.read_text())["data"]
    assert data["tokenizer"] == "none (random token ids)" and data["source"].startswith("random token ids (seed 0")
    assert "carries no tokenizer" in data["source"]
    from titan_pipe.evaluate.batches import load_eval_data

    kw = dict(data=None, vocab_size=300, n_batches=2, batch_size=2, seq_len=16, n_prompts=1, prompt_len=4)
    a = load_eval_data(model_dir=art["model_dir"], **kw)
    b = load_eval_data(model_dir=art["model_dir"], **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.batches, b.batches))  # seeded
    ids = torch.cat(a.batches)
    assert int(ids.max()) < 300 and int(ids.max()) > 256  # the whole vocab, not just bytes
    byte_dir = tmp_path / "byte_model"
    byte_dir.mkdir()
    (byte_dir / "provenance.json").write_text(json.dumps({"tokenizer": {"tokenizer": "byte", "files": {}}}))
    c = load_eval_data(model_dir=byte_dir, **kw)
    assert c.tokenizer == "byte" and "validation split" in c.source


def test_nothing_compared_is_not_a_pass(art, tmp_path):
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], settings=FAST)
    assert not r.passed and "nothing was compared" in r.summary.verdict


def test_reference_device_absent_is_one_line_error_and_cpu_is_named(art, tmp_path):
    """--device picks where the PyTorch reference runs; an absent accelerator is a one-line error
    before any work (this machine has neither CUDA nor an NPU)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(UserError, match=r"^--device cuda: device: cuda, but CUDA is not available"):
        evaluate_model(
            out_dir=tmp_path / "rep",
            model_dir=art["model_dir"],
            onnx=art["onnx32"],
            settings=FAST.model_copy(update={"device": "cuda"}),
        )
    assert not (tmp_path / "rep").exists()
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        model_dir=art["model_dir"],
        onnx=art["onnx32"],
        settings=FAST.model_copy(update={"device": "auto"}),
    )
    assert r.passed and json.loads(r.report_json.read_text())["settings"]["device"] == "auto"


@pytest.mark.parametrize("static", [False, True])
def test_kv_decode_row_runs_the_generation_loop(art, tmp_path, static):
    """onnx_kv_decode: a left-padded batch of prompts of 12 down to 6 tokens through the reference loop,
    on dynamic graphs and on static ones (batch 2), against PyTorch on each prompt alone."""
    kw = dict(dynamic=False, batch=2, seq_len=32, cache_len=40) if static else {}
    res = export_model(art["model_dir"], tmp_path / "onnx", ExportConfig(atc=False, **kw))
    settings = EvaluateConfig(
        operators=False, batches=2, batch_size=2, seq_len=32, prompts=3, prompt_len=12, new_tokens=6
    )
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=res.onnx, settings=settings)
    rep = json.loads(r.report_json.read_text())
    row = next(c for c in rep["comparisons"] if c["id"] == "onnx_kv_decode")
    assert row["status"] == "pass" and r.passed, r.summary.verdict
    assert row["details"]["graphs"] == ("static" if static else "dynamic")
    assert "left-padded, lengths [12, " in row["details"]["positions"] and row["details"]["positions"].endswith(", 6]")
    assert row["details"]["generation"]["identical"]
    assert row["rows"][-1]["metrics"]["max_abs"] <= 1e-4
    # decode.onnx's own per-layer values: 5 teacher-forced steps of each of the 3 prompts (static: 2 batches)
    assert [r["tensor"] for r in row["rows"]] == LAYER_ROWS + ["logits"]
    assert row["rows"][0]["shape"] == [3, 5, 64]
    gen = next(c for c in rep["comparisons"] if c["id"] == "task")["details"]["generation"]
    assert all(g["identical"] for g in gen.values())


def test_fp16_passes_a_massive_activation_and_still_names_a_perturbed_layer(tmp_path):
    """One channel of the residual stream at 22,000 for every token (the "massive activation" released
    models carry, where fp16 rounds in steps of 16): the fp16 export passes with identical greedy
    tokens, though its max abs error is past the absolute msprobe bound of 1; the same graph with one
    channel of layer 2's down projection scaled fails, named at layer 2."""
    model, args = debug_model(seed=3)
    with torch.no_grad():
        # 22,000-22,016 by token: between fp16's steps of 16, as a released model's values fall
        model.tok_embeddings.weight[:, 11] = (
            2.2e4 + torch.rand(args.vocab_size, generator=torch.Generator().manual_seed(0)) * 16
        )
    md = write_unified(model, args, tmp_path / "model")
    onnx16 = export(md, tmp_path / "onnx16", "float16")
    settings = FAST.model_copy(update={"prompts": 2, "new_tokens": 6})
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=md, onnx=onnx16, settings=settings)
    rep = json.loads(r.report_json.read_text())
    rows = next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")["rows"]
    hidden = [row["metrics"] for row in rows if row["tensor"].startswith("hidden.")]
    assert max(m["max_abs"] for m in hidden) > 1.0  # the absolute rule would have cried FAIL here
    assert max(m["max_scaled"] for m in hidden) < 1e-2
    assert r.passed, r.summary.verdict
    task = next(c for c in rep["comparisons"] if c["id"] == "task")
    assert all(g["identical"] for g in task["details"]["generation"].values())

    m = onnx.load(str(onnx16))
    init = next(i for i in m.graph.initializer if i.name == "layers.2.w2")
    w = numpy_helper.to_array(init).copy()
    w[5, :] *= 3  # one output channel of layer 2's MLP (rows: out, cols: in) three times too large
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "bad" / "model.onnx"
    bad.parent.mkdir()
    onnx.save(m, str(bad))
    (bad.parent / "export.json").write_bytes((onnx16.parent / "export.json").read_bytes())
    r = evaluate_model(out_dir=tmp_path / "rep2", model_dir=md, onnx=bad, settings=settings)
    assert not r.passed and r.summary.first_failing_layer["layer"] == 2, r.summary.verdict
