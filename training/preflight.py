"""Everything `titan-pipe train` can know before it launches a rank, checked in one pass.

``titan-pipe validate`` and ``titan-pipe run`` call it before anything starts, and the launcher
(training/launch.py) before it writes the run's record or spawns torchrun, so a run that would
fail in its ranks fails here instead, one line per problem (ConfigError, exit 2) and nothing
written: the run dir must be creatable and writable, ``init_from`` and the checkpoint a
``--resume`` continues from must hold the model flow.yaml describes, the corpus must fill at
least one global batch, a compiled cpu flow needs a compiler for its backend, and (not for
``validate``) the run dir's disk must hold the checkpoints the run keeps at once. The rules on the
config alone are titan_pipe.config's.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_pipe.records.checkpoint_format import (
    MANIFEST_NAME,
    OPTIMIZER_STATE_COPIES,
    Manifest,
    checkpoint_bytes,
    checkpoints_written,
    is_complete,
    newest_complete,
    step_dirs,
)
from titan_pipe.config import ConfigError, FlowConfig, init_from_path
from titan_pipe.errors import UserError
from titan_pipe.io.faults import free_bytes, human
from titan_pipe.model.args import SHAPE_KEYS, count_params, model_differences
from titan_pipe.model.stated import checkpoint_args

# Raw text whose token count its size cannot settle is tokenized here exactly as data prepare will,
# up to this size; a larger corpus is left to the trainer's own check.
EXACT_CORPUS_BYTES = 1 << 20


def check_before_launch(cfg: FlowConfig, *, flow_path: Path, resume: bool = False, disk: bool = True) -> None:
    """ConfigError naming ``flow_path`` with one line per problem the launch would meet; None if none.
    ``disk``: also the room for the run's checkpoints on this host (off for ``validate``, which may
    check a cluster's flow.yaml on a laptop)."""
    base = Path(flow_path).resolve().parent
    lines = [
        p
        for p in (
            runs_dir_problem(cfg),
            init_from_problem(cfg, base),
            resume_problem(cfg, base) if resume else None,
            corpus_problem(cfg, base, demo=disk),
            compile_problem(cfg),
            tensorboard_problem(cfg),
            float8_launch_problem(cfg) if disk else None,
            disk_problem(cfg, resume=resume) if disk else None,
        )
        if p
    ]
    if lines:
        raise ConfigError(str(flow_path), lines)


def float8_launch_problem(cfg: FlowConfig) -> str | None:
    """precision.float8 on the device this host would launch on (validate, which may run away from
    the cluster, leaves it to the launch)."""
    if cfg.precision.float8 == "none":
        return None
    from titan_pipe.rules.devices import resolve_device
    from titan_pipe.training.float8 import float8_problem

    try:
        device = resolve_device(cfg.device).type
    except (UserError, ValueError):
        return None  # device_problem names it
    return float8_problem(cfg.precision.float8, device)


def device_problem(cfg: FlowConfig) -> str | None:
    """The flow's device must be on this host: what train and run would refuse (run: after Prefect's
    start-up), refused by validate unless it checks a flow for another host (--elsewhere)."""
    from titan_pipe.rules.devices import resolve_device

    try:
        resolve_device(cfg.device)
    except (UserError, ValueError) as e:
        return f"{e} (validate checks the host it runs on)"
    return None


def tensorboard_problem(cfg: FlowConfig) -> str | None:
    """metrics.tensorboard needs the tensorboard package on this host (the ranks import it)."""
    if not cfg.metrics.tensorboard:
        return None
    from titan_pipe.training.tensorboard import tensorboard_missing

    why = tensorboard_missing()
    return f"metrics.tensorboard: {why}" if why else None


def runs_dir_problem(cfg: FlowConfig) -> str | None:
    """The run dir must be a directory this user can create and write."""
    run = cfg.run_dir()  # relative runs_dir: against the cwd, as training resolves it (one rule)
    probe = run
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return (
            f"runs_dir: {cfg.runs_dir!r} cannot hold the run dir {run}: {probe} is a file; choose a "
            "directory for runs_dir"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"runs_dir: {probe} is not writable by this user; choose a writable runs_dir"
    return None


def disk_problem(cfg: FlowConfig, *, resume: bool = False) -> str | None:
    """The disk holding the run dir must take the checkpoints that are on it at once at the run's
    peak: checkpoint.keep_last kept plus the one being written (pruning follows a save), less those a
    resumed run already has there, and no more than the run saves. Short of that the run fails at a
    save, maybe hours in; here it fails before a rank starts."""
    run = cfg.run_dir()  # relative runs_dir: against the cwd, as training resolves it (one rule)
    ck, start, kept = cfg.checkpoint, 0, 0
    latest = newest_complete(run) if resume else None
    if latest is not None:
        try:
            start = Manifest.load(latest).step
        except UserError:  # a LayoutError; resume_problem names the manifest
            return None
        kept = min(ck.keep_last, sum(1 for _, d in step_dirs(run / "checkpoints") if is_complete(d)))
    saves = checkpoints_written(cfg.train.steps, ck.every, start)
    if saves == 0:
        return None
    at_once = min(saves, ck.keep_last + 1 - kept)
    n = count_params(cfg.model.args())
    each = checkpoint_bytes(n, optimizer=cfg.train.optimizer.name, save_optimizer=ck.save_optimizer)
    free = free_bytes(run)
    if free >= at_once * each:
        return None
    state = (
        f" and {cfg.train.optimizer.name}'s fp32 state"
        if ck.save_optimizer and OPTIMIZER_STATE_COPIES[cfg.train.optimizer.name]
        else ""
    )
    held = f", {kept} already there" if kept else ""
    return (
        f"checkpoint: the disk holding {run} has {human(free)} free; this run saves {saves} checkpoint(s) of "
        f"about {human(each)} ({n:,} parameters: fp32 weights{state}), up to {at_once} new at once "
        f"(checkpoint.keep_last {ck.keep_last} plus the one being written{held}), {human(at_once * each)}; "
        f"free {human(at_once * each - free)} there, lower checkpoint.keep_last, set "
        "checkpoint.save_optimizer: false, or choose a runs_dir on a larger disk"
    )


def compile_problem(cfg: FlowConfig) -> str | None:
    """train.compile on a cpu flow: the backend must be able to compile on this host. (auto devices
    are resolved by the ranks; npu's TorchAir is imported there too.)"""
    if not cfg.train.compile or cfg.device != "cpu":
        return None
    from titan_pipe.training.compile import backend_problem  # imports torch: only for a compiled flow

    return backend_problem(cfg.train.compile_backend, "cpu")


def shape_problem(what: str, path: Path, cfg: FlowConfig, fix: str) -> str | None:
    """Why the weights at ``path`` (named ``what`` in the message) cannot start flow.yaml's model."""
    try:
        diffs = model_differences(
            checkpoint_args(path), cfg.model.args(), keys=SHAPE_KEYS, labels=("there", "in flow.yaml")
        )
    except (UserError, ValueError) as e:  # LayoutError is a UserError; checkpoint_args' ModelArgs a ValueError
        return f"{what}: {str(e).splitlines()[0]}"
    if diffs:
        return f"{what}: {path} holds another model shape ({'; '.join(diffs)}); {fix}"
    return files_problem(what, path)


def files_problem(what: str, path: Path) -> str | None:
    """Every file the weights at ``path`` list is there, of its listed size (what a rank would
    otherwise find missing mid-load); the sha256s are checked as each rank reads a file."""
    from titan_pipe.model.weights import CheckpointWeights, open_weights

    try:
        weights = open_weights(path)
        if isinstance(weights, CheckpointWeights):
            for rel, info in weights.manifest.files.items():
                f = weights._paths[rel]
                if not f.is_file():
                    return (
                        f"{what}: {f} is listed in {weights.dir / MANIFEST_NAME} but missing; copy the checkpoint again"
                    )
                if f.stat().st_size != info.size:
                    return (
                        f"{what}: {f} has {f.stat().st_size:,} bytes, but {weights.dir / MANIFEST_NAME} lists "
                        f"{info.size:,}; copy the checkpoint again"
                    )
    except UserError as e:
        return f"{what}: {str(e).splitlines()[0]}"
    return None


def init_from_problem(cfg: FlowConfig, base: Path) -> str | None:
    path = init_from_path(cfg, base)
    return None if path is None else shape_problem("init_from", path, cfg, "set model.* in flow.yaml to match it")


def resume_problem(cfg: FlowConfig, base: Path | None = None) -> str | None:
    """--resume continues the newest complete checkpoint of the run: it must be this model."""
    latest = newest_complete(cfg.run_dir())
    if latest is None:
        return None  # nothing to resume: the trainer starts fresh and says so
    changed = data_changed(cfg, base or Path.cwd())
    if changed:
        return changed
    return shape_problem(
        "--resume",
        latest,
        cfg,
        "resume with the flow.yaml that trained it, or start a fresh run (another name, or without --resume)",
    )


def data_changed(cfg: FlowConfig, base: Path) -> str | None:
    """--resume continues the same data: the run's recorded flow.yaml (the one that trained it) must
    name the data this one does (data.path, blend, format, text_key); checked before the launch
    rewrites that record."""
    import yaml

    recorded = cfg.run_dir() / "flow.yaml"
    try:
        before = yaml.safe_load(recorded.read_text(encoding="utf-8"))
        before = before.get("data") or {} if isinstance(before, dict) else {}
    except (OSError, ValueError, yaml.YAMLError):
        return None  # no readable record: the checkpoint's loader state is checked by the trainer
    from titan_pipe.config import DataConfig

    now, default = cfg.data.model_dump(mode="json"), DataConfig().model_dump(mode="json")

    def same(a, b) -> bool:
        if isinstance(a, str) and isinstance(b, str):
            return (base / a).expanduser().resolve() == (base / b).expanduser().resolve()
        return a == b

    for key in ("path", "blend", "format", "text_key"):
        was = before.get(key, default[key])
        if not (same(was, now[key]) if key == "path" else was == now[key]):
            return (
                f"--resume: data.{key} is {now[key]!r}, but the run trained on {was!r} "
                f"({recorded}); resume with the same data, or start a new run (another name, or without --resume)"
            )
    return None


def corpus_problem(cfg: FlowConfig, base: Path, *, demo: bool = True) -> str | None:
    """The training data must fill one global batch: train.batch_size windows of train.seq_len + 1
    tokens (a blend: one window from each dataset), as the trainer's loader requires. Without
    data.path the data is the shipped demo corpus: checked before a launch on this host (``demo``),
    not by ``validate``, since `titan-pipe plan` and `init --flavour` write flows whose data.path is
    left for the user to fill in."""
    d, t = cfg.data, cfg.train
    if d.path is None and not d.blend and not demo:
        return None
    from titan_pipe.tokens.spec import data_spec

    spec = data_spec(d, base=base)
    blend = len(spec.paths) > 1
    need = (t.seq_len + 1) if blend else t.batch_size * t.seq_len + 1  # windows overlap by one token
    try:
        if spec.text is None:  # token data: its training spans, from the .idx (and data.json) alone
            from titan_pipe.tokens.dataset import open_source

            opened = [
                open_source(p, val_fraction=spec.val_fraction, fraction_given=spec.fraction_given) for p in spec.paths
            ]
            for o in opened:
                o.indexed.verify()  # the whole index, in blocks: what the reader will rely on
            return _token_data_problem(cfg, opened, need)
        if spec.records != "text" and cfg.evaluate.data is None:  # chat records: rendered as prepare will
            return _small_records_problem(cfg, spec, need)
        return _raw_text_problem(cfg, spec, need)
    except UserError as e:
        return str(e)


def _token_data_problem(cfg: FlowConfig, opened: list, need: int) -> str | None:
    """Prepared data: the training spans fill a global batch (sft: the loader's own plan says), the
    held-out spans evaluate's batches."""
    t = cfg.train
    if t.mode == "sft":  # whole conversations packed into windows
        from titan_pipe.training.trainer import training_loader
        from titan_pipe.tokens.dataset import TokenData

        training_loader(
            TokenData([(o.train, 1.0) for o in opened], [o.val for o in opened], opened),
            t,
            dp_rank=0,
            dp_size=cfg.parallel.dp,
            vocab_size=None,
        )
    else:
        short = next((o.train for o in opened if len(o.train) < need), None)
        if short is not None:
            return _too_small(cfg, short.name, f"{len(short):,}", need)
    return held_out_problem(cfg, sum(len(o.val) for o in opened))


def held_out_problem(cfg: FlowConfig, tokens: int) -> str | None:
    """Evaluate reads evaluate.batches x batch_size x seq_len tokens of the validation split (without
    evaluate.data): a split of fewer is refused before training, not after it."""
    e = cfg.evaluate
    need = e.batches * e.batch_size * e.seq_len
    if e.data is not None or tokens >= need:
        return None
    return (
        f"data.val_fraction: {cfg.data.val_fraction:g} holds out {tokens:,} tokens of data.path "
        f"{cfg.data.path or '(the shipped corpus)'}, fewer than evaluate reads after training (evaluate.batches "
        f"{e.batches} x batch_size {e.batch_size} x seq_len {e.seq_len} = {need:,}); raise data.val_fraction, "
        "give evaluate.data, or lower evaluate.batches / batch_size / seq_len"
    )


def _small_records_problem(cfg: FlowConfig, spec, need: int) -> str | None:
    """Chat / instruction records up to EXACT_CORPUS_BYTES: prepared into a temporary dir exactly as the
    data stage will (rendered, masked, split), then checked as prepared data; larger ones are left to
    the trainer's and evaluate's own checks."""
    import tempfile

    from titan_pipe.tokens.dataset import open_source
    from titan_pipe.tokens.sources import corpus_files
    from titan_pipe.training.prepare import prepare_spec

    if sum(f.stat().st_size for f in corpus_files(spec.text)) > EXACT_CORPUS_BYTES:
        return None
    d = cfg.data
    with tempfile.TemporaryDirectory(prefix="titan-pipe-preflight-") as tmp:
        prepare_spec(spec, Path(tmp) / "data", progress=False)  # as the data stage will: its errors in flow keys
        opened = open_source(Path(tmp) / "data", val_fraction=spec.val_fraction, fraction_given=spec.fraction_given)
        try:
            return _token_data_problem(cfg, [opened], need)
        except UserError as e:  # named by the records the user gave, not the temporary dir
            raise UserError(str(e).replace(str(Path(tmp) / "data"), f"data.path {d.path} (as prepared)")) from None


def _raw_text_problem(cfg: FlowConfig, spec, need: int) -> str | None:
    """Raw text: refused when even its size cannot hold ``need`` tokens (no tokenizer makes more
    than a token and an end-of-document per byte), else tokenized and split exactly as prepare
    will when it is small and uncompressed; a larger corpus is left to the trainer's check."""
    from titan_pipe.tokens.sources import corpus_files, kind_of

    if spec.records != "text":  # chat records: rendered and packed when prepared; the trainer's loader checks
        return None
    files = corpus_files(spec.text)
    plain = all(kind_of(f) in (".txt", ".jsonl") for f in files)
    size = sum(f.stat().st_size for f in files)
    if plain and 2 * size < need:
        return _too_small(cfg, cfg.data.path, f"at most {2 * size:,}", need)
    if not plain or size > EXACT_CORPUS_BYTES:
        return None
    from titan_pipe.tokens.corpus import load_corpus
    from titan_pipe.tokens.tokenizer import build_tokenizer

    train, val = load_corpus(path=spec.text, tokenizer=build_tokenizer(spec.tokenizer), text_key=spec.text_key).split(
        spec.val_fraction
    )
    if len(train) < need:
        return _too_small(cfg, cfg.data.path, f"{len(train):,}", need)
    return held_out_problem(cfg, len(val))


def _too_small(cfg: FlowConfig, what: object, have: str, need: int) -> str:
    t = cfg.train
    key = "data.blend" if cfg.data.blend else "data.path"
    if what is None:
        what = "null (the shipped demo corpus)"
    batch = "one window" if cfg.data.blend else f"one global batch of train.batch_size {t.batch_size} x"
    return (
        f"{key}: {what} gives {have} training tokens, fewer than {batch} train.seq_len {t.seq_len} (+1) = "
        f"{need:,}; use more text or lower train.batch_size / train.seq_len (or data.val_fraction)"
    )
