"""The progress of ``data prepare``: a rich bar of source bytes with MB/s and tokens/s (stderr)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class PrepareProgress:
    """``with PrepareProgress(total_bytes, enabled=...) as p: p.advance(chars, tokens)``.

    ``total_bytes`` is the sources' size on disk; characters of text stand in for bytes read
    (JSON and compression make the two differ, so the bar is filled at the end).
    """

    def __init__(self, total_bytes: int, *, enabled: bool = True):
        self.total, self.enabled = max(1, total_bytes), enabled
        self.chars = self.tokens = 0
        self._t0 = time.perf_counter()
        self._bar: Progress | None = None

    def __enter__(self) -> "PrepareProgress":
        if self.enabled:
            self._bar = Progress(
                TextColumn("prepare"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("prepare", total=self.total, info="")
        return self

    def advance(self, chars: int, tokens: int) -> None:
        self.chars += chars
        self.tokens += tokens
        if self._bar is not None:
            dt = max(1e-9, time.perf_counter() - self._t0)
            info = (
                f"{self.chars / 1e6:,.1f} MB text, {self.tokens:,} tokens | {self.chars / dt / 1e6:.2f} MB/s, "
                f"{self.tokens / dt:,.0f} tok/s"
            )
            self._bar.update(self._task, completed=min(self.chars, self.total), info=info)

    def __exit__(self, exc_type, *exc) -> None:
        if self._bar is not None:
            if exc_type is None:
                self._bar.update(self._task, completed=self.total)
            else:  # the error's one line is the whole story: no half-filled bar left above it
                self._bar.live.transient = True
            self._bar.stop()
