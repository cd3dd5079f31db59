"""The byte tokenizer (titan_pipe.tokens.tokenizer.ByteTokenizer) as Hugging Face files, so a model
trained on it loads with ``AutoTokenizer.from_pretrained(model_dir)`` and encodes to the same ids.

ids 0..255 are the UTF-8 bytes, 256 is bos, 257 eos (named as Llama 3 names them). In tokenizers' terms: a
byte-level pre-tokenizer (no regex split, no prefix space) that turns each byte into one printable
character, a BPE model with no merges whose vocabulary maps the character of byte b to id b, the
two special tokens added, and a byte-level decoder back to text.
"""

from __future__ import annotations

import json

from titan_pipe.tokens.tokenizer import ByteTokenizer

# Text holding these literal strings encodes to the special ids in transformers (it parses added
# tokens out of text, as for every tokenizer it loads); anything else encodes byte for byte as ours.
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def byte_characters() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level tokenizers: printable
    Latin-1 bytes stand for themselves, the other 68 are numbered on from U+0100 in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def tokenizer_json() -> str:
    vocab = {ch: b for b, ch in enumerate(byte_characters())}
    tok = ByteTokenizer()
    special = [{"id": tok.bos_id, "content": BOS}, {"id": tok.eos_id, "content": EOS}]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {**s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for s in special
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    return json.dumps(doc, ensure_ascii=False, indent=1)


def tokenizer_config_json(*, model_max_length: int | None = None) -> str:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length:
        cfg["model_max_length"] = model_max_length
    return json.dumps(cfg, indent=1)


def byte_tokenizer_files() -> dict[str, str]:
    """{file name: text} to write beside a model trained on the byte tokenizer."""
    return {"tokenizer.json": tokenizer_json(), "tokenizer_config.json": tokenizer_config_json()}
