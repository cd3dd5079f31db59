"""ATC compatibility check on deliberately built graphs, and the atc command / run logic."""

import os
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from titan_pipe.convert.onnx.atc import GraphInput, atc_invocation, command_script, run_atc, seq_gears
from titan_pipe.convert.onnx.atc_ops import find_problems, load_atc_ops, operator_report
from titan_pipe.errors import StageFailed


def _graph(nodes, opset, initializers=(), in_type=TensorProto.FLOAT, check=True):
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", in_type, [2, 4, 4])],
        [helper.make_tensor_value_info("y", in_type, [2, 4, 4])],
        list(initializers),
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    if check:
        onnx.checker.check_model(m, full_check=True)  # valid ONNX: only ATC objects to it
    return m


def test_list_is_data_with_source():
    ops = load_atc_ops()
    assert ops["atc_opset_window"] == [11, 15]
    assert "CANN" in ops["cann_version"] and ops["sources"]
    assert all(e["evidence"] in ops["sources"] for e in ops["operators"].values())


def test_clean_graph_passes():
    m = _graph(
        [helper.make_node("Softmax", ["x"], ["s"], name="soft"), helper.make_node("Sqrt", ["s"], ["y"], name="root")],
        14,
    )
    report = operator_report(m)
    assert {(u.op_type, u.count, u.since_version) for u in report} == {("Softmax", 1, 13), ("Sqrt", 1, 13)}
    assert find_problems(m, report) == []


def test_trilu_is_rejected_with_node_name():
    m = _graph([helper.make_node("Trilu", ["x"], ["y"], name="causal_mask", upper=1)], 14)
    (p,) = find_problems(m)
    assert "node causal_mask (Trilu, 1x)" in str(p) and "not supported by ATC" in str(p)
    assert "decompose" in p.fix


def test_layer_norm_above_the_window_is_rejected():
    scale = numpy_helper.from_array(np.ones(4, np.float32), "scale")
    m = _graph([helper.make_node("LayerNormalization", ["x", "scale"], ["y"], name="ln0")], 17, [scale])
    (p,) = find_problems(m)  # ATC lists LayerNormalization for 17..18, which is outside the window
    assert "declares ONNX opset 17, outside ATC's 11..15" in str(p) and "--opset 14" in p.fix
    # The same node at opset 14 is an operator newer than the opset (not valid ONNX either).
    m = _graph([helper.make_node("LayerNormalization", ["x", "scale"], ["y"], name="ln0")], 14, [scale], check=False)
    (p,) = find_problems(m)
    assert "node ln0 (LayerNormalization, 1x)" in str(p) and "does not exist at the declared opset 14" in str(p)


def test_bf16_tensor_is_rejected():
    m = _graph(
        [
            helper.make_node("Cast", ["x"], ["c"], name="to_bf16", to=TensorProto.BFLOAT16),
            helper.make_node("Cast", ["c"], ["y"], name="back", to=TensorProto.FLOAT),
        ],
        14,
    )
    (p,) = find_problems(m)
    assert "to_bf16" in p.where and "BFLOAT16" in p.what


def test_custom_domain_is_rejected():
    node = helper.make_node("FusedRMSNorm", ["x"], ["y"], name="rms", domain="com.example")
    g = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.example", 1)])
    text = " | ".join(map(str, find_problems(m)))
    assert "custom domain 'com.example'" in text and "node rms (FusedRMSNorm" in text


def _decode_inputs(n_layers=2):
    """decode.onnx's inputs with batch and cache dynamic (-1), as plan_export declares them."""
    ins = [
        GraphInput("input_ids", (-1, 1)),
        GraphInput("position_ids", (-1, 1)),
        GraphInput("attention_mask", (-1, -1)),
        GraphInput("write_index", (-1,)),
    ]
    for i in range(n_layers):
        for kv in ("key", "value"):
            ins.append(GraphInput(f"past_key_values.{i}.{kv}", (-1, 2, -1, 16)))
    return ins


def test_static_command_has_exact_shapes_and_origin_precision():
    inv = atc_invocation(
        graph="model.onnx",
        inputs=[GraphInput("input_ids", (4, 32))],
        soc_version="Ascend310P3",
        precision_mode="origin",
        dynamic=False,
        batch=4,
        seq_len=32,
        max_len=256,
        weight_bytes=10,
        decode=False,
    )
    argv = list(inv.argv)
    assert argv[:6] == [
        "atc",
        "--model=model.onnx",
        "--framework=5",
        "--output=om/model",
        "--soc_version=Ascend310P3",
        "--input_format=ND",
    ]
    assert "--input_shape=input_ids:4,32" in argv and "--precision_mode_v2=origin" in argv
    assert not any(a.startswith(("--dynamic_dims", "--dynamic_batch_size", "--external_weight")) for a in argv)


def test_dynamic_commands_have_matching_gears():
    prefill = [GraphInput(n, (-1, -1)) for n in ("input_ids", "attention_mask", "position_ids")]
    inv = atc_invocation(
        graph="model.onnx",
        inputs=prefill,
        soc_version="Ascend910B3",
        precision_mode="mixed_float16",
        dynamic=True,
        batch=4,
        seq_len=64,
        max_len=256,
        weight_bytes=3 * 1024**3,
        decode=False,
        cache_len=128,
    )
    assert "--input_shape=input_ids:4,-1;attention_mask:4,-1;position_ids:4,-1" in inv.argv
    assert "--precision_mode_v2=mixed_float16" in inv.argv
    # One value per -1 in --input_shape order: 3 per gear, inside CANN 6.x's documented 4 per gear.
    assert inv.gears == ((16, 16, 16), (32, 32, 32), (64, 64, 64))
    assert "--dynamic_dims=16,16,16;32,32,32;64,64,64" in inv.argv and "--external_weight=1" in inv.argv
    # The dynamic decode graph compiles at the one shape a fixed-capacity cache needs: no gears.
    dec = atc_invocation(
        graph="decode.onnx",
        inputs=_decode_inputs(),
        soc_version="Ascend910B3",
        precision_mode="fp16",
        dynamic=True,
        batch=2,
        seq_len=32,
        max_len=256,
        weight_bytes=10,
        decode=True,
        cache_len=128,
    )
    shape = [a for a in dec.argv if a.startswith("--input_shape=")][0]
    assert shape == (
        "--input_shape=input_ids:2,1;position_ids:2,1;attention_mask:2,128;write_index:2;"
        "past_key_values.0.key:2,2,128,16;past_key_values.0.value:2,2,128,16;"
        "past_key_values.1.key:2,2,128,16;past_key_values.1.value:2,2,128,16"
    )
    assert dec.gears == () and not any(a.startswith("--dynamic_dims") for a in dec.argv)
    script = command_script([inv, dec], "origin")
    assert script.startswith("#!/usr/bin/env bash") and "must_keep_origin_dtype" in script
    assert script.count("\natc \\") == 2
    assert seq_gears(1, 256) == [1, 2] and seq_gears(100, 256) == [16, 32, 64, 100]


def _fake_atc(tmp_path, body):
    """A stand-in executable for CANN's atc (not installable here) to exercise the process handling."""
    exe = tmp_path / "bin" / "atc"
    exe.parent.mkdir()
    exe.write_text("#!/usr/bin/env bash\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_run_atc_reports_missing_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    inv = atc_invocation(
        graph="model.onnx",
        inputs=[GraphInput("input_ids", (1, 8))],
        soc_version="Ascend910B3",
        precision_mode="origin",
        dynamic=False,
        batch=1,
        seq_len=8,
        max_len=256,
        weight_bytes=1,
        decode=False,
    )
    assert run_atc([inv], tmp_path, lambda line: None) == "not_found"
    assert not (tmp_path / "om").exists()


def test_run_atc_streams_log_and_checks_om(tmp_path):
    inv = atc_invocation(
        graph="model.onnx",
        inputs=[GraphInput("input_ids", (1, 8))],
        soc_version="Ascend910B3",
        precision_mode="origin",
        dynamic=False,
        batch=1,
        seq_len=8,
        max_len=256,
        weight_bytes=1,
        decode=False,
    )
    work = tmp_path / "work"
    work.mkdir()
    ok = _fake_atc(
        tmp_path,
        'echo "ATC start"; for a in "$@"; do case $a in --output=*) '
        'touch "${a#--output=}.om";; esac; done; echo "ATC run success"\n',
    )
    lines = []
    assert run_atc([inv], work, lines.append, atc=ok) == "ok"
    assert lines == ["ATC start", "ATC run success"] and (work / "om" / "model.om").is_file()

    silent = tmp_path / "silent"
    os.makedirs(silent / "bin")
    exe = silent / "bin" / "atc"
    exe.write_text("#!/usr/bin/env bash\necho done\n")
    exe.chmod(0o755)
    with pytest.raises(StageFailed, match="exited 0 but wrote no om/model.om"):
        run_atc([inv], work, lambda line: None, atc=str(exe))
    assert not (work / "om").exists()
    bad = silent / "bin" / "atc_bad"
    bad.write_text("#!/usr/bin/env bash\necho 'E19999: unsupported op'; exit 3\n")
    bad.chmod(0o755)
    with pytest.raises(StageFailed, match="(?s)exited with 3.*E19999"):
        run_atc([inv], work, lambda line: None, atc=str(bad))
