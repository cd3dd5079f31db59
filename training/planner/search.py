"""The parallelism planner: every valid dp x tp x pp layout of a model on a cluster, estimated
(training/planner/memory.py, timing.py), checked against the config rules ``titan-pipe validate`` applies
(``titan_pipe.config.parse_flow``), ranked by tokens/s, with the reasons a layout does not fit and
the flow.yaml of the winner. Formulas and sources: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_pipe.rules import limits
from titan_pipe.rules.choices import INTERLEAVED, PP_SCHEDULES
from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.args import flops_per_token
from titan_pipe.training.planner.memory import Memory, memory_per_device
from titan_pipe.training.planner.timing import Timing, peak_flops, step_time
from titan_pipe.training.planner.workload import GB, Assumptions, Cluster, Layout, Link, Workload


# ---------------------------------------------------------------------------------------------
# One estimate, and why it does not fit


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: Memory
    timing: Timing
    tokens_per_s: float
    mfu: float  # model FLOPs (no recomputation) / (devices * peak)
    fits: bool
    reason: str | None = None  # why it does not fit, with what would help

    @property
    def step_s(self) -> float:
        return self.timing.step_s


def estimate(
    w: Workload, layout: Layout, cluster: Cluster, assume: Assumptions = Assumptions(), *, explain: bool = True
) -> Estimate:
    mem = memory_per_device(w, layout, assume)
    timing = step_time(w, layout, cluster, assume)
    tps = w.tokens / timing.step_s
    mfu = tps * flops_per_token(w.args, w.seq_len) / (layout.world * peak_flops(cluster, layout))
    fits = mem.total <= cluster.memory_bytes
    reason = None if fits or not explain else misfit_reason(w, layout, cluster, mem, assume)
    return Estimate(layout, mem, timing, tps, mfu, fits, reason)


def _fmt_gb(b: float) -> str:
    return f"{b / GB:.1f} GB"


def _remedies(w: Workload, layout: Layout, component: str, cluster: Cluster) -> list[tuple[str, Layout]]:
    """Changes that shrink ``component`` (label, changed layout) and pass the config rules; the
    caller checks which of them fit."""
    out: list[tuple[str, Layout]] = []
    world, n = layout.world, w.args.n_layers
    if component == "unsharded gradients" and layout.pp > 1 and layout.tp * 2 <= cluster.devices_per_node:
        out.append(
            (
                f"tp {2 * layout.tp}, pp {max(1, layout.pp // 2)}",
                replace(
                    layout,
                    tp=2 * layout.tp,
                    pp=max(1, layout.pp // 2),
                    microbatches=layout.microbatches if layout.pp > 2 else 1,
                ),
            )
        )
    if component in (
        "optimizer states",
        "gradients",
        "parameters",
        "parameter copies",
        "comm buffers",
        "unsharded gradients",
    ):
        if layout.dp > 1 and layout.zero != 3:
            out.append(("use FSDP (dp_mode fsdp)", replace(layout, zero=3)))
        if not layout.offload:
            out.append(("optimizer_offload cpu", replace(layout, zero=3, offload=True)))
        if layout.dp % 2 == 0 and 2 * layout.pp <= n:
            m = max(layout.microbatches, 2 * layout.pp)
            out.append((f"pp >= {2 * layout.pp}", replace(layout, pp=2 * layout.pp, dp=layout.dp // 2, microbatches=m)))
        if layout.dp % 2 == 0 and w.args.kv_heads % (2 * layout.tp) == 0:
            out.append((f"tp {2 * layout.tp}", replace(layout, tp=2 * layout.tp, dp=layout.dp // 2)))
    if component in ("activations", "recompute"):
        if layout.ac_every != 1:
            out.append(("activation checkpointing every layer", replace(layout, ac_every=1)))
        if layout.tp > 1 and not layout.sequence_parallel:
            out.append(("sequence_parallel", replace(layout, sequence_parallel=True)))
        local = w.global_batch // layout.dp
        if layout.pp > 1 and local % (2 * layout.microbatches) == 0:
            out.append(
                (f"microbatches {2 * layout.microbatches}", replace(layout, microbatches=2 * layout.microbatches))
            )
        if layout.pp > 1 and layout.schedule == "gpipe":
            out.append(("pp_schedule 1f1b", replace(layout, schedule="1f1b")))
        if layout.dp % 2 == 0 and w.args.kv_heads % (2 * layout.tp) == 0:
            out.append((f"tp {2 * layout.tp}", replace(layout, tp=2 * layout.tp, dp=layout.dp // 2)))
    return [
        (label, lay)
        for label, lay in out
        if lay.world == world and lay.tp <= cluster.devices_per_node and not check_layout(w, lay, cluster)
    ]


def misfit_reason(w: Workload, layout: Layout, cluster: Cluster, mem: Memory, assume: Assumptions) -> str:
    """'needs 41.3 GB/device > 32.0 GB: optimizer states 26.0 GB — use FSDP (fits) or pp >= 2'."""
    component, size = max(mem.items().items(), key=lambda kv: kv[1])
    head = f"needs {_fmt_gb(mem.total)}/device > {_fmt_gb(cluster.memory_bytes)}: {component} {_fmt_gb(size)}"
    fixes = []
    for label, lay in _remedies(w, layout, component, cluster):
        try:
            total = memory_per_device(w, lay, assume).total
        except ValueError:  # e.g. more stages than layers
            continue
        if total < mem.total:
            fixes.append(
                (
                    total > cluster.memory_bytes,
                    total,
                    f"{label} ({'fits, ' if total <= cluster.memory_bytes else ''}{_fmt_gb(total)})",
                )
            )
    if not fixes:
        return head + " — no single change fits; use more devices or a smaller --global-batch/--seq-len"
    fixes.sort()
    return head + " — " + " or ".join(text for _, _, text in fixes[:3])


# ---------------------------------------------------------------------------------------------
# The cluster from a device profile


# what one accelerator can hold: from 1 GiB (smaller is no training device) to 16 TiB
DEVICE_MEMORY = limits.Bound(2**30, 2**44, "memory of one accelerator")


def parse_device_memory(text: str) -> float:
    """--device-memory in the one size grammar every size flag uses (titan_pipe.rules.sizes: 64GB, 80GiB,
    512MB; a bare number is bytes, as for --max-memory), bounded by DEVICE_MEMORY."""
    from titan_pipe.rules.sizes import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise UserError(f"--device-memory: {e}") from None
    if not DEVICE_MEMORY.lo <= n <= DEVICE_MEMORY.hi:
        raise UserError(
            f"--device-memory {limits.shown(text)} is {n:,} bytes, outside 1 GiB..16 TiB (the {DEVICE_MEMORY.why}); "
            "write the size with its unit, e.g. 64GB or 80GiB"
        )
    return float(n)


def build_cluster(
    device: str, n_devices: int, *, nodes: int | None = None, device_memory: str | None = None
) -> tuple[Cluster, list[str]]:
    """The Cluster for ``n_devices`` of one profile (titan_pipe.rules.device_profiles), with notes
    (e.g. which bin an alias family resolved to). Device memory counts memory_gb as 10^9 bytes."""
    from titan_pipe.rules.device_profiles import resolve_profile

    if n_devices < 1:
        raise UserError(f"--devices {n_devices} must be >= 1")
    try:
        key, prof, note = resolve_profile(device)
    except KeyError as e:
        raise UserError(f"--device: {e.args[0]}") from None
    notes = [note] if note else []
    per_node = prof.get("devices_per_node", 8)
    if nodes is None:
        nodes = max(1, -(-n_devices // per_node))
    if nodes < 1 or n_devices % nodes:
        raise UserError(
            f"--nodes {nodes} does not divide --devices {n_devices}; give a node count "
            f"that splits the devices evenly (a {key} server holds {per_node})"
        )
    if n_devices // nodes > per_node:
        notes.append(
            f"{n_devices // nodes} devices per node, more than the {per_node} of a {key} server: "
            f"the intra-node links are assumed to span them all (pass --nodes to change)"
        )
    per_node = n_devices // nodes
    links = []
    for link in prof.get("links") or [{"name": "link", "span": None, "gbps": 25.0}]:
        span = per_node if link["span"] == "node" else link["span"]
        if span is not None and span >= n_devices:
            span = None
        links.append(Link(link["name"], span, float(link["gbps"])))
    host = prof.get("host_link") or {"name": "PCIe 4.0 x16", "gbps": 32.0}
    memory = parse_device_memory(device_memory) if device_memory else prof["memory_gb"] * GB
    peaks = {k: v for k, v in prof["peak_tflops"].items() if v}
    return Cluster(
        key, n_devices, per_node, memory, peaks, tuple(links), Link(host["name"], None, float(host["gbps"]))
    ), notes


# ---------------------------------------------------------------------------------------------
# Enumerate, check, rank


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def amp_dtype_for(cluster: Cluster) -> str:
    """bf16 where the device has it, else fp16 (with dynamic loss scaling in the flow)."""
    for dtype in ("bfloat16", "float16", "float32"):
        if cluster.peak_tflops.get(dtype):
            return dtype
    raise UserError(
        f"device {cluster.device} lists no peak TFLOPS in titan_pipe.rules.device_profiles (its data/device_profiles.json)"
    )


def candidate_layouts(
    w: Workload,
    cluster: Cluster,
    *,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    ac_choices=(0, 1, 2, 4),
) -> list[Layout]:
    """Every combination the planner tries: tp inside a node, dp*tp*pp = devices, each pp schedule
    (interleaved with 2 virtual stages), microbatches pp, 2pp, 4pp, 8pp or all of the local
    batch, every ZeRO stage the trainer maps (and FSDP2 with CPU offload), sequence parallel
    on/off, checkpointing 0/1/2/4; for a mixture of experts under FSDP, every ep dividing dp and
    the experts."""
    amp = amp_dtype_for(cluster)
    amp = None if amp == "float32" else amp
    out = []
    for t in _divisors(cluster.n_devices):
        if t > cluster.devices_per_node or (tp is not None and t != tp):
            continue
        for p in _divisors(cluster.n_devices // t):
            d = cluster.n_devices // t // p
            if (pp is not None and p != pp) or (dp is not None and d != dp):
                continue
            local = w.global_batch // d if w.global_batch % d == 0 else 0
            if p == 1:
                schedules, mbs = [("1f1b", 1)], [1]
            else:
                schedules = [(s, 2 if s == INTERLEAVED else 1) for s in PP_SCHEDULES]  # every schedule the trainer has
                mbs = sorted({m for m in (p, 2 * p, 4 * p, 8 * p, local) if m and local % m == 0} or {p})
            dps = [(3, False), (3, True)] + ([] if d == 1 else [(2, False), (0, False)])
            # a mixture of experts: experts split over ep of the dp ranks (FSDP only), ep dividing both
            eps = [e for e in _divisors(d) if w.args.moe and e > 1 and not features.split_problems(w.args, e)]
            for sched, v in schedules:
                for m in mbs:
                    for z, off in dps:
                        for e in [1] + (eps if z == 3 else []):
                            for sp in [False, True] if t > 1 else [False]:
                                for ac in ac_choices:
                                    out.append(Layout(d, t, p, sched, v, m, z, sp, ac, amp, off, ep=e))
    return out


def bounded_candidates(
    w: Workload, cluster: Cluster, *, dp: int | None = None, tp: int | None = None, pp: int | None = None
) -> list[Layout]:
    """``candidate_layouts``, refused in one line when there are more than the planner may estimate."""
    candidates = candidate_layouts(w, cluster, dp=dp, tp=tp, pp=pp)
    if len(candidates) > limits.LAYOUTS.hi:
        raise UserError(
            f"{len(candidates):,} candidate layouts of {cluster.n_devices} devices exceed the planner's "
            f"limit of {limits.LAYOUTS.hi:,.0f} ({limits.LAYOUTS.why}); narrow the search with --tp, "
            "--pp or --dp"
        )
    return candidates


def layout_flow(
    w: Workload, layout: Layout, cluster: Cluster, *, name: str = "planned", assume: Assumptions = Assumptions()
) -> dict:
    """The flow.yaml (as a dict) that trains ``w`` with ``layout`` on ``cluster``."""
    nodes = cluster.n_devices // cluster.devices_per_node
    launch = {"nnodes": nodes, "nproc_per_node": cluster.devices_per_node}
    if nodes > 1:
        launch["rdzv_endpoint"] = "NODE0_HOST:29500"
    fp16 = layout.amp_dtype == "float16"
    return {
        "name": name,
        "device": "npu" if cluster.device.startswith("ascend") else "cuda",
        "model": {"flavour": w.flavour, **w.model_overrides},
        "train": {"batch_size": w.global_batch, "seq_len": w.seq_len},
        "parallel": {
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "pp_schedule": layout.schedule,
            "virtual_stages": max(layout.virtual_stages, 1) if layout.schedule == INTERLEAVED else 2,
            "microbatches": layout.microbatches,
            "dp_mode": layout.dp_mode,
            "sequence_parallel": layout.sequence_parallel,
            "ep": layout.ep,
        },
        "zero_stage": {3: None, 2: 2, 0: None}[layout.zero],
        "precision": {
            "amp": layout.amp_dtype is not None,
            "amp_dtype": layout.amp_dtype or "bfloat16",
            "loss_scale": "dynamic" if fp16 else None,
        },
        "memory": {
            "activation_checkpointing": layout.ac_every > 0,
            "activation_checkpointing_layers": max(layout.ac_every, 1),
            "optimizer_offload": "cpu" if layout.offload else "none",
        },
        "comm": {
            "comm_overlap": assume.comm_overlap,
            "fusion_buffer_mb": assume.fusion_buffer_mb,
            "gradient_sync_dtype": assume.gradient_sync_dtype,
        },
        "launch": launch,
    }


def check_layout(w: Workload, layout: Layout, cluster: Cluster) -> list[str]:
    """The problems ``titan-pipe validate`` would report for this layout's flow.yaml ([] if none)."""
    try:
        parse_flow(layout_flow(w, layout, cluster), source="plan")
    except ConfigError as e:
        return e.lines
    return []


@dataclass(frozen=True)
class Plan:
    workload: Workload
    cluster: Cluster
    ranked: list[Estimate]  # fitting layouts, fastest first
    misfits: list[Estimate]  # valid but over device memory, least memory first
    invalid: list[tuple[Layout, list[str]]]  # rejected by the config rules
    notes: list[str]

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def make_plan(
    w: Workload,
    cluster: Cluster,
    *,
    assume: Assumptions = Assumptions(),
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    notes: list[str] | None = None,
    progress=None,
) -> Plan:
    """Enumerate, drop what the config rules reject, estimate the rest, rank by tokens/s.

    ``progress(done, total)`` is called as candidates are estimated (the CLI draws a bar).
    """
    candidates = bounded_candidates(w, cluster, dp=dp, tp=tp, pp=pp)
    if not candidates:
        raise UserError(
            f"no dp x tp x pp layout of {cluster.n_devices} devices matches the given "
            f"--dp/--tp/--pp (tp must divide the devices and stay within a node of "
            f"{cluster.devices_per_node})"
        )
    checked: dict[tuple, list[str]] = {}
    ranked, misfits, invalid = [], [], []
    for i, lay in enumerate(candidates):
        key = replace(lay, ac_every=0)  # checkpointing changes no config rule
        if key not in checked:
            checked[key] = check_layout(w, lay, cluster)
        if checked[key]:
            invalid.append((lay, checked[key]))
        else:
            est = estimate(w, lay, cluster, assume, explain=False)
            (ranked if est.fits else misfits).append(est)
        if progress is not None:
            progress(i + 1, len(candidates))
    if not ranked and not misfits:
        reasons = sorted({line for _, lines in invalid for line in lines})
        raise UserError("no layout is valid for this model and cluster:\n  " + "\n  ".join(reasons[:8]))
    ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory.total))
    misfits.sort(key=lambda e: (e.memory.total, -e.tokens_per_s))
    return Plan(w, cluster, ranked, misfits, invalid, list(notes or []))


def explain(w: Workload, est: Estimate, cluster: Cluster, assume: Assumptions = Assumptions()) -> Estimate:
    """``est`` with its misfit reason filled in (done lazily: it evaluates neighbouring layouts)."""
    if est.fits or est.reason:
        return est
    return replace(est, reason=misfit_reason(w, est.layout, cluster, est.memory, assume))


def best_misfits_per_layout(plan: Plan) -> list[Estimate]:
    """For each (dp, tp, pp) with no fitting variant, its least-memory variant."""
    fitting = {(e.layout.dp, e.layout.tp, e.layout.pp) for e in plan.ranked}
    seen, out = set(), []
    for e in plan.misfits:  # least memory first
        key = (e.layout.dp, e.layout.tp, e.layout.pp)
        if key in fitting or key in seen:
            continue
        seen.add(key)
        out.append(explain(plan.workload, e, plan.cluster))
    return out
