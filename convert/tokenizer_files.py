"""The tokenizer files a conversion carries from the source checkpoint into the unified model dir.

A titan-pipe checkpoint names its tokenizer in manifest ``extra.tokenizer`` ("byte", or
"tokenizer.json" beside the manifest, with every copied file's size and sha256 under
``extra.attached``). Any other source (a Hugging Face dir, Megatron, DCP) contributes the
tokenizer.json / tokenizer_config.json / special_tokens_map.json / chat_template.jinja found beside
its weights. A model
trained on the byte tokenizer gets its Hugging Face form (titan_pipe.tokens.byte_hf), so
``AutoTokenizer.from_pretrained`` loads every converted model dir.
"""
from __future__ import annotations

from pathlib import Path

from titan_pipe.atomic import copy_file
from titan_pipe.checkpoint_format import MANIFEST_NAME, Manifest
from titan_pipe.convert.source_plan import SourcePlan
from titan_pipe.errors import UserError
from titan_pipe.hashing import sha256_file
from titan_pipe.paths import resolve_inside
from titan_pipe.provenance import TokenizerInfo
from titan_pipe.tokens.tokenizer import TOKENIZER_SIDE_FILES

TOKENIZER_NAMES = ("tokenizer.json", *TOKENIZER_SIDE_FILES)


def plan_tokenizer_files(plan: SourcePlan) -> dict[str, Path]:
    """{name in the output dir: source file} to copy; raises UserError when a listed one is missing."""
    root = Path(plan.root)
    if plan.format != "titan":  # copied verbatim into the output: never through a link leading outside
        found = {n: resolve_inside(root, n, source=root, what="tokenizer file") for n in TOKENIZER_NAMES}
        return {n: f for n, f in found.items() if f.is_file()}
    extra = Manifest.load(root).extra
    if (extra.tokenizer or "byte") == "byte":
        return {}
    attached = extra.attached
    names = [n for n in TOKENIZER_NAMES if n in attached]
    if extra.tokenizer != "tokenizer.json" or "tokenizer.json" not in attached:
        return {}  # an older checkpoint that recorded the flow's tokenizer path, not a copy of it
    out = {}
    for n in names:
        f = resolve_inside(root, n, source=root / MANIFEST_NAME, what="attached file")
        if not f.is_file() or f.stat().st_size != attached[n].size:
            raise UserError(f"{f}: missing or not the size {root / MANIFEST_NAME} records "
                            f"({attached[n].size} bytes); copy the complete checkpoint")
        out[n] = f
    return out


def copy_tokenizer_files(plan: SourcePlan, dest: Path) -> tuple[list[Path], TokenizerInfo]:
    """Copy the source's tokenizer files into ``dest`` (the conversion's temp dir).

    Returns the written paths and what the provenance records: "byte" | "tokenizer.json" | None with
    {name: sha256} of the copies; a titan source's sha256s are checked against its manifest.
    """
    todo = plan_tokenizer_files(plan)
    expected = {}
    if plan.format == "titan" and todo:
        expected = {n: v.sha256 for n, v in Manifest.load(plan.root).extra.attached.items()}
    written, digests = [], {}
    for name, src in todo.items():
        path = dest / name
        copy_file(src, path)
        digests[name] = sha256_file(path)
        if name in expected and digests[name] != expected[name]:
            raise UserError(f"{src}: sha256 {digests[name][:12]}... but {Path(plan.root) / MANIFEST_NAME} "
                            f"records {expected[name][:12]}...; the file was replaced. Copy the checkpoint again")
        written.append(path)
    kind = "tokenizer.json" if "tokenizer.json" in todo else "byte" if plan.format == "titan" else None
    if kind == "byte":  # the byte tokenizer in Hugging Face's form, so AutoTokenizer loads the model dir
        from titan_pipe.atomic import write_text
        from titan_pipe.tokens.byte_hf import byte_tokenizer_files

        for name, text in byte_tokenizer_files().items():
            path = dest / name
            write_text(path, text)
            digests[name] = sha256_file(path)
            written.append(path)
    return written, TokenizerInfo(kind, digests)
