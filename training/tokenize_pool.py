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
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator

import numpy as np

from titan_pipe import procs
from titan_pipe.tokens.sources import Block, documents

CHUNK_CHARS = 1 << 22  # ~4 MB of text per task: enough to amortise pickling, small enough to bound memory
IN_FLIGHT_PER_WORKER = 2

_tok = None
_dtype = None
_text_key = "text"


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


def _init(spec: str, dtype: str, text_key: str, single_thread: bool = True, parent: int | None = None) -> None:
    if parent is not None:  # a worker of the pool: no orphan tokenizing on when `data prepare` is killed
        procs.die_with_parent(parent)
    if single_thread:  # a worker of the pool: the pool is the parallelism, not the tokenizer's threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _tok, _dtype, _text_key
    from titan_pipe.tokens.tokenizer import build_tokenizer

    _tok, _dtype, _text_key = build_tokenizer(spec), np.dtype(dtype), text_key


def _encode(blocks: list[Block]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(ids, lengths, characters, documents in) of one chunk."""
    from titan_pipe.tokens.tokenizer import encode_documents

    docs = [d for b in blocks for d in documents(b, text_key=_text_key)]
    return (*encode_documents(_tok, docs, _dtype), sum(map(len, docs)), len(docs))


def encode_stream(chunks: Iterable[list[Block]], *, spec: str, dtype: np.dtype, text_key: str, workers: int
                  ) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """(ids, lengths, characters, documents in) per chunk, in order (empty documents have no length);
    ``workers`` <= 1 encodes in this process."""
    args = (spec, np.dtype(dtype).name, text_key)
    if workers <= 1:
        _init(*args, single_thread=False)
        for chunk in chunks:
            yield _encode(chunk)
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads (torch, rayon)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(*args, True, os.getpid())) as pool:
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
