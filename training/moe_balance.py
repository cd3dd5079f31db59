"""The load-balancing loss of a mixture of experts over the whole data-parallel batch.

Each dp rank routes its own tokens. The loss (titan_pipe.model.transformer.load_balancing_loss) is
a product of two batch means (assignments per expert, router probability per expert), so a mean of
per-rank losses is not the loss of the batch. Here every rank sums the statistics of all ranks
(one all-reduce of 2 x experts + 1 numbers per step): the value is the single-process one; the
gradient reaches this rank's router only through its own tokens' probabilities, scaled by the dp
size, so that data parallelism's averaging of the ranks' gradients gives the batch's gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def batch_balance(group: dist.ProcessGroup, dp: int):
    """The ``reduce`` of load_balancing_loss for the dp ranks of ``group``."""

    def reduce(assigned: torch.Tensor, prob_sum: torch.Tensor, rows: int):
        packed = torch.cat([assigned.detach(), prob_sum.detach(), torch.tensor([float(rows)], device=assigned.device)])
        dist.all_reduce(packed, group=group)
        n = assigned.numel()
        every = packed[:n]
        others = packed[n : 2 * n] - prob_sum.detach()
        return every, prob_sum + others, packed[-1], dp

    return reduce
