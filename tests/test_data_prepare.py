"""data prepare and the indexed-dataset reader: megatron-core reads what we write and we read what it
writes, output independent of the worker count, re-runs that do nothing, atomic publishing, and every
bad input refused with one line naming the file."""

from __future__ import annotations

import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.errors import UserError
from titan_pipe.tokens.dataset import open_data, open_prefix, open_source
from titan_pipe.tokens.indexed import IndexedTokens
from titan_pipe.tokens.loader import PackedLoader
from titan_pipe.tokens.record import DataRecord
from titan_pipe.tokens import sources
from titan_pipe.tokens.shuffle import Permutation
from titan_pipe.tokens.tokenizer import build_tokenizer, tokenizer_info
from titan_pipe.training import tokenize_pool
from titan_pipe.training.prepare import prepare

from test_data import _train_bpe


def import_megatron_indexed():
    """megatron-core's indexed_dataset module (convert_writers.import_megatron: no allow-list left behind)."""
    from convert_writers import import_megatron

    mod = import_megatron("megatron.core.datasets.indexed_dataset")
    if mod is None:
        pytest.skip("megatron-core is not installed (the [test] extra)")
    return mod


@pytest.fixture(scope="module")
def megatron_indexed():
    return import_megatron_indexed()


DOCS = {  # file -> its documents, in the order prepare reads them (sorted relative paths)
    "a.txt": ["Four score and seven years ago — naïve café, 東京 🚀\n"],
    "b.jsonl": ["first record", 'second record, with "quotes"', ""],  # the empty one is left out
    "c.jsonl.gz": ["gzip one", "gzip two"],
    "d.parquet": ["parquet row one", "parquet row two", "parquet row three"],
    "sub/e.txt": ["We the People of the United States, in Order to form a more perfect Union\n" * 3],
}


def write_corpus(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS["a.txt"][0])
    lines = ["\ufeff" + json.dumps({"text": DOCS["b.jsonl"][0], "id": 1})] + [
        json.dumps({"text": t}) for t in DOCS["b.jsonl"][1:]
    ]
    (root / "b.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    with gzip.open(root / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in DOCS["c.jsonl.gz"]))
    pq.write_table(pa.table({"text": DOCS["d.parquet"], "n": [1, 2, 3]}), root / "d.parquet")
    (root / "sub" / "e.txt").write_text(DOCS["sub/e.txt"][0])
    (root / "notes.md").write_text("not a source")
    return root


def all_docs() -> list[str]:
    return [d for docs in DOCS.values() for d in docs if d]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return _train_bpe(tmp_path_factory.mktemp("bpe"), vocab=400)


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def test_megatron_core_reads_what_prepare_writes(bpe, corpus, tmp_path, megatron_indexed):
    r = prepare(sources=[corpus], out_dir=tmp_path / "out", tokenizer=str(bpe), progress=False, val_fraction=0.3)
    tok = build_tokenizer(str(bpe))
    ds = megatron_indexed.IndexedDataset(str(tmp_path / "out" / "tokens"))
    docs = all_docs()
    assert len(ds) == len(docs) == r.record.n_documents and r.record.skipped_empty == 1
    for i, doc in enumerate(docs):
        assert ds[i].dtype == np.uint16
        assert ds[i].tolist() == tok.encode(doc) + [tok.eos_id], f"document {i}"
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    rec = r.record
    assert rec.n_tokens == sum(len(tok.encode(d)) + 1 for d in docs)
    assert rec.max_token_id == max(max(tok.encode(d) + [tok.eos_id]) for d in docs)
    assert rec.tokenizer == tokenizer_info(tok) and rec.dtype == "uint16"
    assert [Path(s.path).name for s in rec.sources] == ["a.txt", "b.jsonl", "c.jsonl.gz", "d.parquet", "e.txt"]
    # the split: the shortest tail of whole documents with >= 30% of the tokens, held out from training
    s = rec.split
    assert s.train_documents + s.val_documents == len(docs) and s.val_tokens >= 0.3 * rec.n_tokens
    last_train = len(tok.encode(docs[s.train_documents - 1])) + 1
    assert s.val_tokens + last_train > 0.3 * rec.n_tokens  # one document fewer would be too few
    src = open_source(tmp_path / "out", val_fraction=0.3)
    assert src.val.read(0, len(src.val)).tolist() == [
        t for d in docs[s.train_documents :] for t in tok.encode(d) + [tok.eos_id]
    ]


def test_output_is_the_same_for_any_worker_count(bpe, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenize_pool, "CHUNK_CHARS", 40)  # a chunk per block: many in flight at once
    monkeypatch.setattr(sources, "BLOCK_BYTES", 16)  # blocks of a line or two; lines longer than a block
    for workers in (1, 2):
        prepare(sources=[corpus], out_dir=tmp_path / f"w{workers}", tokenizer=str(bpe), workers=workers, progress=False)
    for name in ("tokens.bin", "tokens.idx", "data.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_rerun_with_the_same_inputs_does_nothing(corpus, tmp_path):
    out = tmp_path / "out"
    first = prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False)
    assert again.reused and not first.reused and again.record == first.record
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    (corpus / "a.txt").write_text("changed text")
    third = prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False)
    assert not third.reused and third.record.key != first.record.key
    assert IndexedTokens(out / "tokens").document(0).tolist() == list(b"changed text") + [257]
    fourth = prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False, val_fraction=0.5)
    assert not fourth.reused and fourth.record.split.val_fraction == 0.5


def test_small_blocks_give_the_same_documents_and_line_numbers(corpus, tmp_path, monkeypatch):
    whole = [d for f in sources.corpus_files(corpus) for d in sources.iter_documents(f)]
    monkeypatch.setattr(sources, "BLOCK_BYTES", 7)
    assert [d for f in sources.corpus_files(corpus) for d in sources.iter_documents(f)] == whole
    assert whole == [d for docs in DOCS.values() for d in docs]  # the empty record too: prepare drops it
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n\n{"text": "two, a longer line than a block"}\n{"body": 4}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:4: no 'text' field"):
        list(sources.iter_documents(bad))


def test_interrupted_prepare_leaves_nothing_and_keeps_the_old_dir(corpus, tmp_path):
    out = tmp_path / "out"
    prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (corpus / "sub" / "z.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(UserError, match=r"z.jsonl:2: no 'text' field"):
        prepare(sources=[corpus], out_dir=out, tokenizer="byte", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(UserError, match=r"z.jsonl:2"):
        prepare(sources=[corpus], out_dir=tmp_path / "fresh", tokenizer="byte", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out"]  # no temp dir, no "fresh"


# --- bad input, through the CLI: one line naming the file, exit 1, nothing written -----------------


def run_cli(*args: str):
    r = CliRunner().invoke(app, list(args))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    return r.exit_code, lines


def bad_jsonl_utf8(root):
    (root / "x.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n')
    return "x.jsonl:3: not UTF-8"


def bad_txt_utf8(root):
    (root / "x.txt").write_bytes("line one\nline two café".encode("latin-1"))
    return "x.txt:2: not UTF-8"


def bad_no_key(root):
    (root / "x.jsonl").write_text('{"text": "ok"}\n{"body": "t"}\n')
    return "x.jsonl:2: no 'text' field (found ['body'])"


def bad_only_empty(root):
    (root / "x.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (root / "y.txt").write_text("")
    return "holds no text (every document is empty)"


def bad_parquet_column(root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"]}), root / "x.parquet")
    return "x.parquet: no 'text' column (found ['body'])"


def bad_one_document(root):
    (root / "x.txt").write_text("one long document " * 50)
    return "leaves none of its 1 document(s) to train on"


@pytest.mark.parametrize(
    "make", [bad_jsonl_utf8, bad_txt_utf8, bad_no_key, bad_only_empty, bad_parquet_column, bad_one_document]
)
def test_prepare_refuses_bad_sources(tmp_path, make):
    src = tmp_path / "src"
    src.mkdir()
    expected = make(src)
    code, lines = run_cli("data", "prepare", str(src), "-o", str(tmp_path / "out"))
    assert code == 1 and len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_prepare_refuses_an_output_inside_a_source_or_over_other_files(corpus, tmp_path):
    code, lines = run_cli("data", "prepare", str(corpus), "-o", str(corpus / "prepared"))
    assert code == 1 and len(lines) == 1 and "inside the source" in lines[0]
    assert not (corpus / "prepared").exists()
    code, lines = run_cli("data", "prepare", str(corpus / "a.txt"), "-o", str(tmp_path))
    assert code == 1 and "contains the source" in lines[0]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("keep")
    code, lines = run_cli("data", "prepare", str(corpus), "-o", str(tmp_path / "mine"))
    assert code == 1 and "is not a prepared data dir" in lines[0] and (tmp_path / "mine" / "keep.txt").is_file()


@pytest.fixture
def prepared(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"document {i} " * 40)
    prepare(sources=[src], out_dir=tmp_path / "p", tokenizer="byte", progress=False)
    return tmp_path / "p"


def patch_header(idx: Path, *, at: int, fmt: str, value) -> None:
    raw = bytearray(idx.read_bytes())
    struct.pack_into(fmt, raw, at, value)
    idx.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda p: os.truncate(p / "tokens.bin", 1000), "tokens.bin: 1000 bytes, but tokens.idx says"),
        (
            lambda p: patch_header(p / "tokens.idx", at=0, fmt="<9s", value=b"NOTANIDX!"),
            "not a Megatron indexed-dataset index",
        ),
        (lambda p: patch_header(p / "tokens.idx", at=9, fmt="<Q", value=2), "index version 2"),
        (
            lambda p: patch_header(p / "tokens.idx", at=17, fmt="<B", value=7),
            "dtype code 7 (float32) cannot hold token ids",
        ),
        (lambda p: os.truncate(p / "tokens.idx", 60), "the index is truncated or damaged"),
    ],
)
def test_damaged_files_are_refused_in_one_line(prepared, damage, expected):
    damage(prepared)
    for target in (prepared, prepared / "tokens"):
        code, lines = run_cli("data", "inspect", str(target))
        assert code == 1 and len(lines) == 1 and expected in lines[0], lines


def test_ids_beyond_the_model_vocab_and_foreign_tokenizers_are_refused(prepared, bpe, tmp_path):
    byte = tokenizer_info(build_tokenizer("byte"))
    with pytest.raises(UserError, match=r"largest token id 257 is >= model.vocab_size 200"):
        open_data([prepared], val_fraction=0.05, tokenizer=byte, vocab_size=200)
    with pytest.raises(UserError, match=r"a sample of its token ids reaches 257 is >= model.vocab_size 200"):
        open_data([prepared / "tokens"], val_fraction=0.05, tokenizer=byte, vocab_size=200)
    with pytest.raises(UserError, match="prepared with tokenizer byte .* but data.tokenizer is tokenizer.json"):
        open_data([prepared], val_fraction=0.05, tokenizer=tokenizer_info(build_tokenizer(str(bpe))), vocab_size=512)
    other = prepare(sources=[tmp_path / "src"], out_dir=tmp_path / "q", tokenizer=str(bpe), progress=False).out_dir
    with pytest.raises(UserError, match="a blend mixes data of one tokenizer"):
        open_data([prepared, other], [0.5, 0.5], val_fraction=0.05)
    with pytest.raises(UserError, match="prepared with --val-fraction 0.05"):
        open_data([prepared], val_fraction=0.2)
    # the loader checks every batch too (a bare prefix is only sampled when opened)
    data = open_data([prepared / "tokens"], val_fraction=0.05)
    loader = PackedLoader(data.train, seq_len=16, global_batch=4, vocab_size=100)
    with pytest.raises(UserError, match=r"token id \d+ at token .* is >= model.vocab_size 100"):
        loader.next_batch()


# --- reading what megatron-core writes -------------------------------------------------------------


def megatron_build(prefix: Path, docs: list[list[int]], dtype=np.uint16, split_at: int | None = None) -> None:
    b = import_megatron_indexed().IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids in docs:
        lengths = [len(ids)] if split_at is None or len(ids) <= split_at else [split_at, len(ids) - split_at]
        b.add_document(torch.tensor(ids), lengths)
    b.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_a_dataset_megatron_core_writes_is_read_and_split_by_documents(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, size=int(n)).tolist() + [257] for n in rng.integers(5, 200, size=40)]
    megatron_build(tmp_path / "mc", docs, dtype=dtype, split_at=17)  # documents of two sequences too
    src = open_prefix(tmp_path / "mc", val_fraction=0.1)
    stream = [t for d in docs for t in d]
    assert src.indexed.n_documents == 40 and src.indexed.dtype == np.dtype(dtype)
    both = src.train.read(0, len(src.train)).tolist() + src.val.read(0, len(src.val)).tolist()
    assert both == stream
    n_val_docs = next(k for k in range(1, 40) if sum(map(len, docs[-k:])) >= 0.1 * len(stream))
    assert src.val.read(0, len(src.val)).tolist() == [t for d in docs[-n_val_docs:] for t in d]
    loader = PackedLoader(src.train, seq_len=8, global_batch=4, seed=1)
    x, y = loader.next_batch()
    for row, w in zip(x.tolist(), loader.global_windows(0).tolist()):
        assert row == stream[w * 8 : w * 8 + 8]


# --- loader over memory maps: permutations, blends ---------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4097])
def test_keyed_permutation_is_a_bijection(n):
    p = Permutation(n, key=12345)
    out = p(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(out, Permutation(n, key=12346)(np.arange(n)))
        assert not np.array_equal(out, np.arange(n))


@pytest.fixture
def two_sets(tmp_path):
    outs = []
    for name, word in (("a", "alpha "), ("b", "beta ")):
        src = tmp_path / f"src_{name}"
        src.mkdir()
        for i in range(6):
            (src / f"{i}.txt").write_text(f"{word}{i} " * 300)
        outs.append(prepare(sources=[src], out_dir=tmp_path / name, tokenizer="byte", progress=False).out_dir)
    return outs


def test_blend_mixes_by_weight_deterministically_for_any_dp(two_sets):
    data = open_data(two_sets, [0.7, 0.3], val_fraction=0.05)
    ref = PackedLoader(data.train, seq_len=16, global_batch=8, seed=3)
    comp, _ = ref.samples(np.arange(4096 * 2))
    assert np.bincount(comp).tolist() == [2 * 2867, 2 * 1229]  # 0.7 and 0.3 of every 4096-sample block
    stream = [ref.next_batch() for _ in range(30)]
    tokens = [IndexedTokens(p / "tokens").tokens for p in two_sets]
    comp, windows = ref.samples(np.arange(8))
    assert set(comp.tolist()) == {0, 1}
    for x, y, d, w in zip(*stream[0], comp, windows):  # each row: a window of the dataset it was drawn from
        assert x.tolist() == tokens[d][w * 16 : w * 16 + 16].tolist()
        assert y.tolist() == tokens[d][w * 16 + 1 : w * 16 + 17].tolist()
    ranks = [PackedLoader(data.train, seq_len=16, global_batch=8, dp_rank=r, dp_size=4, seed=3) for r in range(4)]
    for r in ranks:
        r.load_state_dict(json.loads(json.dumps(dict(ref.state_dict(), step=10))))
    for step in range(10, 30):
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), stream[step][0])
        assert torch.equal(torch.cat([p[1] for p in parts]), stream[step][1])
    other = PackedLoader(open_data(two_sets, [0.5, 0.5], val_fraction=0.05).train, seq_len=16, global_batch=8, seed=3)
    with pytest.raises(UserError, match="blend was"):
        other.load_state_dict(ref.state_dict())
    assert DataRecord.load(two_sets[0]).split.val_documents == 1


def test_file_array_reads_what_numpy_reads(tmp_path):
    from titan_pipe.tokens.indexed import FileArray

    values = np.arange(1000, dtype=np.int32) * 7
    (tmp_path / "a.bin").write_bytes(b"headr" + values.tobytes())
    a = FileArray(tmp_path / "a.bin", np.int32, offset=5, count=1000)
    assert len(a) == 1000 and a[0] == 0 and a[-1] == 6993 and a[10:13].tolist() == [70, 77, 84]
    assert a[995:2000].tolist() == values[995:].tolist() and a[5:5].tolist() == []
    with pytest.raises(IndexError):
        a[1000]
    os.truncate(tmp_path / "a.bin", 100)
    with pytest.raises(UserError, match="truncated while in use"):
        a[500:510]


def test_train_refuses_bad_token_data_in_one_line_before_any_rank_starts(prepared, bpe, tmp_path):
    import yaml

    def train(data: dict, vocab: int):
        flow = tmp_path / "flow.yaml"
        flow.write_text(
            yaml.safe_dump(
                {
                    "name": "t",
                    "runs_dir": str(tmp_path / "runs"),
                    "device": "cpu",
                    "model": {"flavour": "debug", "vocab_size": vocab},
                    "data": data,
                }
            )
        )
        code, lines = run_cli("train", str(flow))
        return code, [ln for ln in lines if not ln.startswith("training t:")]  # the command's own header

    megatron_build(tmp_path / "mc", [list(range(250, 1000))] * 8)  # ids up to 999, a byte-tokenizer flow
    code, lines = train({"path": str(tmp_path / "mc")}, 320)
    assert code == 1 and len(lines) == 1 and "token ids reaches 999 is >= model.vocab_size 320" in lines[0], lines
    code, lines = train({"path": str(prepared), "tokenizer": str(bpe)}, 512)
    assert code == 1 and len(lines) == 1 and "prepared with tokenizer byte" in lines[0], lines
    assert not (tmp_path / "runs").exists()
