"""Fine-tuning on chat data, one process: templates rendered as transformers renders them, answers
masked as transformers masks them, prepared data megatron-core still reads, bad records counted and
named, conversations packed without seeing each other, the loss over answer tokens only.
(The distributed parity of a fine-tune is in test_training_parallel.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from chat_fixtures import THINKING_TEMPLATE, chat_records, train_tokenizer, write_jsonl
from titan_pipe.cli import app
from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.errors import UserError
from titan_pipe.model.kernels import attention_documents_flex, attention_ref, document_mask
from titan_pipe.model.loss import cross_entropy, linear_cross_entropy
from titan_pipe.model.transformer import build_model
from titan_pipe.tokens.chat import (
    BadRecord,
    answer_mask,
    builtin_template,
    conversation,
    load_chat_template,
    token_mask,
)
from titan_pipe.tokens.dataset import open_source
from titan_pipe.tokens.packing import DocumentLoader, pack_documents, window_row
from titan_pipe.training.prepare import prepare


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("chat") / "tok")


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def prepared(tok_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chatdata")
    write_jsonl(root / "src" / "chat.jsonl", chat_records(60))
    r = prepare(
        sources=[root / "src"],
        out_dir=root / "out",
        tokenizer=str(tok_dir),
        records="chat",
        progress=False,
        val_fraction=0.1,
    )
    return root / "out", r.record


def _encode(tok_dir, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(text, add_special_tokens=False)


def _ids(out):
    return list(out) if isinstance(out, list) else list(out["input_ids"])


def test_the_models_template_renders_token_for_token_as_transformers(tok_dir, hf_tok):
    """Multi-turn conversations through a template that renders the last answer differently (an
    empty think block): tokens equal apply_chat_template's, every answer (and only answers) found."""
    tpl = load_chat_template("model", tokenizer_dir=tok_dir)
    assert tpl.source == THINKING_TEMPLATE and not tpl.marks_answers
    for rec in chat_records(12):
        msgs = rec["messages"]
        text, spans = tpl.answer_spans(msgs)
        enc = _encode(tok_dir, text)
        assert enc.ids == _ids(hf_tok.apply_chat_template(msgs, tokenize=True))
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert len(spans) == len(answers)
        for (a, b), want in zip(spans, answers):
            assert text[a:b].rstrip("\n").endswith(want + "<|im_end|>")  # the answer and its end of turn
            assert "<|im_start|>" not in text[a:b] and "user" not in text[a:b].replace(want, "")
        mask = token_mask(enc.offsets, spans)
        assert 0 < mask.sum() < len(mask)
        assert answer_mask(enc, spans).tolist() == mask.tolist()  # prepare's O(spans) form, the same


def test_generation_blocks_give_transformers_assistant_mask(tok_dir, hf_tok):
    """A template with {% generation %} blocks (the built-in chatml): the mask is transformers'
    return_assistant_tokens_mask, token for token."""
    tpl = builtin_template("chatml")
    assert tpl.marks_answers
    for rec in chat_records(8, seed=3):
        msgs = rec["messages"]
        text, spans = tpl.answer_spans(msgs)
        enc = _encode(tok_dir, text)
        out = hf_tok.apply_chat_template(
            msgs, chat_template=tpl.source, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert enc.ids == list(out["input_ids"])
        assert token_mask(enc.offsets, spans).tolist() == list(out["assistant_masks"])
        assert answer_mask(enc, spans).tolist() == list(out["assistant_masks"])


def test_instruction_records_become_a_conversation():
    got = conversation({"system": "s", "instruction": "do it", "input": "on this", "output": "done"}, fmt="instruction")
    assert got == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "do it\n\non this"},
        {"role": "assistant", "content": "done"},
    ]
    assert conversation({"prompt": "p", "response": "r"}, fmt="instruction")[-1] == {
        "role": "assistant",
        "content": "r",
    }
    for bad, why in [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "a"}]}, "empty content"),
        ({"text": "plain"}, "no 'messages'"),
        ([1, 2], "not a JSON object"),
    ]:
        with pytest.raises(BadRecord, match=why):
            conversation(bad, fmt="chat")


def test_prepared_chat_data_megatron_reads_and_the_mask_is_the_answers(prepared, tok_dir, hf_tok):
    out, rec = prepared
    assert rec.records == "chat" and rec.loss_mask == "tokens.lossmask" and rec.bad_records == 0
    assert rec.chat_template.endswith("sha256:" + load_chat_template("model", tokenizer_dir=tok_dir).sha256)
    from test_data_prepare import import_megatron_indexed

    ds = import_megatron_indexed().IndexedDataset(str(out / "tokens"))
    mask = np.fromfile(out / "tokens.lossmask", dtype=np.uint8)
    assert len(mask) == rec.n_tokens
    tpl = load_chat_template("model", tokenizer_dir=tok_dir)
    at = 0
    for i, r in enumerate(chat_records(60)):
        ids = _ids(hf_tok.apply_chat_template(r["messages"], tokenize=True))
        assert ds[i].tolist() == ids, f"conversation {i}"  # no eos added: the template ends each turn
        text, spans = tpl.answer_spans(r["messages"])
        want = token_mask(_encode(tok_dir, text).offsets, spans)
        assert mask[at : at + len(ids)].tolist() == want.tolist()
        decoded = hf_tok.decode([t for t, m in zip(ids, want) if m])
        assert all(m["content"] in decoded for m in r["messages"] if m["role"] == "assistant")
        assert not any(
            m["content"] in decoded
            for m in r["messages"]
            if m["role"] == "user" and m["content"] not in " ".join(a["content"] for a in r["messages"])
        )
        at += len(ids)


def test_bad_records_are_counted_named_and_bounded(tok_dir, tmp_path):
    recs = chat_records(30)
    recs[4] = {"messages": [{"role": "user", "content": "hi"}]}
    write_jsonl(tmp_path / "src" / "c.jsonl", recs)
    with pytest.raises(UserError, match=r"1 of 30 records .* over the bound of 0\.01 .*c\.jsonl:5: no assistant"):
        prepare(
            sources=[tmp_path / "src"], out_dir=tmp_path / "out", tokenizer=str(tok_dir), records="chat", progress=False
        )
    assert not (tmp_path / "out").exists()
    r = prepare(
        sources=[tmp_path / "src"],
        out_dir=tmp_path / "out",
        tokenizer=str(tok_dir),
        records="chat",
        progress=False,
        max_bad=0.9,
        max_tokens=100,
    )
    long = [
        i
        for i, x in enumerate(recs)
        if i != 4
        and len(
            _ids(
                __import__("transformers")
                .AutoTokenizer.from_pretrained(str(tok_dir))
                .apply_chat_template(x["messages"], tokenize=True)
            )
        )
        > 100
    ]
    assert r.record.bad_records == 1 + len(long) and r.record.n_documents == 29 - len(long)
    assert r.record.bad_examples[0].endswith("c.jsonl:5: no assistant message: nothing to learn from")
    assert any("longer than the window of 100" in e for e in r.record.bad_examples) == bool(long)


def test_chat_cli_refuses_in_one_line(tok_dir, tmp_path):
    write_jsonl(tmp_path / "src" / "c.jsonl", chat_records(4))
    (tmp_path / "src" / "t.txt").write_text("plain")
    cases = [
        (["--tokenizer", "byte"], "needs the model's tokenizer"),
        (["--tokenizer", str(tok_dir), "--chat-template", "nope"], "not a file, nor one of model"),
        (["--tokenizer", str(tok_dir)], "t.txt: --format chat reads .jsonl"),
    ]
    for flags, why in cases:
        r = CliRunner().invoke(
            app, ["data", "prepare", str(tmp_path / "src"), "-o", str(tmp_path / "o"), "--format", "chat", *flags]
        )
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 1 and len(lines) == 1 and why in lines[0], r.output
        assert not (tmp_path / "o").exists()


def test_packing_is_next_fit_whole_documents():
    p = pack_documents(np.array([3, 4, 9, 2, 2, 5, 1]), 8)
    windows = [p.docs[p.offsets[w] : p.offsets[w + 1]].tolist() for w in range(p.n_windows)]
    assert windows == [[0, 1], [3, 4], [5, 6]] and p.too_long.tolist() == [2]
    inputs, labels, positions = window_row(
        [np.array([5, 6, 7]), np.array([8, 9])], [np.array([0, 1, 1]), np.array([0, 1])], 7
    )
    assert inputs.tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert labels.tolist() == [6, 7, -100, 9, -100, -100, -100]  # no label across a document or into padding
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 1]


def test_loader_targets_are_the_global_batchs_and_dp_splits_rows(prepared):
    out, _ = prepared
    src = open_source(out, val_fraction=0.1)
    one = DocumentLoader(src, seq_len=256, global_batch=4, seed=3)
    halves = [DocumentLoader(src, seq_len=256, global_batch=4, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for step in range(3):
        b = one.batch_at(step)
        parts = [h.batch_at(step) for h in halves]
        assert torch.equal(torch.cat([p.inputs for p in parts]), b.inputs)
        assert torch.equal(torch.cat([p.labels for p in parts]), b.labels)
        assert b.targets == int((b.labels != -100).sum()) == parts[0].targets == parts[1].targets
    state = one.state_dict()
    again = DocumentLoader(src, seq_len=256, global_batch=4, seed=3)
    one.next_batch()
    state = one.state_dict()
    again.load_state_dict(state)
    assert torch.equal(again.next_batch().inputs, one.next_batch().inputs)
    with pytest.raises(UserError, match="seq_len was 256"):
        DocumentLoader(src, seq_len=320, global_batch=4, seed=3).load_state_dict(state)


def test_a_document_never_sees_another():
    """Perturbing document A of a packed window leaves document B's logits bit for bit; B's logits
    equal B run alone (positions restart)."""
    args = parse_flow({"model": {"flavour": "debug"}}, base=None).model.args()
    model = build_model(args, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 300, (2, 24), generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(8), torch.arange(6)]).expand(2, 24).contiguous()
    x2 = x.clone()
    x2[:, :10] = torch.randint(0, 300, (2, 10), generator=g)
    with torch.no_grad():
        a, b, alone = model(x, positions=pos), model(x2, positions=pos), model(x[:, 10:18])
        leaky = model(x2)
    assert torch.equal(a[:, 10:], b[:, 10:])
    assert not torch.equal(model(x)[:, 10:18], leaky[:, 10:18])  # without positions, B sees A
    torch.testing.assert_close(a[:, 10:18], alone, rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_attention_equals_the_masked_reference(window):
    """The CUDA path (flex attention's block mask) against SDPA with the document mask, forward on
    CPU (flex has no CPU backward; device_check runs both directions on the GPU)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 24, 16, generator=g) for h in (4, 2, 2))
    pos = torch.cat([torch.arange(7), torch.arange(11), torch.arange(6)]).expand(2, 24).contiguous()
    ref = attention_ref(q, k, v, n_rep=2, positions=pos, window=window)
    flex = attention_documents_flex(q, k, v, pos, window)
    torch.testing.assert_close(flex, ref, rtol=0, atol=2e-6)
    m = document_mask(pos, window)[0, 0]
    assert not m[7, 6] and m[8, 7] and (window is None or not m[17, 7 + 17 - 7 - window])


def test_the_loss_skips_ignored_labels_and_divides_by_the_given_count():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 40, (3, 5), generator=g)
    y[0, :2] = -100
    y[2, 4] = -100
    keep = y != -100
    for denom in (None, 7.0):
        for fused in (True, False):
            logits = h @ w.t()
            want = torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="sum") / (
                int(keep.sum()) if denom is None else denom
            )
            got = linear_cross_entropy(h, w, y, rows=4, denom=denom) if fused else cross_entropy(logits, y, denom=denom)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            gh, gw = torch.autograd.grad(got, (h, w), retain_graph=True)
            eh, ew = torch.autograd.grad(want, (h, w))
            torch.testing.assert_close(gh, eh, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gw, ew, rtol=1e-5, atol=1e-6)


def test_fine_tuning_defaults_and_data_of_the_wrong_kind(prepared, tmp_path):
    from titan_pipe.tokens.dataset import open_data
    from titan_pipe.training.trainer import loss_denominator, training_loader

    t = parse_flow({"train": {"mode": "sft", "steps": 200}}, base=None).train
    assert (t.optimizer.lr, t.optimizer.weight_decay, t.warmup_steps) == (2e-5, 0.0, 6)
    t = parse_flow({"train": {"mode": "sft", "warmup_steps": 0, "optimizer": {"lr": 1e-4}}}, base=None).train
    assert (t.optimizer.lr, t.warmup_steps) == (1e-4, 0)
    assert loss_denominator(120, dp=2, microbatches=3) == 20.0
    out, _ = prepared
    chat = open_data([out], val_fraction=0.1)
    pretrain = parse_flow({"train": {"seq_len": 256, "batch_size": 2}}, base=None).train
    with pytest.raises(UserError, match="train.mode is pretrain.*set train.mode: sft"):
        training_loader(chat, pretrain, dp_rank=0, dp_size=1, vocab_size=320)
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 400)
    prepare(sources=[text], out_dir=tmp_path / "text", tokenizer="byte", progress=False, val_fraction=0)
    sft = parse_flow({"train": {"mode": "sft", "seq_len": 256, "batch_size": 2}}, base=None).train
    with pytest.raises(UserError, match="prepare it with `titan-pipe data prepare --format chat"):
        training_loader(open_data([tmp_path / "text"], val_fraction=0), sft, dp_rank=0, dp_size=1, vocab_size=320)
    with pytest.raises(UserError, match=r"conversations are longer than train.seq_len 16 .* --max-tokens 16"):
        training_loader(chat, sft.model_copy(update={"seq_len": 16}), dp_rank=0, dp_size=1, vocab_size=320)
    assert json.loads((out / "data.json").read_text())["records"] == "chat"


def test_chat_data_prepared_in_parts_and_merged_equals_one_prepare(tok_dir, tmp_path):
    """--shard I/3 of chat records, merged: tokens, index, loss mask and data.json byte for byte."""
    from titan_pipe.training.merge import merge
    from titan_pipe.training.prepare import Shard

    write_jsonl(tmp_path / "src" / "a.jsonl", chat_records(25))
    write_jsonl(tmp_path / "src" / "b.jsonl", chat_records(20, seed=1))
    common = dict(tokenizer=str(tok_dir), records="chat", progress=False, val_fraction=0.1)
    prepare(sources=[tmp_path / "src"], out_dir=tmp_path / "whole", **common)
    parts = [
        prepare(sources=[tmp_path / "src"], out_dir=tmp_path / f"p{i}", shard=Shard(i, 3), **common).out_dir
        for i in (1, 2, 3)
    ]
    merge(inputs=parts[::-1], out_dir=tmp_path / "merged", progress=False)
    for name in ("tokens.bin", "tokens.idx", "tokens.lossmask", "data.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "plain"}\n' * 3)
    prepare(sources=[text], out_dir=tmp_path / "text", tokenizer=str(tok_dir), progress=False, val_fraction=0)
    with pytest.raises(UserError, match="different record formats .chat vs text."):
        merge(inputs=[tmp_path / "whole", tmp_path / "text"], out_dir=tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()


def test_init_sft_writes_a_fine_tune_of_the_released_flavour(tok_dir, tmp_path):
    import yaml

    r = CliRunner().invoke(app, ["init", str(tmp_path / "ex"), "--flavour", "qwen3_0.6b", "--sft"])
    assert r.exit_code == 0, r.output
    import shutil

    raw = yaml.safe_load((tmp_path / "ex" / "flow.yaml").read_text())
    shutil.copytree(tok_dir, tmp_path / "ex" / "qwen3_0.6b-hf")  # where the user puts the released dir
    # a dir without the released config.json is refused by name: the checkpoint states the model
    with pytest.raises(ConfigError, match=r"init_from: .*qwen3_0.6b-hf/config.json: missing"):
        parse_flow(raw, base=tmp_path / "ex")
    assert raw.pop("init_from") == "qwen3_0.6b-hf"
    cfg = parse_flow(raw, base=tmp_path / "ex")
    assert (cfg.train.mode, cfg.data.format, cfg.data.tokenizer) == ("sft", "chat", "qwen3_0.6b-hf")
    assert (cfg.train.optimizer.lr, cfg.train.optimizer.weight_decay, cfg.train.warmup_steps) == (2e-5, 0.0, 30)
    assert cfg.model.flavour == "qwen3_0.6b" and cfg.parallel.world_size == 8
    # the sample records are chat records the model's tokenizer renders
    out = prepare(
        sources=[tmp_path / "ex" / "chat.jsonl"],
        out_dir=tmp_path / "d",
        tokenizer=str(tok_dir),
        records="chat",
        progress=False,
        val_fraction=0,
    )
    assert out.record.n_documents == 3 and out.record.bad_records == 0


def test_the_flow_cache_keys_follow_the_chat_settings(tok_dir, tmp_path):
    """A changed chat template re-runs the data stage (and evaluate's split); the tokenizer's model dir
    is keyed by its files, the template among them; a text flow's keys are unchanged."""
    import shutil

    from titan_pipe.flows.cache import stage_inputs

    shutil.copytree(tok_dir, tmp_path / "m")
    write_jsonl(tmp_path / "c.jsonl", chat_records(4))
    base = {"data": {"path": "c.jsonl", "tokenizer": "m", "format": "chat"}, "train": {"mode": "sft"}}
    a = stage_inputs("data", parse_flow(base, base=tmp_path), flow_dir=tmp_path, upstream={})
    other = dict(base, data=dict(base["data"], chat_template="chatml"))
    b = stage_inputs("data", parse_flow(other, base=tmp_path), flow_dir=tmp_path, upstream={})
    assert a.section != b.section and b.section["chat_template"] == "chatml"
    assert {p.name for p in a.files} == {"c.jsonl", "tokenizer.json", "tokenizer_config.json"}
    text = stage_inputs(
        "data", parse_flow({"data": {"path": "c.jsonl"}}, base=tmp_path), flow_dir=tmp_path, upstream={}
    )
    assert set(text.section) == {"path", "tokenizer", "text_key", "val_fraction"}
