"""Tokenizers: byte-level (no vocabulary file) or a Hugging Face tokenizer.json, with their bos/eos ids.

Shared by training (the corpus is encoded with it) and evaluate (held-out text, prompts).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.tokens.identity import TokenizerRecord

# Special tokens looked for in a tokenizer.json when no tokenizer_config.json names them; the
# spellings of LLaMA-2 (<s>, </s>), LLaMA-3 (<|begin_of_text|>, <|end_of_text|>), GPT-2 and BERT-likes.
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>")
EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]", "<|eot_id|>")


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer. Ids are in [0, vocab_size)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos=256 and eos=257: 258 ids, no vocabulary file."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids carry no text; a cut in the middle of a multi-byte character decodes to U+FFFD
        # instead of failing, since sampled or sliced ids need not end on a character boundary.
        raw = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return raw.decode("utf-8", errors="replace")

    def encode_array(self, text: str) -> np.ndarray:
        """Same ids as encode(), as uint8 without a Python list (fast path for large corpora)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer.json; bos/eos from tokenizer_config.json or by name."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tok

        from titan_pipe.rules.limits import TOKENIZER_BYTES

        self.path = path
        size = path.stat().st_size
        if size > TOKENIZER_BYTES.hi:
            raise UserError(
                f"{path}: {size / 2**20:,.0f} MiB, over the bound of {TOKENIZER_BYTES.hi / 2**20:.0f} MiB "
                f"for a tokenizer.json ({TOKENIZER_BYTES.why}); give the model's own tokenizer.json"
            )
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise UserError(
                f"{path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                "give a tokenizer.json saved by `tokenizers` or transformers, or 'byte'"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = _special_tokens_from_config(path.parent / "tokenizer_config.json")
        for key in ("bos_token", "eos_token"):  # a token the config names must be in the vocab: no silent stand-in
            if named.get(key) and self._tok.token_to_id(named[key]) is None:
                raise UserError(
                    f"{path.parent / 'tokenizer_config.json'}: {key} {named[key]!r} is not in {path}'s "
                    f"vocabulary; fix {key} (or the tokenizer) so the two files belong together"
                )
        self.bos_id = self._find_id(named.get("bos_token"), BOS_CANDIDATES)
        eos = self._find_id(named.get("eos_token"), EOS_CANDIDATES)
        if eos is None:
            raise UserError(
                f"{path}: no end-of-text token found (looked for {', '.join(EOS_CANDIDATES)} "
                "and eos_token in tokenizer_config.json); documents are joined with it, "
                "so add one to the tokenizer"
            )
        self.eos_id = eos

    def _find_id(self, named: str | None, candidates: tuple[str, ...]) -> int | None:
        for token in ((named,) if named else ()) + candidates:
            tid = self._tok.token_to_id(token)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_batch_encodings(self, texts: list[str]) -> list:
        """``tokenizers`` Encodings (ids, offsets, char_to_token) per text: special tokens in the text
        are matched (a chat template's markers), as transformers' apply_chat_template tokenizes."""
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size})"


# The special tokens transformers passes a chat template (and bos/eos, which name the ids here)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def special_tokens(config: dict, keys: tuple[str, ...] = SPECIAL_KEYS) -> dict[str, str]:
    """{bos_token: "<s>", ...} of a tokenizer_config.json's contents: strings or AddedToken dicts."""
    found = {}
    for key in keys:
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            found[key] = v
    return found


def _special_tokens_from_config(path: Path) -> dict[str, str]:
    """bos_token / eos_token as transformers' tokenizer_config.json names them (str or AddedToken dict)."""
    if not path.is_file():
        return {}
    from titan_pipe.rules.values import read_json

    try:
        cfg = read_json(path, what="a tokenizer config")
    except UserError:
        return {}
    return special_tokens(cfg, ("bos_token", "eos_token")) if isinstance(cfg, dict) else {}


def build_tokenizer(spec: str, *, base: Path | None = None) -> ByteTokenizer | HFTokenizer:
    """ "byte" or the path of a tokenizer.json (relative paths are read from ``base``, the flow's dir)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"data.tokenizer: {spec!r} is not a file (resolved to {path}); give the path of a "
            "Hugging Face tokenizer.json or 'byte'"
        )
    return HFTokenizer(path)


# What a checkpoint / converted model carries of an HF tokenizer: the tokenizer.json (always under
# this name, so evaluate and transformers find it) and, when beside it, the files naming bos/eos and
# the chat template (transformers >= 4.43 saves it as chat_template.jinja, older ones inside
# tokenizer_config.json): a fine-tuned model converts back with the template it was trained on.
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tokenizer_files(tok: ByteTokenizer | HFTokenizer) -> dict[str, Path]:
    """{name in a model dir: source path} of the files that reproduce ``tok``; {} for the byte tokenizer."""
    if not isinstance(tok, HFTokenizer):
        return {}
    from titan_pipe.io.paths import resolve_inside

    root = Path(tok.path).parent
    out = {"tokenizer.json": Path(tok.path)}
    for name in TOKENIZER_SIDE_FILES:  # a side file linked out of the tokenizer's dir is refused, never copied
        if os.path.lexists(root / name):
            out[name] = resolve_inside(root, name, source=root, what="tokenizer file")
    return out


def tokenizer_info(tok: ByteTokenizer | HFTokenizer) -> TokenizerRecord:
    """What identifies ``tok`` in a data record: kind, the tokenizer.json's sha256, vocab size, bos/eos."""
    if isinstance(tok, HFTokenizer):
        from titan_pipe.io.hashing import sha256_file

        return TokenizerRecord("tokenizer.json", sha256_file(tok.path), tok.vocab_size, tok.bos_id, tok.eos_id)
    return TokenizerRecord("byte", None, tok.vocab_size, tok.bos_id, tok.eos_id)


def encode_documents(tok: ByteTokenizer | HFTokenizer, docs: list[str], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Documents -> (ids back to back, each document followed by eos, in ``dtype``; lengths (n,) int32).

    Empty documents (no ids) are dropped. The one encoding both data prepare and evaluate use, so
    both give the same ids for the same text.
    """
    if isinstance(tok, ByteTokenizer):
        encoded = [tok.encode_array(d) for d in docs]
    else:
        encoded = [np.asarray(ids) for ids in tok.encode_batch(docs)]
    encoded = [e for e in encoded if len(e)]
    lengths = np.array([len(e) + 1 for e in encoded], dtype=np.int32)
    out = np.empty(int(lengths.sum()), dtype=dtype)
    at = 0
    for e in encoded:
        out[at : at + len(e)] = e
        out[at + len(e)] = tok.eos_id
        at += len(e) + 1
    return out, lengths
