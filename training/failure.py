"""Why a launch failed, in one line: the rank that failed first, its own error line, and where its logs are.

A rank that meets an error it can name writes a failure record in the launch's record dir
(training/rank_records.py: ``error`` or ``fault`` for an operating-system fault such as a full
disk, with its one-line message); torchrun keeps each rank's own stdout.log / stderr.log under
run_dir/logs and ends its own output with a failure summary naming the root-cause rank.
``launch_failure`` takes that rank's record (else the first one written) and says where to look.
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_pipe.config import FlowConfig
from titan_pipe.errors import RankRefused, StageFailed
from titan_pipe.io.faults import OutputFault
from titan_pipe.run_dir import RunDir
from titan_pipe.training.rank_records import RankFailure, read_failures

_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\).*?exitcode\s*:\s*(-?\d+)", re.S)


# torchrun's elastic agent logging a failed worker ("E1206 19:47:28.386000 1518 torch/distributed/
# elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 ..."): its report begins
_AGENT_FAILED = re.compile(r"^E\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/\S+\] failed \(exitcode: -?\d+\)")


def torchrun_report(line: str) -> bool:
    """The first line of torchrun's own failure report (the agent's "failed (exitcode: N)" line or
    its traceback; rank lines carry a ``[default<N>]:`` prefix): from here on the console is spared
    what train.log keeps (the launch's error line says what failed and points there)."""
    line = line.rstrip("\n")
    return line == "Traceback (most recent call last):" or _AGENT_FAILED.match(line) is not None


def root_cause(output: str) -> tuple[int, int, int] | None:
    """(rank, local_rank, exit code) of the first failure in torchrun's failure summary, if any."""
    found = _ROOT_CAUSE.findall(output)
    return tuple(int(x) for x in found[-1]) if found else None  # type: ignore[return-value]


def rank_log_dir(log_root: Path, local_rank: int, since: float) -> Path | None:
    """This launch's log dir of one local rank (torchrun --log_dir layout), newest attempt."""
    dirs = [d for d in log_root.glob(f"*/attempt_*/{local_rank}") if d.is_dir() and d.stat().st_mtime >= since]
    return max(dirs, key=lambda d: d.stat().st_mtime) if dirs else None


def node_log(cfg: FlowConfig, run: RunDir) -> Path:
    """train.log on node 0; train-node<k>.log on node k, so nodes sharing a run dir do not interleave."""
    return run.train_log if cfg.launch.node_rank == 0 else run.root / f"train-node{cfg.launch.node_rank}.log"


def _read_from(path: Path, offset: int = 0) -> str:
    if not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def rank_failure(records: Path | None, root_rank: int | None) -> RankFailure | None:
    """The failure record that says why the launch failed: the root-cause rank's, else the first written."""
    found = read_failures(records)
    own = [r for r in found if r.rank == root_rank]
    return (own or found or [None])[0]


def failure_message(rc: int, run: RunDir, started: float, log_offset: int = 0, log: Path | None = None) -> str:
    """What failed and where its output is: torchrun's root cause rank and that rank's log files.

    ``log_offset``: the size of train.log before this launch (only its own part is searched).
    """
    log = log or run.train_log
    msg = f"training failed: torchrun exited with status {rc}; see {log}"
    cause = root_cause(_read_from(log, log_offset))
    if cause is not None:
        rank, local_rank, code = cause
        msg += f"; rank {rank} failed first (exit code {code})"
        d = rank_log_dir(run.root / "logs", local_rank, started)
        if d is not None:
            msg += f", its output: {d / 'stdout.log'} and {d / 'stderr.log'}"
    return msg


# torchrun's own error when the process runs out of descriptors (its store socket, a rank's pipes)
_LIMITS = (
    ("EMFILE", "too many open files in this process (EMFILE)", "raise the limit (ulimit -n 65536) and run again"),
    ("ENFILE", "too many open files on this machine (ENFILE)", "close other programs or raise fs.file-max"),
    ("[Errno 24]", "too many open files in this process (EMFILE)", "raise the limit (ulimit -n 65536) and run again"),
)


def _process_limit(text: str) -> str | None:
    """A descriptor limit torchrun's own traceback ends with, as one line with its fix."""
    tail = text[-4000:]
    for needle, what, fix in _LIMITS:
        if needle in tail:
            return f"training could not start: {what}; {fix}"
    return None


def launch_failure(
    rc: int, run: RunDir, started: float, log_offset: int, log: Path, records: Path | None = None
) -> StageFailed | OutputFault:
    """The error a failed launch raises: OutputFault (exit 1, never retried) when a rank met an OS
    fault, else StageFailed with torchrun's status as exit code and the rank's own error first.
    ``records``: the launch's rank record dir (rank_records.RECORDS_ENV)."""
    where = failure_message(rc, run, started, log_offset, log)
    text = _read_from(log, log_offset)  # this launch's part of the log
    cause = root_cause(text)
    found = rank_failure(records, cause[0] if cause is not None else None)
    if found is None:
        limit = _process_limit(text)
        if limit is not None:  # torchrun itself met it (no rank got as far as to say so)
            return OutputFault(f"{limit} (torchrun stopped: {where[len('training failed: ') :]})")
    if found is not None and found.kind == "fault":
        return OutputFault(f"{found.message} (training stopped: {where[len('training failed: ') :]})")
    err = RankRefused(f"{where}: {found.message}") if found else StageFailed(where)
    err.exit_code = rc
    return err
