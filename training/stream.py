"""Running the launch: a guarded child process tree whose output is teed to the console and a log file."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Mapping

from titan_pipe.processes import procs
from titan_pipe.training.metrics import bar_info, format_progress_line, new_progress_bar
from titan_pipe.training.rank_records import read_progress


def stream_process(
    cmd: list[str],
    *,
    env: Mapping[str, str] | None,
    log_path: Path,
    console: IO[str] | None = None,
    live: bool | None = None,
    cwd: Path | None = None,
    hide_from: Callable[[str], bool] | None = None,
) -> int:
    """Run ``cmd``, copying each output line (stdout and stderr merged) to ``console`` (stderr) and
    appending it to ``log_path`` as it arrives; returns the exit status (128+N for signal N).

    A progress record (rank_records.progress_line) is written to the log and off a terminal as
    metrics.format_progress_line; on a terminal (``live``) it drives a rich bar and everything else
    prints above it. Every other line is copied as it is. The child runs
    under titan_pipe.processes.procs: it and everything it starts (torchrun's ranks) die with this process
    however it ends. An interrupt (Ctrl-C, or SIGTERM/SIGHUP turned into one by the CLI) is passed
    on as that signal; the tree gets procs.GRACE_S seconds to stop before it is killed, then the
    interrupt propagates. ``hide_from``: from the first line it accepts on, lines go to the log
    only (torchrun's own failure report, which the launcher sums up in one line naming the log).
    """
    console = console or sys.stderr  # progress goes where every other stage's progress goes
    live = console.isatty() if live is None else live
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from titan_pipe.io.atomic import open_append

    with open_append(log_path) as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n")
        log.flush()
        tree = procs.popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env) if env else None,
            cwd=cwd,
            text=True,
            errors="replace",
            bufsize=1,
        )
        bar = _LiveBar(console) if live else None
        beat = _Heartbeat(console, bar)
        with tree:
            try:
                _tee(tree, log, console, bar, hide_from, beat)
                return tree.wait()
            except KeyboardInterrupt as e:
                tree.proc.send_signal(getattr(e, "signum", signal.SIGINT))  # the guardian passes it on
                _tee(tree, log, None, None, None)  # the rest of the output goes to the log (and never blocks the tree)
                tree.wait()
                raise
            finally:
                beat.stop()
                if bar is not None:
                    bar.close()


def _tee(
    tree: procs.Tree,
    log: IO[str],
    console: IO[str] | None,
    bar: "_LiveBar | None",
    hide_from: Callable[[str], bool] | None,
    beat: "_Heartbeat | None" = None,
) -> None:
    assert tree.stdout is not None
    echo = console is not None
    for line in tree.stdout:
        if beat is not None:
            beat.seen()
        progress = read_progress(line)
        if progress is not None:
            line = format_progress_line(*progress) + "\n"
        log.write(line)
        log.flush()
        if echo and hide_from is not None and hide_from(line):
            echo = False
        if not echo:
            continue
        try:
            if bar is not None:
                bar.feed(line.rstrip("\n"), progress)
            else:
                console.write(line)
                console.flush()
        except BrokenPipeError:  # `titan-pipe train | head`: keep training, keep logging
            echo = False


HEARTBEAT_S = 5.0  # a silent child (ranks importing torch, building the model) is reported this often


class _Heartbeat:
    """While the child prints nothing for HEARTBEAT_S seconds, one line says how long it has been
    quiet and what it is likely doing, so a start-up never looks like a hang."""

    def __init__(self, console: IO[str], bar: "_LiveBar | None"):
        import threading

        self.console, self.bar = console, bar
        self.start = self.last = time.monotonic()
        self.lines = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-pipe-heartbeat", daemon=True)
        self._thread.start()

    def seen(self) -> None:
        self.last = time.monotonic()
        self.lines += 1

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            quiet = time.monotonic() - self.last
            if quiet < HEARTBEAT_S or (self.bar is not None and self.bar.task is not None):
                continue  # the bar itself shows the steps going by
            doing = (
                "the ranks start (import torch, join the process group)"
                if self.lines == 0
                else "the ranks work (model build, data, the first step or a checkpoint)"
            )
            text = f"... {time.monotonic() - self.start:.0f} s: {quiet:.0f} s without a line while {doing}\n"
            try:
                if self.bar is not None:
                    self.bar.progress.console.print(text.rstrip(), markup=False, highlight=False)
                else:
                    self.console.write(text)
                    self.console.flush()
            except (BrokenPipeError, ValueError):
                return

    def stop(self) -> None:
        self._stop.set()


class _LiveBar:
    """A rich progress bar fed with the child's lines (progress lines update it, others print)."""

    def __init__(self, stream: IO[str]):
        self.progress = new_progress_bar(stream)
        self.task = None

    def feed(self, line: str, parsed: tuple[int, int, dict] | None = None) -> None:
        """``parsed``: the (step, total, metrics) of a progress record; None prints ``line``."""
        if parsed is None:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        step, total, metrics = parsed
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=step, info="")
        self.progress.update(self.task, completed=step, total=total, info=bar_info(metrics))

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()
