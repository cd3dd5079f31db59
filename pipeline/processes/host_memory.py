"""This process's memory on the host: its own peak resident set, and handing freed memory back."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's own peak resident set so far: VmHWM (ru_maxrss would also count the pages of
    the launcher it was forked from, before exec), else ru_maxrss (KiB on Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> None:
    """Trim glibc's free lists: large freed blocks otherwise stay in the process (a closed ONNX Runtime
    session's arenas, a released layer's storage). Not glibc: nothing to trim."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
