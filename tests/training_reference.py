"""Single-process reference for the distributed training tests: the plainest possible loop on
the same model, data and hyperparameters, written without any titan-pipe training machinery
beyond the model and the data loader."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from titan_pipe.config import parse_flow
from titan_pipe.model.transformer import build_model
from titan_pipe.tokens.loader import PackedLoader
from titan_pipe.tokens.spec import data_spec, open_spec
from titan_pipe.training.prepare import prepare_spec


def training_loader(cfg, *, base, prepared) -> PackedLoader:
    """The loader of ``cfg`` at dp=1, its raw text prepared into ``prepared`` (as the trainer does)."""
    spec = data_spec(cfg.data, base=base)
    if spec.text is not None:
        prepare_spec(spec, prepared, progress=False)
    _, data = open_spec(spec, prepared=prepared, vocab_size=cfg.model.args().vocab_size)
    t = cfg.train
    return PackedLoader(data.train, seq_len=t.seq_len, global_batch=t.batch_size, seed=t.seed)


def reference_run(flow: dict, *, base) -> dict:
    """Per-step losses and pre-clip grad norms, and the final state dict, of ``flow`` at dp=tp=pp=1."""
    cfg = parse_flow(dict(flow, parallel={}), base=base)
    t, o = cfg.train, cfg.train.optimizer
    args = cfg.model.args()
    loader = training_loader(cfg, base=base, prepared=base / "data")
    model = build_model(args, seed=t.seed)
    if o.name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                weight_decay=o.weight_decay, foreach=False)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)

    def factor(s):
        if s < t.warmup_steps:
            return (s + 1) / t.warmup_steps
        frac = min(1.0, (s - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1))
        return t.lr_min_ratio + (1 - t.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    losses, norms = [], []
    for _ in range(t.steps):
        x, y = loader.next_batch()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        aux = model.aux_loss()  # a mixture of experts' load-balancing term (None for a dense model)
        loss = loss if aux is None else loss + aux
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
