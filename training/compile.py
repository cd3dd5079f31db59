"""torch.compile of each transformer block, applied after TP and activation checkpointing, before data parallelism.

Per block, as torchtitan does: the blocks share one code path, so the graph traced for the first
is reused by the others (their parameters are graph inputs), and compile time does not grow with
depth. Only ``forward`` is compiled, in place: the module hooks around it (activation
checkpointing's recompute context, FSDP's all-gathers) run eagerly outside the graph, which is
what lets ``fullgraph=True`` hold, and parameter names do not change (no ``_orig_mod.`` wrapper),
so checkpoints are the same with or without compile.

Under tensor parallelism each block's four sub-layers (the two norms, attention, the FFN) are
compiled instead of the block: with torch 2.13, one AOTAutograd graph spanning a replicated norm's
DTensor hooks and the next column-parallel linear's fails in backward (aot_eager: a DTensor
redistribution receives a plain-tensor gradient; inductor under FSDP: wrong gradients from the
second step), while each sub-layer compiled alone matches eager exactly (tests/test_training_compile.py).
The TP hooks between sub-layers then run eagerly, which costs the fusions across a norm and its
residual add, not those inside a sub-layer (RoPE, the SwiGLU product, the norm's own arithmetic).

AOTAutograd's on-disk cache is turned off for a compiled run (inductor's own FX-graph cache stays
on): with torch 2.13 on CPU, a dp2 x tp2 inductor run that read the graphs an earlier run had
cached died with SIGSEGV in a rank, three tries of three, a run of the same flow whose first
compile wrote the cache passing; with the AOTAutograd cache off the rerun passes (it re-traces the
joint graph, a few seconds, and inductor still finds its compiled kernels).
"""

from __future__ import annotations

import shutil

import torch
from torch import nn

from titan_pipe.rules.choices import COMPILE_BACKENDS
from titan_pipe.errors import UserError


def resolve_backend(name: str, device_type: str):
    """The torch.compile backend for ``train.compile_backend`` on ``device_type``.

    auto: inductor on cuda and cpu (on cpu it generates C++, so a compiler must be installed),
    TorchAir's graph backend on npu (``torchair.get_npu_backend()``, what the Ascend docs give for
    torch.compile). aot_eager traces and runs the same graphs without code generation: the
    backend for checking compile's exactness where no compiler is available.
    """
    if name not in COMPILE_BACKENDS:
        raise UserError(f"train.compile_backend {name!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    if name == "auto" and device_type == "npu":
        try:
            import torchair
        except ImportError:
            raise UserError(
                "train.compile on npu needs TorchAir (torchair, shipped with torch_npu's CANN "
                "toolkit); install it or set train.compile: false"
            ) from None
        return torchair.get_npu_backend()
    problem = backend_problem(name, device_type)
    if problem:
        raise UserError(problem)
    return "inductor" if name == "auto" else name


def backend_problem(name: str, device_type: str) -> str | None:
    """Why ``train.compile_backend`` cannot compile on ``device_type`` on this host (one line), or None:
    inductor on cpu generates C++, so it needs a compiler. Also the launch preflight's check."""
    backend = "inductor" if name == "auto" and device_type != "npu" else name
    if backend == "inductor" and device_type == "cpu" and not cpp_compiler():
        return (
            "train.compile with the inductor backend on cpu needs a C++ compiler (g++ or clang++ on PATH); "
            "install one, or set train.compile_backend: aot_eager"
        )
    return None


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would call on CPU, or None."""
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


# of a TransformerBlock; Gemma 3's norms on the sub-layers' outputs where the model has them
SUBLAYERS = ("attention_norm", "attention", "post_attention_norm", "ffn_norm", "feed_forward", "post_ffn_norm")


def disable_autograd_cache() -> None:
    """Turn off AOTAutograd's on-disk cache in this process (see the module doc: a rerun reading it
    crashed); a torch without the switch is left as it is. TORCHINDUCTOR_AUTOGRAD_CACHE=1 in the
    environment still forces it on."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:
        return
    if hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = False


def apply_compile(part: nn.Module, backend, *, split_blocks: bool = False, fullgraph: bool = True) -> list[str]:
    """Compile the ``forward`` of every transformer block of a stage module in place (``split_blocks``:
    of each block's sub-layers, for TP); returns the compiled modules' names."""
    disable_autograd_cache()
    done = []
    for layer_id, block in part.layers.items():
        names = [n for n in SUBLAYERS if getattr(block, n, None) is not None] if split_blocks else ("",)
        for name in names:
            module = block.get_submodule(name)
            module.forward = torch.compile(module.forward, backend=backend, fullgraph=fullgraph)
            done.append(f"layers.{layer_id}" + (f".{name}" if name else ""))
    return done


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo tracing, the backend, lazy backward graphs).

    Read from torch._dynamo's own timers; 0.0 where this torch does not keep them.
    """
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    keys = ("_compile.compile_inner", "backward._backward_impl")
    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in keys))
