"""A command's options made from its stage's config section: each option is a field of the section
(titan_pipe.config), its default, type, bounds and help written once there, its flag derived from the
field's name (``seq_len`` -> ``--seq-len``; a bool ``x`` -> ``--x/--no-x``) unless the field names its
own (``json_schema_extra={"flag": "--dynamic/--static"}``). The values the user gives are validated
by the section itself (config.section_from_flags), so a flag and the flow.yaml key take the same
values and fail with the same line, naming the flag.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Literal, Optional, get_args, get_origin

import typer

from titan_pipe.rules import limits
from titan_pipe.config import Section, section_from_flags


def flag_of(cls: type[Section], name: str) -> str:
    """The flag(s) setting field ``name`` of section ``cls``: its own, or derived from the name."""
    f = cls.model_fields[name]
    own = (f.json_schema_extra or {}).get("flag") if isinstance(f.json_schema_extra, dict) else None
    if own:
        return own
    dashed = name.replace("_", "-")
    return f"--{dashed}/--no-{dashed}" if f.annotation is bool else f"--{dashed}"


def limit_of(cls: type[Section], name: str) -> limits.Bound | None:
    """The titan_pipe.rules.limits bound a field was declared with (config.bounded), or None."""
    extra = cls.model_fields[name].json_schema_extra
    limit = extra.get("limit") if isinstance(extra, dict) else None
    return None if limit is None else limits.Bound(*limit)


def flags_of(cls: type[Section], names) -> dict[str, str]:
    """field -> the flag a message names it by (the first of a --x/--no-x pair)."""
    return {n: flag_of(cls, n).split("/")[0] for n in names}


def _annotation(cls: type[Section], name: str) -> tuple[Any, Any, str]:
    """(the type typer parses the flag as, its default, the help): a Literal field is a string the
    section checks (a bad value is then the section's one line naming the flag, as for every other
    value), its choices named in the help."""
    f = cls.model_fields[name]
    ann = f.annotation
    optional = type(None) in get_args(ann)
    base = next(a for a in get_args(ann) if a is not type(None)) if optional else ann
    help = f.description or ""
    if get_origin(base) is Literal:
        help = f"{help} ({' | '.join(map(str, get_args(base)))})"
        base = str
    return (Optional[base] if optional else base), (... if f.is_required() else f.default), help


def section_options(cls: type[Section], names, *, overlay: str | None = None) -> list[inspect.Parameter]:
    """The typer options of the fields ``names`` of section ``cls``, in that order. ``overlay`` (the
    section's flow.yaml name): each option defaults to not given (None), its help naming the
    flow.yaml key and default it then keeps."""
    out = []
    for name in names:
        ann, default, help = _annotation(cls, name)
        if overlay is not None:
            shown = default
            if ann is bool:
                shown = str(shown).lower()
            help = f"{help} \\[default: {overlay}.{name}, {shown}]"  # escaped: rich markup would eat [...]
            ann, default = (ann if type(None) in get_args(ann) else Optional[ann]), None
        option = typer.Option(default, flag_of(cls, name), help=help, show_default=overlay is None)
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=ann))
    return out


def with_section(
    cls: type[Section], names=None, *, into: str = "settings", overlay: str | None = None
) -> Callable[[Callable], Callable]:
    """Give a command the options of section ``cls``'s fields ``names`` (None: every field, in its
    order) and call it with the section they make, validated as flow.yaml's section is, as keyword
    ``into``. ``overlay`` (the section's flow.yaml name): the command gets instead the values given,
    {field: value}, to lay over a section it reads (``laid_over`` validates the result)."""
    names = tuple(cls.model_fields) if names is None else tuple(names)

    flags = flags_of(cls, names)
    bounds = {n: b for n in names if (b := limit_of(cls, n)) is not None}

    def wrap(fn: Callable) -> Callable:
        own = [p for n, p in inspect.signature(fn).parameters.items() if n != into]
        extra = section_options(cls, names, overlay=overlay)

        @functools.wraps(fn)
        def command(**kwargs):
            values = {n: kwargs.pop(n) for n in names}
            for name, bound in bounds.items():
                if isinstance(values[name], (int, float)):
                    limits.check_flag(flags[name], values[name], bound)  # one line saying why, with the range
            if overlay is not None:
                kwargs[into] = {k: v for k, v in values.items() if v is not None}
            else:
                kwargs[into] = section_from_flags(cls, flags, **values)
            return fn(**kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + extra
        command.__signature__ = inspect.Signature(params)
        return command

    return wrap


def laid_over(section: Section, given: dict) -> Section:
    """``section`` with the values a command's flags gave laid over it, validated as flow.yaml's
    section is: a bad value is one line naming the flag."""
    cls = type(section)
    return section_from_flags(cls, flags_of(cls, given), **{**section.model_dump(), **given})
