"""Tokenizing a stream of documents in worker processes, results back in input order.

The reader (this process) cuts the documents into chunks of about CHUNK_CHARS characters; each
worker encodes a whole chunk (titan_pipe.tokens.tokenizer.encode_documents) and sends back its
ids in the output dtype. At most 2 chunks per worker are in flight, so memory is bounded by the
chunk size, never the corpus; the output order is the input order whatever the worker count.
"""
from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator

import numpy as np

CHUNK_CHARS = 1 << 22  # ~4 MB of text per task: enough to amortise pickling, small enough to bound memory
IN_FLIGHT_PER_WORKER = 2

_tok = None
_dtype = None


def chunk_documents(docs: Iterable[str], chars: int | None = None) -> Iterator[list[str]]:
    """Consecutive documents grouped into lists of about ``chars`` (default CHUNK_CHARS) characters."""
    chars = chars or CHUNK_CHARS
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _init(spec: str, dtype: str, single_thread: bool = True) -> None:
    if single_thread:  # a worker of the pool: the pool is the parallelism, not the tokenizer's threads
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _tok, _dtype
    from titan_pipe.tokens.tokenizer import build_tokenizer

    _tok, _dtype = build_tokenizer(spec), np.dtype(dtype)


def _encode(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    from titan_pipe.tokens.tokenizer import encode_documents

    return encode_documents(_tok, docs, _dtype)


def encode_stream(chunks: Iterable[list[str]], *, spec: str, dtype: np.dtype, workers: int
                  ) -> Iterator[tuple[np.ndarray, np.ndarray, int, int]]:
    """(ids, lengths, characters, documents in) per chunk, in order (empty documents have no length);
    ``workers`` <= 1 encodes in this process."""
    if workers <= 1:
        _init(spec, np.dtype(dtype).name, single_thread=False)
        for docs in chunks:
            yield (*_encode(docs), sum(map(len, docs)), len(docs))
        return
    ctx = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads (torch, rayon)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init,
                             initargs=(spec, np.dtype(dtype).name)) as pool:
        pending: deque = deque()
        try:
            for docs in chunks:
                pending.append((pool.submit(_encode, docs), sum(map(len, docs)), len(docs)))
                if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                    fut, chars, n = pending.popleft()
                    yield (*fut.result(), chars, n)
            while pending:
                fut, chars, n = pending.popleft()
                yield (*fut.result(), chars, n)
        finally:
            for fut, _, _ in pending:
                fut.cancel()
