"""Raw text tokenized in memory: small held-out files and corpora that evaluation reads without a
prepared dir. Training never uses this (it memory-maps prepared data, titan_pipe.tokens.dataset).

The token ids and the document split are the ones ``titan-pipe data prepare`` writes for the same
text (the same ``encode_documents`` and the same ``val_start`` rule), so evaluating on raw text
scores exactly the documents a training on its prepared form held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.tokens.dataset import TokenSpan, val_start
from titan_pipe.tokens.sources import corpus_files, default_corpus, iter_documents
from titan_pipe.tokens.tokenizer import ByteTokenizer, HFTokenizer, encode_documents

DOCS_PER_BATCH = 256


@dataclass(frozen=True)
class Corpus:
    """tokens: (N,) int64, every document followed by eos; starts: (n_docs + 1,) document offsets."""

    tokens: np.ndarray
    starts: np.ndarray
    root: Path

    @property
    def n_documents(self) -> int:
        return len(self.starts) - 1

    def split(self, val_fraction: float) -> tuple[TokenSpan, TokenSpan]:
        """(train, validation): the held-out tail of whole documents, by titan_pipe.tokens.dataset.val_start."""
        d = val_start(
            lambda i: int(self.starts[i]),
            self.n_documents,
            len(self.tokens),
            val_fraction,
            where=f"data.path {self.root}",
        )
        cut = int(self.starts[d])
        return (
            TokenSpan(self.tokens, 0, cut, f"{self.root} (train)"),
            TokenSpan(self.tokens, cut, len(self.tokens), f"{self.root} (validation)"),
        )


def load_corpus(*, path: Path | None, tokenizer: ByteTokenizer | HFTokenizer, text_key: str = "text") -> Corpus:
    """Every document of ``path`` (None: the shipped corpus) in sorted file order, tokenized in memory."""
    root = default_corpus() if path is None else Path(path)
    pieces, lengths, batch = [], [], []

    def flush():
        ids, lens = encode_documents(tokenizer, batch, np.int64)
        pieces.append(ids)
        lengths.append(lens)
        batch.clear()

    for f in corpus_files(root):
        for doc in iter_documents(f, text_key=text_key):
            batch.append(doc)
            if len(batch) >= DOCS_PER_BATCH:
                flush()
    flush()
    lens = np.concatenate(lengths)
    if not len(lens):
        raise UserError(f"data.path: {root} holds no text (every document is empty); add text or fix data.text_key")
    starts = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    return Corpus(np.concatenate(pieces), starts, root)
