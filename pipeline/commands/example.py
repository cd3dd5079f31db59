"""`titan-pipe init`'s example flow.yaml: the commented template, and for a named flavour a coherent
run of that model (its own name, sequence length, precision, the layout the planner picks for the
devices named, a tokenizer line to fill in), the template's comments kept."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from pydantic import Field

from titan_pipe.rules import limits
from titan_pipe.config import Section, bounded
from titan_pipe.errors import UserError

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "flow.yaml"
EXAMPLE_SEQ_LEN = 4096  # the planner's default; shorter when the model's positions are fewer
TOKENIZER_NOTE = "FILL IN: the model's tokenizer.json (its Hugging Face dir has one); byte only runs"


class InitRequest(Section):
    """`titan-pipe init`'s options (titan_pipe.commands.options makes the flags from these fields)."""

    flavour: str = Field("debug", description="Model flavour (debug, llama3_8b, qwen3_8b, ...)")
    devices: int = bounded(8, limits.DEVICES, description="with --flavour: accelerators the run will have")
    device: str = Field(
        "ascend910b",
        description="with --flavour: their profile (as `plan --device`); cpu: the debug model (or --from's) in one "
        "CPU process",
    )
    force: bool = Field(False, description="Overwrite an existing flow.yaml", json_schema_extra={"flag": "--force"})
    sft: bool = Field(
        False,
        description="a fine-tune of the released --flavour on chat data (and a sample chat.jsonl beside it)",
        json_schema_extra={"flag": "--sft"},
    )
    released: Path | None = Field(
        None,
        description="a released model's Hugging Face dir: a flow for that model (its config.json is the "
        "architecture; --device cpu for one CPU process)",
        json_schema_extra={"flag": "--from"},
    )
    lora: int | None = bounded(
        None,
        limits.LORA_RANK,
        description="with --sft: LoRA adapters of this rank, the released model frozen (docs/finetune.md)",
    )


def set_key(text: str, section: str | None, key: str, value, note: str | None = None) -> str:
    """``text`` with ``section.key`` (a top-level key when section is None) set to ``value``, the
    line's comment kept in its column (or replaced by ``note``). The key must be in the template."""
    rendered = yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
    lines = text.split("\n")
    start, indent = 0, ""
    if section is not None:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{section}:")) + 1
        indent = "  "
    for i in range(start, len(lines)):
        line = lines[i]
        if section is not None and line and not line.startswith((" ", "#")):
            break  # the next section: the key is not in this one
        m = re.match(rf"^{indent}{re.escape(key)}:( *)([^#]*?)( *)(#.*)?$", line)
        if m is None:
            continue
        head = f"{indent}{key}: {rendered}"
        comment = f"# {note}" if note else m.group(4)
        column = len(f"{indent}{key}:{m.group(1)}{m.group(2)}{m.group(3)}") if m.group(4) else 0
        lines[i] = head if not comment else head.ljust(max(column, len(head) + 1)) + comment
        return "\n".join(lines)
    raise KeyError(f"{section}.{key} is not in the template")


SFT_STEPS = 1000
SAMPLE_CHAT = "chat.jsonl"  # written beside an --sft example: the record format, three conversations
SAMPLE_RECORDS = [
    {
        "messages": [
            {"role": "system", "content": "You answer in one sentence."},
            {"role": "user", "content": "What does titan-pipe do?"},
            {
                "role": "assistant",
                "content": "It trains a model, converts it, exports it for ATC and checks "
                "the deployed graphs against the training operators.",
            },
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Which parallelisms does it combine?"},
            {"role": "assistant", "content": "Data, tensor, pipeline and expert parallelism."},
            {"role": "user", "content": "And for fine-tuning?"},
            {"role": "assistant", "content": "The same, with the loss on the answers only."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Where is the loss mask kept?"},
            {"role": "assistant", "content": "In tokens.lossmask, one byte a token beside the indexed dataset."},
        ]
    },
]


def sample_chat() -> str:
    """The --sft example's chat.jsonl: the record format to replace with your own data."""
    import json

    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in SAMPLE_RECORDS)


def finetune_flow(text: str, flavour: str, *, model_dir: str | None = None) -> str:
    """``text`` (an example flow) turned into a fine-tune of the released ``flavour``: init_from its
    Hugging Face dir (weights, tokenizer and chat template; ``model_dir`` where it is known), chat
    data, train.mode sft with the fine-tuning hyperparameters."""
    known = model_dir is not None
    model_dir = model_dir if known else f"{flavour}-hf"
    text = set_key(text, None, "name", f"{flavour}-sft".replace("_", "-"))
    text = set_key(
        text,
        None,
        "init_from",
        model_dir,
        note="the released model: its config.json is the architecture"
        if known
        else f"FILL IN: the released {flavour} Hugging Face dir (config.json, *.safetensors, tokenizer)",
    )
    text = set_key(text, "data", "path", SAMPLE_CHAT, note='your chat jsonl (one {"messages": [...]} a line)')
    text = set_key(text, "data", "tokenizer", model_dir, note="the model's own tokenizer and chat template")
    text = set_key(text, "data", "format", "chat")
    text = set_key(text, "train", "mode", "sft")
    text = set_key(text, "train", "steps", SFT_STEPS)
    text = set_key(text, "train", "warmup_steps", round(0.03 * SFT_STEPS))
    text = set_key(
        text,
        "train",
        "optimizer",
        {"name": "adamw", "lr": 2.0e-5, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.0},
    )
    first = (
        "# Fine-tuning (docs/finetune.md) needs the released model's Hugging Face dir (config.json,\n"
        f"# *.safetensors, tokenizer files) at init_from: {model_dir}{'' if known else ' (FILL IN)'}. Your "
        "chat records go in data.path;\n# chat.jsonl beside this file shows the format.\n"
    )
    return first + text


LORA_LR = 2.0e-4  # LoRA's usual learning rate: the adapters start at zero and are few


def lora_flow(text: str, rank: int) -> str:
    """``text`` with LoRA adapters of ``rank`` on every attention and MLP linear (alpha 2 x rank, dropout
    0.05, as PEFT users commonly set them), the base frozen, and LoRA's learning rate."""
    text = set_key(
        text,
        "train",
        "lora",
        {"rank": rank, "alpha": 2 * rank, "dropout": 0.05, "targets": ["q", "k", "v", "o", "gate", "up", "down"]},
        note="LoRA: only these adapters train, init_from frozen (docs/finetune.md)",
    )
    return set_key(
        text,
        "train",
        "optimizer",
        {"name": "adamw", "lr": LORA_LR, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.0},
    )


def released_flow(model_dir: Path, *, sft: bool, devices: int, device: str) -> str:
    """A flow for the released model at ``model_dir``: init_from it, no model keys (its config.json is the
    architecture), its tokenizer, a layout over ``devices`` whose tp divides its heads (cpu: one process),
    the held-out lengths of the example; ``sft``: a fine-tune of it on chat data."""
    from titan_pipe.model.sharding import tp_choices
    from titan_pipe.model.stated import checkpoint_args
    from titan_pipe.run_dir import suggest_run_name

    args = checkpoint_args(model_dir)  # UserError naming the file when it is no model dir
    text = TEMPLATE.read_text()
    text = re.sub(
        r"^  flavour: .*\n(?:^ {10,}#.*\n)*",
        "  # no flavour: the architecture is init_from's config.json (a key written here must equal it)\n",
        text,
        count=1,
        flags=re.M,
    )
    cpu = device == "cpu"
    tp = 1 if cpu else max(d for d in tp_choices(args) if devices % d == 0 and d <= 8)
    dp = 1 if cpu else devices // tp
    text = set_key(text, None, "device", "cpu" if cpu else "auto")
    for key, value in (("dp", dp), ("tp", tp), ("pp", 1), ("microbatches", None)):
        text = set_key(text, "parallel", key, value)
    text = set_key(text, "train", "batch_size", 2 * dp)
    tok = "tokenizer.json" if (Path(model_dir) / "tokenizer.json").is_file() else None
    name = suggest_run_name(Path(model_dir).resolve().name)
    if sft:
        text = finetune_flow(text, name, model_dir=str(model_dir))
        text = set_key(text, "train", "seq_len", min(1024, args.max_seq_len))
        if tok is None:
            text = set_key(text, "data", "tokenizer", "byte", note=TOKENIZER_NOTE)
        return text
    text = set_key(text, None, "name", name)
    text = set_key(
        text, None, "init_from", str(model_dir), note="the released model: its config.json is the architecture"
    )
    text = set_key(text, "data", "tokenizer", str(model_dir) if tok else "byte", note=None if tok else TOKENIZER_NOTE)
    return text


def example_flow(flavour: str, *, devices: int = 8, device: str = "ascend910b", sft: bool = False) -> str:
    """The template (flavour debug: the tiny example; ``device`` cpu: in one CPU process) or a run of
    ``flavour`` on ``devices`` x ``device`` with the planner's fastest layout that fits; ``sft``: a
    fine-tune of the released ``flavour``."""
    if flavour == "debug" and device == "cpu":
        text = set_key(TEMPLATE.read_text(), None, "device", "cpu")
        for key, value in (("dp", 1), ("tp", 1), ("pp", 1), ("microbatches", None)):
            text = set_key(text, "parallel", key, value)
    else:
        text = _example_flow(flavour, devices=devices, device=device)
    return finetune_flow(text, flavour) if sft else text


def name_run(text: str, directory: Path) -> str:
    """``text`` with its run named after the project ``directory`` (a valid run name made of it): two
    projects written by init never share a run dir, nor take the shipped example's ``tiny``."""
    from titan_pipe.run_dir import suggest_run_name

    return set_key(text, None, "name", suggest_run_name(Path(directory).resolve().name))


def _example_flow(flavour: str, *, devices: int, device: str) -> str:
    from titan_pipe.model.args import FLAVOURS

    if flavour not in FLAVOURS:
        raise UserError(f"--flavour {flavour!r} is unknown; use one of {', '.join(FLAVOURS)}")
    text = TEMPLATE.read_text()
    if flavour == "debug":
        return text
    from titan_pipe.run_dir import run_name_problem, suggest_run_name
    from titan_pipe.training.planner.search import build_cluster, layout_flow, make_plan
    from titan_pipe.training.planner.workload import Workload

    args = FLAVOURS[flavour]
    seq_len = min(EXAMPLE_SEQ_LEN, args.max_seq_len)
    cluster, _ = build_cluster(device, devices)
    plan = make_plan(Workload(args, seq_len, 4 * devices, flavour=flavour), cluster)
    if plan.best is None:
        raise UserError(
            f"{flavour} fits on no layout of {devices} x {cluster.device} (run `titan-pipe plan --model "
            f"{flavour} --devices {devices} --device {device}` to see why); name more devices with --devices"
        )
    chosen = layout_flow(plan.workload, plan.best.layout, cluster, name=flavour)
    name = flavour if run_name_problem(flavour) is None else suggest_run_name(flavour)
    text = set_key(text, None, "name", name)
    text = set_key(text, None, "device", chosen["device"])
    text = set_key(text, "model", "flavour", flavour)
    text = set_key(text, "data", "tokenizer", "byte", note=TOKENIZER_NOTE)
    train = {"steps": 1000, "batch_size": chosen["train"]["batch_size"], "seq_len": seq_len, "warmup_steps": 100}
    for key, value in train.items():
        text = set_key(text, "train", key, value)
    text = set_key(
        text,
        "train",
        "optimizer",
        {"name": "adamw", "lr": 3.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1},
    )
    layout = chosen["parallel"]
    for key in ("dp", "tp", "pp", "pp_schedule", "microbatches", "dp_mode", "sequence_parallel"):
        text = set_key(text, "parallel", key, layout[key])
    if layout["pp_schedule"] == "interleaved_1f1b":
        text = set_key(
            text,
            "parallel",
            "pp_schedule",
            "interleaved_1f1b",
            note=f"virtual_stages: {layout['virtual_stages']} (the planner's pick)",
        )
        text = text.replace(
            "  pp_schedule: interleaved_1f1b",
            f"  virtual_stages: {layout['virtual_stages']}\n  pp_schedule: interleaved_1f1b",
            1,
        )
    for key, value in chosen["precision"].items():
        text = set_key(text, "precision", key, value)
    for key, value in chosen["memory"].items():
        text = set_key(text, "memory", key, value)
    text = set_key(text, None, "zero_stage", chosen["zero_stage"])
    text = set_key(text, "launch", "nnodes", chosen["launch"]["nnodes"])
    if chosen["launch"]["nnodes"] > 1:
        text = set_key(text, "launch", "rdzv_endpoint", chosen["launch"]["rdzv_endpoint"])
    text = set_key(text, "checkpoint", "every", 200)
    for section in ("export", "evaluate"):
        text = set_key(text, section, "seq_len", min(128, seq_len))
    header = (
        f"# {flavour} on {devices} x {cluster.device}: the layout is `titan-pipe plan --model {flavour} "
        f"--devices {devices} --device {device} --seq-len {seq_len}`'s pick\n"
        f"# ({plan.best.tokens_per_s:,.0f} tokens/s, {plan.best.memory.total / 1e9:.1f} GB per device "
        "predicted). Fill in data.path and data.tokenizer, or start from released weights with init_from.\n"
    )
    return header + text
