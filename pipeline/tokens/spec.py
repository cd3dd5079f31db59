"""flow.yaml's ``data`` section resolved to files: raw text to prepare first, or token data to open.

``data.path`` may name raw text (a .txt/.jsonl/.jsonl.gz/.parquet file or a directory of them;
null: the shipped corpus), a prepared dir (``data.json`` + ``tokens.bin/.idx``) or a Megatron
``.bin``/``.idx`` prefix; ``data.blend`` lists prepared dirs / prefixes with weights. Raw text is
prepared once into the run dir's ``data/`` (by the flow's ``data`` stage, or by ``titan-pipe
train`` before it starts the ranks); every rank then opens that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.tokens.indexed import bin_path, idx_path, is_prefix, strip_suffix
from titan_pipe.tokens.record import DATA_JSON, PREFIX, is_prepared
from titan_pipe.tokens.sources import corpus_files, default_corpus


def resolve(path: str, base: Path | None) -> Path:
    """A path from flow.yaml: ~ expanded, relative ones read from ``base`` (the flow's dir)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or base is None else base / p


def is_token_data(path: Path) -> bool:
    """A prepared dir or a .bin/.idx prefix (not raw text)."""
    return is_prepared(path) or is_prefix(path)


def token_files(path: Path) -> list[Path]:
    """The files a prepared dir or a prefix consists of."""
    if is_prepared(path):
        return [path / DATA_JSON, bin_path(path / PREFIX), idx_path(path / PREFIX)]
    prefix = strip_suffix(path)
    return [bin_path(prefix), idx_path(prefix)]


@dataclass(frozen=True)
class DataSpec:
    """text: raw text to prepare (None when the data is token data already); paths/weights: what to open
    (empty for raw text: its prepared dir is the run's); tokenizer: "byte" or a tokenizer.json path."""

    text: Path | None
    paths: tuple[Path, ...]
    weights: tuple[float, ...]
    tokenizer: str
    text_key: str
    val_fraction: float
    fraction_given: bool  # flow.yaml set data.val_fraction itself (a prepared dir's record must agree)
    records: str = "text"  # text | chat | instruction (how raw .jsonl records are read)
    chat_template: str = "model"
    max_tokens: int | None = None  # chat/instruction: a longer conversation is left out as bad
    max_bad_fraction: float = limits.MAX_BAD_FRACTION  # chat/instruction: bad records allowed before prepare fails

    def open_paths(self, prepared: Path) -> list[Path]:
        """What to open: the token data named, or ``prepared`` (the run's data dir) for raw text."""
        return [prepared] if self.text is not None else list(self.paths)

    def input_files(self) -> list[Path]:
        """Every file the data depends on (raw text files or token files, and the tokenizer.json)."""
        files = corpus_files(self.text) if self.text is not None else [f for p in self.paths for f in token_files(p)]
        if self.tokenizer != "byte":
            tok = Path(self.tokenizer)
            if tok.is_dir():  # a model dir: its tokenizer and the files naming its specials and chat template
                from titan_pipe.tokens.tokenizer import TOKENIZER_SIDE_FILES

                files += [f for f in (tok / n for n in ("tokenizer.json", *TOKENIZER_SIDE_FILES)) if f.is_file()]
            else:
                files.append(tok)
        if self.records != "text" and Path(self.chat_template).is_file():
            files.append(Path(self.chat_template))
        return files


def data_spec(data, *, base: Path | None) -> DataSpec:
    """The DataConfig ``data`` of a flow whose relative paths are read from ``base``."""
    tokenizer = data.tokenizer if data.tokenizer == "byte" else str(resolve(data.tokenizer, base))
    template = getattr(data, "chat_template", "model")
    from titan_pipe.tokens.chat import BUILTIN_TEMPLATES

    if template != "model" and template not in BUILTIN_TEMPLATES:  # a .jinja file, relative to the flow's dir
        template = str(resolve(template, base))
    common = dict(
        tokenizer=tokenizer,
        text_key=data.text_key,
        val_fraction=data.val_fraction,
        fraction_given="val_fraction" in data.model_fields_set,
        records=getattr(data, "format", "text"),
        chat_template=template,
        max_tokens=getattr(data, "max_tokens", None),
        max_bad_fraction=getattr(data, "max_bad_fraction", limits.MAX_BAD_FRACTION),
    )
    blend = getattr(data, "blend", None)
    if blend:
        return DataSpec(None, tuple(resolve(b.path, base) for b in blend), tuple(b.weight for b in blend), **common)
    path = default_corpus() if data.path is None else resolve(data.path, base)
    if is_token_data(path):
        return DataSpec(None, (path,), (1.0,), **common)
    return DataSpec(path, (), (), **common)


def open_spec(spec: DataSpec, *, prepared: Path, vocab_size: int | None = None):
    """(tokenizer, TokenData) of a resolved data section; ``prepared``: where its raw text was prepared.

    ``vocab_size`` (the model's) is checked against the tokenizer and the data's largest id, so an
    id can never index past the embedding.
    """
    from titan_pipe.errors import UserError
    from titan_pipe.tokens.dataset import open_data
    from titan_pipe.tokens.tokenizer import build_tokenizer, tokenizer_info

    tok = build_tokenizer(spec.tokenizer)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise UserError(
            f"model.vocab_size: {vocab_size} is smaller than the tokenizer's {tok.vocab_size} "
            f"ids ({tok!r}); raise model.vocab_size to at least {tok.vocab_size}"
        )
    data = open_data(
        spec.open_paths(prepared),
        list(spec.weights) or None,
        val_fraction=spec.val_fraction,
        fraction_given=spec.fraction_given,
        tokenizer=tokenizer_info(tok),
        vocab_size=vocab_size,
    )
    return tok, data
