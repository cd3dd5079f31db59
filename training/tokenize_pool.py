"""Tokenizing source blocks in worker processes, results back in input order.

The reader (this process) only cuts the files into blocks of raw lines (titan_pipe.tokens.sources)
and groups them into chunks of about CHUNK_CHARS; each worker parses a chunk's documents and
encodes them (titan_pipe.tokens.tokenizer.encode_documents), sending back ids in the output dtype.
At most 2 chunks per worker are in flight, so memory is bounded by the chunk size, never the
corpus; the output order is the input order whatever the worker count.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from dataclasses import dataclass
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from titan_pipe.processes import procs
from titan_pipe.tokens.sources import Block, documents

if TYPE_CHECKING:
    from titan_pipe.tokens.chat import ChatTemplate

CHUNK_CHARS = 1 << 22  # ~4 MB of text per task: enough to amortise pickling, small enough to bound memory
IN_FLIGHT_PER_WORKER = 2

_tok = None
_dtype = None
_text_key = "text"
_chat = None  # ChatSpec of chat / instruction data, None for plain text


@dataclass(frozen=True)
class ChatSpec:
    """How chat / instruction records become tokens (picklable: sent to each worker once)."""

    fmt: str  # chat | instruction
    template: "ChatTemplate"  # titan_pipe.tokens.chat: the Jinja source, its origin, the special tokens
    max_tokens: int | None  # a longer conversation is a bad record (None: no limit)

    @property
    def key(self) -> str:
        """sha256 of what the rendering depends on (a prepared dir's key includes it; data merge reads
        it back from the parts' records)."""
        import hashlib
        import json

        doc = [
            self.fmt,
            self.template.source,
            [list(x) for x in sorted(self.template.special.items())],
            self.max_tokens,
        ]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


@dataclass(frozen=True)
class Encoded:
    """One chunk's result: ids back to back, tokens per document, characters and documents read;
    for chat data the loss mask of the ids and the records left out ("file:line: why")."""

    ids: np.ndarray
    lengths: np.ndarray
    chars: int
    docs_in: int
    mask: np.ndarray | None = None
    bad: tuple = ()


def chunk_blocks(blocks: Iterable[Block], chars: int | None = None) -> Iterator[list[Block]]:
    """Consecutive blocks grouped into lists of about ``chars`` (default CHUNK_CHARS) of text."""
    chars = chars or CHUNK_CHARS
    batch, size = [], 0
    for block in blocks:
        batch.append(block)
        size += block.size
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _init(
    spec: str,
    dtype: str,
    text_key: str,
    single_thread: bool = True,
    parent: int | None = None,
    chat: ChatSpec | None = None,
) -> None:
    if parent is not None:  # a worker of the pool: no orphan tokenizing on when `data prepare` is killed
        procs.die_with_parent(parent)
    if single_thread:  # a worker of the pool: the pool is the parallelism, not the tokenizer's threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _tok, _dtype, _text_key, _chat
    from titan_pipe.tokens.tokenizer import build_tokenizer

    _tok, _dtype, _text_key, _chat = build_tokenizer(spec), np.dtype(dtype), text_key, chat


def _encode(blocks: list[Block]) -> Encoded:
    """One chunk's documents encoded."""
    from titan_pipe.tokens.tokenizer import encode_documents

    if _chat is not None:
        return _encode_chat(blocks)
    docs = [d for b in blocks for d in documents(b, text_key=_text_key)]
    return Encoded(*encode_documents(_tok, docs, _dtype), sum(map(len, docs)), len(docs))


def _encode_chat(blocks: list[Block]) -> Encoded:
    """Chat / instruction records rendered by the template, encoded in one batch, masked to their
    answers (titan_pipe.tokens.chat); records that cannot be trained on are named in ``bad``."""
    from titan_pipe.tokens.chat import BadRecord, answer_mask, conversation
    from titan_pipe.tokens.sources import records

    template = _chat.template
    texts, spans, wheres, bad, n_in = [], [], [], [], 0
    for b in blocks:
        for where, record in records(b):
            n_in += 1
            try:
                text, answer = template.answer_spans(conversation(record, fmt=_chat.fmt))
            except BadRecord as e:
                bad.append(f"{where}: {e}")
                continue
            texts.append(text)
            spans.append(answer)
            wheres.append(where)
    ids, masks, lengths = [], [], []
    for where, answer, enc in zip(wheres, spans, _tok.encode_batch_encodings(texts)):
        ids_ = enc.ids
        if _chat.max_tokens is not None and len(ids_) > _chat.max_tokens:
            bad.append(f"{where}: {len(ids_)} tokens, longer than the window of {_chat.max_tokens}")
            continue
        mask = answer_mask(enc, answer)
        if not mask.any():
            bad.append(f"{where}: no answer token after tokenizing")
            continue
        ids.append(np.asarray(ids_, dtype=_dtype))
        masks.append(mask)
        lengths.append(len(ids_))

    def cat(xs, dt):
        return np.concatenate(xs) if xs else np.zeros(0, dtype=dt)

    return Encoded(
        cat(ids, _dtype),
        np.asarray(lengths, dtype=np.int32),
        sum(map(len, texts)),
        n_in,
        cat(masks, np.uint8),
        tuple(bad),
    )


def encode_stream(
    chunks: Iterable[list[Block]],
    *,
    spec: str,
    dtype: np.dtype,
    text_key: str,
    workers: int,
    chat: ChatSpec | None = None,
) -> Iterator[Encoded]:
    """Each chunk encoded, in order (empty documents have no length); ``workers`` <= 1 encodes in
    this process; ``chat``: the chunks hold chat / instruction records."""
    args = (spec, np.dtype(dtype).name, text_key)
    if workers <= 1:
        _init(*args, single_thread=False, chat=chat)
        for chunk in chunks:
            yield _encode(chunk)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads (torch, rayon)
    with ProcessPoolExecutor(
        workers, mp_context=ctx, initializer=_init, initargs=(*args, True, os.getpid(), chat)
    ) as pool:
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_encode, chunk))
                if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()
