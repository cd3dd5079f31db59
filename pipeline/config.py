"""FlowConfig: one flow.yaml describes a whole run. pydantic v2, strict types, unknown keys are errors.

``load_flow(path)`` turns every problem into one line naming the key, the value and the fix
(``ConfigError.lines``); the CLI prints them and exits 2. Values are typed strictly ("false" is no
boolean, 4.0 no integer) and bounded (titan_pipe.rules.limits); choice sets and the export rules come
from titan_pipe.rules.choices, the model's rules from titan_pipe.model.args, so validation refuses what a
stage would. The YAML itself is refused when a key appears twice or its aliases expand past
limits.YAML_NODES; no message prints more of a value than limits.shown does.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from titan_pipe.rules import limits
from titan_pipe.rules.choices import (
    COMPILE_BACKENDS,
    DEVICES,
    DIGESTS,
    DP_MODES,
    KERNELS,
    LOSSES,
    OFFLOADS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISION_MODES,
    default_cache_len,
    export_problems,
)
from titan_pipe.rules.choices import NAMINGS, RECORD_FORMATS, SOURCE_FORMATS, TRAIN_MODES
from titan_pipe.rules.dtypes import EXPORT_NAMES, FLOAT_NAMES
from titan_pipe.errors import UserError
from titan_pipe.flow_yaml import FlowYamlError, load_flow_text
from titan_pipe.records.checkpoint_format import Manifest, complete_step
from titan_pipe.weights.detect import detect_format, other_format
from titan_pipe.model import features
from titan_pipe.model.lora import CONVERT_MODES as LORA_CONVERT, INITS as LORA_INITS, TARGETS as LORA_TARGETS, LoRASpec
from titan_pipe.model.lora import model_problems as lora_model_problems
from titan_pipe.model.args import (
    FIELD_BOUNDS,
    FLAVOURS,
    SCALING_BOUNDS,
    ModelArgs,
    RopeScaling,
    args_problems,
    resolve_args,
)
from titan_pipe.model.sharding import stages_per_rank, tp_problems
from titan_pipe.model.stated import checkpoint_args, stated_conflicts, with_training_fields
from titan_pipe.rules.mesh_math import n_microbatches, world_size
from titan_pipe.run_dir import run_name_problem, suggest_run_name

MAX_FLOW_BYTES = 2**20  # 1 MiB


class ConfigError(UserError, ValueError):
    """An invalid flow.yaml: one line per problem (the CLI exits 2); a UserError, so a flow never retries it."""

    exit_code = 2

    def __init__(self, source: str, lines: list[str]):
        self.source = source
        self.lines = lines
        super().__init__("\n".join(f"{source}: {line}" for line in lines))


class Section(BaseModel):
    # allow_inf_nan: a weight, rate or size of .inf or .nan is refused here, not deep inside a rank
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


def _mirror(
    cls, *, optional: bool, bounds: dict[str, limits.Bound], nested: dict[str, type] | None = None
) -> dict[str, Any]:
    """pydantic field definitions for the fields of dataclass ``cls`` (model_args), so the config
    cannot drift from ModelArgs. ``optional``: every field defaults to None (not given: the flavour's
    value); else each keeps the dataclass default. Numbers are bounded by ``bounds``
    (titan_pipe.model.args: the bounds every reader of a model applies)."""
    hints = get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in fields(cls):
        if nested and f.name in nested:
            out[f.name] = (nested[f.name] | None, None)
            continue
        t = hints[f.name]
        base = next(a for a in get_args(t) if a is not type(None)) if type(None) in get_args(t) else t
        # a YAML list of ints (a mixture of experts' dense layers); strict pydantic takes no list as a tuple
        if get_origin(base) is tuple:
            base = t = list[int]
        b = bounds.get(f.name)
        limit = {} if b is None else {"ge": b.lo, "le": b.hi}
        if not optional:
            out[f.name] = (t, Field(f.default, **limit))
            continue
        out[f.name] = (base | None, None if base is bool else Field(None, **limit))
    return out


RopeScalingConfig = create_model(
    "RopeScalingConfig", __base__=Section, **_mirror(RopeScaling, optional=False, bounds=SCALING_BOUNDS)
)


# ModelArgs fields where null is a value (no scaling, no window, derived from the dims): an explicit
# ``null`` in flow.yaml is kept and laid over the flavour, never dropped.
NULLABLE = tuple(f.name for f in fields(ModelArgs) if type(None) in get_args(get_type_hints(ModelArgs)[f.name]))


class _ModelChoice(Section):
    """A flavour and any dims laid over it (every field of ModelArgs, each optional). With init_from
    the checkpoint's model is the model (``held``, set by parse_flow after comparing it with what
    this section states: titan_pipe.model.stated)."""

    flavour: str | None = "debug"
    kernels: Literal[KERNELS] = "auto"
    _held: ModelArgs | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self):
        if self.flavour is not None and self.flavour not in FLAVOURS:
            raise ValueError(
                f"flavour {limits.shown(self.flavour)} is unknown; use one of {', '.join(FLAVOURS)} "
                "or give the dims (dim, n_layers, n_heads, ...)"
            )
        nulls = [k for k in self.given() if getattr(self, k) is None and k not in NULLABLE and k != "flavour"]
        if nulls:
            raise ValueError(
                f"{nulls[0]}: null is no value of {nulls[0]}; give a number or remove the key "
                f"(null is a value only of {', '.join(NULLABLE)})"
            )
        return self  # the dims' rules: _cross_checks, one line each (titan_pipe.model.args.args_problems)

    def given(self) -> set[str]:
        """The model keys flow.yaml writes (an explicit null included), ``flavour`` among them."""
        return set(self.model_fields_set) - {"kernels"}

    def stated(self) -> ModelArgs:
        """What this section states on its own: the flavour with the keys written laid over it."""
        dims = {k: getattr(self, k) for k in self.given() - {"flavour"}}
        if isinstance(dims.get("rope_scaling"), BaseModel):
            dims["rope_scaling"] = dims["rope_scaling"].model_dump()
        dims = {k: tuple(v) if isinstance(v, list) else v for k, v in dims.items()}  # a YAML list: a tuple field
        return resolve_args(self.flavour, **dims)

    def args(self) -> ModelArgs:
        """The model: the checkpoint's where init_from gives one, else the flavour and the keys."""
        return self._held if self._held is not None else self.stated()


ModelConfig = create_model(
    "ModelConfig",
    __base__=_ModelChoice,
    **_mirror(ModelArgs, optional=True, bounds=FIELD_BOUNDS, nested={"rope_scaling": RopeScalingConfig}),
)


class BlendEntry(Section):
    path: str  # a prepared data dir or a Megatron .bin/.idx prefix
    weight: float = Field(gt=0)


class DataConfig(Section):
    # raw text (.txt/.jsonl/.jsonl.gz/.parquet file or dir; prepared into the run dir first), a prepared
    # dir or a Megatron .bin/.idx prefix; None: the shipped corpus (docs/data.md)
    path: str | None = None
    blend: list[BlendEntry] | None = None  # prepared dirs / prefixes mixed by weight, instead of path
    # `titan-pipe data prepare`'s options are made from the fields below (titan_pipe.commands.options)
    tokenizer: str = Field("byte", description="byte, or a Hugging Face tokenizer.json")
    text_key: str = Field("text", description="the text field of .jsonl / column of .parquet")
    val_fraction: float = Field(
        0.05, ge=0, lt=1, description="held out as whole documents from the end, for validation"
    )  # (a prepared dir: its own)
    # raw .jsonl of chat ("messages") or instruction (prompt/response) records: rendered with the chat
    # template and masked to the answers when prepared (titan_pipe.tokens.chat); trained with train.mode sft
    format: Literal[RECORD_FORMATS] = Field(
        "text",
        description="text; chat (jsonl 'messages') or instruction (jsonl prompt/response): rendered with the chat "
        "template, loss on answers",
    )
    chat_template: str = Field(
        "model", description="chat/instruction: model (the tokenizer's own), chatml, llama3, or a .jinja file"
    )
    # chat/instruction records prepared from data.path: a conversation over max_tokens is left out as a
    # bad record (None: kept; sft then refuses those over train.seq_len), and prepare fails when bad
    # records pass max_bad_fraction of them
    max_tokens: int | None = Field(
        None,
        ge=2,
        le=limits.SEQ_LEN.hi,
        description="chat/instruction: a conversation longer than this (train.seq_len: a packed window holds a "
        "whole conversation) is left out as bad",
    )
    max_bad_fraction: float = Field(
        limits.MAX_BAD_FRACTION,
        ge=0,
        lt=1,
        description="chat/instruction: records that may be left out (counted, the first named in data.json) "
        "before prepare fails",
    )

    @model_validator(mode="after")
    def _one_source(self):
        if self.blend is not None and self.path is not None:
            raise ValueError("path and blend both given; use path for one dataset or blend for a mix")
        if self.blend is not None and not self.blend:
            raise ValueError("blend is empty; list {path, weight} entries or remove it")
        return self


SFT_LR = 2e-5  # train.mode sft's default learning rate


def bounded(default, bound: limits.Bound, **kw):
    """A pydantic Field inside ``bound`` (titan_pipe.rules.limits); the bound is kept on the field, so a
    command's flag made from it says why a value is outside (titan_pipe.commands.options)."""
    return Field(default, ge=bound.lo, le=bound.hi, json_schema_extra={"limit": [bound.lo, bound.hi, bound.why]}, **kw)


class OptimizerConfig(Section):
    name: Literal[OPTIMIZERS] = "adamw"
    lr: float = Field(3e-4, gt=0, le=1e3)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0, le=1)
    weight_decay: float = Field(0.1, ge=0, le=1e3)
    implementation: Literal[OPTIMIZER_IMPLS] = "auto"  # AdamW's: fused on CUDA, foreach elsewhere

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_a_list(cls, v):
        return tuple(v) if isinstance(v, list) else v  # YAML has lists, no tuples; items stay strict


class LoRAConfig(Section):
    """train.lora: low-rank adapters on a frozen base (titan_pipe.model.lora; docs/finetune.md)."""

    rank: int = bounded(16, limits.LORA_RANK)
    alpha: float = Field(32.0, gt=0, le=1e6)  # the adapters' output is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: tuple[Literal[tuple(LORA_TARGETS)], ...] = ("q", "k", "v", "o", "gate", "up", "down")
    init: Literal[LORA_INITS] = "kaiming"
    # the frozen base's dtype: auto = precision.amp_dtype under AMP (half the memory of float32; a released
    # bf16 model is held exactly), else float32
    base_dtype: Literal[("auto", "float32", "bfloat16", "float16")] = "auto"

    @field_validator("targets", mode="before")
    @classmethod
    def _targets_from_a_list(cls, v):
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple) and (not v or len(set(v)) != len(v)):
            raise ValueError(f"{list(v)} must name each target once, at least one of {', '.join(LORA_TARGETS)}")
        return v

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_as_float(cls, v):
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    def spec(self) -> LoRASpec:
        return LoRASpec(rank=self.rank, alpha=self.alpha, targets=self.targets, dropout=self.dropout, init=self.init)

    def held_dtype(self, precision: "PrecisionConfig") -> str:
        """The dtype the frozen base is held in (base_dtype, auto resolved against precision)."""
        if self.base_dtype != "auto":
            return self.base_dtype
        return precision.amp_dtype if precision.amp else "float32"


class TrainConfig(Section):
    steps: int = bounded(20, limits.STEPS)
    batch_size: int = bounded(8, limits.BATCH)  # global batch, in sequences, across all dp ranks
    seq_len: int = bounded(64, limits.SEQ_LEN)
    optimizer: OptimizerConfig = OptimizerConfig()
    warmup_steps: int = Field(2, ge=0, le=limits.STEPS.hi)
    lr_min_ratio: float = Field(0.1, ge=0, le=1)  # cosine decays to lr * lr_min_ratio
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    log_every: int = bounded(1, limits.STEPS)
    compile: bool = False  # torch.compile each transformer block (after TP and AC, before FSDP)
    compile_backend: Literal[COMPILE_BACKENDS] = "auto"
    loss: Literal[LOSSES] = "auto"  # chunked: cross entropy fused with the output projection, no full logits
    # sft: supervised fine-tuning on chat / instruction data: whole conversations packed per window,
    # attention and positions per conversation, the loss on the answers only (docs/finetune.md)
    mode: Literal[TRAIN_MODES] = "pretrain"
    # LoRA: only low-rank adapters train, the init_from base frozen (titan_pipe.model.lora); null: every weight
    lora: LoRAConfig | None = None

    @model_validator(mode="after")
    def _finetune_defaults(self):
        """Fine-tuning's defaults where flow.yaml leaves them out: a released model is adjusted, not
        trained from scratch (lr 2e-5 without weight decay, warmup ~3% of the steps)."""
        if self.mode == "sft":
            o = self.optimizer
            if "lr" not in o.model_fields_set:
                object.__setattr__(o, "lr", SFT_LR)
            if "weight_decay" not in o.model_fields_set:
                object.__setattr__(o, "weight_decay", 0.0)
            if "warmup_steps" not in self.model_fields_set:
                object.__setattr__(self, "warmup_steps", max(1, round(0.03 * self.steps)))
        return self


class ParallelConfig(Section):
    dp: int = bounded(1, limits.PARALLEL)
    tp: int = bounded(1, limits.PARALLEL)
    pp: int = bounded(1, limits.PARALLEL)
    pp_schedule: Literal[PP_SCHEDULES] = "1f1b"
    virtual_stages: int = bounded(2, limits.LAYERS)  # stages per pp rank for interleaved_1f1b
    microbatches: int | None = bounded(None, limits.BATCH)  # default: pp (or 1 without pp)
    dp_mode: Literal[DP_MODES] = "fsdp"
    sequence_parallel: bool = False
    ep: int = bounded(1, limits.PARALLEL)  # expert parallelism: a mixture of experts' experts over ep of the dp ranks

    @property
    def world_size(self) -> int:
        return world_size(self.dp, self.tp, self.pp)

    @property
    def n_microbatches(self) -> int:
        return n_microbatches(self.pp, self.microbatches)

    @property
    def n_stages(self) -> int:
        return self.pp * stages_per_rank(self.pp, self.pp_schedule, self.virtual_stages)


class PrecisionConfig(Section):
    amp: bool = False
    amp_dtype: Literal["float16", "bfloat16"] = "bfloat16"
    loss_scale: float | Literal["dynamic"] | None = None  # initial scale; None: no scaling
    loss_scale_window: int = bounded(2000, limits.STEPS)  # overflow-free steps before the scale doubles
    min_loss_scale: float = Field(1.0, gt=0)
    # float8 matmuls through torchao on CUDA compute capability 9.0+ (training/float8.py); none: off
    float8: Literal["none", "tensorwise", "rowwise"] = "none"


class MemoryConfig(Section):
    activation_checkpointing: bool = False
    activation_checkpointing_layers: int = bounded(1, limits.LAYERS)  # checkpoint every N-th layer
    optimizer_offload: Literal[OFFLOADS] = "none"


class CommConfig(Section):
    comm_overlap: bool = True
    fusion_buffer_mb: int = Field(25, gt=0, le=2**20)
    stream_num: int = Field(1, gt=0, le=64)
    gradient_sync_dtype: Literal[FLOAT_NAMES] = "float32"


class LaunchConfig(Section):
    nproc_per_node: int | None = bounded(None, limits.DEVICES)  # default: dp*tp*pp / nnodes
    nnodes: int = bounded(1, limits.DEVICES)
    node_rank: int = Field(0, ge=0, le=limits.DEVICES.hi)
    rdzv_endpoint: str | None = None  # host:port; required when nnodes > 1
    max_restarts: int = Field(0, ge=0, le=1000)


class CheckpointConfig(Section):
    every: int = bounded(10, limits.STEPS)
    keep_last: int = Field(2, gt=0, le=10_000)
    save_optimizer: bool = True


class ConvertConfig(Section):
    """The convert stage's options: what `titan-pipe convert` builds from its flags and a flow passes
    from its ``convert`` section. The source-only ones (source_format, tp, pp, vocab_size,
    source_config) are for converting other checkpoints; a flow converts its own to the unified model
    its export reads, so it refuses them (_cross_checks)."""

    # `titan-pipe convert`'s options are made from these fields (titan_pipe.commands.options)
    source_format: Literal[SOURCE_FORMATS] = Field("auto", description="The source's format (auto: detected)")
    naming: Literal[NAMINGS] = Field("hf", description="Tensor names of the output (hf: transformers loads it)")
    dtype: Literal[("keep",) + FLOAT_NAMES] = Field("keep", description="The output's dtype (keep: as stored)")
    max_shard_size: str = Field("5GB", description="Split the output past this size")
    tp: int | None = bounded(None, limits.PARALLEL, description="Write our sharded layout with this TP size")
    pp: int | None = bounded(None, limits.PARALLEL, description="... and this number of pipeline stages")
    vocab_size: int | None = bounded(None, limits.VOCAB, description="True vocab size (Megatron padded vocab)")
    source_config: str | None = Field(
        None, description="params.json / config.json for DCP sources", json_schema_extra={"flag": "--model-config"}
    )
    verify: bool = Field(True, description="Hash the source against its manifest (sizes/headers are always checked)")
    digest: Literal[DIGESTS] = Field(
        "xxh3_128",
        description="The source files' digests in provenance.json (xxh3_128: fast, detects corrupted or swapped "
        "files; sha256: cryptographic, what `sha256sum` and the Hub show). A titan-pipe checkpoint is checked "
        "against its manifest's sha256s",
    )
    # a LoRA checkpoint (adapters + its base): merge -> the deployed model W + (alpha/rank) B A; adapter ->
    # a PEFT adapter dir (adapter_config.json + adapter_model.safetensors) for the base model
    lora: Literal[LORA_CONVERT] = Field(
        "merge",
        description="A LoRA checkpoint as the merged model (W + alpha/rank B A, what export takes) or as a PEFT "
        "adapter dir for its base model",
    )

    @field_validator("source_config", mode="before")
    @classmethod
    def _path_as_text(cls, v):
        return str(v) if isinstance(v, Path) else v

    @property
    def sharded(self) -> bool:
        return self.tp is not None or self.pp is not None

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _check_max_shard_size(cls, v):
        from titan_pipe.rules.sizes import parse_size

        parse_size(v)  # the size convert reads: refused here, not after training
        return str(v).strip()


class ExportConfig(Section):
    """The export stage's options, each one's default and help written here once: `titan-pipe export`'s
    flags are made from these fields (titan_pipe.commands.options). The stage's own rules
    (titan_pipe.rules.choices.export_problems) are applied to them by _cross_checks, against the model's
    positions, and by the export itself."""

    opset: int = Field(14, description="ONNX opset (ATC takes 11-15; the exporter needs >= 14)")
    dtype: Literal[EXPORT_NAMES] = Field("float32", description="Weights/activations dtype in the graph")
    batch: int = Field(1, description="Batch size (static shape, and the ATC gears)")
    seq_len: int = Field(32, description="Prompt length T of model.onnx (static shape, and the ATC gears)")
    cache_len: int | None = Field(
        None,
        description="KV-cache slots of decode.onnx (default: min(max_position_embeddings, 4096)); >= seq-len + 1",
    )
    dynamic: bool = Field(
        True,
        description="Dynamic batch/sequence dims, or fixed ones",
        json_schema_extra={"flag": "--dynamic/--static"},
    )
    kv_cache: bool = Field(True, description="Also export decode.onnx with past/present KV")
    soc_version: str = Field("Ascend910B3", description="ATC --soc_version")
    atc: bool = Field(True, description="Run atc when it is on PATH")
    precision_mode: Literal[PRECISION_MODES] = Field(
        "origin", description="ATC precision: origin keeps the graph dtype"
    )
    expose_hidden: bool = Field(
        False, description="Add hidden.{i} outputs (for evaluation)", json_schema_extra={"flag": "--expose-hidden"}
    )
    hash_weights: bool = Field(
        True, description="The digests of the weights' data files in export.json (one pass over the weights)"
    )
    # The weights' external-data files, each written on its own thread (convert/onnx/data_file.py):
    # two measured 1.7-1.9x one's write speed here, where the file system serializes writes to one file.
    data_files: int = bounded(
        2,
        limits.DATA_FILES,
        description="Split the weights over this many external-data files, each written on a thread of its own "
        "(1: one model.onnx.data)",
    )
    digest: Literal[DIGESTS] = Field(
        "xxh3_128",
        description="export.json's file digests: xxh3_128 (fast; detects corrupted or swapped files) or sha256 "
        "(cryptographic, ~10x slower)",
    )


class EvaluateConfig(Section):
    data: str | None = None  # held-out text; None: the validation split of the training data
    batches: int = bounded(2, limits.EVAL_BATCHES, description="Number of held-out batches")
    batch_size: int = bounded(2, limits.BATCH)
    seq_len: int = bounded(32, limits.SEQ_LEN)
    operators: bool = Field(True, description="Run the operator conformance table")
    thresholds: dict[str, dict[str, float]] = Field(default_factory=dict)  # per dtype overrides
    dtype: Literal[("auto",) + FLOAT_NAMES] = Field(
        "auto", description="Threshold set to judge by (auto: each candidate's own dtype)"
    )
    prompts: int = Field(2, ge=0, le=limits.BATCH.hi)  # greedy generations compared token for token (0: none)
    prompt_len: int = bounded(16, limits.SEQ_LEN)
    new_tokens: int = bounded(16, limits.SEQ_LEN)
    device: Literal[DEVICES] = Field(
        "cpu",
        description="Where the PyTorch reference (and the torchrun ranks) run; auto: npu, then cuda, then cpu",
    )
    dump: bool = Field(
        False,
        description="Also write every compared tensor pair as REPORT_DIR/dump/<comparison>/{golden,candidate}/"
        "<tensor>.npy (for msit / msprobe compare)",
    )
    # whole graphs when they fit in it, else one decoder layer at a time (docs/evaluate.md, "Memory")
    max_memory: str = Field(
        "auto",
        description="Memory budget, e.g. 8GB or 6GiB: whole graphs when they fit, else one decoder layer at a "
        "time; auto: half the RAM available",
    )

    @field_validator("max_memory", mode="before")
    @classmethod
    def _check_max_memory(cls, v):
        from titan_pipe.rules.sizes import parse_size

        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        parse_size(v)  # ValueError: one line naming the value and the fix
        return str(v).strip()

    @field_validator("thresholds", mode="after")
    @classmethod
    def _check_thresholds(cls, thresholds):
        # a field validator, not a model one: it runs (and names its unknown keys) even when another
        # key of the section is wrong, so one pass lists every problem
        from titan_pipe.rules.thresholds import validate_overrides

        try:
            validate_overrides(thresholds)
        except UserError as e:  # a known dtype and key each, so a typo cannot keep the default
            raise ValueError(str(e)) from None
        return thresholds


class MetricsConfig(Section):
    tensorboard: bool = False  # TensorBoard event files under <run dir>/tensorboard (the tensorboard extra)


class OrchestrationConfig(Section):
    """How `titan-pipe run` drives the stages under Prefect (docs/flows.md)."""

    # Prefect retries of the training task, each resuming from the newest complete checkpoint.
    # None: 2 when launch.max_restarts is 0, else 0 (torchrun then owns rank failures: one owner).
    retries: int | None = Field(None, ge=0, le=100)
    retry_delay_s: float = Field(10.0, ge=0, le=86400)
    cache: bool = True  # skip a stage whose config section and input files are unchanged

    def train_retries(self, max_restarts: int) -> int:
        if self.retries is not None:
            return self.retries
        return 0 if max_restarts > 0 else 2


class FlowConfig(Section):
    name: str = "run"  # the run dir is runs_dir/<name>: one safe path component (run_dir.run_name_problem)
    runs_dir: str = "runs"
    device: Literal[DEVICES] = "auto"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    memory: MemoryConfig = MemoryConfig()
    zero_stage: int | None = Field(None, ge=0, le=3)  # ZeRO 0-3; None: dp_mode decides
    comm: CommConfig = CommConfig()
    launch: LaunchConfig = LaunchConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    init_from: str | None = None  # our checkpoint dir, a unified safetensors model or an HF dir
    convert: ConvertConfig = ConvertConfig()
    export: ExportConfig = ExportConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    metrics: MetricsConfig = MetricsConfig()

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        why = run_name_problem(name)
        if why:
            raise ValueError(f"run name {why}; use a name like {suggest_run_name(name)!r}")
        return name

    def export_settings(self) -> ExportConfig:
        """The export section as the flow runs it: a decode cache left unset is sized to what the run
        uses (train.seq_len, export.seq_len + 1, evaluate's prompt + new tokens), within the model's
        positions and choices.MAX_DEFAULT_CACHE_LEN, not always that cap (every decode step attends
        over all the cache's slots)."""
        e = self.export
        if e.cache_len is not None or not e.kv_cache:
            return e
        want = max(self.train.seq_len, e.seq_len + 1, self.evaluate.prompt_len + self.evaluate.new_tokens)
        return e.model_copy(update={"cache_len": min(want, default_cache_len(self.model.args().max_seq_len))})

    def run_dir(self) -> Path:
        """runs_dir/name; a relative runs_dir is taken from the current directory (every command,
        check and record resolves it so: one rule, the one docs/launch.md states)."""
        return Path(self.runs_dir) / self.name


def _cross_checks(cfg: FlowConfig, base: Path) -> list[str]:
    """Rules that span sections; each message names the key, the value and the fix."""
    args = cfg.model.args()
    problems = args_problems(args)
    if problems:  # the rules below divide by these dims
        return [f"model.{line}" for line in problems]
    errs = _export_and_positions(cfg, args)
    errs += [
        f"convert.{key}: {getattr(cfg.convert, key)!r} is for converting other checkpoints with "
        "`titan-pipe convert`; a flow converts its own checkpoint to the unified model its export "
        "reads. Remove it"
        for key in ("source_format", "tp", "pp", "vocab_size", "source_config", "digest", "lora")
        if getattr(cfg.convert, key) != ConvertConfig.model_fields[key].default
    ]
    p = cfg.parallel
    errs += [f"parallel.tp: {p.tp} {why}" for why in tp_problems(args, p.tp)]
    errs += _moe_training_problems(cfg, args)
    if args.n_layers < p.n_stages:
        errs.append(
            f"parallel.pp: {p.pp} x {p.n_stages // p.pp} stage(s) per rank needs at least "
            f"{p.n_stages} layers, the model has n_layers={args.n_layers}; lower pp"
        )
    if p.pp > 1 and p.pp_schedule in ("1f1b", "interleaved_1f1b") and p.n_microbatches < p.pp:
        errs.append(
            f"parallel.microbatches: {p.n_microbatches} < pp={p.pp}, which "
            f"{p.pp_schedule} cannot schedule; use microbatches >= {p.pp}"
        )
    if p.pp_schedule == "interleaved_1f1b" and p.pp > 1 and p.n_microbatches % p.pp:
        errs.append(f"parallel.microbatches: {p.n_microbatches} must be a multiple of pp={p.pp} for interleaved_1f1b")
    if cfg.precision.float8 != "none" and p.tp > 1:
        errs.append(
            f"precision.float8: {cfg.precision.float8} runs with tp = 1 (torchao's float8 tensor-parallel "
            f"layouts are not wired in); here tp={p.tp}: use tp 1 or precision.float8: none"
        )
    if cfg.train.loss == "chunked" and (p.tp > 1 or p.pp > 1):
        errs.append(
            f"train.loss: chunked fuses the loss with the output projection inside the model's "
            f"forward, which needs tp = pp = 1 (here tp={p.tp}, pp={p.pp}); use loss: auto (chunked "
            "where it applies) or full"
        )
    if cfg.data.format != "text" and cfg.data.path is None and cfg.data.blend is None:
        errs.append(
            f"data.path: null trains on the shipped corpus, plain text, but data.format: {cfg.data.format} "
            "reads chat/instruction records; give data.path (a .jsonl of them) or set data.format: text"
        )
    if cfg.data.format == "text" and cfg.data.max_tokens is not None:
        errs.append(
            f"data.max_tokens: {cfg.data.max_tokens} applies to chat/instruction records (data.format: "
            "chat or instruction); set it to null for plain text"
        )
    if cfg.data.max_tokens is not None and cfg.train.mode == "sft" and cfg.data.max_tokens > cfg.train.seq_len:
        errs.append(
            f"data.max_tokens: {cfg.data.max_tokens} is over train.seq_len {cfg.train.seq_len}: a kept "
            "conversation must fit one window whole; set data.max_tokens to at most train.seq_len"
        )
    if cfg.data.format != "text" and cfg.data.tokenizer == "byte":
        errs.append(
            f"data.tokenizer: byte, but data.format: {cfg.data.format} renders records with a chat template "
            "whose markers the byte tokenizer does not have; set data.tokenizer to the model's dir (its "
            "tokenizer.json and template)"
        )
    if cfg.train.batch_size % p.dp:
        errs.append(f"train.batch_size: {cfg.train.batch_size} is not divisible by dp={p.dp}")
    elif (cfg.train.batch_size // p.dp) % p.n_microbatches:
        errs.append(
            f"train.batch_size: {cfg.train.batch_size // p.dp} sequences per dp rank do not "
            f"split into microbatches={p.n_microbatches}"
        )
    if p.sequence_parallel and p.tp > 1 and cfg.train.seq_len % p.tp:
        errs.append(
            f"train.seq_len: {cfg.train.seq_len} is not divisible by tp={p.tp} (sequence_parallel splits the sequence)"
        )
    if cfg.train.compile_backend != "auto" and not cfg.train.compile:
        errs.append(
            f"train.compile_backend: {cfg.train.compile_backend!r} has no effect while train.compile is "
            "false; set train.compile: true or remove train.compile_backend"
        )
    pr = cfg.precision
    if pr.amp and pr.amp_dtype == "float16" and pr.loss_scale is None:
        errs.append(
            "precision.loss_scale: float16 AMP needs loss scaling; set loss_scale: dynamic "
            "(or a number like 32768), or use amp_dtype: bfloat16"
        )
    if cfg.device == "cpu" and cfg.model.kernels == "npu_fused":
        errs.append("model.kernels: npu_fused needs device npu; use kernels: reference or auto")
    world = p.world_size
    launch = cfg.launch
    nproc = launch.nproc_per_node or (world // launch.nnodes if world % launch.nnodes == 0 else None)
    if nproc is None or nproc * launch.nnodes != world:
        errs.append(
            f"launch: nproc_per_node={launch.nproc_per_node or nproc} x nnodes={launch.nnodes} "
            f"!= dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {world}; make the world size match"
        )
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        errs.append("launch.rdzv_endpoint: required when nnodes > 1 (host:port of node 0)")
    if launch.node_rank >= launch.nnodes:
        errs.append(f"launch.node_rank: {launch.node_rank} must be < nnodes={launch.nnodes}")
    if (cfg.orchestration.retries or 0) > 0 and launch.max_restarts > 0:
        errs.append(
            f"orchestration.retries: {cfg.orchestration.retries} with launch.max_restarts="
            f"{launch.max_restarts} would retry one failure twice over (torchrun restarts the "
            "ranks, then Prefect relaunches torchrun); set one of them to 0"
        )
    if cfg.zero_stage is not None and cfg.zero_stage >= 1 and p.dp_mode == "ddp" and p.tp > 1:
        errs.append("zero_stage: ZeRO with dp_mode ddp and tp > 1 is not supported; use dp_mode: fsdp")
    if cfg.memory.optimizer_offload == "cpu" and not (p.dp_mode == "fsdp" or (cfg.zero_stage or 0) >= 2):
        errs.append("memory.optimizer_offload: cpu offload runs through FSDP2; set parallel.dp_mode: fsdp")
    errs += _data_path_checks(cfg.data, base)
    if cfg.data.tokenizer != "byte":
        tp_ = Path(cfg.data.tokenizer)
        tp_ = tp_ if tp_.is_absolute() else base / tp_
        if not (tp_.is_file() or (tp_ / "tokenizer.json").is_file()):
            errs.append(
                f"data.tokenizer: {cfg.data.tokenizer!r} is not a file (nor a dir holding a tokenizer.json); "
                "give a tokenizer.json, the model dir holding it, or 'byte'"
            )
    if cfg.data.format != "text" and cfg.train.mode != "sft":
        errs.append(
            f"data.format: {cfg.data.format} data is fine-tuning data (its answers marked); set train.mode: sft"
        )
    if cfg.train.mode == "sft" and cfg.data.blend is not None:
        errs.append("train.mode: sft fine-tunes on one chat dataset; give data.path instead of data.blend")
    elif args.vocab_size < 258:
        errs.append(f"model.vocab_size: {args.vocab_size} is smaller than the byte tokenizer's 258")
    ip = init_from_path(cfg, base)
    if ip is not None and not ip.exists():
        errs.append(f"init_from: {cfg.init_from!r} does not exist (resolved to {ip})")
    errs += _lora_problems(cfg, args, ip)
    return errs


def lora_base_problem(path: Path) -> str | None:
    """Why the model at ``path`` cannot be a LoRA base (what follows "init_from PATH"), or None: the
    adapters' checkpoint names its base by safetensors files, which a LoRA checkpoint (its adapters
    apart) and a DCP / Megatron one are not. Validate and the trainer ask this one rule."""
    step = complete_step(path)
    if step is not None and "lora" in Manifest.load(step).extra.other:
        return (
            "is itself a LoRA checkpoint; convert it to a merged model first (titan-pipe convert STEP -o DIR) and "
            "start from that"
        )
    if other_format(path):
        return (
            f"is a {detect_format(Path(path))} checkpoint; convert it to a Hugging Face dir first (titan-pipe "
            "convert SRC -o DIR) and adapt that"
        )
    return None


def _lora_problems(cfg: FlowConfig, args, init_from: Path | None) -> list[str]:
    lora = cfg.train.lora
    if lora is None:
        return []
    errs = [f"train.lora.{line}" for line in lora_model_problems(lora.spec(), args)]
    why = lora_base_problem(init_from) if init_from is not None and init_from.exists() else None
    if why:
        errs.append(f"train.lora: init_from {init_from} {why}")
    if cfg.init_from is None:
        errs.append(
            "train.lora: adapters train beside a frozen base, and there is none: set init_from to the "
            "model to adapt (a Hugging Face dir or a checkpoint), or remove train.lora to train every weight"
        )
    held = lora.held_dtype(cfg.precision)
    if held != "float32" and not (cfg.precision.amp and cfg.precision.amp_dtype == held):
        errs.append(
            f"train.lora.base_dtype: {held} runs the frozen base's matmuls in {held}, which needs precision.amp: "
            f"true with amp_dtype: {held}; set those, or base_dtype: float32"
        )
    if cfg.precision.float8 != "none":
        errs.append(
            f"train.lora with precision.float8: {cfg.precision.float8}: the frozen base would be swapped for "
            "float8 linears the adapters do not sit beside; use precision.float8: none"
        )
    return errs


def init_from_path(cfg: FlowConfig, base: Path) -> Path | None:
    """init_from resolved against the flow file's dir (None without one)."""
    if cfg.init_from is None:
        return None
    p = Path(cfg.init_from).expanduser()
    return p if p.is_absolute() else base / p


def _hold_checkpoint_model(cfg: FlowConfig, base: Path) -> list[str]:
    """With init_from, the model is the checkpoint's: read it (config.json or the manifest, no tensor
    data), refuse every value flow.yaml states that differs (titan_pipe.model.stated), and hold it
    as ``cfg.model.args()``. A missing init_from is _cross_checks' line."""
    path = init_from_path(cfg, base)
    if path is None or not path.exists():
        return []
    m = cfg.model
    try:
        held = checkpoint_args(path)
        stated = m.stated()
    except (UserError, ValueError, TypeError) as e:  # an unreadable checkpoint, or dims no model has
        return [f"init_from: {str(e).splitlines()[0]}" if isinstance(e, UserError) else f"model: {e}"]
    lines = stated_conflicts(stated, m.given(), held, flavour=m.flavour, where=str(path))
    if not lines:
        m._held = with_training_fields(held, stated, m.given())
        if "flavour" not in m.given():  # the default flavour names no part of this model
            object.__setattr__(m, "flavour", None)
    return lines


def _moe_training_problems(cfg: FlowConfig, args: ModelArgs) -> list[str]:
    """A mixture-of-experts model trains data-, expert- and pipeline-parallel; what it does not combine
    with yet (tensor parallelism, compile, float8) is one line each."""
    p = cfg.parallel
    if not args.moe:
        return features.split_problems(args, p.ep)
    out = []
    if p.ep > 1:
        if p.dp % p.ep:
            out.append(
                f"parallel.ep: {p.ep} does not divide dp={p.dp} (the experts are split over ep of the dp "
                f"ranks); pick ep from the divisors of {p.dp}"
            )
        out += features.split_problems(args, p.ep)
        if p.dp_mode != "fsdp":
            out.append(
                f"parallel.dp_mode: {p.dp_mode} with ep={p.ep}: expert parallelism runs under FSDP (the "
                "experts are sharded over the dp ranks that share them); use dp_mode: fsdp"
            )
    if p.tp > 1 and p.ep > 1:
        out.append(
            f"parallel.tp: {p.tp} with ep={p.ep}: tensor parallelism splits the attention and runs "
            "every expert on each tp rank; expert parallelism with it is not built: use tp: 1 or ep: 1"
        )
    if p.tp > 1 and p.sequence_parallel:
        out.append(
            "parallel.sequence_parallel: true with a mixture of experts: the routing layers take the "
            "whole sequence on each tp rank; set sequence_parallel: false"
        )
    if cfg.train.compile:
        out.append(
            "train.compile: true: the routing has data-dependent shapes (tokens per expert), which "
            "the block-wise compile does not take; set train.compile: false"
        )
    if cfg.precision.float8 != "none":
        out.append(
            f"precision.float8: {cfg.precision.float8}: float8 training converts the dense linears; "
            "the router and the stacked experts are not; use float8: none"
        )
    return out


def _export_and_positions(cfg: FlowConfig, args: ModelArgs) -> list[str]:
    """Every length the model's positions bound, and the export stage's own option rules."""
    errs = [
        f"{key}: {value} exceeds model max_seq_len={args.max_seq_len}; lower it or raise model.max_seq_len"
        for key, value in (("train.seq_len", cfg.train.seq_len), ("evaluate.seq_len", cfg.evaluate.seq_len))
        if value > args.max_seq_len
    ]
    e = cfg.export_settings()
    errs += [
        f"export: {line}"
        for line in export_problems(
            max_positions=args.max_seq_len,
            opset=e.opset,
            dtype=e.dtype,
            batch=e.batch,
            seq_len=e.seq_len,
            cache_len=e.cache_len,
            kv_cache=e.kv_cache,
            precision_mode=e.precision_mode,
            digest=e.digest,
            data_files=e.data_files,
            spell=lambda k: f"export.{k}:",
        )
    ]
    return errs


def _data_path_checks(data: DataConfig, base: Path) -> list[str]:
    """data.path exists (a file, a dir or a .bin/.idx prefix); every data.blend entry is token data."""
    from titan_pipe.tokens.spec import is_token_data, resolve

    errs = []
    if data.path is not None:
        p = resolve(data.path, base)
        if not p.exists() and not is_token_data(p):
            errs.append(
                f"data.path: {data.path!r} does not exist (resolved to {p}); fix the path "
                "or remove it to use the shipped corpus"
            )
    for i, entry in enumerate(data.blend or []):
        p = resolve(entry.path, base)
        if not is_token_data(p):
            errs.append(
                f"data.blend[{i}].path: {entry.path!r} (resolved to {p}) is not a prepared data dir or a "
                ".bin/.idx prefix; prepare raw text first with `titan-pipe data prepare SRC -o DIR`"
            )
    return errs


def _yaml_string_hint(value: Any, kind: str) -> str:
    """YAML 1.1 (PyYAML) reads 1e-3 and 3e4 as strings (a float needs a dot: 1.0e-3): say so where a
    number was expected and a string that Python would read as one came."""
    if not isinstance(value, str) or not kind.startswith(("float", "int")):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return f"; YAML read {limits.shown(value)} as a string: write a number with a dot, e.g. 1.0e-3"


def _format_pydantic(e: ValidationError) -> list[str]:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key; remove it or check its spelling")
            continue
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {limits.shown(value)})"  # never a whole input
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}{shown}{_yaml_string_hint(value, err['type'])}")
    return lines


def section_from_flags(cls: type[Section], flags: dict[str, str], **values) -> Section:
    """A stage's config section from a command's flags (``flags``: field -> the flag that sets it),
    validated as flow.yaml's is: a bad value is one line naming the flag, the value and the fix."""
    try:
        return cls.model_validate(values)
    except ValidationError as e:
        lines = _format_pydantic(e)
        for field_name, flag in flags.items():
            lines = [flag + line[len(field_name) :] if line.startswith(field_name + ":") else line for line in lines]
        raise UserError("; ".join(lines)) from None


def parse_flow(data: dict[str, Any], *, source: str = "flow.yaml", base: Path | None = None) -> FlowConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must hold a mapping of sections (name, model, train, ...)"])
    try:
        cfg = FlowConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(source, _format_pydantic(e)) from None
    base = base or Path.cwd()
    errs = _hold_checkpoint_model(cfg, base)
    errs = errs or _cross_checks(cfg, base)
    if errs:
        raise ConfigError(source, errs)
    return cfg


def load_flow(path: str | Path) -> FlowConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["file not found; create one with `titan-pipe init DIR`"])
    size = path.stat().st_size
    if size > MAX_FLOW_BYTES:  # PyYAML parses ~1 MB/s; a flow file is a few KB
        raise ConfigError(
            str(path),
            [
                f"is {size / 1e6:.1f} MB, larger than a flow file can be "
                f"({MAX_FLOW_BYTES // 2**20} MB); pass the flow.yaml, not a data file"
            ],
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            str(path), [f"not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); save the file as UTF-8"]
        ) from None
    try:
        data = load_flow_text(text) or {}
    except FlowYamlError as e:
        raise ConfigError(str(path), [str(e)]) from None
    except yaml.YAMLError as e:
        raise ConfigError(str(path), [f"not valid YAML: {str(e).splitlines()[0]}"]) from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise ConfigError(
            str(path),
            ["nested too deeply to be a flow file; a flow.yaml is sections of keys (name, model, train, ...)"],
        ) from None
    return parse_flow(data, source=str(path), base=path.parent.resolve())
