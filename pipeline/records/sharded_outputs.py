"""The sharded forward as a process: its command line and the files it exchanges with its caller.

Training owns the process (``python -m titan_pipe.training.sharded_forward``: a checkpoint forwarded
under its own dp/tp/pp layout by the training model and operators); evaluate starts it through
torch.distributed.run and reads what it wrote. Both use this module, so neither spells the other's
file names. Files in the exchange directory:

  tokens.safetensors      (by the caller) ``batch.{i}`` (B, T) int64
  logits.safetensors      ``batch.{i}`` (B, T, vocab), by global rank 0
  hidden-pp{r}.safetensors ``batch.{i}.hidden.{layer}`` (B, T, dim) for pp rank r's layers, by its dp0/tp0 rank
  done.json               ``{"hidden_files": [...], "streamed": bool, "peak_rss": [bytes per global rank]}``,
                          by global rank 0 after every file above
  logs/                   every rank's stdout/stderr as files (torchrun --log-dir, --tee 3: still on the
                          console too), so a failure can be told by the failing rank's own last lines
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from titan_pipe.io.safetensors_io import load

MODULE = "titan_pipe.training.sharded_forward"
TOKENS_FILE = "tokens.safetensors"
LOGITS_FILE = "logits.safetensors"
DONE_FILE = "done.json"
LOG_DIR = "logs"


def hidden_file(pp_rank: int) -> str:
    return f"hidden-pp{pp_rank}.safetensors"


def batch_key(i: int) -> str:
    return f"batch.{i}"


def hidden_key(i: int, layer: int) -> str:
    return f"batch.{i}.hidden.{layer}"


def command(*, world_size: int, checkpoint: Path, out_dir: Path, device: str, streamed: bool = False) -> list[str]:
    """The torchrun command line forwarding ``out_dir/tokens.safetensors`` through ``checkpoint``
    (``streamed``: each rank materialises one decoder layer at a time)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        "--log-dir",
        str(Path(out_dir) / LOG_DIR),
        "--tee",
        "3",
        "-m",
        MODULE,
        "--checkpoint",
        str(checkpoint),
        "--tokens",
        str(Path(out_dir) / TOKENS_FILE),
        "--out",
        str(out_dir),
        "--device",
        device,
        *(["--streamed"] if streamed else []),
    ]


def failing_ranks_lines(out_dir: Path, launcher_output: str, *, lines: int = 8) -> list[str]:
    """The last ``lines`` lines of the stderr of the rank torchrun names as the root cause in
    ``launcher_output`` (else of every rank with stderr, at most two), each rank's headed ``rank N:``;
    [] when no rank wrote any. torchrun's own summary names the rank and its signal, not what the rank said."""
    logs = sorted(Path(out_dir, LOG_DIR).glob("**/stderr.log"), key=lambda p: int(p.parent.name))
    found = re.search(r"Root Cause.*?local_rank:\s*(\d+)", launcher_output, re.S)
    if found:
        logs = [p for p in logs if p.parent.name == found.group(1)] or logs
    out: list[str] = []
    shown = 0
    for path in logs:
        text = path.read_text(errors="replace").strip().splitlines()
        if text and shown < 2:
            out += [f"rank {path.parent.name}:"] + ["  " + line for line in text[-lines:]]
            shown += 1
    return out


def write_done(out_dir: Path, pp: int, *, streamed: bool = False, peak_rss: list[int] | None = None) -> None:
    """The completion marker, written last by global rank 0."""
    (Path(out_dir) / DONE_FILE).write_text(
        json.dumps(
            {"hidden_files": [hidden_file(r) for r in range(pp)], "streamed": streamed, "peak_rss": peak_rss or []}
        )
    )


def read_done(out_dir: Path) -> dict:
    """done.json: the hidden-state files, whether the ranks streamed, their peak RSS (bytes)."""
    return json.loads((Path(out_dir) / DONE_FILE).read_text())


def read_outputs(out_dir: Path, *, n_batches: int, n_layers: int) -> list[tuple]:
    """(logits (B, T, vocab), [hidden (B, T, dim) per layer] or [] if any layer is missing) per batch."""
    out_dir = Path(out_dir)
    done = read_done(out_dir)
    logits = load(out_dir / LOGITS_FILE)
    hidden: dict = {}
    for f in done["hidden_files"]:
        hidden.update(load(out_dir / Path(f).name))
    out = []
    for i in range(n_batches):
        hs = [hidden[hidden_key(i, j)] for j in range(n_layers) if hidden_key(i, j) in hidden]
        out.append((logits[batch_key(i)], hs if len(hs) == n_layers else []))
    return out
