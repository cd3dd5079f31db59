"""What travels with the weights besides the tokenizer: the stop tokens and the generation settings.

A released model names its special token ids in config.json (``bos_token_id``, ``eos_token_id``
— a list where it has several stops, e.g. ``<|im_end|>`` and ``<|endoftext|>`` —, ``pad_token_id``)
and its decoding defaults in ``generation_config.json``; transformers' ``generate`` stops on those.
Every conversion and every checkpoint carries both: config.json's ids in a checkpoint manifest's
``extra.token_ids``, generation_config.json as an attached file, copied byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.errors import UserError
from titan_pipe.io.paths import resolve_inside
from titan_pipe.rules.values import read_json

GENERATION_CONFIG = "generation_config.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
MAX_STOP_IDS = 64  # eos lists of released models hold 1-3 ids


def token_ids(values: dict, *, source: object) -> dict:
    """The token id keys of ``values`` (a config.json or a manifest's record), each checked: a token
    id (an integer in 0..limits.VOCAB) or, for eos, a list of them; null keys are left out."""
    out = {}
    for key in TOKEN_ID_KEYS:
        v = values.get(key)
        if v is None:
            continue
        ids = v if isinstance(v, list) and key == "eos_token_id" else [v]
        if not ids or len(ids) > MAX_STOP_IDS or any(type(i) is not int or not 0 <= i < limits.VOCAB.hi for i in ids):
            raise UserError(
                f"{source}: {key} {limits.shown(v)} is not a token id (an integer >= 0"
                f"{', or a list of them' if key == 'eos_token_id' else ''}); copy the model's "
                "original config.json"
            )
        out[key] = v
    return out


def dir_token_ids(model_dir: Path) -> dict:
    """The token ids a model dir's config.json names ({} without a config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    return token_ids(read_json(path, what="a model config"), source=path)


def generation_config(model_dir: Path) -> Path | None:
    """A model dir's generation_config.json (never through a link leading outside it), or None."""
    path = resolve_inside(Path(model_dir), GENERATION_CONFIG, source=Path(model_dir), what="generation config")
    if not path.is_file():
        return None
    read_json(path, what="a generation config")  # refused here when it is not JSON, not in the model's loader
    return path
