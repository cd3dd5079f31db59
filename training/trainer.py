"""The Trainer and its command line (``main``; torchrun runs it as ``python -m titan_pipe.training.rank``).

The Trainer only: setup (process group and mesh, this rank's model, optimizer, loader), the step,
the checkpoint, the loop with metrics. Everything else lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from titan_pipe.io.atomic import write_text
from titan_pipe.records.checkpoint_format import (
    CheckpointExtra,
    ParallelLayout,
    checkpoint_bytes,
    complete_step,
    is_save_step,
    newest_complete,
)
from titan_pipe.config import ConfigError, FlowConfig, init_from_path, load_flow, lora_base_problem
from titan_pipe.rules.dtypes import TORCH_BY_NAME
from titan_pipe.rules.devices import peak_memory_bytes, resolve_device, set_local_device
from titan_pipe.errors import UserError
from titan_pipe.io.faults import STAGE_OUTPUTS, OutputFault, writing
from titan_pipe.model import features
from titan_pipe.model.args import count_params, flops_per_token
from titan_pipe.model.lora import adapter_count, trained_flops_per_token
from titan_pipe.model.loss import cross_entropy
from titan_pipe.run_dir import RunDir
from titan_pipe.training.launch_command import comm_env
from titan_pipe.training import checkpoint as ckpt
from titan_pipe.training import metrics
from titan_pipe.training.amp import LossScaler, autocast
from titan_pipe.training.compile import compile_seconds, resolve_backend
from titan_pipe.tokens.loader import PackedLoader
from titan_pipe.tokens.spec import data_spec, open_spec
from titan_pipe.tokens.tokenizer import tokenizer_files
from titan_pipe.training.data_parallel import plan_dp, unwrap
from titan_pipe.model.kernels import resolve_kernels
from titan_pipe.model.sharding import stage_ranks
from titan_pipe.model.stated import checkpoint_side
from titan_pipe.training.known_warnings import silence_known_warnings
from titan_pipe.training.rank_records import write_failure
from titan_pipe.training.tensorboard import TensorBoardWriter
from titan_pipe.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from titan_pipe.training.tied import counted
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model
from titan_pipe.training.pipeline_parallel import build_schedule
from titan_pipe.model.weights import AdaptedWeights, base_ref, check_compatible, open_adapted, open_weights
from titan_pipe.training.zero1 import build_zero1


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Next-token cross entropy; logits (B, T, vocab) in fp32 for a stable softmax. The mean over the
    labels, or (fine-tuning) the sum over those that are not -100 divided by ``denom``."""
    return cross_entropy(logits, labels, denom=denom)


def resolve_loss(choice: str, *, tp: int, pp: int, measured: str | None = None) -> bool:
    """Whether the loss is fused with the output projection (titan_pipe.model.loss). ``auto``: fused
    where the model's last part computes it in its own forward with a plain output weight (tp = pp
    = 1), unless ``measured`` (the device profile's ``faster_loss``, from the device check's loss
    phase) says the full loss was faster there at equal results."""
    if choice == "auto":
        return tp == 1 and pp == 1 and measured != "full"
    return choice == "chunked"


def _init_distributed(device) -> None:
    if not dist.is_initialized():
        set_local_device(device, int(os.environ.get("LOCAL_RANK", 0)))
        # On accelerators a gloo side-channel carries the small CPU collectives (per-step loss and
        # memory stats, checkpoint bookkeeping); the model's collectives go over nccl/hccl.
        backend = device.backend if device.type == "cpu" else f"cpu:gloo,{device.type}:{device.backend}"
        dist.init_process_group(backend)


def loss_denominator(targets: int, *, dp: int, microbatches: int) -> float:
    """What each part's summed cross entropy is divided by so that, once data parallelism averages the
    dp ranks' gradients and the pipeline schedule averages its microbatches', the gradient is the one
    of the mean over the ``targets`` target tokens of the whole global batch (and each rank's reported
    loss, averaged the same way, that mean)."""
    return max(targets, 1) / (dp * microbatches)


def training_loader(data, train, *, dp_rank: int, dp_size: int, vocab_size: int):
    """PackedLoader over the training spans, or for ``train.mode: sft`` the DocumentLoader over the
    one chat / instruction dataset (titan_pipe.tokens.packing); data of the other kind is refused."""
    from titan_pipe.tokens.packing import DocumentLoader

    common = dict(
        seq_len=train.seq_len,
        global_batch=train.batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=train.seed,
        vocab_size=vocab_size,
    )
    masked = [s for s in data.sources if s.record is not None and s.record.loss_mask]
    if train.mode == "sft":
        if len(data.sources) != 1:
            raise UserError(
                "train.mode sft: data.blend mixes several datasets; fine-tune on one chat dataset "
                "(join the files into one prepare)"
            )
        return DocumentLoader(data.sources[0], **common)
    if masked:
        raise UserError(
            f"{masked[0].path}: chat / instruction data (its answers marked), but train.mode is "
            "pretrain, which would learn the prompts too and let packed conversations see each "
            "other; set train.mode: sft"
        )
    return PackedLoader(data.train, **common)


class Trainer:
    """One training run of ``cfg`` on the current torchrun world, in torchtitan's Trainer shape:
    ``__init__`` sets everything up (process group and mesh, data, this rank's model, optimizers,
    a resumed state), ``train_step`` runs one step and returns its metrics record, ``save`` writes
    a checkpoint, ``train`` is the loop. Works inside an existing process group too.

    base: the flow.yaml's directory (relative data/init_from paths). The run dir is ``cfg.run_dir()``.
    """

    def __init__(self, cfg: FlowConfig, *, base: Path, resume: bool = False):
        self.cfg = cfg
        t0 = time.perf_counter()
        self._setup_world()
        p = cfg.parallel
        self._say(
            f"{self.world} ranks joined ({dist.get_backend()}, dp{p.dp} x tp{p.tp} x pp{p.pp}) in "
            f"{time.perf_counter() - t0:.1f}s; building the model"
        )
        self._setup_data(base)
        latest = self._find_resume_point(resume)
        t1 = time.perf_counter()
        self._setup_model(self._weights(latest, base))
        self._say(
            f"model built ({count_params(self.args) / 1e6:,.1f}M parameters, "
            f"{'from ' + latest.name if latest else 'init_from' if cfg.init_from else 'seeded init'}) in "
            f"{time.perf_counter() - t1:.1f}s"
            + ("; the first steps compile the blocks (tens of seconds)" if cfg.train.compile else "; first step next")
        )
        self._setup_optimizers()
        self._setup_loss()
        self.start = self._restore(latest)
        self._setup_schedule()
        self._setup_metrics()

    # -- setup ---------------------------------------------------------------------------------

    def _say(self, text: str) -> None:
        """One start-up line from rank 0 (the launcher streams it): the seconds before step 1 are not silent."""
        if self.rank == 0:
            print(f"setup: {text}", flush=True)

    def _setup_world(self) -> None:
        cfg, p = self.cfg, self.cfg.parallel
        self.device = resolve_device(cfg.device)
        for k, v in comm_env(cfg, self.device.type).items():
            os.environ.setdefault(k, v)
        _init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep).build_mesh(self.device.type)
        self.torch_device = self.device.torch_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.manual_seed(cfg.train.seed)
        self.run = RunDir(cfg.run_dir())
        if self.rank == 0:
            self.run.root.mkdir(parents=True, exist_ok=True)
        if cfg.comm.stream_num != 1 and self.rank == 0:
            warnings.warn("comm.stream_num has no PyTorch-native equivalent; it is recorded, not applied", stacklevel=2)
        self.args = cfg.model.args()
        self.lora = cfg.train.lora.spec() if cfg.train.lora is not None else None

    def _setup_data(self, base: Path) -> None:
        """Memory-map the token data; raw text is prepared first, once (rank 0; a no-op when the
        launcher or the flow's data stage already did), never tokenized per rank."""
        cfg, t = self.cfg, self.cfg.train
        spec = data_spec(cfg.data, base=base)
        if spec.text is not None:
            if self.rank == 0:
                from titan_pipe.training.prepare import prepare_spec

                prepare_spec(spec, self.run.data, progress=False)
            dist.barrier()
        tok, data = open_spec(spec, prepared=self.run.data, vocab_size=self.args.vocab_size)
        # Copied into every checkpoint so it names its tokenizer itself, not a path relative to flow.yaml;
        # with the stop ids and generation settings of the model it starts from (the tokenizer's own
        # ids where that names none), so the converted model stops where the released one does.
        self.tok_files = tokenizer_files(tok)
        self.token_ids, side = ({}, {}) if (src := init_from_path(cfg, base)) is None else checkpoint_side(src)
        self.tok_files.update(side)
        if not self.token_ids:
            self.token_ids = {
                "eos_token_id": tok.eos_id,
                **({"bos_token_id": tok.bos_id} if tok.bos_id is not None else {}),
            }
        self.sft = t.mode == "sft"
        self.loader = training_loader(
            data, t, dp_rank=self.mesh["dp"].get_local_rank(), dp_size=cfg.parallel.dp, vocab_size=self.args.vocab_size
        )

    def _find_resume_point(self, resume: bool) -> Path | None:
        latest = newest_complete(self.run.checkpoints, warn=True) if resume else None
        if resume and latest is None and self.rank == 0:
            warnings.warn(
                f"--resume: no complete checkpoint under {self.run.checkpoints}; starting fresh", stacklevel=2
            )
        return latest

    def _weights(self, latest: Path | None, base: Path):
        """The weights to start from: the resumed checkpoint, else init_from, else none (seeded init).
        With LoRA: the frozen init_from base and the adapters, resumed or seeded (AdaptedWeights)."""
        source = latest if latest is not None else init_from_path(self.cfg, base)
        if source is None:
            return None
        if self.lora is not None:
            return self._lora_weights(latest, init_from_path(self.cfg, base))
        weights = open_weights(source)
        if getattr(weights, "lora", None) is not None and latest is not None:
            raise UserError(
                f"--resume: {latest} holds LoRA adapters, but train.lora is not set; set train.lora as it "
                "was (its manifest's extra.lora), or start a new run with init_from: " + str(latest)
            )
        check_compatible(weights.args, self.args, source)
        return weights

    def _lora_weights(self, latest: Path | None, init_from: Path) -> AdaptedWeights:
        if latest is None:
            why = lora_base_problem(init_from)  # validate's rule, asked again of the files as they are now
            if why:
                raise UserError(f"train.lora: init_from {init_from} {why}")
            base = open_weights(init_from)
            check_compatible(base.args, self.args, init_from)
            weights = AdaptedWeights(base, self.lora, seed=self.cfg.train.seed)
        else:
            weights = open_adapted(latest)
            if weights.lora != self.lora:
                raise UserError(
                    f"--resume: {latest} holds adapters of {weights.lora.to_dict()}, but train.lora is "
                    f"{self.lora.to_dict()}; set train.lora as it was, or start a new run"
                )
            held = Path(weights.base.dir).resolve()
            if held != _weights_dir(init_from):
                raise UserError(
                    f"--resume: {latest}'s adapters were trained on the base {held}, but init_from is "
                    f"{init_from}; point init_from back at {held}"
                )
        # the base's files, hashed once at the first save (base_ref); the source itself is not kept, so its
        # mapped pages leave this process once the model is built
        self._base_files = (Path(weights.base.dir), weights.base.files())
        self._base_ref = None
        return weights

    def _setup_model(self, weights) -> None:
        cfg, p = self.cfg, self.cfg.parallel
        from titan_pipe.training.float8 import float8_problem

        why = float8_problem(cfg.precision.float8, self.device.type)
        if why:
            raise UserError(why)
        self.dp_plan = plan_dp(
            dp=p.dp,
            tp=p.tp,
            dp_mode=p.dp_mode,
            zero_stage=cfg.zero_stage,
            offload=cfg.memory.optimizer_offload,
            amp_dtype=cfg.precision.amp_dtype if cfg.precision.amp else None,
            gradient_sync_dtype=cfg.comm.gradient_sync_dtype,
            fusion_buffer_mb=cfg.comm.fusion_buffer_mb,
            comm_overlap=cfg.comm.comm_overlap,
        )
        ac_every = cfg.memory.activation_checkpointing_layers if cfg.memory.activation_checkpointing else None
        backend = resolve_backend(cfg.train.compile_backend, self.device.type) if cfg.train.compile else None
        self.model = build_parallel_model(
            self.args,
            self.mesh,
            device=self.torch_device,
            schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages,
            sequence_parallel=p.sequence_parallel,
            ac_every=ac_every,
            dp_plan=self.dp_plan,
            kernels=resolve_kernels(cfg.model.kernels, self.device.type),
            seed=cfg.train.seed,
            weights=weights,
            compile_backend=backend,
            float8=cfg.precision.float8,
            lora=self.lora,
            base_dtype=TORCH_BY_NAME[cfg.train.lora.held_dtype(cfg.precision)]
            if self.lora is not None
            else torch.float32,
        )
        self.params = self.model.trainable()  # with LoRA the adapters only: the base takes no gradient
        self.counted = counted(
            ((n, p) for _, n, p in self.model.named_parameters() if p.requires_grad), self.model.tied is not None
        )

    def _setup_optimizers(self) -> None:
        t, o = self.cfg.train, self.cfg.train.optimizer
        hparams = dict(name=o.name, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        if self.dp_plan.zero1:
            self.optimizers = [
                build_zero1(_trained(m), self.mesh["dp"].get_group(), **hparams) for m in self.model.modules
            ]
        else:
            self.optimizers = [
                build_optimizer(_trained(m), implementation=o.implementation, device_type=self.device.type, **hparams)
                for m in self.model.modules
            ]
        self.schedulers = [
            build_scheduler(opt, warmup=t.warmup_steps, total=t.steps, min_ratio=t.lr_min_ratio)
            for opt in self.optimizers
        ]
        self.scaler = LossScaler.from_config(self.cfg.precision)

    def _restore(self, latest: Path | None) -> int:
        """Optimizer, scheduler, loader and loss-scaler state of a resumed run; its step (0: fresh)."""
        if latest is None:
            return 0
        state = ckpt.load_train_state(latest, self.model, self.optimizers)
        for s, sd in zip(self.schedulers, state["scheduler"]):
            s.load_state_dict(sd)
        self.loader.load_state_dict(state["loader"])
        self.scaler.load_state_dict(state["scaler"])
        return int(state["step"])

    def _setup_loss(self) -> None:
        p = self.cfg.parallel
        self.chunked_loss = resolve_loss(
            self.cfg.train.loss, tp=p.tp, pp=p.pp, measured=metrics.measured_loss(self.device)
        )
        self.loss_of = loss_fn
        if self.cfg.train.compile:  # the loss compiled with the blocks' backend (not over tp's DTensor logits)
            from titan_pipe.model.loss import CompiledLoss

            compiled = CompiledLoss(resolve_backend(self.cfg.train.compile_backend, self.device.type))
            for module in self.model.modules:
                unwrap(module).loss_chunk = compiled.chunk
            if p.tp == 1:
                self.loss_of = lambda logits, labels, denom=None: compiled.full(logits, labels, denom=denom)
        self.balance_reduce = None
        if self.args.moe and p.dp > 1:  # the load-balancing loss of the whole batch, not of each rank's part
            from titan_pipe.training.moe_balance import batch_balance

            self.balance_reduce = batch_balance(self.mesh["dp"].get_group(), p.dp)
            for module in self.model.modules:  # the stage modules under any dp wrapper
                module.balance_reduce = self.balance_reduce
        if self.args.moe and p.pp > 1:  # each stage passes its routers' statistics on (Transformer.carry_balance)
            for module in self.model.modules:
                unwrap(module).carry_balance = True

    def _pipeline_loss(self, out, labels: torch.Tensor) -> torch.Tensor:
        """The loss of one microbatch on the last stage: cross entropy, plus for a mixture of experts
        the load-balancing loss of every stage's routers from the statistics the stages carried."""
        if not isinstance(out, tuple):
            return self.loss_of(out, labels, self.denom)
        logits, assigned, prob = out
        loss = self.loss_of(logits, labels, self.denom)
        a = self.args
        if not a.router_aux_loss_coef:
            return loss
        from titan_pipe.model.transformer import balance_loss

        rows = logits.shape[0] * logits.shape[1] * len(a.moe_layers)
        return loss + a.router_aux_loss_coef * balance_loss(
            assigned.detach(), prob, rows, features.routing(a).experts, self.balance_reduce
        )

    def _setup_schedule(self) -> None:
        p, plan = self.cfg.parallel, self.model.stage_plan
        self.has_first, self.has_last = 0 in plan.local, plan.n_stages - 1 in plan.local
        self.schedule = None
        self.denom = None  # fine-tuning: this step's loss denominator (loss_denominator)
        if p.pp > 1:
            self.schedule = build_schedule(
                self.model.parts,
                plan,
                schedule=p.pp_schedule,
                pp_mesh=self.mesh["pp"],
                n_microbatches=p.n_microbatches,
                device=self.torch_device,
                loss_fn=lambda out, y: self.scaler.scale_loss(self._pipeline_loss(out, y)),
            )
        self.parallel_meta = ParallelLayout(
            dp=p.dp,
            tp=p.tp,
            pp=p.pp,
            pp_schedule=p.pp_schedule,
            stages=tuple(map(tuple, plan.stages)),
            stage_ranks=tuple(stage_ranks(plan.n_stages, p.pp)),
            sequence_parallel=p.sequence_parallel,
            dp_mode=p.dp_mode,
            dp_kind=self.dp_plan.kind,
            ep=p.ep,
        )

    def _setup_metrics(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        amp_dtype = torch.float16 if cfg.precision.amp_dtype == "float16" else torch.bfloat16
        # Only rank 0 reports MFU; measuring the CPU peak on every rank would only contend for cores.
        self.peak, self.peak_source = (
            metrics.peak_flops(self.device, amp_dtype if cfg.precision.amp else torch.float32)
            if self.rank == 0
            else (None, "")
        )
        # with LoRA the base's weight gradients are not computed: MFU counts the FLOPs the step does
        self.fpt = (
            flops_per_token(self.args, t.seq_len)
            if self.lora is None
            else trained_flops_per_token(self.args, t.seq_len)
        )
        self.tokens_per_step = t.batch_size * t.seq_len

    # -- one step ------------------------------------------------------------------------------

    def _forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward of one global batch slice; this rank's loss (None off the last stage).
        ``positions``: packed documents (fine-tuning), with ``self.denom`` set for the step."""
        amp = self.cfg.precision
        extra = {} if positions is None else {"positions": positions}
        with autocast(self.device.type, enabled=amp.amp, dtype=amp.amp_dtype):
            if self.schedule is not None:
                losses: list = []
                self.schedule.step(
                    *([inputs] if self.has_first else []),
                    target=labels if self.has_last else None,
                    losses=losses if self.has_last else None,
                    **extra,
                )
                return torch.stack(losses).mean().detach() / self.scaler.scale if self.has_last else None
            part = self.model.parts[0]
            if self.chunked_loss:  # fused with the output projection: no full float32 logits (+ the MoE's aux loss)
                loss = part(inputs, labels=labels, loss_denom=self.denom, **extra)
            else:
                loss = self.loss_of(part(inputs, **extra), labels, self.denom)
                aux = unwrap(part).aux_loss()  # a mixture of experts' load-balancing term
                loss = loss if aux is None else loss + aux
        self.scaler.scale_loss(loss).backward()  # outside autocast, as torch.amp recommends
        return loss.detach()

    def _optimizer_step(self, step: int, loss: float) -> tuple[bool, float | None, float]:
        """Unscale, clip and step (skipped on an fp16 overflow); (found_inf, grad norm, lr). A NaN or
        infinite gradient norm outside fp16's loss scaling stops training before the update writes
        it into the weights (the norm is global: every rank stops at the same step)."""
        if (
            self.model.tied is not None and self.lora is None
        ):  # tied embeddings under tp/pp: both ends get the summed gradient
            self.model.tied.sync((n, p) for _, n, p in self.model.named_parameters())
        found_inf = self.scaler.unscale_(self.params)
        grad_norm = None  # skipped step (fp16 overflow): no norm worth logging
        if not found_inf:
            grad_norm = float(
                clip_grad_norm_(self.params, self.cfg.train.grad_clip, self.mesh["pp"], counted=self.counted)
            )
            if not math.isfinite(grad_norm) or not math.isfinite(loss):
                raise UserError(self._diverged(step, loss, grad_norm))
            for opt in self.optimizers:
                opt.step()
        self.scaler.update(found_inf)
        lr = self.schedulers[0].get_last_lr()[0]
        for s, opt in zip(self.schedulers, self.optimizers):
            opt.zero_grad(set_to_none=True)
            s.step()
        return found_inf, grad_norm, lr

    def train_step(self, step: int) -> dict:
        """One optimizer step; returns its metrics record (loss over all dp ranks, memory of every rank)."""
        p = self.cfg.parallel
        t0, compiled0 = time.perf_counter(), compile_seconds()
        if self.sft:
            batch = self.loader.next_batch()
            self.denom = loss_denominator(batch.targets, dp=p.dp, microbatches=p.n_microbatches if p.pp > 1 else 1)
            inputs, labels, positions = (x.to(self.torch_device) for x in (batch.inputs, batch.labels, batch.positions))
        else:
            inputs, labels = (x.to(self.torch_device) for x in self.loader.next_batch())
            positions = None
        local_loss = self._forward_backward(inputs, labels, positions)
        # Every holder of the last stage has the loss of its dp slice (tp ranks the same value).
        stats = torch.tensor(
            [0.0 if local_loss is None else float(local_loss), float(peak_memory_bytes(self.device))],
            dtype=torch.float64,
        )
        loss_sum = stats[:1].clone()
        dist.all_reduce(loss_sum)
        loss = float(loss_sum) / (p.dp * p.tp)
        found_inf, grad_norm, lr = self._optimizer_step(step, loss)
        per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(per_rank, stats[1:].clone())  # peak memory of every rank, in rank order
        mem = max(float(m) for m in per_rank)
        dt = time.perf_counter() - t0
        tps = self.tokens_per_step / dt
        extra = {"target_tokens": batch.targets} if self.sft else {}  # what the loss averaged over
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            **extra,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": metrics.mfu(tps, self.fpt, self.peak * self.world if self.peak else None),
            "peak_mem_mb": mem / 2**20,
            "peak_mem_mb_per_rank": [round(float(m) / 2**20, 1) for m in per_rank],
            "loss_scale": self.scaler.scale,
            "skipped": bool(found_inf),
            "compile_s": compile_seconds() - compiled0,
        }  # inside step_time_s (the first steps compile)

    def _diverged(self, step: int, loss: float, grad_norm: float) -> str:
        t = self.cfg.train
        last = newest_complete(self.run.checkpoints)
        kept = f"the last checkpoint, {last.name}, was written before it" if last else "no checkpoint was written"
        return (
            f"step {step}: the loss is {loss:.6g} and the gradient norm {grad_norm:.6g}; training diverged, so it "
            f"stopped before this update reached the weights ({kept}). Lower train.optimizer.lr (now "
            f"{t.optimizer.lr:g}) or raise train.warmup_steps (now {t.warmup_steps}), or look for bad records in the "
            "data (train.log has every step's loss)"
        )

    # -- checkpoint ----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return is_save_step(step, steps=self.cfg.train.steps, every=self.cfg.checkpoint.every)  # the same on all ranks

    def checkpoint_bytes(self) -> int:
        """About what one checkpoint takes (for a full disk's "free N" advice); with LoRA, the adapters."""
        n = count_params(self.args) if self.lora is None else adapter_count(self.args, self.lora)
        return checkpoint_bytes(
            n, optimizer=self.cfg.train.optimizer.name, save_optimizer=self.cfg.checkpoint.save_optimizer
        )

    def _lora_record(self) -> dict:
        """The manifest's extra.lora: the spec and the base it references (hashed once, by rank 0)."""
        if self.lora is None or self.rank != 0:
            return {}
        if self._base_ref is None:
            self._base_ref = base_ref(*self._base_files)
        return {"lora": {**self.lora.to_dict(), "base": self._base_ref.to_dict()}}

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (collective), then prune old ones on rank 0."""
        cfg = self.cfg
        state = {
            "step": step,
            "scheduler": [s.state_dict() for s in self.schedulers],
            "loader": self.loader.state_dict(),
            "scaler": self.scaler.state_dict(),
        }
        with writing(self.run.checkpoint(step), what=f"the checkpoint of step {step}", needs=self.checkpoint_bytes()):
            ckpt.save_checkpoint(
                self.run.checkpoint(step),
                model=self.model,
                optimizers=self.optimizers if cfg.checkpoint.save_optimizer else None,
                train_state=state,
                parallel=self.parallel_meta,
                extra=CheckpointExtra(
                    kernels=cfg.model.kernels,
                    tokenizer="tokenizer.json" if "tokenizer.json" in self.tok_files else "byte",
                    token_ids=self.token_ids,
                    other=self._lora_record(),
                ),
                attach=self.tok_files,
                frozen_out=self.lora is not None,
            )
        if self.rank == 0:
            ckpt.prune(self.run.checkpoints, cfg.checkpoint.keep_last)

    # -- the loop ------------------------------------------------------------------------------

    def train(self) -> dict:
        """Steps start+1..train.steps with metrics and checkpoints; the summary (rank 0's)."""
        t, rank = self.cfg.train, self.rank
        history: list[dict] = []
        with (
            metrics.MetricsLogger(self.run.metrics, enabled=rank == 0) as logger,
            TensorBoardWriter(self.run.root, enabled=rank == 0 and self.cfg.metrics.tensorboard) as board,
            metrics.TrainProgress(
                t.steps, enabled=rank == 0, log_every=t.log_every, initial_step=self.start
            ) as progress,
        ):
            for step in range(self.start + 1, t.steps + 1):
                record = self.train_step(step)
                history.append(record)
                if step % t.log_every == 0 or step == t.steps:
                    logger.log(record)
                    board.log(record)
                progress.update(step, record)
                if self.should_save(step):
                    self.save(step)
        summary = self._summary(history)
        if rank == 0:
            write_text(self.run.root / "summary.json", json.dumps(summary, indent=1))
        dist.barrier()
        return summary

    def _summary(self, history: list[dict]) -> dict:
        # Throughput of the steady state: not the first step, nor any step that compiled.
        timed = [r for r in history[1:] if not r["compile_s"]] or history[1:] or history
        return {
            "final_loss": history[-1]["loss"] if history else None,
            "compile_s": sum(r["compile_s"] for r in history),
            "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
            "mfu": history[-1]["mfu"] if history else None,
            "steps": self.cfg.train.steps,
            "start_step": self.start,
            "peak_flops_source": self.peak_source,
            "checkpoint": str(newest_complete(self.run.checkpoints, warn=True)) if self.rank == 0 else None,
        }


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of a stage module its optimizer steps (LoRA: the adapters only)."""
    return [p for p in module.parameters() if p.requires_grad]


def _weights_dir(path: Path) -> Path:
    """The directory a weight source opened at ``path`` reads (a run dir means its newest step)."""
    return (complete_step(path) or Path(path)).resolve()


def train(cfg: FlowConfig, *, base: Path, resume: bool = False) -> dict:
    """Run the training of ``cfg`` on the current torchrun world; returns the summary (rank 0's)."""
    return Trainer(cfg, base=base, resume=resume).train()


def _failed(kind: str, message: str) -> int:
    """A named error: one line for a person on stderr, and the record the launcher reads."""
    print(f"{kind}: {message}", file=sys.stderr, flush=True)
    try:
        write_failure(kind, message)
    except OSError as e:  # a full disk may refuse the record too: the line above still says it
        print(f"fault: the failure record could not be written ({e})", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_pipe.training.rank")
    ap.add_argument("--flow", required=True, type=Path, help="flow.yaml")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    a = ap.parse_args(argv)
    from titan_pipe.processes.procs import rank_dies_with_launcher

    rank_dies_with_launcher()
    silence_known_warnings()
    try:
        cfg = load_flow(a.flow)
        with writing(cfg.run_dir(), what=STAGE_OUTPUTS["train"]):
            train(cfg, base=a.flow.resolve().parent, resume=a.resume)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except OutputFault as e:  # the launcher reports the record as the run's error (training/failure.py)
        return _failed("fault", str(e))
    except UserError as e:
        return _failed("error", str(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
