"""The files a conversion carries from the source beside the weights: tokenizer, chat template,
generation settings, and the stop-token ids config.json names.

A titan-pipe checkpoint lists them in its manifest: ``extra.tokenizer`` ("byte", or "tokenizer.json"
beside the manifest), ``extra.attached`` (every copied file's size and sha256, checked here) and
``extra.token_ids``. Any other source (a Hugging Face dir, Megatron, DCP) contributes the
tokenizer.json / tokenizer_config.json / special_tokens_map.json / chat_template.jinja /
generation_config.json found beside its weights, and a Hugging Face dir the ids of its config.json.
Both outputs carry them: a unified dir as its own files and config.json keys, a sharded one as
attached files and ``extra.token_ids`` of its manifest, so HF -> sharded -> HF keeps every byte.
A model trained on the byte tokenizer (the manifest says "byte") gets its Hugging Face form
(titan_pipe.tokens.byte_hf); a source with no tokenizer gets none, and the result says so — never
a stand-in.
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.io.atomic import copy_file
from titan_pipe.records.checkpoint_format import MANIFEST_NAME, FileInfo, Manifest
from titan_pipe.weights.source_plan import SourcePlan
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import sha256_file
from titan_pipe.io.paths import resolve_inside
from titan_pipe.tokens.identity import TokenizerRecord
from titan_pipe.tokens.model_files import GENERATION_CONFIG, dir_token_ids
from titan_pipe.tokens.tokenizer import TOKENIZER_SIDE_FILES

TOKENIZER_NAMES = ("tokenizer.json", *TOKENIZER_SIDE_FILES)
SIDE_NAMES = (*TOKENIZER_NAMES, GENERATION_CONFIG)


def plan_tokenizer_files(plan: SourcePlan) -> dict[str, Path]:
    """{name in the output dir: source file} to copy; raises UserError when a listed one is missing."""
    root = Path(plan.root)
    if plan.format != "titan":  # copied verbatim into the output: never through a link leading outside
        found = {n: resolve_inside(root, n, source=root, what="tokenizer file") for n in SIDE_NAMES}
        return {n: f for n, f in found.items() if f.is_file()}
    extra = Manifest.load(root).extra
    attached = extra.attached
    # the tokenizer's files where the manifest names the attached tokenizer.json (an older checkpoint
    # recorded the flow's tokenizer path instead of a copy: none), the generation config where attached
    tokenizer = extra.tokenizer == "tokenizer.json" and "tokenizer.json" in attached
    names = [n for n in SIDE_NAMES if n in attached and (tokenizer or n not in TOKENIZER_NAMES)]
    out = {}
    for n in names:
        f = resolve_inside(root, n, source=root / MANIFEST_NAME, what="attached file")
        if not f.is_file() or f.stat().st_size != attached[n].size:
            raise UserError(
                f"{f}: missing or not the size {root / MANIFEST_NAME} records "
                f"({attached[n].size} bytes); copy the complete checkpoint"
            )
        out[n] = f
    return out


def source_token_ids(plan: SourcePlan) -> dict:
    """The bos/eos/pad ids the source names: a titan manifest's extra.token_ids, a Hugging Face
    or unified dir's config.json keys; {} for sources that record none (DCP, Megatron)."""
    if plan.format == "titan":
        return dict(Manifest.load(plan.root).extra.token_ids or {})
    return dir_token_ids(plan.root) if plan.format == "hf" else {}


def copy_tokenizer_files(
    plan: SourcePlan, dest: Path, *, byte_files: bool = True
) -> tuple[list[Path], TokenizerRecord, dict[str, FileInfo]]:
    """Copy the source's side files into ``dest`` (the conversion's temp dir); ``byte_files``: write
    the byte tokenizer's Hugging Face form where the source trained on it (a unified output).

    Returns the written paths, what the provenance records ("byte" | "tokenizer.json" | None with
    {name: sha256} of the copies) and each copy's FileInfo (a sharded output's manifest lists them
    as attached); a titan source's sha256s are checked against its manifest.
    """
    todo = plan_tokenizer_files(plan)
    extra = Manifest.load(plan.root).extra if plan.format == "titan" else None
    expected = {n: v.sha256 for n, v in extra.attached.items()} if extra is not None else {}
    written, digests = [], {}
    for name, src in todo.items():
        path = dest / name
        copy_file(src, path)
        digests[name] = sha256_file(path)
        if name in expected and digests[name] != expected[name]:
            raise UserError(
                f"{src}: sha256 {digests[name][:12]}... but {Path(plan.root) / MANIFEST_NAME} "
                f"records {expected[name][:12]}...; the file was replaced. Copy the checkpoint again"
            )
        written.append(path)
    byte = extra is not None and TokenizerRecord.of_checkpoint(extra).kind == "byte"
    kind = "tokenizer.json" if "tokenizer.json" in todo else "byte" if byte else None
    if kind == "byte" and byte_files:  # the byte tokenizer in Hugging Face's form, so AutoTokenizer loads the model dir
        from titan_pipe.io.atomic import write_text
        from titan_pipe.tokens.byte_hf import byte_tokenizer_files

        for name, text in byte_tokenizer_files().items():
            path = dest / name
            write_text(path, text)
            digests[name] = sha256_file(path)
            written.append(path)
    infos = {p.name: FileInfo(p.stat().st_size, digests[p.name]) for p in written}
    return written, TokenizerRecord(kind, sha256=digests.get("tokenizer.json"), files=digests), infos
