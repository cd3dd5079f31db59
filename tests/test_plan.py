"""The planner against the real model: activation bytes against the CPU memory profiler, FLOPs
(with recomputation) against FlopCounterMode, parameter accounting against count_params, and the
CLI (ranked table, misfit reasons, --write flow.yaml that validates, bad inputs)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.config import load_flow
from titan_pipe.model.args import FLAVOURS, count_params, resolve_args
from titan_pipe.training.activation_checkpoint import apply_ac
from titan_pipe.model.transformer import build_model
from titan_pipe.training.planner.memory import (
    ActDtypes,
    activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    memory_per_device,
    optimizer_bytes,
    rank_params,
)
from titan_pipe.training.planner.search import build_cluster, estimate, layout_flow, make_plan
from titan_pipe.training.planner.timing import (
    bubble_fraction,
    dp_bytes,
    rank_flops_per_token,
    step_flops_per_token,
)
from titan_pipe.training.planner.workload import Assumptions, Layout, Workload

# Small but not degenerate: GQA (8 heads, 2 kv heads), ffn 384, vocab 512.
SMALL = resolve_args(
    "debug", dim=128, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=512, multiple_of=128, max_seq_len=256
)
B, T = 2, 128


def measured_forward_bytes(model, tokens, *, autocast_dtype=None) -> int:
    """Bytes allocated during forward + loss and still held when it ends (kept for backward),
    from the CPU memory profiler."""
    from torch.profiler import ProfilerActivity, profile

    ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else torch.autocast("cpu", enabled=False)
    with ctx:  # warm-up: lazily built buffers and caches are not activations
        model(tokens)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with ctx:
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    held = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    loss.backward()  # the graph was real
    return held


# The other families, fp32: q/k/v biases (nothing more is kept), Qwen3's q/k norms on q 256 wide
# (head_dim 32 on a 128-wide model), Mistral's window shorter than T (its (T, T) mask per layer).
FAMILY_CASES = {
    "qwen2_biases": {"qkv_bias": True},
    "qwen3_qk_norm": {"qk_norm": True, "head_dim": 32},
    "mistral_window": {"sliding_window": 16},
}


@pytest.mark.parametrize(
    "case", ["fp32", "fp32_mha", "ac1", "ac2", "autocast_fp32_params", "bf16_params", *FAMILY_CASES]
)
def test_activation_estimate_matches_profiler(case):
    args = replace(SMALL, n_kv_heads=8) if case == "fp32_mha" else replace(SMALL, **FAMILY_CASES.get(case, {}))
    ac = {"ac1": 1, "ac2": 2}.get(case, 0)
    model = build_model(args, seed=0)
    if ac:
        apply_ac(model, ac)
    tokens = torch.randint(0, args.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    w = Workload(args, T, B)
    if case == "bf16_params":
        # FSDP2 mixed precision computes with low-precision parameters: the residual stream is bf16.
        model = model.to(torch.bfloat16)
        dt = ActDtypes(matmul=2, resid=2)
        expected = (
            T * B * (args.n_layers * layer_activation_bytes(args, dt=dt) + head_activation_bytes(args, dt=dt) + 8)
        )
        got = measured_forward_bytes(model, tokens, autocast_dtype=torch.bfloat16)
    else:
        amp = "bfloat16" if case == "autocast_fp32_params" else None
        layout = Layout(1, 1, 1, ac_every=ac, amp_dtype=amp)
        kept, _ = activation_bytes(w, layout, 0)
        # Autocast's bf16 copies of the weights are held for backward too (the planner books
        # them as "parameter copies").
        expected = kept + memory_per_device(w, layout).param_copies
        got = measured_forward_bytes(model, tokens, autocast_dtype=torch.bfloat16 if amp else None)
    assert abs(got - expected) / got < 0.15, (case, got, expected)
    # Not just within 15 %: the table is the real list of saved tensors (checkpointing adds the
    # RNG state it saves, 5 KB per checkpointed layer).
    assert abs(got - expected) < 0.02 * got + 5100 * args.n_layers, (case, got, expected)


def test_checkpointing_and_sp_shrink_activations_by_the_formula():
    w = Workload(FLAVOURS["llama2_13b"], 4096, 8)
    full = activation_bytes(w, Layout(1, 1, 1, amp_dtype="bfloat16"), 0)[0]
    ac = activation_bytes(w, Layout(1, 1, 1, ac_every=1, amp_dtype="bfloat16"), 0)[0]
    assert ac < full / 10  # only layer inputs remain
    tp = activation_bytes(w, Layout(1, 8, 1, amp_dtype="bfloat16"), 0)[0]
    sp = activation_bytes(w, Layout(1, 8, 1, sequence_parallel=True, amp_dtype="bfloat16"), 0)[0]
    assert sp < tp < full


@pytest.mark.parametrize("ac", [0, 1, 2])
def test_flops_with_recompute_match_flop_counter(ac):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    args = SMALL
    model = build_model(args, seed=0)
    if ac:
        apply_ac(model, ac)
    tokens = torch.randint(0, args.vocab_size, (1, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(tokens).sum().backward()
    measured = fc.get_total_flops() / T
    assert abs(measured - step_flops_per_token(args, T, ac)) / measured < 0.02
    # The pipeline ranks' shares add up to the whole model.
    lay = Layout(1, 1, 3, "1f1b", microbatches=3, ac_every=ac)
    total = sum(rank_flops_per_token(args, T, lay, r) for r in range(3))
    assert total == pytest.approx(step_flops_per_token(args, T, ac), rel=1e-12)


def test_bubble_fractions():
    assert bubble_fraction(Layout(1, 1, 1)) == 0
    assert bubble_fraction(Layout(1, 1, 4, "1f1b", microbatches=8)) == pytest.approx(3 / 11)
    assert bubble_fraction(Layout(1, 1, 4, "gpipe", microbatches=4)) == pytest.approx(3 / 7)
    # interleaved: the idle (p-1) is divided by v
    assert bubble_fraction(Layout(1, 1, 4, "interleaved_1f1b", 2, 8)) == pytest.approx(1.5 / 9.5)


@pytest.mark.parametrize("dp,tp,pp,zero", [(4, 1, 1, 3), (1, 2, 2, 3), (2, 2, 1, 0), (3, 1, 1, 3)])
def test_rank_params_partition_the_model(dp, tp, pp, zero):
    """Summed over ranks, the shards are the whole model once (replicated norms once per tp rank)."""
    args = resolve_args("debug", vocab_size=322)  # 322 rows do not split evenly over 3 or 4 dp ranks
    lay = Layout(dp, tp, pp, "1f1b", microbatches=max(pp, 1), zero=zero)
    total = 0
    for p in range(pp):
        for t in range(tp):
            for d in range(dp):
                rp = rank_params(args, lay, pp_rank=p, tp_rank=t, dp_rank=d)
                total += rp.params
    replicated = args.dim * (2 * args.n_layers + 1) * (tp - 1)  # norms on every tp rank
    copies = 1 if zero == 3 or dp == 1 else dp
    assert total == copies * count_params(args) + replicated * copies


@pytest.mark.parametrize(
    "over", [{"qkv_bias": True}, {"qk_norm": True, "head_dim": 32}, {"qkv_bias": True, "tie_embeddings": True}]
)
def test_rank_params_count_the_families_parameters(over):
    """q/k/v biases split over tp with their rows; q/k norms (head_dim each) on every tp rank; tied
    embeddings under tp x pp: the last stage's output copy of the embedding (training/tied.py)."""
    args = resolve_args("debug", **over)
    lay = Layout(1, 2, 2, "1f1b", microbatches=2)
    total = sum(rank_params(args, lay, pp_rank=p, tp_rank=t).params for p in range(2) for t in range(2))
    norms = args.dim * (2 * args.n_layers + 1) + (2 * args.head_dim * args.n_layers if args.qk_norm else 0)
    copy = args.vocab_size * args.dim if args.tie_embeddings else 0
    assert total == count_params(args) + norms + copy  # replicated ones twice (tp 2), the rest once


def test_plain_dp_13b_needs_208_gb_of_state():
    """16 bytes per parameter under DDP + AdamW: 13.0e9 x 16 = 208 GB per replica (docs/plan.md)."""
    args = FLAVOURS["llama2_13b"]
    lay = Layout(8, 1, 1, zero=0, amp_dtype="float16")
    rp = rank_params(args, lay, pp_rank=0)
    assert rp.params == count_params(args)
    state = 4 * rp.params + 4 * rp.params + optimizer_bytes(rp)
    assert state == 16 * count_params(args) + 4 * len(rp.names)
    assert state / 1e9 == pytest.approx(208.25, abs=0.01)
    fsdp = rank_params(args, replace(lay, zero=3), pp_rank=0)
    assert fsdp.params == pytest.approx(count_params(args) / 8, rel=1e-3)


def test_links_and_aliases():
    c, notes = build_cluster("ascend910", 16)
    assert c.device == "ascend910a" and "ascend910a" in notes[0] and c.devices_per_node == 8
    assert c.link_for([0, 1, 2, 3]).name == "HCCS"
    assert c.link_for(list(range(8))).name == "PCIe 4.0"
    assert c.link_for([0, 8]).name == "RoCE"
    c, notes = build_cluster("ascend910b", 8)
    assert c.device == "ascend910b3" and "ascend910b1" in notes[0]
    assert c.link_for(list(range(8))).name == "HCCS" and c.memory_bytes == 64e9
    c, _ = build_cluster("h100", 16, device_memory="40GB")
    assert c.memory_bytes == 40e9 and c.link_for([0, 8]).name == "InfiniBand NDR"


def test_dp_traffic_ddp_vs_fsdp():
    w = Workload(FLAVOURS["llama2_7b"], 2048, 16)
    n = count_params(w.args)
    ddp = dp_bytes(w, Layout(8, 1, 1, zero=0), Assumptions())
    assert ddp == pytest.approx(2 * 7 / 8 * 4 * n)  # ring all-reduce of fp32 gradients
    fsdp = dp_bytes(w, Layout(8, 1, 1, zero=3), Assumptions())
    assert fsdp == pytest.approx(7 / 8 * (2 * 2 * n + 4 * n))  # 2 bf16 all-gathers + fp32 reduce-scatter


def test_misfit_reason_names_the_component_and_a_fix():
    c, _ = build_cluster("ascend910a", 8)
    w = Workload(FLAVOURS["llama2_13b"], 4096, 8, flavour="llama2_13b")
    e = estimate(w, Layout(8, 1, 1, zero=0, ac_every=1, amp_dtype="float16"), c)
    assert not e.fits
    assert e.reason.startswith(f"needs {e.memory.total / 1e9:.1f} GB/device > 32.0 GB: optimizer states")
    assert "use FSDP" in e.reason


def test_plan_ranks_fitting_layouts_fastest_first():
    c, _ = build_cluster("ascend910b", 8)
    w = Workload(FLAVOURS["llama2_7b"], 4096, 32, flavour="llama2_7b")
    plan = make_plan(w, c)
    assert plan.ranked and all(e.fits for e in plan.ranked) and not any(e.fits for e in plan.misfits)
    speeds = [e.tokens_per_s for e in plan.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for e in plan.ranked[:20]:
        assert e.memory.total == memory_per_device(w, e.layout).total <= c.memory_bytes
        assert all(e.layout.tp <= 8 for e in plan.ranked)


runner = CliRunner()


def test_memory_chart_draws_one_bar_per_table_row_equal_to_its_gb_per_device():
    """The variants of one layout (dp mode, SP, AC) once shared a label and were drawn over each
    other: each bar now has its own row, named like the table's, and its stacked length is the
    table's GB/dev."""
    import matplotlib.pyplot as plt

    from titan_pipe.commands.plan import memory_figure

    c, _ = build_cluster("h100", 8)
    w = Workload(FLAVOURS["llama2_13b"], 4096, 32, flavour="llama2_13b")
    plan = make_plan(w, c)
    top = 10
    fig = memory_figure(plan, top)
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert len(labels) == len(set(labels)), labels
        widths: dict[float, float] = {}
        for patch in ax.patches:
            y = round(patch.get_y() + patch.get_height() / 2, 6)
            widths[y] = widths.get(y, 0.0) + patch.get_width()
        totals = [widths[y] for y in sorted(widths)]
        ranked = plan.ranked[:top]
        assert len(ranked) == top and len({e.layout.label() for e in ranked}) < top  # variants of one layout
        for i, e in enumerate(ranked):
            assert totals[i] == pytest.approx(e.memory.total / 1e9, rel=1e-9)
            assert labels[i].startswith(f"#{i + 1} ")
    finally:
        plt.close(fig)


def test_cli_plan_writes_a_flow_that_validates(tmp_path):
    out = tmp_path / "flow.yaml"
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "llama2_13b",
            "--devices",
            "8",
            "--device",
            "ascend910b",
            "--top",
            "3",
            "--write",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "ascend910b means ascend910b3" in r.output and "Top 3 of" in r.output and "best:" in r.output
    cfg = load_flow(out)
    p = cfg.parallel
    assert p.dp * p.tp * p.pp == 8 and cfg.model.flavour == "llama2_13b" and cfg.train.seq_len == 4096
    assert runner.invoke(app, ["validate", str(out), "--elsewhere"]).exit_code == 0
    # never overwritten without --force
    r = runner.invoke(
        app, ["plan", "--model", "llama2_13b", "--devices", "8", "--device", "ascend910b", "--write", str(out)]
    )
    assert r.exit_code == 1 and "--force" in r.output


def test_cli_multi_node_flow(tmp_path):
    out = tmp_path / "big.yaml"
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "debug",
            "--devices",
            "16",
            "--device",
            "a100",
            "--seq-len",
            "64",
            "--global-batch",
            "32",
            "--write",
            str(out),
            "--plot",
            str(tmp_path / "mem.png"),
        ],
    )
    assert r.exit_code == 0, r.output
    cfg = load_flow(out)
    assert cfg.launch.nnodes == 2 and cfg.launch.nproc_per_node == 8 and cfg.device == "cuda"
    assert cfg.parallel.tp <= 8
    assert (tmp_path / "mem.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--device", "tpu9"], "unknown device 'tpu9'"),
        (["--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
        (
            ["--device-memory", "64"],
            "--device-memory '64' is 64 bytes, outside 1 GiB..16 TiB",
        ),  # bytes, as --max-memory
        (["--device-memory", "99999TB"], "outside 1 GiB..16 TiB"),
        (["--nodes", "3"], "--nodes 3 does not divide --devices 8"),
        (["--seq-len", "999999"], "exceeds model max_seq_len"),
        (["--model", "llama9"], "--model 'llama9' is neither a flavour"),
        (["--device-memory", "2GB"], "no layout fits in 2.0 GB per device"),
    ],
)
def test_cli_bad_input(argv, needle):
    base = {"--model": "llama2_7b", "--devices": "8", "--device": "ascend910b2"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    args = ["plan"] + [x for kv in base.items() for x in kv]
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_cpu_offload_moves_state_to_the_host_and_costs_pcie_time(tmp_path):
    c, _ = build_cluster("ascend910a", 32)
    w = Workload(FLAVOURS["llama2_70b"], 4096, 16, flavour="llama2_70b")
    lay = Layout(16, 2, 1, "1f1b", 1, 1, 3, True, 1, "float16")
    on_device = estimate(w, lay, c)
    offloaded = estimate(w, replace(lay, offload=True), c)
    # 69.0e9 x 16 B / 32 ranks = 34.5 GB of state per device cannot fit in 32 GB ...
    assert on_device.memory.optimizer + on_device.memory.params + on_device.memory.grads > 34e9
    assert not on_device.fits and "optimizer_offload cpu (fits" in on_device.reason
    # ... and goes to the host under offload, leaving activations and gathered layers.
    m = offloaded.memory
    assert m.params == m.grads == m.optimizer == 0 and m.host > 34e9 and offloaded.fits
    assert "host" in offloaded.timing.comm and offloaded.step_s > on_device.step_s
    flow = tmp_path / "f.yaml"
    import yaml

    flow.write_text(yaml.safe_dump(layout_flow(w, replace(lay, offload=True), c)))
    assert load_flow(flow).memory.optimizer_offload == "cpu"


def test_cli_model_from_flow_yaml_and_filters(tmp_path):
    flow = tmp_path / "custom.yaml"
    flow.write_text("model: {flavour: debug, n_layers: 6, dim: 96, n_heads: 6, n_kv_heads: 2}\n")
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            str(flow),
            "--devices",
            "4",
            "--device",
            "h100",
            "--seq-len",
            "64",
            "--tp",
            "2",
            "--pp",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "dp1 tp2 pp2" in r.output and "0.65M parameters" in r.output
    r = runner.invoke(
        app, ["plan", "--model", str(flow), "--devices", "4", "--device", "h100", "--seq-len", "64", "--tp", "4"]
    )
    assert r.exit_code == 1 and "does not divide model n_kv_heads=2" in r.output  # the config rule, verbatim
    r = runner.invoke(app, ["plan", "--model", str(flow), "--devices", "4", "--device", "h100", "--tp", "3"])
    assert r.exit_code == 1 and "no dp x tp x pp layout of 4 devices" in r.output


def test_calibrate_from_a_device_check_sets_the_efficiency_that_reproduces_it(tmp_path):
    """The first H200 run (issue 31): the trainer measured 43,512 tokens/s at 81.5 GB on Llama-3.2-1B's
    untied shape, where the planner predicted 60,190 tokens/s and 70.7 GB at efficiency 0.5."""
    import json

    from titan_pipe.training.planner.calibrate import calibrate, read_measurement
    from titan_pipe.training.planner.workload import Assumptions

    model = {
        "flavour": "llama3_8b",
        "dim": 2048,
        "n_layers": 16,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_hidden_dim": 8192,
        "tie_embeddings": False,
        "max_seq_len": 2048,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    report = tmp_path / "device_check.json"
    report.write_text(
        json.dumps(
            {
                "spec": {"model": model, "batch": 8, "seq": 2048},
                "phases": {
                    "trainer": {"tokens_per_s": 43512, "peak_mem_gb": 81.5},
                    "trainer_compiled": {"tokens_per_s": 56209, "peak_mem_gb": 68.7},
                },
            }
        )
    )
    cluster, _ = build_cluster("h200", 1)
    cal = calibrate(read_measurement(report), cluster, Assumptions())
    assert round(cal.predicted_tokens_per_s) == pytest.approx(60190, abs=2)
    assert cal.predicted_mem_bytes / 1e9 == pytest.approx(70.7, abs=0.05)
    assert cal.efficiency == pytest.approx(0.5 * 43512 / cal.predicted_tokens_per_s)
    again = calibrate(read_measurement(report), cluster, Assumptions(compute_efficiency=cal.efficiency))
    assert again.predicted_tokens_per_s == pytest.approx(43512, rel=0.01)  # the calibrated model reproduces it
    compiled = calibrate(read_measurement(report, phase="trainer_compiled"), cluster, Assumptions())
    assert compiled.efficiency == pytest.approx(0.467, abs=0.001)
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--device",
            "h200",
            "--top",
            "1",
            "--calibrate",
            str(report),
        ],
    )
    assert r.exit_code == 0 and "efficiency set to 0.361" in r.output, r.output
    (tmp_path / "bad.json").write_text("{}")
    r = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "llama3_8b",
            "--devices",
            "8",
            "--device",
            "h200",
            "--calibrate",
            str(tmp_path / "bad.json"),
        ],
    )
    assert r.exit_code == 1 and "not a device_check.json" in r.output
    # the dry run's figures (measured on this CPU) are refused for a GPU, in one line
    report.write_text(
        json.dumps(
            {
                "spec": {"model": model, "batch": 8, "seq": 2048, "device": "cpu"},
                "phases": {"trainer": {"tokens_per_s": 900, "peak_mem_gb": 1.5}},
            }
        )
    )
    r = runner.invoke(
        app, ["plan", "--model", "llama3_8b", "--devices", "8", "--device", "h200", "--calibrate", str(report)]
    )
    assert r.exit_code == 1 and "measured on cpu, and h200 is an accelerator" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_parallel_shards_the_experts_and_costs_the_all_to_all(ep):
    """A mixture of experts under ep: summed over the 8 dp ranks every parameter is held once (the
    experts as E/ep per ep rank, FSDP over the dp/ep sharing them); a rank gathers E/ep experts, so
    FSDP's traffic for them shrinks by ep while each routing layer's tokens cross the ep group in
    4 all-to-alls (dispatch and combine, forward and backward) of tokens x top-k x dim."""
    from titan_pipe.training.planner.timing import ep_bytes

    args = FLAVOURS["debug_moe"]
    lay = Layout(8, 1, 1, zero=3, ep=ep)
    ranks = [rank_params(args, lay, pp_rank=0, dp_rank=d) for d in range(8)]
    assert sum(r.params for r in ranks) == count_params(args)
    experts = 3 * args.n_experts * args.expert_dim * args.dim * len(args.moe_layers)
    assert all(r.expert_full_params == experts // ep for r in ranks)
    w = Workload(args, 64, 16)
    want = (
        0.0
        if ep == 1
        else 4 * (ep - 1) / ep * len(args.moe_layers) * (16 // 8 * 64) * args.experts_per_token * args.dim * 2
    )
    assert ep_bytes(w, lay, 0) == pytest.approx(want)
    n, e = ranks[0].full_params - ranks[0].expert_full_params, ranks[0].expert_full_params
    de = 8 // ep
    fsdp = 7 / 8 * (2 * 2 + 4) * n + ((de - 1) / de * (2 * 2 + 4) * e if de > 1 else 0)
    assert dp_bytes(w, lay, Assumptions()) == pytest.approx(fsdp if ep > 1 else 7 / 8 * (2 * 2 + 4) * (n + e))


def test_a_moe_plan_ranks_expert_parallel_layouts_that_validate():
    c, _ = build_cluster("ascend910b", 64)
    w = Workload(FLAVOURS["mixtral_8x7b"], 4096, 256, flavour="mixtral_8x7b")
    plan = make_plan(w, c, dp=64)
    eps = {e.layout.ep for e in plan.ranked}
    assert eps >= {1, 2, 4, 8} and plan.best.layout.ep > 1
    assert "ep" in plan.best.timing.comm and plan.best.layout.label().startswith("dp64 ep")
    flow = layout_flow(w, plan.best.layout, c)
    assert flow["parallel"]["ep"] == plan.best.layout.ep
    from titan_pipe.config import parse_flow

    parse_flow(flow, source="plan")  # titan-pipe validate's rules pass
    # expert memory: a rank gathers 1/ep of each routing layer's experts
    mems = {e.layout.ep: e.memory.param_copies for e in plan.ranked if e.layout.offload and e.layout.ac_every == 1}
    assert mems[8] < mems[4] < mems[2] < mems[1]
