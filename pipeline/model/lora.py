"""LoRA: low-rank adapters beside frozen base linears (Hu et al. 2021, PEFT's layout).

A targeted linear ``y = W x`` becomes ``y = W x + (alpha / rank) * B (A dropout(x))`` with A (rank,
in) and B (out, rank) the only trained parameters; W stays as loaded. Each adapter is a small module
(``Adapter``: ``a`` then ``b``, two bias-free linears) held beside its base linear in a ``lora``
ModuleDict of the attention or feed-forward (``layers.3.attention.lora.wq.a.weight``), so the base
keeps its own names and the sharding table gives each adapter weight its own tensor-parallel style
(titan_pipe.model.params: A replicated / B split with a column-split base, A split / B replicated
with a row-split one). ``merge`` is W + (alpha / rank) B A, what a deployed model holds.

``LoRASpec`` is the record a flow's ``train.lora`` section, the checkpoint's manifest and a PEFT
``adapter_config.json`` all carry. This file is pure data (no torch: the config reads it); the
modules and the arithmetic are titan_pipe.model.lora_modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.errors import UserError
from titan_pipe.rules.limits import LORA_RANK
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs, flops_per_token
from titan_pipe.model.params import LAYER_PARAMS, LAYER_PREFIX, adapter_param, split_layer

# target -> the base linear it adapts (module relative to the layer); the names PEFT and Hugging Face use
TARGETS = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "gate": "feed_forward.w1",
    "up": "feed_forward.w3",
    "down": "feed_forward.w2",
}
INITS = ("kaiming", "gaussian")  # PEFT's init_lora_weights True ("kaiming" A) and "gaussian"; B starts at 0
CONVERT_MODES = ("merge", "adapter")  # convert --lora: the merged model, or PEFT's adapter dir
_BASE = {p.module: p for p in LAYER_PARAMS if p.name.endswith(".weight")}


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    init: str = "kaiming"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self) -> list[str]:
        """The base linears adapted, relative to a layer, in model order."""
        return [TARGETS[t] for t in TARGETS if t in self.targets]

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "init": self.init,
        }

    @classmethod
    def from_dict(cls, d: dict, *, source: object) -> "LoRASpec":
        """The record as stored (a manifest's ``extra.lora``); one-line UserError naming ``source``."""
        try:
            spec = cls(
                rank=d["rank"],
                alpha=d["alpha"],
                targets=tuple(d["targets"]),
                dropout=d.get("dropout", 0.0),
                init=d.get("init", "kaiming"),
            )
        except (KeyError, TypeError) as e:
            raise UserError(f"{source}: the LoRA record is malformed ({e}); copy the checkpoint again") from None
        problems = spec_problems(spec)
        if problems:
            raise UserError(f"{source}: the LoRA record {problems[0]}; copy the checkpoint again")
        return spec


def spec_problems(spec: LoRASpec) -> list[str]:
    """What is wrong with a spec's values, each finishing "train.lora.<key> ..." for the config."""
    out = []
    if not isinstance(spec.rank, int) or isinstance(spec.rank, bool) or LORA_RANK.problem(spec.rank):
        out.append(f"rank {spec.rank!r} is not a whole number from {LORA_RANK.range.replace('..', ' to ')}")
    if not isinstance(spec.alpha, (int, float)) or isinstance(spec.alpha, bool) or not 0 < spec.alpha <= 1e6:
        out.append(f"alpha {spec.alpha!r} is not a number above 0")
    if not isinstance(spec.dropout, (int, float)) or not 0 <= spec.dropout < 1:
        out.append(f"dropout {spec.dropout!r} is not in [0, 1)")
    bad = [t for t in spec.targets if t not in TARGETS]
    if bad or not spec.targets or len(set(spec.targets)) != len(spec.targets):
        out.append(f"targets {list(spec.targets)} must be distinct names from {', '.join(TARGETS)}")
    if spec.init not in INITS:
        out.append(f"init {spec.init!r} is not one of {', '.join(INITS)}")
    return out


def model_problems(spec: LoRASpec, args: ModelArgs) -> list[str]:
    """Targets the model cannot take: a mixture of experts' feed-forward is its experts, which hold no
    adapters here (their stacked weights are not linears); its attention does."""
    ffn = [t for t in spec.targets if TARGETS[t].startswith("feed_forward.")]
    if ffn and args.moe:
        return [
            f"targets {ffn}: this model routes its feed-forward through {features.routing(args).experts} experts, which take "
            "no adapters; target the attention (q, k, v, o)"
        ]
    return []


def trained_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token with the base frozen: the full count (model.args.flops_per_token)
    without the base's weight gradients, a third of its matmul FLOPs (backward still computes the
    input gradients through every frozen linear); the adapters' own, rank-wide, are left out. What
    the trainer's MFU and the planner's step time count under LoRA."""
    return flops_per_token(args, seq_len) - flops_per_token(args, 0) / 3


def is_adapter(name: str) -> bool:
    """A native parameter name of an adapter weight (``layers.N.attention.lora.wq.a.weight``)."""
    return ".lora." in name


def adapter_names(args: ModelArgs, spec: LoRASpec) -> list[str]:
    """Every adapter parameter's native name, in model order (a, then b, per targeted linear)."""
    out = []
    for i in range(args.n_layers):
        for module in spec.modules():
            if _BASE[module].in_layer(args, i):
                out += [f"{LAYER_PREFIX}{i}.{adapter_param(module, part)}" for part in ("a", "b")]
    return out


def adapter_of(weight: str, part: str = "a") -> str | None:
    """The native name an adapter weight beside base weight ``weight`` would have (``layers.0.attention.wq.weight``
    -> ``layers.0.attention.lora.wq.a.weight``; the model may hold none), None for a tensor no adapter can sit
    beside (a bias, a norm, a per-model weight)."""
    lid, rest = split_layer(weight)
    module = rest.removesuffix(".weight")
    if lid is None or module == rest or "." not in module:
        return None
    return f"{LAYER_PREFIX}{lid}.{adapter_param(module, part)}"


def adapter_count(args: ModelArgs, spec: LoRASpec) -> int:
    """How many parameters the adapters hold (what trains)."""
    return sum(a * b for a, b in adapter_shapes(args, spec).values())


def base_of(name: str) -> tuple[str, str]:
    """(native name of the base weight, "a" | "b") of an adapter parameter's native name."""
    lid, rest = split_layer(name)
    owner, _, linear, part, _ = rest.split(".")
    return f"{LAYER_PREFIX}{lid}.{owner}.{linear}.weight", part


def adapter_shape(name: str, args: ModelArgs, spec: LoRASpec) -> tuple[int, int]:
    base, part = base_of(name)
    out_f, in_f = _BASE[base.split(".", 2)[2].rsplit(".", 1)[0]].shape(args)
    return (spec.rank, in_f) if part == "a" else (out_f, spec.rank)


def adapter_shapes(args: ModelArgs, spec: LoRASpec) -> dict[str, tuple[int, int]]:
    return {n: adapter_shape(n, args, spec) for n in adapter_names(args, spec)}


def peft_key(name: str, hf_name: str) -> str:
    """The key PEFT's adapter_model.safetensors stores an adapter weight under, from the base weight's
    Hugging Face name (``model.layers.3.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.3.
    self_attn.q_proj.lora_A.weight``)."""
    part = base_of(name)[1]
    return "base_model.model." + hf_name[: -len(".weight")] + (".lora_A.weight" if part == "a" else ".lora_B.weight")


@dataclass(frozen=True)
class BaseRef:
    """The frozen base a LoRA checkpoint's adapters were trained on: where it was, and the size and
    sha256 of every file its weights were read from (config.json or manifest.json included), so a
    reader opens that base and no other. The checkpoint holds no copy of it."""

    path: str
    files: dict[str, tuple[int, str]]  # name relative to path -> (size, sha256)

    def to_dict(self) -> dict:
        return {"path": self.path, "files": {k: {"size": s, "sha256": h} for k, (s, h) in sorted(self.files.items())}}


def lora_record(extra_other: dict, *, source: object) -> tuple[LoRASpec, BaseRef] | None:
    """(spec, base) of a manifest's ``extra.lora`` (kept in CheckpointExtra.other), None without one;
    a malformed record is one UserError naming ``source``."""
    rec = extra_other.get("lora")
    if rec is None:
        return None
    bad = f"{source}: extra.lora is malformed"
    if not isinstance(rec, dict) or not isinstance(rec.get("base"), dict):
        raise UserError(f"{bad} (no base record); copy the checkpoint again")
    spec = LoRASpec.from_dict(rec, source=source)
    base = rec["base"]
    files = base.get("files")
    if not isinstance(base.get("path"), str) or not isinstance(files, dict) or not files:
        raise UserError(f"{bad} (base.path / base.files); copy the checkpoint again")
    out = {}
    for name, info in files.items():
        ok = (
            isinstance(name, str)
            and isinstance(info, dict)
            and isinstance(info.get("size"), int)
            and not isinstance(info.get("size"), bool)
            and info["size"] >= 0
            and isinstance(info.get("sha256"), str)
            and len(info["sha256"]) == 64
            and "/" not in name.replace("model/", "", 1)
            and not name.startswith(".")
        )
        if not ok:
            raise UserError(f"{bad} (base.files[{name!r}]); copy the checkpoint again")
        out[name] = (info["size"], info["sha256"])
    return spec, BaseRef(base["path"], out)
