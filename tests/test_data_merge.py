"""data prepare --shard I/N on N "hosts" + data merge = one unsharded prepare, byte for byte; what
cannot be merged is one line naming both dirs."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.training.prepare import Shard, shard_pieces


def cli(*argv) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in argv])
    return r.exit_code, " ".join(r.output.split())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Files of every kind and size, so parts cut through .jsonl files and fall between whole ones."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"record {i} " + "x" * (i % 37)}) + "\n" for i in range(400))
    )
    (root / "b.txt").write_text("Four score and seven years ago — naïve café, 東京 🚀\n" * 20)
    (root / "c.jsonl").write_text("")  # empty
    with gzip.open(root / "d.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"gz {i}"}) + "\n" for i in range(50))
    (root / "e.jsonl").write_text(
        "\n".join(json.dumps({"text": "é" * (i % 50) + str(i)}) for i in range(700)) + "\n\n"
    )  # blank lines too
    (root / "f.jsonl").write_text(json.dumps({"text": "one long line " * 300}) + "\n")
    return root


@pytest.mark.parametrize("n", [3, 7])
def test_parts_merged_equal_one_prepare_byte_for_byte(corpus, tmp_path, n):
    code, text = cli("data", "prepare", corpus, "-o", tmp_path / "whole", "--workers", 1)
    assert code == 0, text
    parts = []
    for i in range(1, n + 1):
        out = tmp_path / f"part{i}"
        code, text = cli("data", "prepare", corpus, "-o", out, "--shard", f"{i}/{n}", "--workers", 1)
        assert code == 0, text
        parts.append(out)
    code, text = cli("data", "merge", *reversed(parts), "-o", tmp_path / "merged")  # any order: part order rules
    assert code == 0, text
    for name in ("tokens.bin", "tokens.idx", "data.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_every_document_is_read_by_exactly_one_part(corpus):
    files = sorted(p for p in corpus.iterdir())
    sizes = [f.stat().st_size for f in files]
    for n in (1, 2, 5, 64):
        covered: dict[Path, list] = {}
        for i in range(1, n + 1):
            for f, rng in shard_pieces(files, sizes, Shard(i, n)):
                covered.setdefault(f, []).append(rng)
        for f, size in zip(files, sizes):
            rngs = covered.get(f, [])
            if f.suffix == ".jsonl" and size:
                assert sorted(rngs)[0][0] == 0 and sorted(rngs)[-1][1] == size
                assert all(a[1] == b[0] for a, b in zip(sorted(rngs), sorted(rngs)[1:]))  # back to back
            elif f.suffix != ".jsonl":
                assert rngs == [None], (f, n)


def test_megatron_core_reads_the_merged_dataset(corpus, tmp_path):
    from test_data_prepare import import_megatron_indexed

    for i in (1, 2):
        assert cli("data", "prepare", corpus, "-o", tmp_path / f"p{i}", "--shard", f"{i}/2")[0] == 0
    assert cli("data", "merge", tmp_path / "p1", tmp_path / "p2", "-o", tmp_path / "m")[0] == 0
    ds = import_megatron_indexed().IndexedDataset(str(tmp_path / "m" / "tokens"))
    rec = json.loads((tmp_path / "m" / "data.json").read_text())
    assert len(ds) == rec["n_documents"] and sum(len(ds[i]) for i in range(len(ds))) == rec["n_tokens"]


def test_what_cannot_be_merged_is_one_line_naming_both(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    for i in (1, 2, 3):
        assert cli("data", "prepare", corpus, "-o", tmp_path / f"p{i}", "--shard", f"{i}/3")[0] == 0
    code, text = cli("data", "merge", tmp_path / "p1", tmp_path / "p2", tmp_path / "p2", "-o", tmp_path / "m")
    assert code == 1 and "are both part 2/3: their documents overlap" in text and not (tmp_path / "m").exists()
    code, text = cli("data", "merge", tmp_path / "p1", tmp_path / "p3", "-o", tmp_path / "m")
    assert code == 1 and "parts 2/3 are missing" in text
    assert cli("data", "prepare", corpus, "-o", tmp_path / "q1", "--shard", "1/2")[0] == 0
    code, text = cli("data", "merge", tmp_path / "p1", tmp_path / "q1", "-o", tmp_path / "m")
    assert code == 1 and "parts of different shardings" in text
    # another tokenizer: a word-level one over the same corpus
    vocab = {"[UNK]": 0, "</s>": 1, "record": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert (
        cli("data", "prepare", corpus / "a.jsonl", "-o", tmp_path / "w", "--tokenizer", tmp_path / "tokenizer.json")[0]
        == 0
    )
    assert cli("data", "prepare", corpus / "e.jsonl", "-o", tmp_path / "b")[0] == 0
    code, text = cli("data", "merge", tmp_path / "b", tmp_path / "w", "-o", tmp_path / "m")
    assert code == 1 and str(tmp_path / "b") in text and str(tmp_path / "w") in text and "different" in text
    # the same source twice in whole prepared dirs: overlapping documents
    assert cli("data", "prepare", corpus / "e.jsonl", "-o", tmp_path / "b2")[0] == 0
    code, text = cli("data", "merge", tmp_path / "b", tmp_path / "b2", "-o", tmp_path / "m")
    assert code == 1 and "both hold the documents of" in text
    code, text = cli("data", "prepare", corpus, "-o", tmp_path / "z", "--shard", "4/3")
    assert code == 1 and "--shard '4/3': give I/N with 1 <= I <= N" in text
