"""The ATC step: build the exact `atc` command for each exported graph, write atc/command.sh, run it if present.

Planning (``atc_invocation``) is pure data from the graph's inputs; only ``run_atc`` touches the
process table. ATC's own default precision is force_fp16, which silently changes the numbers of an
fp32/bf16-trained model, so the command always states a precision mode: ``origin`` keeps the
graph's dtype (the default here), ``mixed_float16`` and ``fp16`` are explicit choices.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.processes import procs
from titan_pipe.rules.choices import PRECISION_MODES
from titan_pipe.errors import StageFailed
from titan_pipe.graphs.graph_io import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, WRITE_INDEX

# --precision_mode_v2 (CANN >= 8.0) value, and the older --precision_mode spelling of the same intent.
_PRECISION_V2 = {"origin": "origin", "mixed_float16": "mixed_float16", "fp16": "fp16"}
_PRECISION_V1 = {"origin": "must_keep_origin_dtype", "mixed_float16": "allow_mix_precision_fp16", "fp16": "force_fp16"}
EXTERNAL_WEIGHT_BYTES = 2 * 1024**3  # above this, --external_weight=1 keeps weights out of the .om
MAX_GEARS = 100  # ATC's --dynamic_dims limit (2..100 gears, CANN 6.x and 8.0 alike)


@dataclass(frozen=True)
class GraphInput:
    """An ONNX graph input as ATC sees it: name and dims, -1 where the dim is dynamic."""

    name: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class AtcInvocation:
    """One atc call; ``argv`` runs in the export directory (paths are relative to it)."""

    graph: str  # model.onnx / decode.onnx
    om: str  # om/model (atc appends .om)
    argv: tuple[str, ...]
    gears: tuple[tuple[int, ...], ...]

    def shell(self) -> str:
        return " \\\n    ".join(shlex.quote(a) if i == 0 else _quote_opt(a) for i, a in enumerate(self.argv))


def _quote_opt(arg: str) -> str:
    key, _, value = arg.partition("=")
    return f"{key}={shlex.quote(value)}" if value else arg


def seq_gears(seq_len: int, max_len: int) -> list[int]:
    """Sequence-length gears: powers of two from 16 up to seq_len, plus seq_len (at least two gears)."""
    gears = {seq_len}
    g = 16
    while g < seq_len:
        gears.add(g)
        g *= 2
    if len(gears) < 2:  # ATC wants at least two gears; add a longer one if the model allows it
        gears.add(min(max(2 * seq_len, seq_len + 1), max_len) if seq_len < max_len else max(1, seq_len // 2))
    return sorted(gears)


def atc_invocation(
    *,
    graph: str,
    inputs: list[GraphInput],
    soc_version: str,
    precision_mode: str,
    dynamic: bool,
    batch: int,
    seq_len: int,
    max_len: int,
    weight_bytes: int,
    decode: bool,
    cache_len: int | None = None,
) -> AtcInvocation:
    """The atc argv for one graph.

    Static graphs get their exact shapes. A dynamic prefill graph keeps the batch at ``batch`` and
    gets ``--dynamic_dims`` gears over the sequence (ATC compiles one static graph per gear); its
    three (B, T) inputs make 3 values per gear, inside the 4 that CANN 6.x documents as the per-gear
    maximum (CANN 8.0 documents no per-gear maximum, only 2..100 gears). A dynamic decode graph is
    compiled at one shape, (batch, cache_len): the fixed-capacity cache needs no other, and its
    2 * n_layers + 1 cache-length dims would pass that per-gear maximum.
    """
    if precision_mode not in PRECISION_MODES:
        raise ValueError(f"precision_mode {precision_mode!r} is not one of {PRECISION_MODES}")
    stem = Path(graph).stem
    gears: list[tuple[int, ...]] = []

    def fixed(i: GraphInput) -> tuple[int, ...]:
        """Dynamic dims pinned: batch (dim 0) -> batch, cache slots -> cache_len, new tokens -> 1."""
        if i.name == WRITE_INDEX:
            return (batch,)
        if i.name in (INPUT_IDS, POSITION_IDS):
            return (batch, 1)
        if i.name == ATTENTION_MASK:
            return (batch, cache_len)
        _, h, _, d = i.dims
        return (batch, h, cache_len, d)

    if not dynamic:
        dims = [i.dims for i in inputs]
    elif decode:
        if cache_len is None:
            raise ValueError("a dynamic decode graph needs cache_len for its ATC shape")
        dims = [fixed(i) for i in inputs]
    else:
        dims = [(batch, -1) for _ in inputs]
        gears = [tuple([s] * len(inputs)) for s in seq_gears(seq_len, max_len)]
    shapes = [f"{i.name}:{','.join(map(str, d))}" for i, d in zip(inputs, dims)]
    argv = [
        "atc",
        f"--model={graph}",
        "--framework=5",
        f"--output=om/{stem}",
        f"--soc_version={soc_version}",
        "--input_format=ND",
        f"--input_shape={';'.join(shapes)}",
        f"--precision_mode_v2={_PRECISION_V2[precision_mode]}",
    ]
    if gears:
        gears = gears[:MAX_GEARS]
        argv.append("--dynamic_dims=" + ";".join(",".join(map(str, g)) for g in gears))
    if weight_bytes > EXTERNAL_WEIGHT_BYTES:
        argv.append("--external_weight=1")
    argv.append("--log=error")
    return AtcInvocation(graph, f"om/{stem}", tuple(argv), tuple(gears))


def command_script(invocations: list[AtcInvocation], precision_mode: str) -> str:
    """atc/command.sh: runs every invocation from the export directory."""
    lines = [
        "#!/usr/bin/env bash",
        "# Compile the exported ONNX graphs to Ascend .om files (written by `titan-pipe export`).",
        "# Needs CANN's atc on PATH (source /usr/local/Ascend/ascend-toolkit/set_env.sh).",
        f"# Precision: --precision_mode_v2={_PRECISION_V2[precision_mode]} (CANN >= 8.0). On older CANN",
        f"# replace it with --precision_mode={_PRECISION_V1[precision_mode]}.",
        "set -euo pipefail",
        'cd "$(dirname "$0")/.."',
        "mkdir -p om",
        "",
    ]
    for inv in invocations:
        lines += [inv.shell(), ""]
    return "\n".join(lines)


def run_atc(invocations: list[AtcInvocation], export_dir: Path, log, atc: str | None = None) -> str:
    """Run atc for each graph in ``export_dir`` if it is on PATH; returns the ATC status string.

    'not_found' when atc is absent (the caller says so and goes on); 'ok' when every .om exists;
    a failing atc raises StageFailed with the tail of its log (the .om directory is removed).
    """
    exe = atc or shutil.which("atc")
    if exe is None:
        return "not_found"
    om_dir = export_dir / "om"
    shutil.rmtree(om_dir, ignore_errors=True)  # a stale .om must not pass for a fresh one
    om_dir.mkdir()
    for inv in invocations:
        argv = [exe, *inv.argv[1:]]
        tail: list[str] = []
        # guarded (titan_pipe.processes.procs): atc dies with this process, however it ends
        with procs.popen(
            argv, cwd=export_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:  # stream ATC's log as it comes
                log(line.rstrip("\n"))
                tail = (tail + [line.rstrip("\n")])[-20:]
            rc = proc.wait()
        produced = sorted(om_dir.glob(Path(inv.om).name + "*.om"))
        if rc != 0 or not produced:
            shutil.rmtree(om_dir, ignore_errors=True)
            why = f"exited with {rc}" if rc != 0 else f"exited 0 but wrote no {inv.om}.om"
            raise StageFailed(
                f"atc for {inv.graph} {why}; the command is in atc/command.sh. Last lines:\n" + "\n".join(tail)
            )
    return "ok"
