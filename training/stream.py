"""Running the launch: a guarded child process tree whose output is teed to the console and a log file."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, Mapping

from titan_pipe import procs
from titan_pipe.training.metrics import bar_info, new_progress_bar, parse_progress_line


def stream_process(cmd: list[str], *, env: Mapping[str, str] | None, log_path: Path,
                   console: IO[str] | None = None, live: bool | None = None,
                   cwd: Path | None = None, hide_from: Callable[[str], bool] | None = None) -> int:
    """Run ``cmd``, copying each output line (stdout and stderr merged) to ``console`` (stderr) and
    appending it to ``log_path`` as it arrives; returns the exit status (128+N for signal N).

    On a terminal (``live``), progress lines (metrics.format_progress_line) drive a rich bar and
    everything else prints above it; off a terminal every line is echoed as it is. The child runs
    under titan_pipe.procs: it and everything it starts (torchrun's ranks) die with this process
    however it ends. An interrupt (Ctrl-C, or SIGTERM/SIGHUP turned into one by the CLI) is passed
    on as that signal; the tree gets procs.GRACE_S seconds to stop before it is killed, then the
    interrupt propagates. ``hide_from``: from the first line it accepts on, lines go to the log
    only (torchrun's own failure report, which the launcher sums up in one line naming the log).
    """
    console = console or sys.stderr  # progress goes where every other stage's progress goes
    live = console.isatty() if live is None else live
    log_path.parent.mkdir(parents=True, exist_ok=True)
    from titan_pipe.atomic import open_append

    with open_append(log_path) as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n")
        log.flush()
        tree = procs.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=dict(env) if env else None, cwd=cwd, text=True, errors="replace", bufsize=1)
        bar = _LiveBar(console) if live else None
        with tree:
            try:
                _tee(tree, log, console, bar, hide_from)
                return tree.wait()
            except KeyboardInterrupt as e:
                tree.proc.send_signal(getattr(e, "signum", signal.SIGINT))  # the guardian passes it on
                _tee(tree, log, None, None, None)  # the rest of the output goes to the log (and never blocks the tree)
                tree.wait()
                raise
            finally:
                if bar is not None:
                    bar.close()


def _tee(tree: procs.Tree, log: IO[str], console: IO[str] | None, bar: "_LiveBar | None",
         hide_from: Callable[[str], bool] | None) -> None:
    assert tree.stdout is not None
    echo = console is not None
    for line in tree.stdout:
        log.write(line)
        log.flush()
        if echo and hide_from is not None and hide_from(line):
            echo = False
        if not echo:
            continue
        try:
            if bar is not None:
                bar.feed(line.rstrip("\n"))
            else:
                console.write(line)
                console.flush()
        except BrokenPipeError:  # `titan-pipe train | head`: keep training, keep logging
            echo = False


class _LiveBar:
    """A rich progress bar fed with the child's lines (progress lines update it, others print)."""

    def __init__(self, stream: IO[str]):
        self.progress = new_progress_bar(stream)
        self.task = None

    def feed(self, line: str) -> None:
        parsed = parse_progress_line(line)
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
