"""The planner's inputs: the cluster (devices, links), one layout, the workload and the assumptions."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_pipe.rules.choices import INTERLEAVED
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.lora import LoRASpec
from titan_pipe.rules.mesh_math import world_size


GB = 1e9  # decimal gigabytes, as device datasheets count them


# ---------------------------------------------------------------------------------------------
# Inputs: the cluster and one layout


@dataclass(frozen=True)
class Link:
    """One interconnect tier: groups of ranks inside one aligned block of ``span`` ranks use it.

    gbps: GB/s one device can send on it (one direction); span None: the whole cluster.
    """

    name: str
    span: int | None
    gbps: float


@dataclass(frozen=True)
class Cluster:
    device: str  # profile key, e.g. "ascend910b3"
    n_devices: int
    devices_per_node: int
    memory_bytes: float
    peak_tflops: dict[str, float]  # per amp dtype
    links: tuple[Link, ...]  # fastest (smallest span) first
    host_link: Link = Link("PCIe 4.0 x16", None, 32.0)  # device <-> host, for CPU offload

    def link_for(self, ranks: list[int]) -> Link:
        """The slowest tier a ring over ``ranks`` must cross: the smallest block holding them all."""
        for link in self.links:
            if link.span is None or len({r // link.span for r in ranks}) == 1:
                return link
        return self.links[-1]


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel degrees and every knob the planner varies.

    ep > 1 (a mixture of experts, FSDP only): each routing layer's experts split over ep of the dp
    ranks, FSDP sharding them further over the dp / ep ranks that share them.
    zero: 3 = FSDP2 (dp_mode fsdp), 2 = FSDP2 without resharding after forward, 0 = DDP (FSDP2
    replicate when tp > 1); data_parallel.plan_dp makes the same mapping. (ZeRO-1 is left out: the
    trainer's optimizer does not shard states yet.) ac_every 0: no activation checkpointing.
    amp_dtype None: float32 throughout. offload: FSDP2 CPU offload of parameters, gradients and
    optimizer states (memory.optimizer_offload: cpu; zero 3 only).
    """

    dp: int
    tp: int
    pp: int
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    zero: int = 3
    sequence_parallel: bool = False
    ac_every: int = 0
    amp_dtype: str | None = "bfloat16"
    offload: bool = False
    ep: int = 1  # a mixture of experts' experts split over ep of the dp ranks (parallel.ep)

    @property
    def world(self) -> int:
        return world_size(self.dp, self.tp, self.pp)

    @property
    def dp_mode(self) -> str:
        return "fsdp" if self.zero >= 2 else "ddp"

    def label(self) -> str:
        sched = (
            ""
            if self.pp == 1
            else (f" {self.schedule}" + (f"(v={self.virtual_stages})" if self.schedule == INTERLEAVED else ""))
        )
        return f"dp{self.dp}{f' ep{self.ep}' if self.ep > 1 else ''} tp{self.tp} pp{self.pp}{sched}"


@dataclass(frozen=True)
class Workload:
    args: ModelArgs
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all dp ranks
    flavour: str | None = None
    model_overrides: dict = field(default_factory=dict)  # dims given on top of the flavour
    lora: LoRASpec | None = None  # train.lora: the base frozen, only the adapters train (titan_pipe.model.lora)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Assumptions:
    """Efficiencies the estimate multiplies peak figures by (docs/plan.md, "Step time")."""

    compute_efficiency: float = 0.5  # achieved fraction of peak matmul FLOPs
    comm_efficiency: float = 0.7  # achieved fraction of the link bandwidth
    host_memory_gbps: float = 20.0  # host DRAM bandwidth per device for the offloaded AdamW step
    comm_overlap: bool = True  # DP gradient traffic overlaps backward (comm.comm_overlap)
    gradient_sync_dtype: str = "float32"
    fusion_buffer_mb: int = 25
