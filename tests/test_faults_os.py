"""Operating-system faults, kills and interrupts across the commands (issue: one error path for the OS).

Each fault case asserts: the exit code, ONE error line naming the path and the fix, no traceback,
the tree under the output's parent unchanged except for what the command documents, and (kill
cases) no process left.

How the faults are made, and why:
- A failing-write shim (tests/faultshim/sitecustomize.py) makes the OS calls under one directory
  fail with the errno the kernel would give (ENOSPC, EROFS, EACCES, EMFILE, ...), after N bytes
  if asked, and can make statvfs report a small disk. It runs everywhere: CI runs as root (which
  ignores permission bits) on a machine where mounting may not be permitted. It is installed
  in-process for convert/export/evaluate/train/run/plan/init (fast: one process), and through
  PYTHONPATH for subprocesses (a kill, a rank of torchrun).
- Where mounting works (root with CAP_SYS_ADMIN), a real small tmpfs, full or read-only, is used
  too (``tmpfs`` fixture: skipped with the reason where mount is refused).
- ENAMETOOLONG, a file where a directory must be made, and a mount point are real.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from convert_writers import model_args, native_state, write_hf
from titan_pipe.config import ConvertConfig, ExportConfig
from titan_pipe.io import faults
from titan_pipe.processes import procs
from titan_pipe.io.atomic import _HOST
from titan_pipe.cli import app
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.graphs.graph_io import data_file_names
from titan_pipe.processes.guard import descendants

HERE = Path(__file__).resolve().parent
SHIM = HERE / "faultshim"


def _load_shim():
    """The shim as a module of its own (``import sitecustomize`` would return the interpreter's own,
    which Debian's Python has); it installs nothing without TITAN_FAULT_ROOT."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("titan_faultshim", SHIM / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shim = _load_shim()


# --- helpers ------------------------------------------------------------------------------------


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (hidden ones and empty dirs included): files by sha256."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def cli(*argv) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in argv])
    return r.exit_code, r.output


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error")]


def fails_once(watch: Path, *argv, expect: tuple[str, ...], code: int = 1, only_line: bool = True) -> str:
    """The command exits ``code`` with one error line holding every ``expect``, no traceback, and
    nothing under ``watch`` changed. ``only_line``: the error is the whole output."""
    before = tree(watch)
    got, text = cli(*argv)
    assert got == code, text
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = error_lines(text)
    assert len(errs) == 1 and (len(lines) == 1 or not only_line), f"expected one error line:\n{text}"
    for e in expect:
        assert e in errs[0], f"{e!r} not in {errs[0]!r}"
    assert tree(watch) == before, "the tree under the output's parent changed"
    return errs[0]


@contextlib.contextmanager
def fault(root: Path, errno: str | None, **kw):
    shim.install(root=str(root), errno=errno, **kw)
    try:
        yield shim._state
    finally:
        shim.uninstall()


@contextlib.contextmanager
def tmpfs(path: Path, size: str, *, ro: bool = False):
    """A real tmpfs of ``size`` at ``path`` (read-only with ``ro``); skipped where mount is refused."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); the shim cases cover this")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def handles_sigterm(pid: int) -> bool:
    """``pid`` has set what SIGTERM does to it (ignored or caught): it is past its start-up."""
    with open(f"/proc/{pid}/status") as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigIgn:", "SigCgt:"))]
    return any(m & (1 << (signal.SIGTERM - 1)) for m in masks)


def lock_is_free(lock_file: Path) -> bool:
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def wait_gone(pids: list[int], *, lock_file: Path | None = None, timeout: float = 60.0) -> None:
    """Wait until every pid is gone; with ``lock_file``, check it stays locked while any lives."""
    end = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if lock_file is not None and lock_is_free(lock_file):
            # a process past exit_mm (cmdline empty, on its way to a zombie) runs no more code: not a writer
            living = [(p, " ".join(args)[:160]) for p in pids if alive(p) and any(args := _cmdline(p))]
            assert not living, f"the lock was free while a writer under it lived: {living}"
        assert time.monotonic() < end, f"still alive after {timeout}s: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


def shim_env(root: Path, errno: str | None = None, **kw) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SHIM), os.environ.get("PYTHONPATH", "")]),
        "TITAN_FAULT_ROOT": str(root),
        "TITAN_FAULT_ERRNO": errno or "",
        "COLUMNS": "400",
    }
    env.update({f"TITAN_FAULT_{k.upper()}": str(v) for k, v in kw.items()})
    return env


def _sigint_default() -> None:
    # a test session started in the background (`pytest &`) ignores SIGINT, and children inherit that
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def titan_pipe(*argv, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "titan_pipe.cli", *map(str, argv)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_sigint_default,
        **kw,
    )


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    args = model_args()
    hf = write_hf(native_state(args), args, base / "hf")
    model = convert_checkpoint(hf, base / "model").out_dir
    onnx = export_model(model, base / "onnx", ExportConfig(atc=False)).onnx
    return {"hf": hf, "model": model, "onnx": onnx}


# --- the one line ---------------------------------------------------------------------------------


def test_fault_message_names_the_output_file_and_never_calls_a_read_a_write(tmp_path):
    import errno

    out = tmp_path / "out"
    tmp = tmp_path / f".out.tmp-{_HOST}-123-abcd1234" / "model.safetensors"
    line = faults.fault_message(OSError(errno.ENOSPC, "No space", str(tmp)), path=out, what="the model", needs=10**15)
    assert line.startswith(f"{out / 'model.safetensors'}: cannot write the model: the disk filled up (ENOSPC); ")
    assert "free at least" in line and "the output needs 1000000.0 GB" in line
    lock = faults.fault_message(OSError(errno.EROFS, "ro", str(tmp_path / ".out.lock")), path=out, what="the model")
    assert lock == f"{out}: cannot write the model: the file system is read-only (EROFS); choose a writable directory"
    src = faults.fault_message(OSError(errno.EACCES, "denied", "/data/src.bin"), path=out, what="the model")
    assert src == "/data/src.bin: permission denied (EACCES); fix its permissions, or run as a user who may use it"
    rust = faults.as_fault(
        RuntimeError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"),
        path=out,
        what="the model",
    )
    assert rust is not None and "(EDQUOT)" in str(rust) and str(rust).startswith(f"{out}: cannot write the model")
    assert faults.as_fault(ValueError("a bug"), path=out, what="x") is None


def test_a_rank_fault_record_is_the_launch_error(tmp_path):
    from titan_pipe.errors import StageFailed
    from titan_pipe.run_dir import RunDir
    from titan_pipe.training.failure import launch_failure
    from titan_pipe.training.launch import fresh_records_dir
    from titan_pipe.training.rank_records import RECORDS_ENV, write_failure

    run = RunDir(tmp_path / "run")
    records = fresh_records_dir(run.root / "logs", 0)
    env = {RECORDS_ENV: str(records), "RANK": "1"}
    write_failure(
        "fault",
        "/r/checkpoints/step-000004/model: cannot write the checkpoint of step 4: the disk filled up (ENOSPC); "
        "free space there",
        env,
    )
    run.train_log.write_text("# earlier launch\n")
    offset = run.train_log.stat().st_size
    with run.train_log.open("a") as f:
        f.write(
            "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 9)\n"
        )
    err = launch_failure(1, run, 0, offset, run.train_log, records)
    assert isinstance(err, faults.OutputFault) and not isinstance(err, StageFailed)
    assert str(err).startswith("/r/checkpoints/step-000004/model: cannot write the checkpoint of step 4")
    assert "rank 1 failed first" in str(err) and "train.log" in str(err)
    write_failure("error", "data.path: corpus.txt holds no text", env)
    err = launch_failure(1, run, 0, offset, run.train_log, records)
    assert isinstance(err, StageFailed) and err.exit_code == 1 and str(err).endswith("corpus.txt holds no text")
    # the next launch starts with no record of this one
    assert fresh_records_dir(run.root / "logs", 0) == records and not list(records.iterdir())
    assert isinstance(launch_failure(1, run, 0, offset, run.train_log, records), StageFailed)
    assert not str(launch_failure(1, run, 0, offset, run.train_log, records)).endswith("no text")


# --- convert ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "errno,expect",
    [
        ("EROFS", ("read-only (EROFS)", "choose a writable directory")),
        ("EACCES", ("permission denied (EACCES)", "choose a directory you can write")),
        ("ENOSPC", ("the disk filled up (ENOSPC)", "free space there")),
        ("EDQUOT", ("quota", "(EDQUOT)")),
        ("EMFILE", ("too many open files", "ulimit -n")),
    ],
)
def test_convert_output_dir_refused_by_the_os(built, tmp_path, errno, expect):
    out = tmp_path / "out"
    with fault(tmp_path, errno):
        fails_once(
            tmp_path, "convert", built["hf"], "-o", out, expect=(f"{out}: cannot write the converted model", *expect)
        )


def test_convert_disk_fills_up_mid_write(built, tmp_path):
    out = tmp_path / "out"
    with fault(tmp_path, "ENOSPC", after=300_000) as st:
        line = fails_once(
            tmp_path,
            "convert",
            built["hf"],
            "-o",
            out,
            expect=(str(out / "model.safetensors"), "the disk filled up (ENOSPC)", "needs 1.0 MB"),
        )
        assert st["written"] > 0  # it failed part way through, and removed what it had written
    assert "nothing was kept" not in line and not list(tmp_path.iterdir())


def test_convert_refuses_before_writing_a_byte_when_the_disk_is_too_small(built, tmp_path):
    out = tmp_path / "out"
    with fault(tmp_path, "ENOSPC", after=10**12, free=100 * 4096) as st:  # whole blocks
        fails_once(
            tmp_path,
            "convert",
            built["hf"],
            "-o",
            out,
            expect=(f"{out}: cannot write the converted model: it needs 1.0 MB", "409.6 kB free", "free at least 6"),
        )
        assert [Path(p).name for p in st["by_file"]] == [".out.lock"]  # only its lock (the PID in it)


def test_convert_name_too_long_and_a_file_where_a_directory_must_be(built, tmp_path):
    fails_once(
        tmp_path,
        "convert",
        built["hf"],
        "-o",
        tmp_path / ("x" * 300),
        expect=("ENAMETOOLONG", "choose a shorter output path"),
    )
    (tmp_path / "plain.txt").write_text("a file")
    fails_once(
        tmp_path,
        "convert",
        built["hf"],
        "-o",
        tmp_path / "plain.txt" / "out",
        expect=("plain.txt", "a file stands where a directory must be made", "remove that file"),
    )


def test_convert_onto_a_mount_point_is_refused_before_writing(built, tmp_path):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        fails_once(
            tmp_path,
            "convert",
            built["hf"],
            "-o",
            mnt,
            expect=(f"{mnt}: cannot write the converted model", "mount point", f"e.g. {mnt}/out"),
        )


def test_real_small_and_read_only_disks(built, tmp_path):
    """A real tmpfs: too small for the model (refused before writing), and read-only."""
    with tmpfs(tmp_path / "small", "600k") as small:
        fails_once(
            small, "convert", built["hf"], "-o", small / "model", expect=("it needs 1.0 MB", "free at least", "kB free")
        )
        fails_once(
            small,
            "export",
            built["model"],
            "-o",
            small / "onnx",
            "--no-atc",
            expect=("cannot write the ONNX export: it needs 1.3 MB",),
        )
    with tmpfs(tmp_path / "ro", "1m", ro=True) as ro:
        for argv in (
            ("convert", built["hf"]),
            ("export", built["model"], "--no-atc"),
            ("evaluate", "--model-dir", built["model"], "--onnx", built["onnx"], "--no-operators"),
        ):
            fails_once(ro, *argv, "-o", ro / "out", expect=("read-only (EROFS)", str(ro / "out")))


def test_real_disk_filling_up_during_the_evaluation_report(built, tmp_path):
    with tmpfs(tmp_path / "small", "40k") as small:
        fails_once(
            small,
            "evaluate",
            "--model-dir",
            built["model"],
            "--onnx",
            built["onnx"],
            "--batches",
            "1",
            "--no-operators",
            "-o",
            small / "report",
            only_line=False,
            expect=(str(small / "report"), "cannot write the evaluation report", "the disk filled up (ENOSPC)"),
        )


# --- export, evaluate ---------------------------------------------------------------------------


@pytest.mark.parametrize("errno", ["EROFS", "ENOSPC"])
def test_export_output_dir_refused_by_the_os(built, tmp_path, errno):
    out = tmp_path / "onnx"
    with fault(tmp_path, errno):
        fails_once(
            tmp_path,
            "export",
            built["model"],
            "-o",
            out,
            "--no-atc",
            expect=(f"{out}: cannot write the ONNX export", f"({errno})"),
        )


def test_export_disk_fills_up_mid_write_and_refuses_a_small_disk(built, tmp_path):
    out = tmp_path / "onnx"
    with fault(tmp_path, "ENOSPC", after=200_000) as st:
        fails_once(
            tmp_path,
            "export",
            built["model"],
            "-o",
            out,
            "--no-atc",
            expect=(str(out / "model.onnx.data"), "the disk filled up (ENOSPC)", "needs 1.3 MB"),
        )
        assert st["written"] > 0
    with fault(tmp_path, "ENOSPC", after=10**12, free=10 * 4096) as st:
        fails_once(
            tmp_path,
            "export",
            built["model"],
            "-o",
            out,
            "--no-atc",
            expect=("it needs 1.3 MB and the disk holding it has 41.0 kB free",),
        )
        assert [Path(p).name for p in st["by_file"]] == [".onnx.lock"]


@pytest.mark.parametrize("errno", ["EROFS", "ENOSPC", "EACCES"])
def test_evaluate_report_dir_refused_by_the_os(built, tmp_path, errno):
    out = tmp_path / "report"
    with fault(tmp_path, errno):
        fails_once(
            tmp_path,
            "evaluate",
            "--model-dir",
            built["model"],
            "--onnx",
            built["onnx"],
            "-o",
            out,
            expect=(f"{out}: cannot write the evaluation report", f"({errno})"),
        )


def test_evaluate_report_under_a_file(built, tmp_path):
    (tmp_path / "f").write_text("x")
    fails_once(
        tmp_path,
        "evaluate",
        "--model-dir",
        built["model"],
        "--onnx",
        built["onnx"],
        "-o",
        tmp_path / "f" / "report",
        expect=("a file stands where a directory must be made",),
    )


# --- data prepare -------------------------------------------------------------------------------


def _corpus(path: Path, docs: int) -> Path:
    line = '{"text": "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron"}\n'
    path.write_text(line * docs)
    return path


@pytest.mark.parametrize("errno", ["EROFS", "ENOSPC"])
def test_data_prepare_output_refused_by_the_os(tmp_path, errno):
    src = _corpus(tmp_path / "corpus.jsonl", 200)
    out = tmp_path / "w" / "data"
    (tmp_path / "w").mkdir()
    with fault(tmp_path / "w", errno):
        fails_once(
            tmp_path, "data", "prepare", src, "-o", out, expect=(f"{out}: cannot write the prepared data", f"({errno})")
        )


def test_data_prepare_disk_fills_up_on_a_real_small_disk(tmp_path):
    src = _corpus(tmp_path / "corpus.jsonl", 2000)  # 170 kB of text: 340 kB of uint16 tokens
    with tmpfs(tmp_path / "small", "64k") as small:
        fails_once(
            small,
            "data",
            "prepare",
            src,
            "-o",
            small / "data",
            "--workers",
            "1",
            only_line=False,
            expect=(str(small / "data"), "cannot write the prepared data: the disk filled up (ENOSPC)"),
        )


def test_sigkill_of_data_prepare_ends_its_tokenizer_workers(tmp_path):
    src = _corpus(tmp_path / "corpus.jsonl", 600_000)  # ~50 MB: seconds of tokenizing
    p = titan_pipe("data", "prepare", src, "-o", tmp_path / "data", "--workers", "2", env=dict(os.environ))
    end = time.monotonic() + 120
    while len([x for x in descendants(p.pid) if "multiprocessing" in " ".join(_cmdline(x))]) < 2:
        assert p.poll() is None and time.monotonic() < end, p.communicate()[0]
        time.sleep(0.01)
    p.send_signal(signal.SIGSTOP)  # hold it while the workers are known: it cannot finish first
    pids = descendants(p.pid)
    p.kill()
    p.wait()
    wait_gone(pids, timeout=30)


# --- train, run, plan, init ---------------------------------------------------------------------


def _flow(tmp_path: Path, runs: Path, name: str = "t", **sections) -> Path:
    data = {
        "name": name,
        "runs_dir": str(runs),
        "device": "cpu",
        "model": {"flavour": "debug"},
        "train": {"steps": 2, "batch_size": 2, "seq_len": 16},
        "parallel": {"dp": 1, "tp": 1, "pp": 1},
    }
    data.update(sections)
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("command", ["train", "run"])
def test_read_only_runs_dir_is_one_line_before_anything_starts(tmp_path, command):
    runs = tmp_path / "ro" / "runs"
    flow = _flow(tmp_path, runs)
    with fault(tmp_path / "ro", "EROFS"):
        fails_once(
            tmp_path,
            command,
            flow,
            only_line=command == "run",
            expect=(str(runs / "t"), "read-only (EROFS)", "choose a writable directory"),
        )


def test_plan_write_and_init_into_a_read_only_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    with fault(ro, "EROFS"):
        fails_once(
            tmp_path, "init", ro, expect=(str(ro / "flow.yaml"), "cannot write the example flow.yaml", "read-only")
        )
        fails_once(
            tmp_path,
            "plan",
            "--model",
            "debug",
            "--devices",
            "2",
            "--device",
            "ascend910b",
            "--seq-len",
            "64",
            "--write",
            ro / "flow.yaml",
            only_line=False,
            expect=(str(ro / "flow.yaml"), "cannot write the flow.yaml", "(EROFS)"),
        )


def test_disk_full_in_a_training_rank_is_the_launch_error(tmp_path):
    """The rank meets ENOSPC writing its checkpoint (the shim rides into torchrun and the rank via
    PYTHONPATH): `titan-pipe train` exits 1 with the rank's one line, torchrun's report stays in
    train.log, and no partial step dir is left."""
    runs = tmp_path / "runs"
    flow = _flow(tmp_path, runs, checkpoint={"every": 2})
    ckpts = runs / "t" / "checkpoints"
    p = titan_pipe("train", flow, env=shim_env(ckpts, "ENOSPC"))
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out
    errs = error_lines(out)
    assert len(errs) == 1 and "Traceback" not in out, out
    assert str(ckpts / "step-000002") in errs[0] and "cannot write the checkpoint of step 2" in errs[0]
    assert "the disk filled up (ENOSPC)" in errs[0] and "train.log" in errs[0]
    assert "ChildFailedError" in (runs / "t" / "train.log").read_text()
    assert not ckpts.exists()


# --- stale temps, umask, one writer per output ------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temps_of_dead_owners_are_removed_by_the_next_writer(built, tmp_path):
    dead = tmp_path / f".out.tmp-{_HOST}-{_dead_pid()}-0badc0de"
    old = tmp_path / f".out.old-{_HOST}-{_dead_pid()}"
    live = tmp_path / f".out.tmp-{_HOST}-{os.getppid()}-00000001"  # pytest's parent: alive
    foreign = tmp_path / ".out.tmp-otherhost-12345-00000002"  # cannot be asked from here
    other = tmp_path / f".other.tmp-{_HOST}-{_dead_pid()}-00000003"  # another output's
    for d in (dead, old, live, foreign, other):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "big.bin").write_bytes(b"x" * 1000)
    code, text = cli("convert", built["hf"], "-o", tmp_path / "out")
    assert code == 0, text
    notes = [ln for ln in text.splitlines() if ln.startswith("removed")]
    assert len(notes) == 1 and "removed 2 stale temporary output(s)" in notes[0], text
    assert dead.name in notes[0] and old.name in notes[0] and "Traceback" not in text
    assert not dead.exists() and not old.exists() and live.exists() and foreign.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, foreign.name, other.name])


def test_outputs_follow_the_umask(built, tmp_path):
    """Under umask 002 every output dir is 0775 (it was 0700, tempfile's mode; 0755 would be a fixed mode)."""
    umask, mode = 0o002, 0o775
    previous = os.umask(umask)
    try:
        assert cli("convert", built["hf"], "-o", tmp_path / "model")[0] == 0
        assert cli("export", tmp_path / "model", "-o", tmp_path / "onnx", "--no-atc")[0] == 0
        assert (
            cli(
                "evaluate",
                "--model-dir",
                tmp_path / "model",
                "--onnx",
                tmp_path / "onnx" / "model.onnx",
                "--batches",
                "1",
                "--no-operators",
                "-o",
                tmp_path / "report",
            )[0]
            == 0
        )
    finally:
        os.umask(previous)
    for d in ("model", "onnx", "report"):
        assert (tmp_path / d).stat().st_mode & 0o777 == mode, d
    for f in (
        "model/model.safetensors",
        "onnx/model.onnx",
        "report/report.json",
        *(f"onnx/{name}" for name in data_file_names(ExportConfig().data_files)),
    ):
        assert (tmp_path / f).stat().st_mode & 0o777 == mode & 0o666, f
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "onnx", "report"]  # no lock or temp left


def _slow_convert(src: Path, out: Path, *, delay: float) -> subprocess.Popen:
    """convert in a subprocess whose writes under out's parent each take ``delay`` seconds; returns
    once it is writing."""
    p = titan_pipe("convert", src, "-o", out, env=shim_env(out.parent, delay=delay))
    end = time.monotonic() + 120
    while not list(out.parent.glob(f".{out.name}.tmp-*/*")):
        assert p.poll() is None and time.monotonic() < end, p.communicate()[0]
        time.sleep(0.05)
    return p


def test_two_writers_of_one_output_cannot_both_succeed(built, tmp_path):
    out = tmp_path / "out"
    first = _slow_convert(built["hf"], out, delay=0.05)
    code, text = cli("convert", built["hf"], "-o", out, "--overwrite")
    assert code == 1 and len(error_lines(text)) == 1 and "Traceback" not in text, text
    assert f"{out}: being written by PID {first.pid} (titan-pipe convert)" in text
    assert first.wait(timeout=300) == 0, first.communicate()[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # its lock file is gone with it
    assert (out / "model.safetensors").stat().st_size == (built["model"] / "model.safetensors").stat().st_size


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_convert_removes_its_temp(built, tmp_path, sig, code):
    p = _slow_convert(built["hf"], tmp_path / "out", delay=0.2)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == code, out
    assert error_lines(out) == [f"error interrupted by {signal.Signals(sig).name}"] and "Traceback" not in out, out
    assert list(tmp_path.iterdir()) == []


def test_a_killed_convert_leaves_a_temp_the_next_run_removes(built, tmp_path):
    p = _slow_convert(built["hf"], tmp_path / "out", delay=0.2)
    p.kill()
    p.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.startswith(".out.tmp-") for n in left) and ".out.lock" in left
    code, text = cli("convert", built["hf"], "-o", tmp_path / "out")
    assert code == 0 and "removed 1 stale temporary output(s) of" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- process trees (titan_pipe.processes.procs) -----------------------------------------------------------

PARENT = textwrap.dedent("""
    import sys, time, subprocess
    from titan_pipe.processes import procs
    from titan_pipe.processes.run_lock import run_lock
    # a child that starts a grandchild in its own session, as torchrun starts its ranks
    child = ("import subprocess, sys, time; "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
             "print(g.pid, flush=True); time.sleep(120)")
    with run_lock(sys.argv[1], what="test parent"):
        tree = procs.popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        print(tree.pid, tree.stdout.readline().strip(), flush=True)
        time.sleep(120)
""")


def _guarded_parent(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    p = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    guard, grandchild = map(int, p.stdout.readline().split())
    pids = descendants(p.pid)
    assert guard in pids and grandchild in pids and len(pids) == 3
    return p, pids


def test_a_sigkilled_parent_takes_its_whole_tree_and_the_lock_outlives_it(tmp_path):
    p, pids = _guarded_parent(tmp_path)
    p.kill()
    p.wait()
    wait_gone(pids, lock_file=tmp_path / "run" / ".lock", timeout=30)
    assert lock_is_free(tmp_path / "run" / ".lock")


def test_tree_stop_passes_the_signal_on_and_reports_128_plus_n(tmp_path):
    code = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: sys.exit(7)); print('up', flush=True); time.sleep(60)"
    tree = procs.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert tree.stdout.readline().strip() == "up"
    assert tree.stop(signal.SIGINT) == 7  # its own handler ran: the signal reached it
    tree = procs.popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        grace=0.5,
    )
    assert tree.stdout.readline().strip() == "up"
    assert tree.stop(signal.SIGTERM) == 128 + signal.SIGTERM
    tree.stdout.close()
    done = procs.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], capture_output=True, text=True)
    assert done.returncode == 3 and done.stdout == "out\n"
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5, grace=0.5)


def test_a_watched_process_dies_with_its_watcher(tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    code = f"from titan_pipe.processes import procs; import time; w = procs.watch({victim.pid}, grace=1); print('w', flush=True); time.sleep(120)"
    watcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert watcher.stdout.readline().strip() == "w"
    guardians = descendants(watcher.pid)
    end = time.monotonic() + 30
    while not all(handles_sigterm(g) for g in guardians):  # started: its signal dispositions are set
        assert time.monotonic() < end
        time.sleep(0.05)
    for g in guardians:  # SIGTERM to every process of a service: the watch is not a stop
        os.kill(g, signal.SIGTERM)
    time.sleep(2.5)  # the old watch stopped its process here (grace 1 s, a poll each 0.5 s)
    assert victim.poll() is None and all(alive(g) for g in guardians)
    watcher.kill()
    watcher.wait()
    victim.wait(timeout=30)  # ours to reap: it was stopped by the watch
    wait_gone(guardians, timeout=30)
    w = procs.watch(os.getpid())  # closing a watch leaves the watched process alone
    w.close()
    assert alive(os.getpid())


def test_a_rank_exits_with_its_code_its_output_and_its_exit_hooks_but_no_finalization():
    """exit_rank: what was printed (block-buffered: stdout is a pipe) and logged arrives, a
    non-daemon thread is waited for and the atexit hooks run (multiprocessing's stops a rank's
    workers: megatron-core's saver leaves some), the code is the one given, and the interpreter is not
    finalized (a module global's __del__ stands for it: in a torchrun rank finalization is where
    gloo's worker threads abort the process)."""
    code = textwrap.dedent("""
        import atexit, logging, sys, threading, time
        from titan_pipe.processes.procs import exit_rank
        class Finalized:
            def __del__(self):
                print(' finalized', flush=True)
        keep = Finalized()
        atexit.register(lambda: print(' atexit ran', end=''))
        threading.Thread(target=lambda: (time.sleep(0.5), print(' thread done', end=''))).start()
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        print('written', end='')
        logging.getLogger('rank').info('logged')
        exit_rank(5)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert done.stdout == "written thread done atexit ran", done.stdout
    assert "INFO:rank:logged" in done.stderr


# --- interrupts are not failures to retry -----------------------------------------------------------


def test_an_interrupted_task_is_not_retried_and_a_crash_is(prefect_harness, tmp_path):
    from prefect import flow, task

    from titan_pipe.errors import Interrupted, StageFailed
    from titan_pipe.flows.train_to_deploy import run_pipeline

    flow_path = _flow(tmp_path, tmp_path / "runs", orchestration={"retries": 2, "retry_delay_s": 0})
    calls: list[str] = []

    def pipeline(exc: BaseException):
        @task(name="train")
        def train(*, flow_path, cfg, resume):
            calls.append(type(exc).__name__)
            raise exc

        @flow(name="interrupt-test")
        def body():
            return run_pipeline(flow_path, only="train", tasks={"train": train}, publish=False)

        return body

    with pytest.raises(KeyboardInterrupt):
        pipeline(Interrupted(signal.SIGTERM))()
    assert calls == ["Interrupted"]  # once: an interrupt is never retried
    calls.clear()
    with pytest.raises(faults.OutputFault):
        pipeline(faults.OutputFault("x: cannot write ...: the disk filled up (ENOSPC)"))()
    assert calls == ["OutputFault"]  # nor is a full disk
    calls.clear()
    with pytest.raises(StageFailed):
        pipeline(StageFailed("rank 1 died"))()
    assert calls == ["StageFailed"] * 3  # a crash is: 1 + 2 retries


# --- kills of the real launches (torchrun, 2 ranks of the debug model) -----------------------------


def _start_training(
    tmp_path: Path,
    *argv,
    env: dict | None = None,
    name: str = "k",
    parallel: dict | None = None,
    batch_size: int = 2,
    **kw,
) -> tuple[subprocess.Popen, Path]:
    flow = _flow(
        tmp_path,
        tmp_path / "runs",
        name=name,
        train={"steps": 100000, "batch_size": batch_size, "seq_len": 16, "log_every": 1},
        parallel=parallel or {"dp": 1, "tp": 2, "pp": 1},
        checkpoint={"every": 100000},
    )
    p = titan_pipe(*argv, flow, env=env or dict(os.environ), **kw)
    log = tmp_path / "runs" / name / "train.log"
    end = time.monotonic() + 300
    while not (log.is_file() and re.search(r"step [2-9]\d*/", log.read_text())):
        assert p.poll() is None and time.monotonic() < end, p.communicate()[0]
        time.sleep(0.2)
    return p, tmp_path / "runs" / name


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ranks(pids: list[int]) -> list[int]:
    """The trainer ranks among ``pids`` (not torchrun or the guardian, whose argv name the module too)."""
    return [
        p
        for p in pids
        if "titan_pipe.training.rank" in _cmdline(p)
        and "torch.distributed.run" not in _cmdline(p)
        and not any(a.endswith("guard.py") for a in _cmdline(p))
    ]


@pytest.mark.distributed
def test_sigkill_of_train_ends_torchrun_and_its_ranks_and_the_lock_outlives_them(tmp_path):
    p, run = _start_training(tmp_path, "train")
    pids = descendants(p.pid)
    assert len(_ranks(pids)) == 2
    p.kill()
    p.wait()
    wait_gone(pids, lock_file=run / ".lock", timeout=60)
    assert lock_is_free(run / ".lock")  # a second `train --resume` gets in only now


@pytest.mark.distributed
@pytest.mark.parametrize("victim", ["guardian", "torchrun"])
def test_sigkill_of_the_guardian_or_torchrun_leaves_no_rank_training(tmp_path, victim):
    """Any OOM-killer or operator can kill -9 one process of the tree: killing the guardian or
    torchrun once left both ranks training on (writing checkpoints with no lock held). Now each rank
    dies with its parent, and torchrun with the guardian: within seconds no rank is left."""
    p, run = _start_training(tmp_path, "train")
    pids = descendants(p.pid)
    ranks = _ranks(pids)
    assert len(ranks) == 2
    is_guard = [x for x in pids if any(a.endswith("guard.py") for a in _cmdline(x))]
    is_torchrun = [x for x in pids if "torch.distributed.run" in _cmdline(x) and x not in is_guard]
    target = (is_guard if victim == "guardian" else is_torchrun)[0]
    os.kill(target, signal.SIGKILL)
    end = time.monotonic() + 15
    while [r for r in ranks if _cmdline(r)] and time.monotonic() < end:
        time.sleep(0.1)
    assert not [r for r in ranks if _cmdline(r)], f"ranks still alive 15 s after kill -9 of the {victim}"
    out, _ = p.communicate(timeout=60)
    assert p.returncode != 0 and "Traceback" not in out, out
    wait_gone(pids, lock_file=run / ".lock", timeout=30)


@pytest.mark.distributed
@pytest.mark.slow
def test_sigterm_of_train_is_one_line_exit_143_and_no_rank_left(tmp_path):
    p, run = _start_training(tmp_path, "train")
    pids = descendants(p.pid)
    p.terminate()
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143, out
    errs = error_lines(out)
    assert len(errs) == 1 and errs[0].startswith("error interrupted by SIGTERM; torchrun and its ranks were stopped")
    assert "--resume" in errs[0] and "Traceback" not in out  # torchrun's own report stays in train.log
    wait_gone(pids, timeout=5)  # gone before the command returned


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_run_ends_the_prefect_server_the_task_and_its_ranks(tmp_path, sig):
    """`titan-pipe run` with its own temporary Prefect server: SIGKILL or SIGTERM during training
    leaves nothing behind; SIGTERM is one line, exit 143, and the training is not retried."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    p, run = _start_training(tmp_path, "run", env=env)
    pids = descendants(p.pid)
    assert len(_ranks(pids)) == 2
    assert any("titan_pipe.flows.server_process" in _cmdline(x) for x in pids)  # our temporary Prefect server
    p.send_signal(sig)
    out, _ = p.communicate(timeout=300)
    wait_gone(pids, lock_file=run / ".lock", timeout=60)
    if sig == signal.SIGTERM:
        assert p.returncode == 143, out
        assert error_lines(out)[-1].startswith("error interrupted by SIGTERM") and len(error_lines(out)) == 1, out
        assert "Traceback" not in out and "attempt 2" not in out


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ["ctrl-c-to-the-group", "sigterm-to-every-process"])
def test_run_stops_in_seconds_whatever_receives_the_signal(tmp_path, how, ranks):
    """A terminal's Ctrl-C reaches the whole process group, a systemd/cgroup stop sends SIGTERM to
    every process: Prefect's temporary server died first and the command took 74-150 s to end, rc 1,
    with a ConnectError and tracebacks. Now: 130 / 143 within 15 s, one line, nothing left."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    parallel = {"dp": 1, "tp": 2, "pp": 1} if ranks == 2 else {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}
    p, run = _start_training(tmp_path, "run", env=env, parallel=parallel, batch_size=4, start_new_session=True)
    pids = descendants(p.pid)
    assert len(_ranks(pids)) == ranks and any("server_process" in " ".join(_cmdline(x)) for x in pids)
    t0 = time.monotonic()
    if how == "ctrl-c-to-the-group":
        os.killpg(p.pid, signal.SIGINT)
    else:
        for x in [p.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(x, signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == (130 if how.startswith("ctrl-c") else 143), out[-3000:]
    assert took < 15, f"{took:.1f} s"
    errs = error_lines(out)
    assert len(errs) == 1 and errs[0].startswith("error interrupted by SIG"), out[-3000:]
    assert "Traceback" not in out and "ConnectError" not in out and "Error logging to API" not in out, out[-3000:]
    wait_gone(pids, timeout=10)
    assert not [x.name for x in run.iterdir() if ".tmp-" in x.name or x.name.endswith(".partial")]


@pytest.mark.distributed
def test_sigkill_of_evaluate_ends_its_sharded_ranks(built, tmp_path):
    """evaluate --checkpoint runs the checkpoint under its own layout (torchrun, tp=2): killed with
    SIGKILL during that step, it leaves no rank behind."""
    ckpt = convert_checkpoint(built["hf"], tmp_path / "ckpt", ConvertConfig(tp=2)).out_dir
    p = titan_pipe(
        "evaluate", "--checkpoint", ckpt, "--model-dir", built["model"], "-o", tmp_path / "report", env=dict(os.environ)
    )
    end = time.monotonic() + 300
    while len(pids := descendants(p.pid)) < 4:  # guardian, torchrun, two ranks
        assert p.poll() is None and time.monotonic() < end, p.communicate()[0]
        time.sleep(0.1)
    time.sleep(1)
    pids = descendants(p.pid)
    p.kill()
    p.wait()
    wait_gone(pids, timeout=60)
    assert sorted(x.name for x in tmp_path.iterdir()) == [".report.lock", "ckpt"]  # no report, no temp


@pytest.mark.distributed
def test_disk_full_in_the_training_of_a_run_is_one_line_and_not_retried(prefect_harness, tmp_path):
    """`titan-pipe run`: the training's rank meets ENOSPC writing its checkpoint; the train task fails
    with the one line and is not retried (retries: 2 would retry a crash), no traceback anywhere."""
    from prefect.settings import PREFECT_API_URL

    runs = tmp_path / "runs"
    flow = _flow(tmp_path, runs, orchestration={"retries": 2, "retry_delay_s": 0}, checkpoint={"every": 2})
    env = {**shim_env(runs / "t" / "checkpoints", "ENOSPC"), "PREFECT_API_URL": PREFECT_API_URL.value()}
    p = titan_pipe("run", flow, env=env)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 1, out
    errs = error_lines(out)
    assert len(errs) == 1 and "Traceback" not in out, out
    assert str(runs / "t" / "checkpoints" / "step-000002") in errs[0]
    assert "cannot write the checkpoint of step 2: the disk filled up (ENOSPC)" in errs[0]
    assert "attempt 1: training from step 0" in out and "attempt 2" not in out
    assert not (runs / "t" / "checkpoints").exists()
