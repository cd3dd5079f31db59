"""Typed reading of values from files someone else wrote: strict types, bounds, one-line refusals.

config.json, params.json, manifest.json, Megatron args, export.json and flow.yaml hold numbers
and flags that size what titan-pipe allocates. Nothing read from them is coerced: ``"false"`` is
not a boolean, ``4.7`` and ``4.0`` are not layer counts, ``true`` is not the integer 1, ``null``
is not a dimension. Every refusal is one UserError line: the file, the key, the value (cut short
by titan_pipe.rules.limits.shown) and the fix.

    n = read(cfg, "num_hidden_layers", INT, source=path, bound=limits.LAYERS)
    eps = read(cfg, "rms_norm_eps", FLOAT, source=path, default=1e-5, bound=limits.NORM_EPS)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from titan_pipe.errors import UserError
from titan_pipe.rules.limits import JSON_BYTES, Bound, shown

INT, FLOAT, BOOL, STR, DICT, LIST = "int", "float", "bool", "str", "dict", "list"
REQUIRED = object()  # the ``default`` of a key that must be present

_NAMES = {
    INT: "an integer",
    FLOAT: "a number",
    BOOL: "true or false",
    STR: "a string",
    DICT: "an object",
    LIST: "a list",
}
_FIXES = {
    INT: "write a whole number without quotes or a decimal point",
    FLOAT: "write a number without quotes",
    BOOL: "write true or false without quotes",
    STR: "write a quoted string",
    DICT: "write an object {...}",
    LIST: "write a list [...]",
}


def _type_name(value: object) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def type_problem(value: object, kind: str) -> str | None:
    """Why ``value`` is not of ``kind`` (strictly: bool is no int, 4.0 is no int), or None."""
    if kind == INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok and isinstance(value, float) and math.isfinite(value):
            return "is not a whole number" if value != int(value) else "has a decimal point; an integer is needed"
    elif kind == FLOAT:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            return "is not a finite number"
    elif kind == BOOL:
        ok = isinstance(value, bool)
    elif kind == STR:
        ok = isinstance(value, str)
    elif kind == DICT:
        ok = isinstance(value, dict)
    elif kind == LIST:
        ok = isinstance(value, (list, tuple))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return None if ok else f"is {_type_name(value)}, not {_NAMES[kind]}"


def refuse(
    source: object, key: str, value: object, problem: str, fix: str, *, exc: type[Exception] = UserError
) -> Exception:
    """The one-line error for ``key`` = ``value`` of ``source`` (a UserError, or ``exc`` for a
    record whose callers expect their own error type)."""
    return exc(f"{source}: {key} = {shown(value)} {problem}; {fix}")


def check(
    value: object,
    kind: str,
    *,
    source: object,
    key: str,
    bound: Bound | None = None,
    fix: str = "",
    exc: type[Exception] = UserError,
) -> Any:
    """``value`` if it is strictly of ``kind`` and inside ``bound``; ``exc`` naming it otherwise."""
    why = type_problem(value, kind)
    if why:
        raise refuse(source, key, value, why, fix or _FIXES[kind], exc=exc)
    if bound is not None and kind in (INT, FLOAT):
        why = bound.problem(value)
        if why:
            raise refuse(source, key, value, why, fix or f"use a value in {bound.range}", exc=exc)
    return float(value) if kind == FLOAT else value


def read(
    d: Mapping,
    key: str,
    kind: str,
    *,
    source: object,
    default: Any = REQUIRED,
    bound: Bound | None = None,
    fix: str = "",
    prefix: str = "",
    exc: type[Exception] = UserError,
) -> Any:
    """``d[key]`` checked as ``kind`` (see ``check``). Absent, or null where a default exists:
    the default; absent or null where none does: ``exc`` saying so. ``prefix`` names the
    enclosing key in messages (``rope_parameters.``)."""
    name = prefix + key
    value = d.get(key) if isinstance(d, Mapping) else None
    if value is None:
        if default is not REQUIRED:
            return default
        if isinstance(d, Mapping) and key in d:
            raise refuse(source, name, None, f"is null, not {_NAMES[kind]}", fix or f"give {name} a value", exc=exc)
        raise exc(f"{source}: missing field {name!r}; {fix or f'add {name}'}")
    return check(value, kind, source=source, key=name, bound=bound, fix=fix, exc=exc)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json object hook: a key given twice is refused (json.loads would silently keep the last)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_json(path: Path, *, what: str, fix: str = "rewrite it or copy it again from where it was made") -> dict:
    """The JSON object in ``path`` (``what`` it should hold, for messages): bounded in size, UTF-8,
    no key given twice, an object at the top; UserError naming the file otherwise."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > JSON_BYTES.hi:
            raise UserError(
                f"{path}: {size / 2**20:.0f} MiB, larger than {what} can be ({JSON_BYTES.hi / 2**20:.0f} MiB); {fix}"
            )
        data = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; {fix}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 JSON (byte {e.start}); {fix}") from None
    except (ValueError, RecursionError) as e:
        raise UserError(f"{path}: not valid JSON for {what} ({str(e)[:200]}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object ({what}), got {_type_name(data)}; {fix}")
    return data
