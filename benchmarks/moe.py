"""Benchmark: the mixture-of-experts layer, measured side by side in one run.

1. Training (forward + backward of one MoE layer on the same tokens and weights):
     loop      a bare PyTorch loop over the experts, as transformers' Mixtral/Qwen3-MoE blocks do it:
               per expert, find its tokens (where over a one-hot), gather, SwiGLU, index_add
     titan     titan_pipe.model.transformer.MoE: tokens sorted by expert once, one contiguous slice
               per expert (the reference kernel set: model.kernels reference / CPU)
     grouped   the same with the torch_fused kernel set (torch._grouped_mm: CUDA, compute
               capability 9.0+, bfloat16; elsewhere it is the loop and the row says so)
   Target: titan >= 1.0x loop (tokens per second).
2. Export (ONNX Runtime, one thread, the routed layer alone, built by titan_pipe.graphs.onnx_nodes as export
   builds it): the dense-weighted form (every expert on every token, weighted by its gate) against
   the gathered form (each token's k experts' weights gathered from the stacks), for a
   prefill-sized batch of tokens and a decode-sized one. Export uses the faster of the two for each
   graph: dense-weighted in model.onnx, gathered in decode.onnx.

    python benchmarks/moe.py [--tokens 4096] [--dim 512] [--hidden 1024] [--experts 8] [--top-k 2]
                             [--device cpu] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from titan_pipe.model.args import resolve_args
from titan_pipe.model.kernels import reference_kernels, torch_fused_kernels
from titan_pipe.model.transformer import MoE


def loop_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """transformers' way: per expert hit, its tokens by where over a one-hot mask, then index_add."""
    _, chosen, weights = moe.route(x)
    out = torch.zeros_like(x)
    mask = F.one_hot(chosen, moe.n_experts).permute(2, 1, 0)  # (E, k, N)
    e = moe.experts
    for i in range(moe.n_experts):
        slot, token = torch.where(mask[i])
        if token.numel() == 0:
            continue
        xe = x[token]
        y = F.linear(F.silu(F.linear(xe, e.w1[i])) * F.linear(xe, e.w3[i]), e.w2[i])
        out.index_add_(0, token, (y.float() * weights[token, slot, None]).to(x.dtype))
    return out


def timed(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def training(a) -> None:
    args = resolve_args(
        "debug_moe",
        dim=a.dim,
        ffn_hidden_dim=a.hidden,
        n_experts=a.experts,
        experts_per_token=a.top_k,
        n_heads=8,
        n_kv_heads=8,
    )
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.dim, device=a.device, dtype=dtype)
    rows = {}
    for label, kernels in (("titan", reference_kernels()), ("grouped", torch_fused_kernels())):
        moe = MoE(args, kernels).to(a.device, dtype)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.02)
        if label == "titan":
            state = moe.state_dict()
            loop_model = moe
        else:
            moe.load_state_dict(state)

        def step(m=moe):
            m.zero_grad(set_to_none=True)
            m(x[None]).float().square().mean().backward()

        rows[label] = timed(step, a.repeats, a.device)

    def loop_step():
        loop_model.zero_grad(set_to_none=True)
        loop_moe(loop_model, x).float().square().mean().backward()

    rows["loop"] = timed(loop_step, a.repeats, a.device)
    grouped_real = a.device == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    print(
        f"MoE layer forward+backward: {a.tokens} tokens, dim {a.dim}, {a.experts} experts of {a.hidden}, "
        f"top-{a.top_k}, {dtype}, {a.device}; best of {a.repeats}"
    )
    for label in ("loop", "titan", "grouped"):
        note = "" if label != "grouped" or grouped_real else "  (no grouped GEMM here: the per-expert loop)"
        print(
            f"  {label:8s} {rows[label] * 1e3:9.1f} ms   {a.tokens / rows[label]:12,.0f} tokens/s   "
            f"{rows['loop'] / rows[label]:5.2f}x loop{note}"
        )


def _graph(form: str, n: int, dim: int, hidden: int, experts: int, top_k: int):
    """One routed layer as export builds it: titan_pipe.graphs.onnx_nodes' router, then the dense-weighted
    experts (prefill) or the gathered ones (decode)."""
    import onnx
    from onnx import TensorProto, helper

    from titan_pipe.graphs.onnx_nodes import NodeBuilder, experts as dense_experts, experts_gathered, gates, route

    g = NodeBuilder("float32")
    top, chosen = route(g, "x", "router", top_k=top_k, norm_topk=True, name="route")
    if form == "dense-weighted":
        out = dense_experts(g, "x", gates(g, top, chosen, n_experts=experts, name="route"), "w1", "w3", "w2", "moe")
    else:
        out = experts_gathered(g, "x", top, chosen, "w1", "w3", "w2", top_k=top_k, dim=dim, name="moe")
    return _model(g, out, n, dim, hidden, experts, onnx, TensorProto, helper)


def _model(g, out, n, dim, hidden, experts, onnx, TensorProto, helper):
    rng = np.random.default_rng(0)
    weights = {
        "router": (experts, dim),
        "w1": (experts, hidden, dim),
        "w3": (experts, hidden, dim),
        "w2": (experts, dim, hidden),
    }
    inits = [
        onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.05).astype(np.float32), k) for k, s in weights.items()
    ]
    g.op("Identity", [out], "y_out")
    graph = helper.make_graph(
        g.nodes,
        "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, dim])],
        [helper.make_tensor_value_info("y_out", TensorProto.FLOAT, [n, dim])],
        inits + g.consts,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def export_forms(a) -> None:
    import onnxruntime as ort

    print(f"ONNX Runtime, one MoE layer ({a.experts} experts of {a.hidden}, dim {a.dim}, top-{a.top_k}), one thread:")
    for n in (a.tokens // 8, 2):
        x = np.random.default_rng(1).standard_normal((n, a.dim)).astype(np.float32)
        times, outs = {}, {}
        for label in ("dense-weighted", "gathered"):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            s = ort.InferenceSession(
                _graph(label, n, a.dim, a.hidden, a.experts, a.top_k).SerializeToString(),
                opts,
                providers=["CPUExecutionProvider"],
            )
            outs[label] = s.run(None, {"x": x})[0]
            times[label] = timed(lambda: s.run(None, {"x": x}), a.repeats, "cpu")
        same = np.abs(outs["dense-weighted"] - outs["gathered"]).max()
        print(
            f"  {n:5d} tokens: dense-weighted {times['dense-weighted'] * 1e3:8.2f} ms, gathered "
            f"{times['gathered'] * 1e3:8.2f} ms ({times['gathered'] / times['dense-weighted']:.2f}x the "
            f"dense time); outputs differ by {same:.1e}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    training(a)
    export_forms(a)


if __name__ == "__main__":
    main()
