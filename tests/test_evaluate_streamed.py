"""Layer-streamed evaluation: the same rows and verdict as whole-graph mode, pieces that compute what the
whole graph computes, and a budget too small for one layer refused before any work."""

import json
import math

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("onnxruntime")

from test_evaluate_model import LAYER_ROWS, debug_model, write_unified  # noqa: E402
from titan_pipe.config import ExportConfig
from titan_pipe.cli import app  # noqa: E402
from titan_pipe.config import EvaluateConfig  # noqa: E402
from titan_pipe.convert.onnx.export import export_model  # noqa: E402
from titan_pipe.errors import UserError  # noqa: E402
from titan_pipe.evaluate.api import evaluate_model  # noqa: E402
from titan_pipe.evaluate.runners.ort import OnnxRuntimeRunner  # noqa: E402
from titan_pipe.evaluate.runners.ort_layers import LayerChain  # noqa: E402
from titan_pipe.graphs.generation import ort_session  # noqa: E402

SETTINGS = EvaluateConfig(operators=False, batches=2, batch_size=2, seq_len=32, prompts=2, new_tokens=5)


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    model, args = debug_model()
    md = write_unified(model, args, root / "model")
    onnx = {
        dt: export_model(md, root / dt, ExportConfig(dtype=dt, kv_cache=True, atc=False)).onnx
        for dt in ("float32", "float16")
    }
    return {"model_dir": md, "args": args, "onnx": onnx}


def _report(art, tmp_path, dtype: str, memory: str) -> dict:
    r = evaluate_model(
        out_dir=tmp_path / f"{dtype}-{memory}",
        model_dir=art["model_dir"],
        onnx=art["onnx"][dtype],
        settings=SETTINGS.model_copy(update={"max_memory": memory}),
    )
    return json.loads(r.report_json.read_text())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_streamed_rows_equal_whole_graph_rows(art, tmp_path, dtype):
    whole, streamed = _report(art, tmp_path, dtype, "auto"), _report(art, tmp_path, dtype, "2MB")
    assert (whole["memory"]["mode"], streamed["memory"]["mode"]) == ("whole", "streamed")
    assert "one layer at a time" in streamed["memory"]["why"] and "fits" in whole["memory"]["why"]
    assert whole["verdict"]["text"] == streamed["verdict"]["text"] and whole["passed"] == streamed["passed"]
    pairs = 0
    for a, b in zip(whole["comparisons"], streamed["comparisons"], strict=True):
        assert (a["id"], a["status"]) == (b["id"], b["status"])
        assert [r["tensor"] for r in a["rows"]] == [r["tensor"] for r in b["rows"]]
        for ra, rb in zip(a["rows"], b["rows"]):
            for key, va in ra["metrics"].items():
                vb = rb["metrics"][key]
                if isinstance(va, float) and math.isfinite(va):
                    assert vb == pytest.approx(va, rel=1e-6, abs=1e-300), (a["id"], ra["tensor"], key)
                    pairs += 1
    rows = {c["id"]: [r["tensor"] for r in c["rows"]] for c in streamed["comparisons"]}
    assert rows["torch_vs_onnx"] == rows["onnx_kv_decode"] == LAYER_ROWS + ["logits"]
    assert pairs > 400  # every finite measure of 2 x 13 rows
    onnx_row = next(c for c in streamed["comparisons"] if c["id"] == "torch_vs_onnx")
    assert [e["layer"] for e in onnx_row["details"]["own_error"]] == [0, 1, 2, 3]  # each layer on the reference's input


def test_pieces_compute_what_the_whole_graph_computes(art):
    """float32: every layer's values and the logits of the chained pieces equal, bit for bit, those of
    the whole graph in one session (the graph with the recorded values added as outputs)."""
    path = art["onnx"]["float32"]
    ort = OnnxRuntimeRunner(path)
    ort.find_layers(art["args"].n_layers)
    chain = LayerChain(ort.graph)
    assert [p.name for p in chain.pieces] == ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "head"]
    inits = {t.name for p in chain.pieces for t in p.model.graph.initializer if len(t.dims) == 2}
    whole_inits = {t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer if len(t.dims) == 2}
    assert inits == whole_inits  # every weight in some piece, nothing re-exported
    tokens = torch.randint(0, art["args"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    got = chain.outputs([ort.feeds(tokens)])[0]
    m = onnx.load(str(path), load_external_data=False)
    names = [n for n in ort.graph.taps.names()]
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    whole = ort_session(m, external_dir=path.parent).run(["logits"] + names, ort.feeds(tokens))
    assert np.array_equal(whole[0], got.logits.numpy())
    value = dict(zip(names, whole[1:]))
    t = ort.graph.taps
    for i in range(art["args"].n_layers):
        assert np.array_equal(value[t.layer[i]], got.hidden[i].numpy())
        assert np.array_equal(value[t.attn[i]], got.attn[i].numpy())


def test_evaluate_sessions_leave_the_weights_unpacked(art):
    """evaluate's sessions, whole graph and pieces, skip ONNX Runtime's weight pre-packing (each runs a
    few dozen times: packing cost more time and memory than it saved, docs/evaluate.md); their logits
    are a default session's to rounding."""
    path = art["onnx"]["float32"]
    ort = OnnxRuntimeRunner(path)
    ort.find_layers(art["args"].n_layers)
    chain = LayerChain(ort.graph)

    def unpacked(session) -> bool:
        try:
            return session.get_session_options().get_session_config_entry("session.disable_prepacking") == "1"
        except RuntimeError:  # ONNX Runtime's answer for an entry never set
            return False

    default = ort_session(path)
    assert unpacked(ort.session) and unpacked(chain.session(chain.pieces[1])) and not unpacked(default)
    tokens = torch.randint(0, art["args"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    got, packed = (s.run(["logits"], ort.feeds(tokens))[0] for s in (ort.session, default))
    np.testing.assert_allclose(got, packed, rtol=1e-4, atol=1e-5)


def test_budget_too_small_for_one_layer_is_one_line(art, tmp_path):
    with pytest.raises(
        UserError,
        match=r"^--max-memory 100kB \(100 kB\): too small for one layer: .*layer \d.* "
        r"needs ~[0-9.]+ kB; give at least",
    ):
        evaluate_model(
            out_dir=tmp_path / "rep",
            model_dir=art["model_dir"],
            onnx=art["onnx"]["float32"],
            settings=SETTINGS.model_copy(update={"max_memory": "100kB"}),
        )
    res = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--model-dir",
            str(art["model_dir"]),
            "--onnx",
            str(art["onnx"]["float32"]),
            "--max-memory",
            "100kB",
            "-o",
            str(tmp_path / "cli"),
        ],
    )
    assert res.exit_code == 1 and "too small for one layer" in res.output and "Traceback" not in res.output
    assert len([ln for ln in res.output.strip().splitlines() if ln.strip()]) <= 3  # one message (wrapped)
    bad = CliRunner().invoke(
        app, ["evaluate", "--model-dir", str(art["model_dir"]), "--max-memory", "lots", "-o", str(tmp_path / "cli2")]
    )
    assert bad.exit_code == 1 and "'lots' is not a size" in bad.output
    assert not (tmp_path / "rep").exists() and not (tmp_path / "cli").exists() and not (tmp_path / "cli2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_graph_that_cannot_stream_is_refused_when_it_does_not_fit(art, tmp_path):
    """No export.json and a residual chain that does not split into layers: no pieces to stream, so a
    budget the whole graph exceeds is one line, not a silent whole-graph run."""
    alone = tmp_path / "alone"
    alone.mkdir()
    src = art["onnx"]["float32"].parent
    m = onnx.load(str(src / "model.onnx"))  # its weights inline: no export.json, no external data
    for n in m.graph.node:  # rename the residual Adds so the structure gives no layers
        if n.op_type == "Add":
            n.op_type = "Sum"
    onnx.save(m, str(alone / "model.onnx"))
    with pytest.raises(UserError, match="cannot go one layer at a time"):
        evaluate_model(
            out_dir=tmp_path / "rep",
            model_dir=art["model_dir"],
            onnx=alone / "model.onnx",
            settings=SETTINGS.model_copy(update={"max_memory": "2MB"}),
        )
    r = evaluate_model(
        out_dir=tmp_path / "rep", model_dir=art["model_dir"], onnx=alone / "model.onnx", settings=SETTINGS
    )
    rows = next(c for c in json.loads(r.report_json.read_text())["comparisons"] if c["id"] == "torch_vs_onnx")["rows"]
    assert r.passed and [row["tensor"] for row in rows] == ["logits"]


def test_session_budget_keeps_what_fits_and_never_more(art, monkeypatch):
    """The sessions kept between passes (ort_layers.Sessions): a session opens only where what is open
    plus it fits in the budget (or nothing else is open), so a budget of one layer never holds two
    layers' sessions; with room for every piece a second pass opens none; with room for two layers
    it opens fewer than streaming does. The values are the same bit for bit whichever the budget."""
    import titan_pipe.evaluate.runners.ort_layers as ol

    ort = OnnxRuntimeRunner(art["onnx"]["float16"])
    ort.find_layers(art["args"].n_layers)
    tokens = torch.randint(0, art["args"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    feeds = [ort.feeds(tokens)]
    need = lambda p: 3 * p.weight_bytes  # noqa: E731  (memory.ort_bytes of a float16 graph)
    pieces = LayerChain(ort.graph).pieces
    layer = max(need(p) for p in pieces[1:-1])
    opened: list[tuple[int, int, int, int]] = []  # (sessions open, bytes held, layers open, its need) at each open

    def run(budget):
        sessions = ol.Sessions(budget)
        chain = LayerChain(ort.graph, sessions=sessions, need=need)
        piece_of = {id(p.model): p for p in chain.pieces}
        real = ol.ort_session

        def spy(model, **kw):
            p = piece_of[id(model)]
            layers = sum(1 for _, name in sessions.open if name.startswith("layer")) + (p.layer is not None)
            opened.append((len(sessions.open), sessions.held, layers, need(p)))
            return real(model, **kw)

        monkeypatch.setattr(ol, "ort_session", spy)
        first, second = chain.outputs(feeds)[0], chain.outputs(feeds)[0]
        monkeypatch.setattr(ol, "ort_session", real)
        return first, second

    one, again = run(layer)
    assert len(opened) > len(pieces) and all(n == 0 or held + p <= layer for n, held, _, p in opened)
    assert max(layers for _, _, layers, _ in opened) == 1  # one layer's budget: one layer's session at a time
    opened.clear()
    every, kept = run(None)
    assert len(opened) == len(pieces)  # the second pass opened nothing
    opened.clear()
    two, two_again = run(2 * layer)
    assert len(pieces) < len(opened) < 2 * len(pieces)
    assert all(n == 0 or held + p <= 2 * layer for n, held, _, p in opened)
    for a in (again, every, kept, two, two_again):
        assert np.array_equal(a.logits.numpy(), one.logits.numpy())
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.hidden, one.hidden))


@pytest.mark.parametrize("memory", ["auto", "2MB"])
def test_each_piece_opens_once_and_the_report_times_each_step(art, tmp_path, monkeypatch, memory):
    """The torch_vs_onnx row's pass over the prefill graph's pieces also prefills the KV row's
    prompts, so each piece of each graph opens one session in the whole evaluation, whole or
    streamed (before, the KV row opened every prefill piece again); report.json and report.md
    give the seconds of each step that ran."""
    import titan_pipe.evaluate.runners.ort_layers as ol

    opened: dict[int, int] = {}
    real = ol.ort_session

    def spy(model, **kw):
        opened[id(model)] = opened.get(id(model), 0) + 1
        return real(model, **kw)

    monkeypatch.setattr(ol, "ort_session", spy)
    out = tmp_path / memory
    r = evaluate_model(
        out_dir=out,
        model_dir=art["model_dir"],
        onnx=art["onnx"]["float32"],
        settings=SETTINGS.model_copy(update={"max_memory": memory}),
    )
    n_pieces = art["args"].n_layers + 2  # embedding, each layer, head
    assert r.passed and len(opened) == 2 * n_pieces and set(opened.values()) == {1}  # prefill and decode pieces
    report = json.loads(r.report_json.read_text())
    took = report["seconds"]
    assert {"set-up", "reference generation", "reference forward", "torch_vs_onnx", "onnx_kv_decode"} <= set(took)
    assert all(v >= 0 for v in took.values()) and took["onnx_kv_decode"] > 0
    assert not any(k.startswith(("om", "npu_fused", "sharded")) for k in took)  # skipped rows take no time
    assert "\nTime: " in (out / "report.md").read_text()


def test_decode_caches_count_in_the_budget_and_prompts_are_held_at_their_length(art, tmp_path):
    """A decode layer's need counts the caches its steps run on: a static cache of 256 slots needs more
    than one of 48 by at least three times the extra cache bytes (the caches in, out, and the last
    step's kept), so a budget that holds the layer's weights but not its caches is refused before any
    work. And the prefill run kept for every layer at once (ort_layers.Prefilled) holds the prompt
    positions only: its size does not grow with the cache's slots (it did: every layer's caches
    padded to C slots, which for a 7B-width static 4096-slot export went 1 GB over --max-memory)."""
    from titan_pipe.evaluate.graph_pieces import past_bytes
    from titan_pipe.evaluate.runners.ort import OnnxDecodeRunner
    from titan_pipe.evaluate.runners.ort_layers import prefill
    from titan_pipe.graphs.generation import plan_batches
    from titan_pipe.rules.sizes import parse_size

    def needs(cache_len: int):
        onnx = export_model(
            art["model_dir"],
            tmp_path / f"c{cache_len}",
            ExportConfig(
                dtype="float32", kv_cache=True, dynamic=False, batch=1, seq_len=32, cache_len=cache_len, atc=False
            ),
        ).onnx
        with pytest.raises(UserError, match=r"too small for one layer: decode\.onnx layer \d") as e:
            evaluate_model(
                out_dir=tmp_path / "rep",
                model_dir=art["model_dir"],
                onnx=onnx,
                settings=SETTINGS.model_copy(update={"max_memory": "1kB"}),
            )
        need = parse_size(e.value.args[0].split("needs ~")[1].split(";")[0].replace(" ", ""))  # 3 digits
        ort = OnnxRuntimeRunner(onnx)
        ort.find_layers(art["args"].n_layers)
        dec = OnnxDecodeRunner.beside(ort)
        dec.find_layers(art["args"].n_layers)
        return need, ort, dec

    small, _, dec_small = needs(48)
    large, ort, dec = needs(256)
    extra = past_bytes(LayerChain(dec.graph).layers[0], rows=1, slots=0) - past_bytes(
        LayerChain(dec_small.graph).layers[0], rows=1, slots=0
    )
    assert extra == 2 * 2 * (256 - 48) * 16 * 4  # key and value, 2 KV heads of 16, float32
    assert large - small >= 3 * extra
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    plan = plan_batches(prefill=ort.graph.io, decode=dec.graph.io, prompts=prompts, max_new_tokens=4)
    pre = prefill(LayerChain(ort.graph), plan)
    held = [v for layer in pre.caches for batch in layer for v in batch.values()]
    assert len(held) == 2 * len(plan) * art["args"].n_layers
    assert all(
        v.shape[2] == pb.ids.shape[1] < pb.cache_len == 256
        for layer in pre.caches
        for pb, batch in zip(plan, layer)
        for v in batch.values()
    )
