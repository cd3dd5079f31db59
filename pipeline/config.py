"""FlowConfig: one flow.yaml describes a whole run. pydantic v2, unknown keys are errors.

``load_flow(path)`` turns every problem into one line naming the key, the value and the fix
(``ConfigError.lines``); the CLI prints them and exits 2.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from titan_pipe.dtypes import EXPORT_NAMES, FLOAT_NAMES
from titan_pipe.model.args import FLAVOURS, ModelArgs, RopeScaling, resolve_args
from titan_pipe.run_dir import run_name_problem, suggest_run_name

MAX_FLOW_BYTES = 2**20  # 1 MiB
# train.compile_backend: auto = inductor on cuda/cpu, TorchAir's backend on npu (titan_pipe.training.compile)
COMPILE_BACKENDS = ("auto", "inductor", "aot_eager", "eager")


class ConfigError(ValueError):
    def __init__(self, source: str, lines: list[str]):
        self.source = source
        self.lines = lines
        super().__init__("\n".join(f"{source}: {line}" for line in lines))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _mirror(cls, *, optional: bool, nested: dict[str, type] | None = None) -> dict[str, Any]:
    """pydantic field definitions for the fields of dataclass ``cls`` (model_args), so the config
    cannot drift from ModelArgs. ``optional``: every field defaults to None (not given: the flavour's
    value) and numbers must be > 0; else each keeps the dataclass default."""
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        if nested and f.name in nested:
            out[f.name] = (nested[f.name] | None, None)
            continue
        t = hints[f.name]
        if not optional:
            out[f.name] = (t, f.default)
            continue
        base = next(a for a in get_args(t) if a is not type(None)) if type(None) in get_args(t) else t
        out[f.name] = (base | None, None if base is bool else Field(None, gt=0))
    return out


RopeScalingConfig = create_model("RopeScalingConfig", __base__=Section, **_mirror(RopeScaling, optional=False))


class _ModelChoice(Section):
    """A flavour and any dims laid over it (every field of ModelArgs, each optional)."""

    flavour: str | None = "debug"
    kernels: Literal["auto", "reference", "npu_fused"] = "auto"

    @model_validator(mode="after")
    def _check(self):
        if self.flavour is not None and self.flavour not in FLAVOURS:
            raise ValueError(f"flavour {self.flavour!r} is unknown; use one of {', '.join(FLAVOURS)} "
                             "or give the dims (dim, n_layers, n_heads, ...)")
        args = self.args()
        if args.dim % args.n_heads:
            raise ValueError(f"dim={args.dim} is not divisible by n_heads={args.n_heads}")
        if args.n_heads % args.kv_heads:
            raise ValueError(f"n_heads={args.n_heads} is not divisible by n_kv_heads={args.kv_heads}")
        if args.head_dim % 2:
            raise ValueError(f"head_dim={args.head_dim} must be even for RoPE")
        return self

    def args(self) -> ModelArgs:
        dims = self.model_dump(exclude={"flavour", "kernels"}, exclude_none=True)
        return resolve_args(self.flavour, **dims)


ModelConfig = create_model("ModelConfig", __base__=_ModelChoice,
                           **_mirror(ModelArgs, optional=True, nested={"rope_scaling": RopeScalingConfig}))


class DataConfig(Section):
    path: str | None = None  # text/jsonl file or directory; None: the shipped corpus
    tokenizer: str = "byte"  # "byte" or a path to a Hugging Face tokenizer.json
    text_key: str = "text"  # field of a jsonl record holding the text
    val_fraction: float = Field(0.05, ge=0, lt=1)


class OptimizerConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)


class TrainConfig(Section):
    steps: int = Field(20, gt=0)
    batch_size: int = Field(8, gt=0)  # global batch, in sequences, across all dp ranks
    seq_len: int = Field(64, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig()
    warmup_steps: int = Field(2, ge=0)
    lr_min_ratio: float = Field(0.1, ge=0, le=1)  # cosine decays to lr * lr_min_ratio
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = 0
    log_every: int = Field(1, gt=0)
    compile: bool = False  # torch.compile each transformer block (after TP and AC, before FSDP)
    compile_backend: Literal[COMPILE_BACKENDS] = "auto"


class ParallelConfig(Section):
    dp: int = Field(1, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = Field(2, gt=0)  # stages per pp rank for interleaved_1f1b
    microbatches: int | None = Field(None, gt=0)  # default: pp (or 1 without pp)
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or (self.pp if self.pp > 1 else 1)

    @property
    def n_stages(self) -> int:
        return self.pp * (self.virtual_stages if self.pp_schedule == "interleaved_1f1b" else 1)


class PrecisionConfig(Section):
    amp: bool = False
    amp_dtype: Literal["float16", "bfloat16"] = "bfloat16"
    loss_scale: float | Literal["dynamic"] | None = None  # initial scale; None: no scaling
    loss_scale_window: int = Field(2000, gt=0)  # overflow-free steps before the scale doubles
    min_loss_scale: float = Field(1.0, gt=0)


class MemoryConfig(Section):
    activation_checkpointing: bool = False
    activation_checkpointing_layers: int = Field(1, gt=0)  # checkpoint every N-th layer
    optimizer_offload: Literal["none", "cpu"] = "none"


class CommConfig(Section):
    comm_overlap: bool = True
    fusion_buffer_mb: int = Field(25, gt=0)
    stream_num: int = Field(1, gt=0)
    gradient_sync_dtype: Literal[FLOAT_NAMES] = "float32"


class LaunchConfig(Section):
    nproc_per_node: int | None = Field(None, gt=0)  # default: dp*tp*pp / nnodes
    nnodes: int = Field(1, gt=0)
    node_rank: int = Field(0, ge=0)
    rdzv_endpoint: str | None = None  # host:port; required when nnodes > 1
    max_restarts: int = Field(0, ge=0)


class CheckpointConfig(Section):
    every: int = Field(10, gt=0)
    keep_last: int = Field(2, gt=0)
    save_optimizer: bool = True


class ConvertConfig(Section):
    naming: Literal["hf", "native"] = "hf"
    dtype: Literal[("keep",) + FLOAT_NAMES] = "keep"
    max_shard_size: str = "5GB"


class ExportConfig(Section):
    opset: int = Field(14, ge=11, le=15)  # ATC takes ONNX opsets 11-15 (the graphs need >= 14)
    dtype: Literal[EXPORT_NAMES] = "float32"
    batch: int = Field(1, gt=0)
    seq_len: int = Field(32, gt=0)
    cache_len: int | None = Field(None, gt=1)  # decode KV-cache slots; None: min(max_position_embeddings, 4096)
    hash_weights: bool = True  # sha256 of model.onnx.data in export.json
    dynamic: bool = True
    kv_cache: bool = True
    soc_version: str = "Ascend910B3"
    atc: bool = True  # run atc when it is on PATH
    precision_mode: Literal["origin", "mixed_float16", "fp16"] = "origin"


class EvaluateConfig(Section):
    data: str | None = None  # held-out text; None: the validation split of the training data
    batches: int = Field(2, gt=0)
    batch_size: int = Field(2, gt=0)
    seq_len: int = Field(32, gt=0)
    operators: bool = True
    thresholds: dict[str, dict[str, float]] = Field(default_factory=dict)  # per dtype overrides
    dtype: Literal[("auto",) + FLOAT_NAMES] = "auto"  # threshold set; auto: the candidate's
    prompts: int = Field(2, ge=0)  # greedy generations compared token for token (0: none)
    prompt_len: int = Field(16, gt=0)
    new_tokens: int = Field(16, gt=0)
    device: Literal["auto", "cpu", "cuda", "npu"] = "cpu"  # where the PyTorch reference runs
    dump: bool = False  # REPORT_DIR/dump/<comparison>/{golden,candidate}/<tensor>.npy for msit/msprobe

    @model_validator(mode="after")
    def _check_thresholds(self):
        from titan_pipe.errors import UserError
        from titan_pipe.thresholds import validate_overrides

        try:
            validate_overrides(self.thresholds)
        except UserError as e:  # a known dtype and key each, so a typo cannot keep the default
            raise ValueError(str(e)) from None
        return self


class OrchestrationConfig(Section):
    """How `titan-pipe run` drives the stages under Prefect (docs/flows.md)."""
    # Prefect retries of the training task, each resuming from the newest complete checkpoint.
    # None: 2 when launch.max_restarts is 0, else 0 (torchrun then owns rank failures: one owner).
    retries: int | None = Field(None, ge=0)
    retry_delay_s: float = Field(10.0, ge=0)
    cache: bool = True  # skip a stage whose config section and input files are unchanged

    def train_retries(self, max_restarts: int) -> int:
        if self.retries is not None:
            return self.retries
        return 0 if max_restarts > 0 else 2


class FlowConfig(Section):
    name: str = "run"  # the run dir is runs_dir/<name>: one safe path component (run_dir.run_name_problem)
    runs_dir: str = "runs"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    memory: MemoryConfig = MemoryConfig()
    zero_stage: Literal[0, 1, 2, 3] | None = None  # None: dp_mode decides
    comm: CommConfig = CommConfig()
    launch: LaunchConfig = LaunchConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    init_from: str | None = None  # our checkpoint dir, a unified safetensors model or an HF dir
    convert: ConvertConfig = ConvertConfig()
    export: ExportConfig = ExportConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        why = run_name_problem(name)
        if why:
            raise ValueError(f"run name {why}; use a name like {suggest_run_name(name)!r}")
        return name

    def run_dir(self, base: Path | None = None) -> Path:
        root = Path(self.runs_dir)
        if not root.is_absolute() and base is not None:
            root = base / root
        return root / self.name


def _cross_checks(cfg: FlowConfig, base: Path) -> list[str]:
    """Rules that span sections; each message names the key, the value and the fix."""
    errs: list[str] = []
    args = cfg.model.args()
    p = cfg.parallel
    if args.n_heads % p.tp:
        errs.append(f"parallel.tp: {p.tp} does not divide model n_heads={args.n_heads}; "
                    f"pick tp from the divisors of {args.n_heads}")
    if args.kv_heads % p.tp:
        errs.append(f"parallel.tp: {p.tp} does not divide model n_kv_heads={args.kv_heads}; "
                    f"pick tp dividing {args.kv_heads}")
    if args.hidden_dim % p.tp:
        errs.append(f"parallel.tp: {p.tp} does not divide the FFN hidden size {args.hidden_dim}")
    if args.vocab_size % p.tp:
        errs.append(f"parallel.tp: {p.tp} does not divide vocab_size={args.vocab_size}; pad the "
                    "vocabulary to a multiple of tp")
    if args.n_layers < p.n_stages:
        errs.append(f"parallel.pp: {p.pp} x {p.n_stages // p.pp} stage(s) per rank needs at least "
                    f"{p.n_stages} layers, the model has n_layers={args.n_layers}; lower pp")
    if p.pp > 1 and p.pp_schedule in ("1f1b", "interleaved_1f1b") and p.n_microbatches < p.pp:
        errs.append(f"parallel.microbatches: {p.n_microbatches} < pp={p.pp}, which "
                    f"{p.pp_schedule} cannot schedule; use microbatches >= {p.pp}")
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and p.n_microbatches % p.pp:
        errs.append(f"parallel.microbatches: {p.n_microbatches} must be a multiple of pp={p.pp} "
                    "for interleaved_1f1b")
    if args.tie_embeddings and p.pp > 1:
        errs.append(f"model.tie_embeddings: the embedding and the output projection sit on different pipeline "
                    f"stages with parallel.pp={p.pp}, so they cannot share a weight; use pp: 1 or untie them")
    if cfg.train.batch_size % p.dp:
        errs.append(f"train.batch_size: {cfg.train.batch_size} is not divisible by dp={p.dp}")
    elif (cfg.train.batch_size // p.dp) % p.n_microbatches:
        errs.append(f"train.batch_size: {cfg.train.batch_size // p.dp} sequences per dp rank do not "
                    f"split into microbatches={p.n_microbatches}")
    if cfg.train.seq_len > args.max_seq_len:
        errs.append(f"train.seq_len: {cfg.train.seq_len} exceeds model max_seq_len={args.max_seq_len}")
    if p.sequence_parallel and p.tp > 1 and cfg.train.seq_len % p.tp:
        errs.append(f"train.seq_len: {cfg.train.seq_len} is not divisible by tp={p.tp} "
                    "(sequence_parallel splits the sequence)")
    if cfg.train.compile_backend != "auto" and not cfg.train.compile:
        errs.append(f"train.compile_backend: {cfg.train.compile_backend!r} has no effect while train.compile is "
                    "false; set train.compile: true or remove train.compile_backend")
    pr = cfg.precision
    if pr.amp and pr.amp_dtype == "float16" and pr.loss_scale is None:
        errs.append("precision.loss_scale: float16 AMP needs loss scaling; set loss_scale: dynamic "
                    "(or a number like 32768), or use amp_dtype: bfloat16")
    if cfg.device == "cpu" and cfg.model.kernels == "npu_fused":
        errs.append("model.kernels: npu_fused needs device npu; use kernels: reference or auto")
    world = p.world_size
    launch = cfg.launch
    nproc = launch.nproc_per_node or (world // launch.nnodes if world % launch.nnodes == 0 else None)
    if nproc is None or nproc * launch.nnodes != world:
        errs.append(f"launch: nproc_per_node={launch.nproc_per_node or nproc} x nnodes={launch.nnodes} "
                    f"!= dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {world}; make the world size match")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        errs.append("launch.rdzv_endpoint: required when nnodes > 1 (host:port of node 0)")
    if launch.node_rank >= launch.nnodes:
        errs.append(f"launch.node_rank: {launch.node_rank} must be < nnodes={launch.nnodes}")
    if (cfg.orchestration.retries or 0) > 0 and launch.max_restarts > 0:
        errs.append(f"orchestration.retries: {cfg.orchestration.retries} with launch.max_restarts="
                    f"{launch.max_restarts} would retry one failure twice over (torchrun restarts the "
                    "ranks, then Prefect relaunches torchrun); set one of them to 0")
    if cfg.zero_stage is not None and cfg.zero_stage >= 1 and p.dp_mode == "ddp" and p.tp > 1:
        errs.append("zero_stage: ZeRO with dp_mode ddp and tp > 1 is not supported; use dp_mode: fsdp")
    if cfg.memory.optimizer_offload == "cpu" and not (p.dp_mode == "fsdp" or (cfg.zero_stage or 0) >= 2):
        errs.append("memory.optimizer_offload: cpu offload runs through FSDP2; set parallel.dp_mode: fsdp")
    if cfg.data.path is not None:
        dp_ = Path(cfg.data.path)
        dp_ = dp_ if dp_.is_absolute() else base / dp_
        if not dp_.exists():
            errs.append(f"data.path: {cfg.data.path!r} does not exist (resolved to {dp_}); fix the path "
                        "or remove it to use the shipped corpus")
    if cfg.data.tokenizer != "byte":
        tp_ = Path(cfg.data.tokenizer)
        tp_ = tp_ if tp_.is_absolute() else base / tp_
        if not tp_.is_file():
            errs.append(f"data.tokenizer: {cfg.data.tokenizer!r} is not a file; give a tokenizer.json "
                        "or 'byte'")
    elif args.vocab_size < 258:
        errs.append(f"model.vocab_size: {args.vocab_size} is smaller than the byte tokenizer's 258")
    if cfg.init_from is not None:
        ip = Path(cfg.init_from)
        ip = ip if ip.is_absolute() else base / ip
        if not ip.exists():
            errs.append(f"init_from: {cfg.init_from!r} does not exist (resolved to {ip})")
    return errs


def _format_pydantic(e: ValidationError) -> list[str]:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key; remove it or check its spelling")
            continue
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}{shown}")
    return lines


def parse_flow(data: dict[str, Any], *, source: str = "flow.yaml", base: Path | None = None) -> FlowConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must hold a mapping of sections (name, model, train, ...)"])
    try:
        cfg = FlowConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, _format_pydantic(e)) from None
    errs = _cross_checks(cfg, base or Path.cwd())
    if errs:
        raise ConfigError(source, errs)
    return cfg


def load_flow(path: str | Path) -> FlowConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["file not found; create one with `titan-pipe init DIR`"])
    size = path.stat().st_size
    if size > MAX_FLOW_BYTES:  # PyYAML parses ~1 MB/s; a flow file is a few KB
        raise ConfigError(str(path), [f"is {size / 1e6:.1f} MB, larger than a flow file can be "
                                      f"({MAX_FLOW_BYTES // 2**20} MB); pass the flow.yaml, not a data file"])
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                                      "save the file as UTF-8"]) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(str(path), [f"not valid YAML: {str(e).splitlines()[0]}"]) from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(str(path), ["nested too deeply to be a flow file; a flow.yaml is sections of "
                                      "keys (name, model, train, ...)"]) from None
    return parse_flow(data, source=str(path), base=path.parent.resolve())
