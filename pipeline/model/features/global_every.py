"""Global layers among sliding ones (Gemma 3: five sliding-window layers to one global): layer i
attends to every position before it when (i + 1) % ``global_every`` == 0, the others slide over the
model's window (ModelArgs.layer_window; the window needs to be set: features.REQUIRES). The sliding layers may rotate with a RoPE base
of their own, unscaled (``rope_local_theta``); the global ones with rope_theta and the configured
scaling. Fields ``model.global_every`` (0: off) and ``model.rope_local_theta`` (None: one table)."""

from __future__ import annotations

from titan_pipe.model.features.feature import Feature, RopeTable
from titan_pipe.rules import limits
from titan_pipe.rules.limits import Bound

LOCAL = "local"  # the sliding layers' RoPE table (buffers and initializers ``rope_cos_local``, ``rope_sin_local``)


def _table(args) -> RopeTable | None:
    return None if args.rope_local_theta is None else RopeTable(LOCAL, args.rope_local_theta, scaled=False)


def _layer_rope(args, i: int) -> str:
    return LOCAL if args.rope_local_theta is not None and not args.is_global_layer(i) else ""


def _check(args) -> list[str]:
    out = []
    if args.rope_local_theta is not None and not args.global_every:
        out.append(
            f"rope_local_theta: {args.rope_local_theta:g} is the sliding layers' RoPE base beside global "
            "layers, but global_every is 0; set global_every, or drop rope_local_theta"
        )
    return out


def _describe(m: dict) -> str:
    local = m.get("rope_local_theta")
    bases = f"RoPE base {m['rope_theta']:,.0f}" + (f", sliding {local:,.0f}" if local is not None else "")
    return f"1 global layer in {m['global_every']} ({bases})"


FEATURE = Feature(
    name="global_every",
    label="global layers among sliding ones",
    switch=False,
    compared=(("global_every", "global_every"), ("rope_local_theta", "rope_local_theta")),
    bounds=(
        ("global_every", Bound(0, limits.LAYERS.hi, "0: no global layers; N: every N-th layer attends fully")),
        ("rope_local_theta", limits.ROPE_THETA),
    ),
    rope_table=_table,
    layer_rope=_layer_rope,
    check=_check,
    describe=_describe,
)
