"""The typed stage records of the core: the parameter list, the manifest's parallel layout, the export
record and the provenance record — round trips, records written by the previous version, bad input."""

import dataclasses
import json
import re

import pytest

from titan_pipe.records.checkpoint_format import LayoutError, Manifest, ParallelLayout
from titan_pipe.errors import UserError
from titan_pipe.records.export_record import (
    RECORD_FILE,
    DecodeContract,
    ExportRecord,
    FileEntry,
    GraphRecord,
    OperatorUse,
)
from titan_pipe.model.args import resolve_args
from titan_pipe.model.names import MEGATRON_TO_NATIVE, hf_to_native, megatron_to_native, native_to_hf
from titan_pipe.model.params import (
    ADAPTER_PARAMS,
    LAYER_PARAMS,
    MODEL_PARAMS,
    Param,
    fused_parts,
    native_shapes,
    param_of,
    params,
)
from titan_pipe.model.sharding import TP_PLAN, stage_of, tp_split_dim
from titan_pipe.model.transformer import build_model
from titan_pipe.records.provenance import PROVENANCE_FILE, Provenance, SourceInfo
from titan_pipe.tokens.identity import TokenizerRecord


# --- the parameter list ---------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"n_kv_heads": 4, "n_layers": 3}])
def test_the_parameter_list_is_what_the_module_holds(overrides):
    args = resolve_args("debug", **overrides)
    model = build_model(args, device="meta", seed=None)
    assert native_shapes(args) == {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_every_table_derives_from_the_list():
    args = resolve_args("debug")
    for name, p in params(args):
        assert hf_to_native(native_to_hf(name)) == name
        assert (
            tp_split_dim(name)
            == {"colwise": 0, "rowwise": 1, "vocab": 0, "replicate": None, "replicate_heads": None}[p.tp]
        )
        owner = 0 if p.scope == "first" else 1 if p.scope == "last" else int(name.split(".")[1]) // 2
        assert stage_of(name, [[0, 1], [2, 3]]) == owner
    modules = {r.module for r in TP_PLAN}
    # LoRA adapters (titan_pipe.model.lora) have rows too: two beside each linear of the attention and MLP
    assert modules == {p.module for p in MODEL_PARAMS} | {f"layers.*.{p.module}" for p in LAYER_PARAMS + ADAPTER_PARAMS}
    assert {p.module.replace(".lora", "").rsplit(".", 1)[0] for p in ADAPTER_PARAMS} == {
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w3",
        "feed_forward.w2",
    }
    assert megatron_to_native("decoder.layers.1.self_attention.linear_qkv.weight", 2) == "<qkv>:3"
    assert megatron_to_native("decoder.layers.0.pre_mlp_layernorm.weight", 5) == "layers.5.ffn_norm.weight"
    assert len(MEGATRON_TO_NATIVE) == len(dict(MEGATRON_TO_NATIVE))
    assert list(fused_parts("qkv")) == ["q", "k", "v"] and list(fused_parts("fc1")) == ["gate", "up"]
    with pytest.raises(KeyError, match="titan_pipe.model.params"):
        param_of("layers.0.attention.wo.bias")  # no family has an o_proj bias


def test_an_optional_parameter_is_one_entry_with_its_condition(monkeypatch):
    """What a new bias entry looks like (an MLP gate bias, which no family has yet): present exactly
    when its ModelArgs condition holds, with its shape, split and owner."""
    from titan_pipe.model import params as plist

    bias = Param(
        "feed_forward.w1.bias",
        lambda a: (a.hidden_dim,),
        "colwise",
        "layer",
        "mlp.gate_proj.bias",
        "w1.bias",
        init="ones",
        matmul=False,
        when=lambda a: a.n_layers == 3,
    )
    monkeypatch.setattr(plist, "LAYER_PARAMS", LAYER_PARAMS + (bias,))
    monkeypatch.setitem(plist._LAYER, bias.name, bias)
    with_bias, without = resolve_args("debug", n_layers=3), resolve_args("debug")
    assert native_shapes(with_bias)["layers.2.feed_forward.w1.bias"] == (with_bias.hidden_dim,)
    assert not any(n.endswith(".bias") for n in native_shapes(without))
    assert tp_split_dim("layers.2.feed_forward.w1.bias") == 0
    assert stage_of("layers.2.feed_forward.w1.bias", [[0, 1], [2]]) == 1
    with pytest.raises(ValueError, match="not one of"):
        Param("x.weight", lambda a: (1,), "diagonal", "layer", "x", "x")


# --- the manifest's parallel layout ---------------------------------------------------------------


def test_parallel_layout_round_trips_and_reads_old_manifests():
    lay = ParallelLayout(
        dp=2,
        tp=2,
        pp=2,
        pp_schedule="interleaved_1f1b",
        stages=((0,), (1,), (2,), (3,)),
        stage_ranks=(0, 1, 0, 1),
        sequence_parallel=True,
        dp_mode="fsdp",
        dp_kind="fsdp",
    )
    assert ParallelLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert (lay.world_size, lay.n_stages, lay.virtual_stages) == (8, 4, 2)
    old = ParallelLayout.from_dict({"dp": 1, "tp": 2, "pp": 2, "pp_schedule": "gpipe"})  # tests' early manifests
    assert (old.world_size, old.n_stages, old.virtual_stages, old.sequence_parallel) == (4, 2, 1, False)
    for bad, why in (({"tp": "two"}, "malformed"), ({"pp": 0}, ">= 1"), ([1, 2], "not an object")):
        with pytest.raises(LayoutError, match=why):
            ParallelLayout.from_dict(bad, source="m.json")


def test_manifest_extra_is_typed_and_keeps_what_it_does_not_know():
    """What the trainer and convert write round-trips; keys of a later version are written back as
    they were; a wrong type is one line naming the key (a LayoutError, so a UserError)."""
    from titan_pipe.records.checkpoint_format import CheckpointExtra, FileInfo

    written = {
        "optimizer": "optimizer",
        "train_state": "train_state.json",
        "kernels": "auto",
        "tokenizer": "tokenizer.json",
        "attached": {"tokenizer.json": {"size": 3, "sha256": "ab"}},
        "later_key": [1, 2],
    }
    extra = CheckpointExtra.from_dict(written)
    assert extra.attached == {"tokenizer.json": FileInfo(3, "ab")} and extra.other == {"later_key": [1, 2]}
    assert extra.to_dict() == written
    assert CheckpointExtra(converted_from={"format": "hf", "path": "/x"}).to_dict() == {
        "optimizer": None,
        "converted_from": {"format": "hf", "path": "/x"},
    }  # what convert wrote before
    for bad, key in (
        ({"kernels": 3}, "extra.kernels"),
        ({"attached": {"t": {"size": "3", "sha256": "a"}}}, "extra.attached.t.size"),
        ([], "extra"),
    ):
        with pytest.raises(LayoutError, match=key):
            CheckpointExtra.from_dict(bad, source="m.json")
    assert issubclass(LayoutError, UserError)


def test_manifest_parallel_is_typed():
    m = Manifest(step=1, model={}, parallel=ParallelLayout(tp=2), params={}, files={})
    back = Manifest.from_json(m.to_json())
    assert back.parallel == ParallelLayout(tp=2) and json.loads(m.to_json())["parallel"]["tp"] == 2


# --- the export record ----------------------------------------------------------------------------


def _record() -> ExportRecord:
    g = GraphRecord(
        opset=14,
        inputs={"input_ids": ["batch", "seq"]},
        outputs={"logits": ["batch", "seq", 320]},
        n_nodes=7,
        operators=(OperatorUse("", "Gemm", 3, 13),),
        layer_outputs=("layers.0.output",),
        attn_outputs=("layers.0.attn.output",),
        mlp_outputs=(None,),
    )
    return ExportRecord(
        graphs={"model.onnx": g},
        files={"model.onnx": FileEntry(10, "ab" * 16, "xxh3_128")},
        decode=DecodeContract(64),
        options={"opset": 14},
        export_seconds=1.5,
    )


def test_export_record_round_trips(tmp_path):
    rec = _record()
    (tmp_path / RECORD_FILE).write_text(rec.to_json())
    assert ExportRecord.load(tmp_path) == rec
    d = json.loads(rec.to_json())
    assert d["format"] == "titan-pipe-export/3" and d["decode"]["write_index"] == "write_index"
    assert d["files"]["model.onnx"] == {"bytes": 10, "digest": "ab" * 16, "algorithm": "xxh3_128"}
    assert d["graphs"]["model.onnx"]["operators"][0]["op_type"] == "Gemm"
    assert ExportRecord.find(tmp_path / "elsewhere") is None


def test_export_record_of_an_older_version_loads(tmp_path):
    """A version-1 record (no per-layer values, fewer sections) still loads, with empty defaults."""
    (tmp_path / RECORD_FILE).write_text(
        json.dumps(
            {
                "format": "titan-pipe-export/1",
                "graphs": {"model.onnx": {"opset": 14, "inputs": {}, "outputs": {}, "n_nodes": 3, "operators": []}},
                "files": {"model.onnx": {"bytes": 3, "sha256": None}},
            }
        )
    )
    rec = ExportRecord.load(tmp_path)
    assert rec.format_version == 1 and rec.graph().layer_outputs == () and rec.decode is None


def _exported_files(tmp_path, algorithm: str, *, version: int) -> bytes:
    """An export dir with a data file and its record in format ``version`` (2: ``sha256`` entries)."""
    import hashlib

    import xxhash

    data = bytes(range(256)) * 64
    (tmp_path / "model.onnx.data").write_bytes(data)
    digest = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}[algorithm](data).hexdigest()
    entry = (
        {"bytes": len(data), "sha256": digest}
        if version == 2
        else {"bytes": len(data), "algorithm": algorithm, "digest": digest}
    )
    (tmp_path / RECORD_FILE).write_text(
        json.dumps({"format": f"titan-pipe-export/{version}", "graphs": {}, "files": {"model.onnx.data": entry}})
    )
    return data


@pytest.mark.parametrize("algorithm, version", [("xxh3_128", 3), ("sha256", 3), ("sha256", 2)])
def test_export_files_are_checked_with_the_recorded_algorithm(tmp_path, algorithm, version):
    """The record's digest re-computed with its own algorithm (a version-2 record's sha256 too): the
    written bytes pass; a flipped byte, a swapped file of the same size and a truncated one are refused
    in one line naming the file."""
    data = _exported_files(tmp_path, algorithm, version=version)
    rec = ExportRecord.load(tmp_path)
    assert rec.files["model.onnx.data"].algorithm == algorithm
    rec.check_files(tmp_path)
    path = tmp_path / "model.onnx.data"
    for bad, message in (
        (data[:100] + bytes([data[100] ^ 1]) + data[101:], f"its {algorithm} digest does not match"),
        (data[::-1], f"its {algorithm} digest does not match"),
        (data[:-1], "has 16383 bytes but"),
    ):
        path.write_bytes(bad)
        with pytest.raises(UserError, match=message) as e:
            rec.check_files(tmp_path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
    path.unlink()
    with pytest.raises(UserError, match="is missing but"):
        rec.check_files(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"format": "titan-pipe-export/9", "graphs": {}}', "newer than this titan-pipe reads"),
        (
            '{"format": "titan-pipe-export/3", "files": {"a": {"bytes": 1, "algorithm": "md5", "digest": "0"}}}',
            "malformed field",
        ),
        ('{"format": "titan-pipe-export/3", "files": {"a": {"bytes": 1, "sha256": "00"}}}', "malformed field"),
        (
            '{"format": "titan-pipe-export/3", "files": {"a": {"bytes": 1, "algorithm": "sha256", "digest": 5}}}',
            "malformed field",
        ),
        ('{"format": "something-else/1"}', "is not 'titan-pipe-export'/N"),
        ("[1]", "expected a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"format": "titan-pipe-export/2", "graphs": {"/etc/passwd": {}}}', "absolute path"),
        ('{"format": "titan-pipe-export/2", "files": {"a.onnx": {"sha256": null}}}', "malformed field"),
        ('{"format": "titan-pipe-export/2", "graphs": {"m.onnx": {"layer_outputs": [null]}}}', "malformed field"),
    ],
)
def test_bad_export_records_fail_with_one_line(tmp_path, content, message):
    (tmp_path / RECORD_FILE).write_text(content)
    with pytest.raises(UserError, match=message) as e:
        ExportRecord.load(tmp_path)
    assert str(tmp_path / RECORD_FILE) in str(e.value) and "\n" not in str(e.value)


# --- the provenance record ------------------------------------------------------------------------


def test_provenance_round_trips_and_reads_records_without_a_format(tmp_path):
    p = Provenance(
        source=SourceInfo("titan", "/runs/x/step-000002", 2, {"tp": 2}, {"a": "0" * 64}, "sha256", True),
        converter="titan-pipe-convert 1",
        output={"kind": "unified"},
        created="2025-01-01T00:00:00Z",
        tokenizer=TokenizerRecord("tokenizer.json", files={"tokenizer.json": "1" * 64}),
    )
    (tmp_path / PROVENANCE_FILE).write_text(p.to_json())
    assert Provenance.load(tmp_path) == p
    assert json.loads(p.to_json())["source"]["algorithm"] == "sha256"
    d = json.loads(p.to_json())
    d.pop("format")  # as every provenance.json before the field existed: version 1, sha256 digests
    d["source"]["sha256"], d["source"]["sha256_verified"] = d["source"].pop("digests"), d["source"].pop("verified")
    del d["source"]["algorithm"]
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps(d))
    assert Provenance.load(tmp_path) == dataclasses.replace(p, format_version=1)
    d["format"] = "titan-pipe-provenance/1"
    d["source"]["sha256_verified"] = False
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps(d))
    old = Provenance.load(tmp_path).source
    assert (old.digests, old.algorithm, old.verified) == ({"a": "0" * 64}, "sha256", False)
    x = dataclasses.replace(p, source=dataclasses.replace(p.source, algorithm="xxh3_128", digests={"a": "1" * 32}))
    (tmp_path / PROVENANCE_FILE).write_text(x.to_json())
    assert Provenance.load(tmp_path) == x
    (tmp_path / PROVENANCE_FILE).write_text('{"format": "titan-pipe-provenance/7"}')
    with pytest.raises(UserError, match="upgrade titan-pipe"):
        Provenance.load(tmp_path)
    for bad in ('{"source": {"path": "x"}}', '{"format": "titan-pipe-provenance/1", "source": "ab"}'):
        (tmp_path / PROVENANCE_FILE).write_text(bad)
        with pytest.raises(UserError, match="malformed field"):
            Provenance.load(tmp_path)
    d = json.loads(x.to_json())
    d["source"]["algorithm"] = "md5"
    (tmp_path / PROVENANCE_FILE).write_text(json.dumps(d))
    with pytest.raises(UserError, match=r"source.algorithm 'md5' is not one of xxh3_128, sha256"):
        Provenance.load(tmp_path)
    assert Provenance.find(tmp_path / "none") is None


def test_one_tokenizer_record_each_file_holding_its_part(tmp_path):
    """data.json, provenance.json and a checkpoint's manifest each hold their fields of the one
    TokenizerRecord, as they always did; each reads back to the record; a tampered data.json field is
    refused naming it."""
    from titan_pipe.records.checkpoint_format import CheckpointExtra, FileInfo

    rec = TokenizerRecord("tokenizer.json", "a" * 64, 151_936, None, 151_645)
    assert rec.data_fields() == {
        "kind": "tokenizer.json",
        "sha256": "a" * 64,
        "vocab_size": 151_936,
        "bos_id": None,
        "eos_id": 151_645,
    }
    assert TokenizerRecord.from_data_fields(json.loads(json.dumps(rec.data_fields()))) == rec
    assert rec.fingerprint == f"tokenizer.json:{'a' * 64}:151936:151645" and rec.describe().endswith("a" * 12)
    carried = TokenizerRecord("byte", files={"tokenizer.json": "b" * 64})
    assert carried.provenance_fields() == {"tokenizer": "byte", "files": {"tokenizer.json": "b" * 64}}
    assert TokenizerRecord.from_provenance_fields(carried.provenance_fields()) == carried
    extra = CheckpointExtra(tokenizer="tokenizer.json", attached={"tokenizer.json": FileInfo(10, "c" * 64)})
    got = TokenizerRecord.of_checkpoint(extra)
    assert (got.kind, got.sha256, got.files) == ("tokenizer.json", "c" * 64, {"tokenizer.json": "c" * 64})
    assert got.path_in(tmp_path) == str(tmp_path / "tokenizer.json")
    assert TokenizerRecord.of_checkpoint(CheckpointExtra(tokenizer="byte")).path_in(tmp_path) == "byte"
    assert TokenizerRecord.of_checkpoint(CheckpointExtra()).path_in(tmp_path) is None
    for bad, said in (
        ({**rec.data_fields(), "vocab_size": "5"}, "tokenizer.vocab_size is '5'"),
        ({**rec.data_fields(), "eos_id": True}, "tokenizer.eos_id is True"),
        ({**rec.data_fields(), "kind": "sentencepiece"}, "tokenizer.kind is 'sentencepiece'"),
        ({**rec.data_fields(), "bos_id": -1}, "tokenizer.bos_id is -1, below 0"),
        ({**rec.data_fields(), "files": {}}, "unknown field(s) ['files']"),
        ([1, 2], "not an object"),
    ):
        with pytest.raises((TypeError, ValueError), match=re.escape(said)):
            TokenizerRecord.from_data_fields(bad)
