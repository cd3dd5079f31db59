"""ParallelDims(dp, tp, pp): validation of a 3D layout and its DeviceMesh over ("dp", "pp", "tp")."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_pipe.rules.mesh_math import world_size

MESH_DIMS = ("dp", "pp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the three parallel dimensions. Rank r sits at mesh coordinate (dp, pp, tp) with tp
    fastest-varying, so a TP group is made of neighbouring ranks (same node, fastest links)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: the dp ranks as dp_mod_ep x ep (ep divides dp)

    def __post_init__(self):
        if not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"parallel.ep must be an integer >= 1 dividing dp={self.dp}, got {self.ep!r}")
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return world_size(self.dp, self.tp, self.pp)

    def check_world(self, world_size: int) -> None:
        """Fail fast when the launch does not match dp*tp*pp."""
        if world_size != self.world_size:
            raise ValueError(
                f"parallel: dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size} "
                f"but {world_size} processes were launched; make them equal"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank, matching the mesh layout."""
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        return dp_rank, pp_rank, tp_rank

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The (dp, pp, tp) DeviceMesh over the whole world; call after init_process_group."""
        self.check_world(dist.get_world_size())
        if self.ep == 1:
            return init_device_mesh(device_type, (self.dp, self.pp, self.tp), mesh_dim_names=MESH_DIMS)
        # dp split as dp_mod_ep x ep (ep fastest: an ep group is neighbouring dp ranks), "dp" their flattening
        mesh = init_device_mesh(
            device_type, (self.dp // self.ep, self.ep, self.pp, self.tp), mesh_dim_names=("dp_mod_ep", "ep", "pp", "tp")
        )
        mesh["dp_mod_ep", "ep"]._flatten("dp")
        return mesh
