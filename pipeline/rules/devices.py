"""Device and collective backend per platform: cpu/gloo, cuda/nccl, npu/hccl (torch_npu lazily)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titan_pipe.errors import UserError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Device:
    type: str  # cpu | cuda | npu
    backend: str  # gloo | nccl | hccl

    def torch_device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu") if self.type == "cpu" else torch.device(self.type, local_rank)


def npu_available() -> bool:
    """True only on an Ascend host with torch_npu installed; never imports it elsewhere."""
    if os.environ.get("TITAN_PIPE_NO_NPU"):
        return False
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available()  # type: ignore[attr-defined]
    except Exception:  # a broken torch_npu (no CANN) must not take the CPU path down with it
        return False


def resolve_device(choice: str = "auto") -> Device:
    """auto picks npu, then cuda, then cpu. An explicit choice that is absent is an error."""
    if choice == "auto":
        if npu_available():
            choice = "npu"
        elif torch.cuda.is_available():
            choice = "cuda"
        else:
            choice = "cpu"
    if choice == "npu" and not npu_available():
        raise UserError(
            "device: npu, but torch_npu/CANN is not available on this host; install the "
            "[npu] extra (pip install 'titan-pipe[npu]') on an Ascend host, or set device: cpu"
        )
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda, but CUDA is not available on this host; run on a GPU host, or set device: cpu")
    if choice not in BACKENDS:
        raise ValueError(f"unknown device {choice!r}; use auto, cpu, cuda or npu")
    return Device(choice, BACKENDS[choice])


def set_local_device(device: Device, local_rank: int) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    elif device.type == "npu":
        import torch_npu  # noqa: F401

        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]


def peak_memory_bytes(device: Device) -> int:
    """Peak allocated memory on the accelerator, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    if device.type == "npu":
        return torch.npu.max_memory_allocated()  # type: ignore[attr-defined]
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
