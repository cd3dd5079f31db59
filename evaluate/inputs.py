"""evaluate's input checks: every path, the reference device, "one model" — before any work."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.records.checkpoint_format import is_complete
from titan_pipe.weights.detect import other_format
from titan_pipe.errors import UserError
from titan_pipe.evaluate.graph_files import check_external_data, external_locations
from titan_pipe.records.export_record import ExportRecord
from titan_pipe.model.args import ModelArgs, model_differences


def check_inputs(*, checkpoint, model_dir, onnx, om, data) -> None:
    """Missing files fail before any work, each with the flag, the path and the fix."""
    if checkpoint is None and model_dir is None:
        raise UserError(
            "evaluate needs a reference: pass --checkpoint runs/<name>/checkpoints/step-XXXXXX "
            "and/or --model-dir runs/<name>/model"
        )
    for flag, p, kind in (
        ("--checkpoint", checkpoint, "dir"),
        ("--model-dir", model_dir, "dir"),
        ("--onnx", onnx, "file"),
        ("--om", om, "file"),
        ("--data", data, "any"),
    ):
        if p is not None:
            _check_path(flag, Path(p), kind)
    if onnx is not None:  # names only files inside the export dir, or is refused before any work
        record = ExportRecord.find(Path(onnx).parent)
        graph = check_external_data(Path(onnx))
        if record is not None:  # the weights it reads are the exported ones: a corrupted or swapped data file
            # is refused here, not reported as a numerical fault (a graph re-saved with its weights inline
            # reads none of the record's files, and is compared as it is)
            record.check_files(Path(onnx).parent, only=external_locations(graph))


def _check_path(flag: str, p: Path, kind: str) -> None:
    if not p.exists():
        raise UserError(f"{flag} {p}: does not exist; check the path")
    if kind == "dir" and not p.is_dir():
        raise UserError(f"{flag} {p}: is a file, expected a directory")
    if flag == "--checkpoint" and not is_complete(p) and not other_format(p):
        raise UserError(
            f"--checkpoint {p}: no manifest.json, so not a complete titan-pipe checkpoint (nor a torch DCP / "
            "torchtitan step or a Megatron-LM checkpoint, nor a run dir holding one); pass runs/<name>, its checkpoints/ or a step-XXXXXX in it (the "
            "manifest is written last)"
        )
    if kind == "file" and not p.is_file():
        raise UserError(
            f"{flag} {p}: is a directory, expected a file" + ("; pass OUT_DIR/model.onnx" if flag == "--onnx" else "")
        )


def reference_device(choice: str) -> str:
    """--device auto|cpu|cuda|npu -> the torch device type the PyTorch reference runs on."""
    from titan_pipe.rules.devices import resolve_device

    try:
        return resolve_device(choice).type
    except (UserError, ValueError) as e:
        raise UserError(f"--device {choice}: {e}") from None


def same_model(a: ModelArgs, b: ModelArgs, where: str) -> None:
    diffs = model_differences(a, b)
    if diffs:
        raise UserError(f"{where}: the models disagree ({'; '.join(diffs)}); pass artifacts of the same run")
