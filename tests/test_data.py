"""Token data: tokenizers, corpus reading, the document split and the dp-invariant packed loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_pipe.errors import UserError
from titan_pipe.config import parse_flow
from titan_pipe.tokens.corpus import load_corpus
from titan_pipe.tokens.dataset import val_start
from titan_pipe.tokens.loader import PackedLoader
from titan_pipe.tokens.sources import default_corpus
from titan_pipe.tokens.spec import data_spec, open_spec
from titan_pipe.tokens.tokenizer import ByteTokenizer, build_tokenizer
from titan_pipe.training.prepare import prepare_spec


def load_tokens(**kw) -> torch.Tensor:
    """Every document of a corpus, each followed by eos, as one int64 tensor (the in-memory reader)."""
    return torch.from_numpy(load_corpus(**kw).tokens)


SAMPLE = "Four score and seven years ago — naïve café, 東京, emoji 🚀.\nSecond line\ttab."


def _train_bpe(tmp_path: Path, *, specials=("<s>", "</s>"), vocab=400) -> Path:
    """A real byte-level BPE tokenizer.json trained on the shipped corpus with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    files = sorted(str(p) for p in default_corpus().glob("*.txt"))
    tok.train(files, trainer)
    out = tmp_path / "tokenizer.json"
    tok.save(str(out))
    return out


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_ids():
    tok = build_tokenizer("byte")
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    # special ids carry no text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == SAMPLE


def test_hf_tokenizer_round_trip(tmp_path):
    path = _train_bpe(tmp_path)
    tok = build_tokenizer(str(path))
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert max(ids) < tok.vocab_size
    assert len(ids) < len(SAMPLE.encode("utf-8"))  # BPE merges something
    assert tok.eos_id == 1 and tok.bos_id == 0  # </s>, <s> in trainer order
    # relative to base, and a directory holding tokenizer.json
    assert build_tokenizer("tokenizer.json", base=tmp_path).vocab_size == tok.vocab_size
    assert build_tokenizer(str(tmp_path)).encode(SAMPLE) == ids


def test_hf_tokenizer_eos_from_tokenizer_config(tmp_path):
    path = _train_bpe(tmp_path, specials=("<|begin|>", "<|end|>"))
    with pytest.raises(UserError, match="no end-of-text token"):
        build_tokenizer(str(path))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|end|>"}, "bos_token": "<|begin|>"})
    )
    tok = build_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_tokenizer_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="is not a file"):
        build_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(str(bad))


# --- corpus -------------------------------------------------------------------------------------


def test_default_corpus_equals_bytes_of_sorted_files():
    files = sorted(default_corpus().glob("*.txt"))
    assert sum(f.stat().st_size for f in files) > 0
    expected = []
    for f in files:
        expected += list(f.read_bytes()) + [257]
    tokens = load_tokens(path=None, tokenizer=ByteTokenizer())
    assert tokens.dtype == torch.int64 and tokens.ndim == 1
    assert tokens.tolist() == expected


def test_directory_of_txt_and_jsonl_is_read_in_sorted_order(tmp_path):
    (tmp_path / "b.jsonl").write_text('\ufeff{"text": "two"}\r\n\n{"text": "three", "id": 3}\n')  # BOM, CRLF
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("four")
    (tmp_path / "ignored.csv").write_text("x,y")
    tok = ByteTokenizer()
    got = load_tokens(path=tmp_path, tokenizer=tok).tolist()
    expected = []
    for doc in ("one", "two", "three", "four"):
        expected += list(doc.encode()) + [257]
    assert got == expected
    # custom text key
    (tmp_path / "b.jsonl").write_text('{"body": "two"}\n')
    with pytest.raises(UserError, match="b.jsonl:1: no 'text' field"):
        load_tokens(path=tmp_path, tokenizer=tok)
    got = load_tokens(path=tmp_path / "b.jsonl", tokenizer=tok, text_key="body").tolist()
    assert got == list(b"two") + [257]


def test_corpus_bad_inputs(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(UserError, match="does not exist"):
        load_tokens(path=tmp_path / "nope", tokenizer=tok)
    with pytest.raises(UserError, match="holds no .txt, .jsonl, .jsonl.gz, .parquet files"):
        load_tokens(path=tmp_path, tokenizer=tok)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="holds no text"):
        load_tokens(path=tmp_path, tokenizer=tok)
    j = tmp_path / "x.jsonl"
    j.write_text('{"text": "ok"}\n{"text": "ok"\n')
    with pytest.raises(UserError, match=r"x.jsonl:2: not valid JSON"):
        load_tokens(path=j, tokenizer=tok)
    j.write_text('{"text": "ok"}\n{"title": "t"}\n')
    with pytest.raises(UserError, match=r"x.jsonl:2: no 'text' field \(found \['title'\]\)"):
        load_tokens(path=j, tokenizer=tok)
    j.write_text('{"text": 5}\n')
    with pytest.raises(UserError, match="is a int, not a string"):
        load_tokens(path=j, tokenizer=tok)
    b = tmp_path / "latin1.txt"
    b.write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        load_tokens(path=b, tokenizer=tok)
    with pytest.raises(UserError, match="is not a .txt, .jsonl, .jsonl.gz, .parquet file"):
        (tmp_path / "d.csv").write_text("a")
        load_tokens(path=tmp_path / "d.csv", tokenizer=tok)


def test_validation_is_the_shortest_tail_of_whole_documents():
    starts = [0, 100, 300, 350, 1000]  # four documents of 100, 200, 50 and 650 tokens

    def first_val(f):
        return val_start(lambda d: starts[d], 4, 1000, f, where="x")

    assert first_val(0.0) == 4  # nothing held out
    assert first_val(0.5) == 3  # 650 tokens >= 500: the last document alone
    assert first_val(0.65) == 3  # exactly 65%
    assert first_val(0.66) == 2  # the last two documents (700 tokens)
    assert first_val(0.01) == 3  # at least one whole document
    assert first_val(0.8) == 1
    with pytest.raises(UserError, match="leaves none of its 4 document"):
        first_val(0.95)
    with pytest.raises(UserError, match="leaves none of its 1 document"):
        val_start(lambda d: 0, 1, 10, 0.05, where="one.txt")
    with pytest.raises(UserError, match="must be in"):
        first_val(1.0)
    # the in-memory corpus (evaluate without prepared data) splits by the same rule
    train, val = load_corpus(path=None, tokenizer=ByteTokenizer()).split(0.05)
    files = sorted(default_corpus().glob("*.txt"))
    tail = sum(f.stat().st_size + 1 for f in files[6:])
    assert len(val) == tail and len(train) + len(val) == sum(f.stat().st_size + 1 for f in files)
    assert val.read(0, 5).tolist() == list(files[6].read_bytes()[:5])


def test_open_spec_checks_vocab(tmp_path):
    (tmp_path / "t.txt").write_text("hello world " * 10)
    cfg = parse_flow({"data": {"path": "t.txt", "val_fraction": 0}}, base=tmp_path)
    spec = data_spec(cfg.data, base=tmp_path)
    assert spec.text == tmp_path / "t.txt"
    prepare_spec(spec, tmp_path / "prepared", progress=False)
    tok, data = open_spec(spec, prepared=tmp_path / "prepared", vocab_size=320)
    assert data.train[0][0].read(0, 200).tolist() == list(b"hello world " * 10) + [257]
    assert data.n_val == 0 and tok.eos_id == 257
    with pytest.raises(UserError, match="smaller than the tokenizer's 258"):
        open_spec(spec, prepared=tmp_path / "prepared", vocab_size=100)


# --- packed loader ------------------------------------------------------------------------------

TOKENS = torch.arange(10_000, dtype=torch.int64) * 7 % 1009  # distinct-ish, not sorted


def _global(step_batches):
    return torch.cat([b[0] for b in step_batches]), torch.cat([b[1] for b in step_batches])


def test_packed_windows_shift_and_cover_the_stream():
    T, B = 16, 4
    loader = PackedLoader(TOKENS, seq_len=T, global_batch=B, seed=3, shuffle=False)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[0], TOKENS[:T]) and torch.equal(y[0], TOKENS[1 : T + 1])
    assert torch.equal(x[1], TOKENS[T : 2 * T])
    # shuffled: each epoch is a permutation of all windows
    loader = PackedLoader(TOKENS, seq_len=T, global_batch=B, seed=3)
    n_seq = (len(TOKENS) - 1) // T
    assert loader.steps_per_epoch == n_seq // B
    seen = torch.cat([loader.global_windows(s) for s in range(loader.steps_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == loader.steps_per_epoch * B
    x, y = loader.batch_at(0).inputs, loader.batch_at(0).labels
    w = loader.global_windows(0)
    for i in range(B):
        start = int(w[i]) * T
        assert torch.equal(x[i], TOKENS[start : start + T]) and torch.equal(y[i], TOKENS[start + 1 : start + T + 1])


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_global_batch_is_identical_for_any_dp(dp):
    T, B = 8, 8
    ref = PackedLoader(TOKENS, seq_len=T, global_batch=B, seed=11)
    ranks = [PackedLoader(TOKENS, seq_len=T, global_batch=B, dp_rank=r, dp_size=dp, seed=11) for r in range(dp)]
    steps = ref.steps_per_epoch + 3  # crosses an epoch boundary
    for _ in range(steps):
        rx, ry = ref.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert all(p[0].shape == (B // dp, T) for p in parts)
        gx, gy = _global(parts)
        assert torch.equal(gx, rx) and torch.equal(gy, ry)


def test_shuffle_is_deterministic_and_seeded_per_epoch():
    a = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=5)
    b = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=5)
    c = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=6)
    assert torch.equal(a.global_windows(0), b.global_windows(0))
    assert not torch.equal(a.global_windows(0), c.global_windows(0))
    e1 = a.global_windows(a.steps_per_epoch)  # first batch of epoch 1
    assert not torch.equal(a.global_windows(0), e1)
    assert torch.equal(b.global_windows(b.steps_per_epoch), e1)


def test_state_round_trip_resumes_under_another_dp():
    ref = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=2)
    stream = [ref.next_batch() for _ in range(12)]
    first = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=2)
    for _ in range(5):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["step"] == 5
    resumed = [PackedLoader(TOKENS, seq_len=8, global_batch=4, dp_rank=r, dp_size=2, seed=2) for r in range(2)]
    for r in resumed:
        r.load_state_dict(state)
    for step in range(5, 12):
        gx, gy = _global([r.next_batch() for r in resumed])
        assert torch.equal(gx, stream[step][0]) and torch.equal(gy, stream[step][1])


def test_loader_bad_inputs():
    with pytest.raises(UserError, match="not divisible by dp=3"):
        PackedLoader(TOKENS, seq_len=8, global_batch=4, dp_size=3)
    with pytest.raises(UserError, match="fewer than one global batch"):
        PackedLoader(TOKENS[:100], seq_len=64, global_batch=4)
    with pytest.raises(UserError, match="dp_rank"):
        PackedLoader(TOKENS, seq_len=8, global_batch=4, dp_rank=2, dp_size=2)
    loader = PackedLoader(TOKENS, seq_len=8, global_batch=4, seed=2)
    other = PackedLoader(TOKENS, seq_len=16, global_batch=4, seed=2)
    with pytest.raises(UserError, match="seq_len was 16"):
        loader.load_state_dict(other.state_dict())
    changed = PackedLoader(TOKENS + 1, seq_len=8, global_batch=4, seed=2)
    with pytest.raises(UserError, match="tokens_crc32"):
        loader.load_state_dict(changed.state_dict())
    with pytest.raises(UserError, match="step"):
        loader.load_state_dict({"step": -1})
