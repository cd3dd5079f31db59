"""The .om per-layer path without an Ascend host: a dump directory written to the msit/ACL naming
(converted .npy files under {time}/{device}/{model}/{model_id}/{index}/), mapped onto the ONNX graph's
per-layer values, including a fused operator recorded in the ATC model json."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("onnxruntime")

from titan_pipe.config import ExportConfig
from titan_pipe.convert.onnx.export import export_model  # noqa: E402
from titan_pipe.evaluate.compare import compare_outputs  # noqa: E402
from titan_pipe.evaluate.om_dump import (
    acl_dump_config,
    load_layer,
    map_values_to_dump,
    read_fusion_json,  # noqa: E402
    safe_name,
    scan_dump,
)
from titan_pipe.evaluate.runners.ort import OnnxRuntimeRunner  # noqa: E402
from titan_pipe.evaluate.runners.ort_layers import LayerChain  # noqa: E402
from titan_pipe.evaluate.runners.outputs import Outputs  # noqa: E402
from titan_pipe.evaluate.runners.pytorch import LayeredModel  # noqa: E402
from titan_pipe.rules.thresholds import resolve_thresholds  # noqa: E402


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    from test_evaluate_model import debug_model, write_unified

    root = tmp_path_factory.mktemp("omdump")
    model, args = debug_model()
    md = write_unified(model, args, root / "model")
    onnx_path = export_model(md, root / "onnx", ExportConfig(kv_cache=False, atc=False)).onnx
    ort = OnnxRuntimeRunner(onnx_path)
    ort.find_layers(args.n_layers)
    return {"root": root, "model_dir": md, "ort": ort, "args": args}


def _write_dump(root: Path, graph: onnx.ModelProto, values: dict[str, np.ndarray], fused: dict[str, list[str]]):
    """A recorded example of `msaccucmp convert` output for one inference, as an .om would dump it:
    one file per operator output, ONNX node names with '/' and '.' written '_', fused operators
    under their own name."""
    leaf = root / "20261203101500" / "0" / "model" / "1" / "0"
    leaf.mkdir(parents=True)
    producer = {o: (n, i) for n in graph.node for i, o in enumerate(n.output)}
    replaced = {orig[-1]: om for om, orig in fused.items()}
    for k, (name, arr) in enumerate(values.items()):
        node, idx = producer[name]
        op_name, op_type = (replaced[node.name], "FusedMatMul") if node.name in replaced else (node.name, node.op_type)
        fname = f"{op_type}.{safe_name(op_name)}.{10 + k}.2.{1764756900000000 + k}.output.{idx}.npy"
        np.save(leaf / fname, arr.reshape(-1))  # dumps are flat; the mapper restores (B, T, dim)
    # noise that must be ignored: an input dump, an unrelated operator, a non-dump file
    np.save(leaf / "Gather._tok_embeddings_Gather.3.2.1764756800000000.input.0.npy", np.zeros(3))
    np.save(leaf / "Softmax._Softmax.4.2.1764756800000001.output.0.npy", np.zeros(3))
    (leaf / "notes.txt").write_text("not a dump")


def test_dump_maps_to_layers_and_matches_the_reference(graph, tmp_path):
    ort, args = graph["ort"], graph["args"]
    taps = ort.graph.taps
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    got = LayerChain(ort.graph).outputs([ort.feeds(tokens)])[0]  # stands in for what the .om computed
    values = {}
    for kind, names in (("hidden", taps.layer), ("attn", taps.attn), ("mlp", taps.mlp)):
        for i, n in enumerate(names):
            values[n] = getattr(got, kind)[i].numpy()
    model = ort.graph.structure
    producer = {o: n for n in model.graph.node for o in n.output}
    mlp1_node = producer[taps.mlp[1]].name  # ATC fused layer 1's down projection with the op before it
    fused = {"fused_mlp_1": ["/some/Mul_x", mlp1_node]}
    atc_json = tmp_path / "model.json"
    atc_json.write_text(
        json.dumps(
            {
                "graph": [
                    {
                        "op": [
                            {
                                "name": "fused_mlp_1",
                                "type": "FusedMatMul",
                                "attr": [
                                    {
                                        "key": "_datadump_original_op_names",
                                        "value": {"list": {"s": fused["fused_mlp_1"]}},
                                    }
                                ],
                            },
                            {"name": "plain", "type": "Add", "attr": []},
                        ]
                    }
                ]
            }
        )
    )
    _write_dump(tmp_path / "dump", model.graph, values, fused)
    dump = scan_dump(tmp_path / "dump")
    assert len(dump) == len(values) + 1  # the Softmax output too; inputs and other files ignored
    fusion = read_fusion_json(atc_json)
    assert fusion == fused
    lists = {}
    for kind, names in (("hidden", taps.layer), ("attn", taps.attn), ("mlp", taps.mlp)):
        mapped = map_values_to_dump(model, list(names), dump, fusion)
        assert all(f is not None for f in mapped.files), mapped.notes
        lists[kind] = [torch.from_numpy(load_layer(f, (2, 8, args.dim))) for f in mapped.files]
    assert "fused operator" in map_values_to_dump(model, [taps.mlp[1]], dump, fusion).notes[0]
    missing = map_values_to_dump(model, [taps.mlp[1]], dump, None)  # without the json: not found, said so
    assert missing.files == [None] and "no dump of operator" in missing.notes[0]
    ref = LayeredModel.from_path(graph["model_dir"]).run(tokens)
    om_like = Outputs(got.logits, lists["hidden"], lists["attn"], lists["mlp"])
    c = compare_outputs(
        "om",
        "dump",
        ref,
        om_like,
        ref_label="torch",
        cand_label="om",
        dtype="float32",
        limits=resolve_thresholds("float32"),
    )
    assert c.status == "pass" and [r.tensor for r in c.rows][:3] == ["attn_out.0", "mlp_out.0", "hidden.0"]
    # a corrupted dump of layer 2's output is named at layer 2
    bad = [h.clone() for h in lists["hidden"]]
    bad[2] = bad[2] * 1.5
    c = compare_outputs(
        "om",
        "dump",
        ref,
        Outputs(got.logits, bad, lists["attn"], lists["mlp"]),
        ref_label="torch",
        cand_label="om",
        dtype="float32",
        limits=resolve_thresholds("float32"),
    )
    assert c.first_failing_layer == 2


def test_acl_dump_config_is_what_msit_writes():
    cfg = acl_dump_config(Path("/d"), "model")
    assert cfg == {"dump": {"dump_path": "/d", "dump_mode": "output", "dump_list": [{"model_name": "model"}]}}
    assert safe_name("/layers.0/attn/MatMul") == "_layers_0_attn_MatMul"


def test_om_without_runtime_stays_skipped(graph, tmp_path):
    from titan_pipe.config import EvaluateConfig
    from titan_pipe.evaluate.api import evaluate_model

    om = tmp_path / "model.om"
    om.write_bytes(b"\0" * 16)
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        model_dir=graph["model_dir"],
        om=om,
        onnx=graph["ort"].path,
        settings=EvaluateConfig(operators=False, batches=1, prompts=0),
    )
    assert r.summary.comparisons["om"].startswith("skipped: no Ascend runtime")
