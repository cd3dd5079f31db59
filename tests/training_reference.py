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


def warmup_cosine(opt, t):
    """The trainer's schedule written out: linear warmup over train.warmup_steps, then cosine down to
    lr x lr_min_ratio at the last step."""

    def factor(s):
        if s < t.warmup_steps:
            return (s + 1) / t.warmup_steps
        frac = min(1.0, (s - t.warmup_steps) / max(1, t.steps - t.warmup_steps - 1))
        return t.lr_min_ratio + (1 - t.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def microbatch_groups(batch: int, *, dp: int, microbatches: int) -> list[list[int]]:
    """Rows of the global batch in each pipeline microbatch: microbatch m is rows [m*b, (m+1)*b) of
    every dp rank's slice (b = batch / dp / microbatches). A mixture of experts' load-balancing loss
    is computed per microbatch over all dp ranks' rows of it, and averaged over the microbatches."""
    local = batch // dp
    b = local // microbatches
    return [[r * local + m * b + i for r in range(dp) for i in range(b)] for m in range(microbatches)]


def reference_run(flow: dict, *, base, microbatches: int = 1) -> dict:
    """Per-step losses and pre-clip grad norms, and the final state dict, of ``flow`` at dp=tp=pp=1.
    ``microbatches``: the pipeline's, when a mixture of experts' load-balancing loss is per microbatch
    (flow's parallel.dp says how the rows are split)."""
    cfg = parse_flow(dict(flow, parallel={}), base=base)
    t, o = cfg.train, cfg.train.optimizer
    args = cfg.model.args()
    loader = training_loader(cfg, base=base, prepared=base / "data")
    model = build_model(args, seed=t.seed)
    if o.name == "adamw":
        opt = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)

    sched = warmup_cosine(opt, t)
    losses, norms = [], []
    groups = microbatch_groups(t.batch_size, dp=flow.get("parallel", {}).get("dp", 1), microbatches=microbatches)
    for _ in range(t.steps):
        x, y = loader.next_batch()
        ce, aux = 0.0, 0.0
        for rows in groups:  # one forward per pipeline microbatch (its rows on every dp rank)
            logits = model(x[rows])
            ce = ce + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[rows].reshape(-1), reduction="sum")
            term = model.aux_loss()  # a mixture of experts' load-balancing term (None for a dense model)
            aux = aux if term is None else aux + term / len(groups)
        loss = ce / y.numel() + aux
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "grad_norms": norms,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def sft_loader(cfg, *, base, prepared):
    """The fine-tuning loader of ``cfg`` at dp=1 (chat data prepared into ``prepared``, as the trainer does)."""
    from titan_pipe.tokens.packing import DocumentLoader

    spec = data_spec(cfg.data, base=base)
    if spec.text is not None:
        prepare_spec(spec, prepared, progress=False)
    _, data = open_spec(spec, prepared=prepared, vocab_size=cfg.model.args().vocab_size)
    t = cfg.train
    return DocumentLoader(data.sources[0], seq_len=t.seq_len, global_batch=t.batch_size, seed=t.seed)


def documents_of(batch):
    """(row, start, end) of each packed document of a fine-tuning batch (the padding included: its
    labels are all -100)."""
    out = []
    for r, pos in enumerate(batch.positions):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        out += [(r, a, b) for a, b in zip(starts, starts[1:])]
    return out


def sft_reference_run(flow: dict, *, base, state: dict, masked: bool = True) -> dict:
    """Fine-tuning without packing: every conversation of every global batch run through the model on
    its own (no positions, no document mask: nothing else is in its sequence), the cross entropy
    summed over its answer tokens (``masked=False``: over all its tokens) and divided by the batch's
    count of them. Starts from ``state``; per-step losses and pre-clip grad norms."""
    cfg = parse_flow(dict(flow, parallel={}), base=base)
    t, o = cfg.train, cfg.train.optimizer
    loader = sft_loader(cfg, base=base, prepared=base / "sft-data")
    model = build_model(cfg.model.args(), seed=None)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )

    sched = warmup_cosine(opt, t)
    losses, norms = [], []
    for _ in range(t.steps):
        b = loader.next_batch()
        parts, count = [], 0
        for r, lo, hi in documents_of(b):
            x, y = b.inputs[r, lo:hi], b.labels[r, lo:hi].clone()
            if not masked:  # every next token of the conversation
                y[:-1] = x[1:]
                if (b.labels[r, lo:hi] == -100).all():
                    continue  # the padding
            if (y == -100).all():
                continue
            logits = model(x[None])[0]
            parts.append(F.cross_entropy(logits, y, ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
        loss = sum(parts) / count
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip or float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms}


def lora_reference_run(flow: dict, *, base) -> dict:
    """A LoRA fine-tune written out by hand: the init_from weights frozen in a plain model (no
    adapters), each adapted linear's weight replaced in the forward by W + (alpha / rank) B A of two
    leaf tensors (torch.func.functional_call), AdamW over those tensors only, the trainer's schedule.
    A (rank, in) starts as the trainer seeds it (the layout-independent init), B at zero. Per-step
    losses and pre-clip grad norms, and the final A and B by their native adapter names."""
    from torch.func import functional_call

    from titan_pipe.model.lora import adapter_shapes, base_of
    from titan_pipe.model.lora_modules import init_adapter
    from titan_pipe.model.weights import open_weights

    cfg = parse_flow(dict(flow, parallel={}), base=base)
    t, o, spec = cfg.train, cfg.train.optimizer, cfg.train.lora.spec()
    args = cfg.model.args()
    loader = training_loader(cfg, base=base, prepared=base / "lora-ref-data")
    weights = open_weights(base / cfg.init_from if not str(cfg.init_from).startswith("/") else cfg.init_from)
    model = build_model(args, seed=None)
    model.load_state_dict({n: weights.full(n).float() for n in model.state_dict()}, strict=False)
    model.requires_grad_(False)
    shapes = adapter_shapes(args, spec)
    adapters = {n: init_adapter(n, s, t.seed, spec.init).requires_grad_() for n, s in shapes.items()}
    opt = torch.optim.AdamW(
        list(adapters.values()), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )
    sched = warmup_cosine(opt, t)
    params = dict(model.named_parameters())
    losses, norms = [], []
    for _ in range(t.steps):
        x, y = loader.next_batch()
        merged = dict(params)
        for n in shapes:
            w, part = base_of(n)
            if part == "a":
                merged[w] = params[w] + spec.scale * adapters[n[: -len("a.weight")] + "b.weight"] @ adapters[n]
        logits = functional_call(model, merged, (x,))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(adapters.values()), t.grad_clip or float("inf"))))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "adapters": {n: a.detach().clone() for n, a in adapters.items()}}
