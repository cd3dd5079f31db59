"""Benchmark: `data prepare` against the tokenizer's own encode_batch, and the trainer's data start-up
(time, peak RSS) for a 10 MB, a 1 GB and a 20 GB corpus.

1. Throughput. A .jsonl of the shipped corpus's paragraphs, shuffled and repeated to --mb MB, and a
   byte-level BPE tokenizer.json trained on the shipped corpus (--vocab ids, in-process, no
   download). Each in its own process with the same worker count N (--workers):
     encode_batch  the tokenizer alone over the documents already in memory, its thread pool set
                   to N threads (RAYON_NUM_THREADS): the floor
     prepare       titan-pipe data prepare, N worker processes: reading, tokenizing, writing
   Target: prepare >= 0.8x encode_batch (MB of text per second).
2. Start-up flat in corpus size. What a training rank does with its data before the first step,
   in a fresh process each: import, open the data (data.path), build the loader, 8 batches.
     10 MB   real text prepared with the tokenizer above (a prepared dir)
     1 GB    a generated .bin/.idx of random ids (written for real)
     20 GB   a sparse 20 GB .bin with a matching .idx (documents of 2,048 tokens)
   and, for 10 MB, the path before this change (every rank tokenizing the text into one int64
   tensor: titan_pipe.tokens.corpus.load_corpus, which evaluation still uses for raw text).
   Target: 20 GB within 1.2x of 10 MB in start-up time and peak RSS.
3. Chat prepare. Conversations made of the shipped corpus's paragraphs (1-3 exchanges, a system
   message in a third), a ChatML tokenizer (the BPE above plus <|im_start|>/<|im_end|>) whose
   tokenizer_config.json carries a chat template without {% generation %} marks (answers found by
   rendering each turn's prefix, the slower of the two ways):
     apply_chat_template  transformers' own: AutoTokenizer.apply_chat_template(conversations,
                          tokenize=True) over all of them at once, N tokenizer threads: the floor
     data prepare         --format chat, N worker processes: render, tokenize, find the answers'
                          tokens, write tokens + loss mask
   Target: prepare >= 0.8x apply_chat_template (conversations per second), same token count.

    python benchmarks/data.py [--workdir /tmp/titan-pipe-data-bench] [--mb 50] [--workers 2] [--keep]
                              [--only throughput|startup|chat] [--chat-mb 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

DOC_TOKENS = 2048  # generated datasets: documents of this many tokens


def _peak_self_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --- inputs (untimed) -------------------------------------------------------------------------------


def make_tokenizer(work: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_pipe.tokens.sources import default_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(sorted(str(p) for p in default_corpus().glob("*.txt")), trainer)
    out = work / "tokenizer.json"
    tok.save(str(out))
    return out


def make_jsonl(path: Path, mb: float, seed: int = 0) -> int:
    """Paragraphs of the shipped corpus, shuffled, one document per line, up to ``mb`` MB of text."""
    from titan_pipe.tokens.sources import default_corpus

    paras = [
        p.strip() for f in sorted(default_corpus().glob("*.txt")) for p in f.read_text().split("\n\n") if p.strip()
    ]
    rng, size, target = random.Random(seed), 0, int(mb * 1e6)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        while size < target:
            rng.shuffle(paras)
            for p in paras:
                f.write(json.dumps({"text": p}) + "\n")
                size += len(p.encode())
                if size >= target:
                    break
    return size


def write_generated(prefix: Path, n_tokens: int, *, sparse: bool, seed: int = 0) -> None:
    """A uint16 .bin of ``n_tokens`` (random ids, or a sparse file of zeros) and its .idx (one
    document per DOC_TOKENS tokens), both written block by block."""
    import numpy as np

    from titan_pipe.tokens.indexed import HEADER, MAGIC, VERSION, dtype_code

    n_docs = -(-n_tokens // DOC_TOKENS)
    with open(f"{prefix}.bin", "wb") as f:
        if sparse:
            f.truncate(2 * n_tokens)
        else:
            rng = np.random.default_rng(seed)
            for lo in range(0, n_tokens, 1 << 26):
                f.write(rng.integers(0, 4000, size=min(1 << 26, n_tokens - lo), dtype=np.uint16).tobytes())
    block = 1 << 20
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype_code(np.uint16), n_docs, n_docs + 1))
        for lo in range(0, n_docs, block):
            d = np.arange(lo, min(n_docs, lo + block), dtype=np.int64)
            f.write(np.minimum(DOC_TOKENS, n_tokens - d * DOC_TOKENS).astype(np.int32).tobytes())
        for lo in range(0, n_docs, block):
            d = np.arange(lo, min(n_docs, lo + block), dtype=np.int64)
            f.write((d * DOC_TOKENS * 2).tobytes())
        for lo in range(0, n_docs + 1, block):
            f.write(np.arange(lo, min(n_docs + 1, lo + block), dtype=np.int64).tobytes())


# --- measured in child processes --------------------------------------------------------------------


def child_encode(jsonl: str, tokenizer: str) -> dict:
    from tokenizers import Tokenizer

    docs = [json.loads(line)["text"] for line in open(jsonl)]
    tok = Tokenizer.from_file(tokenizer)
    t0 = time.perf_counter()
    n = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
    return {"seconds": time.perf_counter() - t0, "tokens": n, "peak_mb": _peak_self_mb()}


def child_prepare(jsonl: str, tokenizer: str, out: str, workers: int) -> dict:
    from titan_pipe.training.prepare import prepare

    t0 = time.perf_counter()
    r = prepare(sources=[Path(jsonl)], out_dir=Path(out), tokenizer=tokenizer, workers=workers, progress=False)
    return {"seconds": time.perf_counter() - t0, "tokens": r.record.n_tokens, "peak_mb": _peak_self_mb()}


def child_startup(path: str, tokenizer: str, vocab: int, old: bool) -> dict:
    """A rank's data set-up before its first step: imports, open, loader, 8 batches of 8 x 512."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - a rank has torch loaded before its data; counted in both figures

    from titan_pipe.tokens.loader import PackedLoader
    from titan_pipe.tokens.spec import data_spec, open_spec
    from titan_pipe.config import DataConfig

    base_mb, t_import = _rss_mb(), time.perf_counter() - t0
    if old:  # before: every rank tokenized the whole text into one int64 tensor
        from titan_pipe.tokens.corpus import load_corpus
        from titan_pipe.tokens.tokenizer import build_tokenizer

        train, _ = load_corpus(path=Path(path), tokenizer=build_tokenizer(tokenizer)).split(0.05)
    else:
        spec = data_spec(DataConfig(path=path, tokenizer=tokenizer), base=None)
        _, data = open_spec(spec, prepared=Path(path), vocab_size=vocab)
        train = data.train
    loader = PackedLoader(train, seq_len=512, global_batch=8, seed=0, vocab_size=vocab)
    for _ in range(8):
        loader.next_batch()
    return {
        "seconds": time.perf_counter() - t0,
        "import_s": t_import,
        "peak_mb": _peak_self_mb(),
        "rss_after_imports_mb": base_mb,
    }


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_chat(work: Path, tokenizer: Path, mb: float, seed: int = 0) -> tuple[Path, Path]:
    """(a chat .jsonl of about ``mb`` MB, a tokenizer dir: the BPE + ChatML specials + the template)."""
    from tokenizers import AddedToken, Tokenizer

    tok_dir = work / "chat_tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer))
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHATML,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    from titan_pipe.tokens.sources import default_corpus

    paras = [
        p.strip()
        for f in sorted(default_corpus().glob("*.txt"))
        for p in f.read_text().split("\n\n")
        if len(p.strip()) > 40
    ]
    rng = random.Random(seed)
    path = work / "chat" / "chat.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    size, i = 0, 0
    with open(path, "w") as f:
        while size < mb * 1e6:
            msgs = [{"role": "system", "content": "Answer from the founding documents."}] if i % 3 == 0 else []
            for _ in range(1 + i % 3):
                msgs += [
                    {"role": "user", "content": rng.choice(paras)[:300]},
                    {"role": "assistant", "content": rng.choice(paras)},
                ]
            line = json.dumps({"messages": msgs}) + "\n"
            f.write(line)
            size += len(line)
            i += 1
    return path, tok_dir


def child_chat_floor(jsonl: str, tok_dir: str) -> dict:
    from transformers import AutoTokenizer

    convs = [json.loads(line)["messages"] for line in open(jsonl)]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    t0 = time.perf_counter()
    out = tok.apply_chat_template(convs, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": sum(map(len, ids)),
        "records": len(convs),
        "peak_mb": _peak_self_mb(),
    }


def child_chat_prepare(jsonl: str, tok_dir: str, out: str, workers: int) -> dict:
    from titan_pipe.training.prepare import prepare

    t0 = time.perf_counter()
    r = prepare(
        sources=[Path(jsonl)],
        out_dir=Path(out),
        tokenizer=tok_dir,
        workers=workers,
        progress=False,
        records="chat",
        val_fraction=0,
    )
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": r.record.n_tokens,
        "records": r.record.n_documents,
        "peak_mb": _peak_self_mb(),
    }


def chat(work: Path, tokenizer: Path, mb: float, workers: int) -> None:
    jsonl, tok_dir = make_chat(work, tokenizer, mb)
    env = {"RAYON_NUM_THREADS": str(workers)}
    run_child("chat_floor", jsonl, tok_dir, env=env)  # warm the page cache and the imports
    base = run_child("chat_floor", jsonl, tok_dir, env=env)
    shutil.rmtree(work / "chat_prepared", ignore_errors=True)
    ours = run_child("chat_prepare", jsonl, tok_dir, work / "chat_prepared", workers)
    assert ours["tokens"] == base["tokens"] and ours["records"] == base["records"], (ours, base)
    print(
        f"\n3. chat prepare on {jsonl.stat().st_size / 1e6:.1f} MB ({base['records']:,} conversations, "
        f"{base['tokens']:,} tokens, the same in both), {workers} worker(s), load {os.getloadavg()[0]:.2f}"
    )
    print(f"   {'method':<20} {'seconds':>8} {'conv/s':>8} {'tok/s':>11} {'peak MB':>8} {'ratio':>6}")
    for name, r in (("apply_chat_template", base), ("data prepare --chat", ours)):
        print(
            f"   {name:<20} {r['seconds']:8.2f} {r['records'] / r['seconds']:8,.0f} "
            f"{r['tokens'] / r['seconds']:11,.0f} {r['peak_mb']:8.0f} {base['seconds'] / r['seconds']:6.2f}x"
        )


def run_child(name: str, *args, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", name, *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=3600)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the report -------------------------------------------------------------------------------------


def throughput(work: Path, tokenizer: Path, mb: float, workers: int) -> None:
    jsonl = work / "text" / "corpus.jsonl"
    text_mb = make_jsonl(jsonl, mb) / 1e6
    run_child("encode", jsonl, tokenizer, env={"RAYON_NUM_THREADS": str(workers)})  # warm the page cache
    base = run_child("encode", jsonl, tokenizer, env={"RAYON_NUM_THREADS": str(workers)})
    shutil.rmtree(work / "prepared", ignore_errors=True)
    ours = run_child("prepare", jsonl, tokenizer, work / "prepared", workers)
    assert ours["tokens"] - base["tokens"] == sum(1 for _ in open(jsonl)), "one eos per document"
    print(
        f"\n1. throughput on {text_mb:.1f} MB of text ({base['tokens']:,} tokens), {workers} worker(s), "
        f"load {os.getloadavg()[0]:.2f}"
    )
    print(f"   {'method':<14} {'seconds':>8} {'MB/s':>7} {'tok/s':>11} {'peak MB':>8} {'ratio':>6}")
    for name, r in (("encode_batch", base), ("data prepare", ours)):
        print(
            f"   {name:<14} {r['seconds']:8.2f} {text_mb / r['seconds']:7.2f} {r['tokens'] / r['seconds']:11,.0f} "
            f"{r['peak_mb']:8.0f} {base['seconds'] / r['seconds']:6.2f}x"
        )


def startup(work: Path, tokenizer: Path, vocab: int) -> None:
    ten = work / "ten_mb"
    make_jsonl(ten / "text.jsonl", 10)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_pipe.cli",
            "data",
            "prepare",
            str(ten / "text.jsonl"),
            "-o",
            str(ten / "prepared"),
            "--tokenizer",
            str(tokenizer),
        ],
        check=True,
        capture_output=True,
    )
    (work / "gen").mkdir(exist_ok=True)
    write_generated(work / "gen" / "one_gb", 500_000_000, sparse=False)
    write_generated(work / "gen" / "twenty_gb", 10_000_000_000, sparse=True)
    cases = [
        ("10 MB, before (tokenize per rank)", ten / "text.jsonl", True),
        ("10 MB, prepared dir", ten / "prepared", False),
        ("1 GB, .bin/.idx", work / "gen" / "one_gb", False),
        ("20 GB sparse, .bin/.idx", work / "gen" / "twenty_gb", False),
    ]
    rows = [(name, run_child("startup", path, tokenizer, vocab, int(old))) for name, path, old in cases]
    ref = rows[1][1]
    print(f"\n2. a rank's data start-up (imports + open + loader + 8 batches), load {os.getloadavg()[0]:.2f}")
    print(
        f"   {'corpus':<34} {'seconds':>8} {'peak MB':>8} {'time/10MB':>10} {'RSS/10MB':>9} "
        f"{'data s':>7} {'data MB':>8}"
    )
    for name, r in rows:
        print(
            f"   {name:<34} {r['seconds']:8.2f} {r['peak_mb']:8.0f} {r['seconds'] / ref['seconds']:9.2f}x "
            f"{r['peak_mb'] / ref['peak_mb']:8.2f}x {r['seconds'] - r['import_s']:7.2f} "
            f"{r['peak_mb'] - r['rss_after_imports_mb']:8.1f}"
        )
    print(f"   (imports alone: {ref['import_s']:.2f} s, {ref['rss_after_imports_mb']:.0f} MB RSS; 'data': the rest)")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        name, args = sys.argv[2], sys.argv[3:]
        fn = {
            "encode": child_encode,
            "prepare": lambda j, t, o, w: child_prepare(j, t, o, int(w)),
            "chat_floor": child_chat_floor,
            "chat_prepare": lambda j, t, o, w: child_chat_prepare(j, t, o, int(w)),
            "startup": lambda p, t, v, o: child_startup(p, t, int(v), bool(int(o))),
        }[name]
        print(json.dumps(fn(*args)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/titan-pipe-data-bench"))
    ap.add_argument("--mb", type=float, default=50.0, help="MB of text for the throughput case")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--keep", action="store_true", help="keep the work dir (40+ GB of sparse files)")
    ap.add_argument("--only", choices=("throughput", "startup", "chat"), default=None)
    ap.add_argument("--chat-mb", type=float, default=20.0, help="MB of chat records for the chat case")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = make_tokenizer(a.workdir, a.vocab)
        print(
            f"tokenizer: byte-level BPE, {a.vocab} ids, trained on the shipped corpus; load at start "
            f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        if a.only in (None, "throughput"):
            throughput(a.workdir, tokenizer, a.mb, a.workers)
        if a.only in (None, "startup"):
            startup(a.workdir, tokenizer, a.vocab)
        if a.only in (None, "chat"):
            chat(a.workdir, tokenizer, a.chat_mb, a.workers)
    finally:
        if not a.keep:
            shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
