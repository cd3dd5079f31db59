"""Chat and instruction records rendered with a chat template, and which characters are answers.

A record is a conversation: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI style) or
an instruction pair ``{"prompt": ..., "response": ...}`` (``system`` optional; ``instruction`` /
``input`` / ``output`` as Alpaca names them are read too). It is rendered to text by a Jinja chat
template exactly as transformers' ``apply_chat_template`` renders it (same environment: sandboxed,
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``, the special
tokens of tokenizer_config.json as variables), so the tokens equal ``apply_chat_template``'s.

The loss targets are the assistant turns: the characters a template marks with
``{% generation %}`` when it has such blocks (what transformers' ``return_assistant_tokens_mask``
reads), otherwise found from the template's own structure, in one render of the whole
conversation: every ``for`` loop of the template is instrumented to record where each iteration
starts and where the loop ends, and the loop whose iterations are the conversation's own message
objects and render the most text is the turn loop. Message i's turn is the text its iteration
renders; an assistant turn's answer is that text after its header (the longest prefix it shares
with the template's generation prompt, ``render(messages[:i], add_generation_prompt=True)`` past
``render(messages[:i])``) up to its last non-space character: the content and the end-of-turn
marker, a think block the template puts there included, as a ``{% generation %}`` block around
them would mark it. Each answer is checked to hold its message's content; a template whose turns
cannot be found that way (no turn loop, no generation prompt, turns rendered through buffers) is
refused with the advice to mark its answers. A token is a target when it overlaps a target span
(transformers' rule).

Bounds (``RENDER_SECONDS``, ``RENDER_CHARS``): one render stops with a one-line refusal after 10 s
or 4 Mi characters of output, whichever first, so a looping or exploding template never hangs
prepare nor exhausts memory.
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.rules.limits import TEMPLATE_BYTES
from titan_pipe.tokens.tokenizer import special_tokens

ROLES = ("system", "user", "assistant", "tool")

# Built-in templates for tokenizers without one of their own; both mark the answers with
# {% generation %} blocks, the end-of-turn marker included (the model learns to stop).
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}


class BadRecord(ValueError):
    """A record that cannot be trained on; the message says why (counted and named by prepare)."""


_tracking: ContextVar = ContextVar("titan_pipe_generation_spans", default=None)
_turns: ContextVar = ContextVar("titan_pipe_turns", default=None)
_deadline: ContextVar = ContextVar("titan_pipe_render_deadline", default=None)
TURN_CALL = "__titan_pipe_turn"  # the function the instrumented loops call (not a name a template uses)
CONCAT_CALL = "__titan_pipe_concat"  # what the ``~`` operator becomes: a concatenation with its size checked
RENDER_SECONDS = 10.0  # one render of one conversation
RENDER_CHARS = 4 * 2**20  # its output
MAX_MESSAGES = 65536  # turns in one conversation


def _instrument(tree) -> None:
    """Every ``for`` loop calls TURN_CALL(loop id, item) as its body starts (item: its target, or
    a tick for a tuple target) and TURN_CALL(loop id, None) once the loop is done (in place, on
    the parsed template): the turn finder's marks, and where a render's time bound is checked."""
    from jinja2 import nodes

    count = [0]

    def mark(loop_id: int, item) -> "nodes.Output":
        return nodes.Output([nodes.Call(nodes.Name(TURN_CALL, "load"), [nodes.Const(loop_id), item], [], None, None)])

    def walk(node) -> None:
        for field_name, value in list(node.iter_fields()):
            if isinstance(value, nodes.Concat):
                setattr(node, field_name, nodes.Call(nodes.Name(CONCAT_CALL, "load"), value.nodes, [], None, None))
            elif isinstance(value, list):
                setattr(
                    node,
                    field_name,
                    [
                        nodes.Call(nodes.Name(CONCAT_CALL, "load"), v.nodes, [], None, None)
                        if isinstance(v, nodes.Concat)
                        else v
                        for v in value
                    ],
                )
        for field_name in ("body", "else_", "elif_"):
            children = getattr(node, field_name, None)
            if not isinstance(children, list):
                continue
            out = []
            for child in children:
                walk(child)
                out.append(child)
                if isinstance(child, nodes.For):
                    count[0] += 1
                    item = (
                        nodes.Name(child.target.name, "load")
                        if isinstance(child.target, nodes.Name)
                        else nodes.Const("tick")
                    )
                    child.body.insert(0, mark(count[0], item))
                    out.append(mark(count[0], nodes.Const(None)))
            setattr(node, field_name, out)
        for child in node.iter_child_nodes():
            if not isinstance(child, list):
                walk(child)

    walk(tree)


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: records the span of text the block renders."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            state = _tracking.get()
            if state is not None:
                blocks, spans = state
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with ``*``, ``**`` and ``+`` refused where their result would pass the output
        bound (one such operation allocates its result at once, before any time check)."""

        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            if (
                operator == "**"
                and isinstance(right, int)
                and isinstance(left, (int, float))
                and abs(left) > 1
                and right > 4096
            ):
                raise BadRecord(f"the chat template raises a number to the power {right} (over the bound of 4096)")
            if operator in ("*", "+"):
                _check_size(_result_size(operator, left, right))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                _check_size(_method_size(owner, getattr(__obj, "__name__", ""), args))
            return super().call(__context, __obj, *args, **kwargs)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals[CONCAT_CALL] = lambda *parts: (
        "".join(map(str, parts))
        if _check_size(sum(len(p) if isinstance(p, str) else len(str(p)) for p in parts)) is None
        else ""
    )
    for name in ("center", "indent", "replace", "join", "wordwrap"):  # their result's size, checked first
        env.filters[name] = _bounded_filter(name, env.filters[name])

    def turn(loop_id, item):
        deadline = _deadline.get()
        if deadline is not None and time.monotonic() > deadline:
            raise BadRecord(
                f"the chat template took over {RENDER_SECONDS:.0f} s to render one conversation "
                "(the bound); a template that loops?"
            )
        state = _turns.get()
        if state is not None and not isinstance(item, str):
            blocks, events, ids = state
            index = ids.get(id(item)) if item is not None else -1
            if index is not None:
                events.append((loop_id, sum(map(len, blocks)), index))
        return ""

    env.globals[TURN_CALL] = turn
    tree = env.parse(source)
    _instrument(tree)
    return env.from_string(tree)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source, where it came from, and the special tokens it may name."""

    source: str
    origin: str  # a file path or "builtin:NAME"
    special: dict = field(default_factory=dict)

    @property
    def marks_answers(self) -> bool:
        import re

        return re.search(r"\{%-?\s*generation\s*-?%\}", self.source) is not None

    @property
    def sha256(self) -> str:
        import hashlib

        return hashlib.sha256(self.source.encode()).hexdigest()

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        return "".join(self._pieces(_compile(self.source), messages, add_generation_prompt, []))

    def _pieces(self, template, messages: list[dict], add_generation_prompt: bool, blocks: list[str]) -> list[str]:
        """The rendered pieces, appended to ``blocks`` as they come, within RENDER_SECONDS (checked at
        every piece and every loop iteration) and RENDER_CHARS."""
        deadline, size = time.monotonic() + RENDER_SECONDS, 0
        token = _deadline.set(deadline)
        try:
            for piece in template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            ):
                blocks.append(piece)
                size += len(piece)
                if size > RENDER_CHARS:
                    raise BadRecord(
                        f"the chat template's output passed {RENDER_CHARS:,} characters (the bound of "
                        "one conversation's render); a template that loops or repeats text?"
                    )
                if time.monotonic() > deadline:
                    raise BadRecord(
                        f"the chat template took over {RENDER_SECONDS:.0f} s to render one "
                        "conversation (the bound); a template that loops?"
                    )
        finally:
            _deadline.reset(token)
        return blocks

    def _render_marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _tracking.set((blocks, spans))
        try:
            self._pieces(_compile(self.source), messages, False, blocks)
        finally:
            _tracking.reset(token)
        return "".join(blocks), spans

    def answer_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the [start, end) character spans of its answers."""
        import jinja2

        try:
            if self.marks_answers:
                text, spans = self._render_marked(messages)
            else:
                text, spans = self._structural_spans(messages)
        except BadRecord:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise BadRecord(f"the chat template failed: {_line(e)}") from None
        except RecursionError:
            raise BadRecord("the chat template recurses without end") from None
        except (
            TypeError,
            ValueError,
            KeyError,
            AttributeError,
            IndexError,
            ZeroDivisionError,
            OverflowError,
            MemoryError,
        ) as e:
            raise BadRecord(f"the chat template failed: {type(e).__name__}: {_line(e)}") from None
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            raise BadRecord("the chat template renders no answer text (an assistant turn is empty?)")
        return text, spans

    def _structural_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation rendered once through the instrumented template, and its answers:
        each assistant iteration of the turn loop past its header, to its last non-space character."""
        blocks: list[str] = []
        events: list[tuple[int, int, int]] = []
        token = _turns.set((blocks, events, {id(m): i for i, m in enumerate(messages)}))
        try:
            self._pieces(_compile(self.source), messages, False, blocks)
        finally:
            _turns.reset(token)
        text = "".join(blocks)
        turns = _turn_loop(events)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i not in turns:
                raise BadRecord(f"message {i} (assistant) is not rendered by a loop over the messages; {ADVICE}")
            start, end = turns[i]
            header = self._header(messages, i)
            seg = text[start:end]
            h = len(_common_prefix(seg, header))
            body = seg[h:].rstrip()
            if h == 0 or not body:
                raise BadRecord(
                    f"message {i} (assistant): its turn does not start with the template's generation "
                    f"prompt {header!r}; {ADVICE}"
                )
            want = m["content"].split("</think>")[-1].strip()
            if want and want not in body:
                raise BadRecord(f"message {i} (assistant): its content is not in the text its turn renders; {ADVICE}")
            spans.append((start + h, start + h + len(body)))
        return text, spans

    def _header(self, messages: list[dict], i: int) -> str:
        """What the template writes before an answer: its generation prompt after ``messages[:i]``."""
        before = self.render(messages[:i])
        prompt = self.render(messages[:i], add_generation_prompt=True)
        if not prompt.startswith(before) or len(prompt) == len(before):
            raise BadRecord(
                f"the chat template writes no generation prompt after message {i - 1}, so where an "
                f"answer starts is unknown; {ADVICE}"
            )
        return prompt[len(before) :]


ADVICE = "mark the answers with {% generation %} blocks in the template, or use --chat-template chatml/llama3"


def _check_size(size: int) -> None:
    if size > RENDER_CHARS:
        raise BadRecord(
            f"the chat template builds a value of {size:,} characters, over the bound of "
            f"{RENDER_CHARS:,}; a template that repeats text?"
        )


def _method_size(s: str, name: str, args: tuple) -> int:
    """The size of what a str method called from a template would build (0: no growth to bound)."""
    n = next((a for a in args if isinstance(a, int)), 0)
    if name in ("ljust", "rjust", "center", "zfill"):
        return max(len(s), n)
    if name == "expandtabs":
        return len(s) + s.count("\t") * max(n, 8)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return len(s) + (s.count(args[0]) if args[0] else len(s) + 1) * max(0, len(args[1]) - len(args[0]))
    if name == "join" and args:
        items = list(args[0]) if isinstance(args[0], (list, tuple)) else []
        return sum(len(str(i)) for i in items) + len(s) * max(0, len(items) - 1)
    return 0


def _bounded_filter(name: str, fn):
    """A Jinja filter that refuses, before building it, a result over the output bound."""
    import functools

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        value = args[1] if args and not isinstance(args[0], (str, list, tuple, int)) else (args[0] if args else "")
        rest = args[2:] if value is not (args[0] if args else None) else args[1:]
        if isinstance(value, str):
            if name in ("center", "indent"):
                width = next((a for a in rest if isinstance(a, int)), kwargs.get("width", 4))
                lines = value.count("\n") + 1
                _check_size(len(value) + max(width, 0) * (lines if name == "indent" else 1))
            elif name == "replace":
                _check_size(_method_size(value, "replace", tuple(rest[:2])))
        elif name == "join" and isinstance(value, (list, tuple)):
            sep = rest[0] if rest and isinstance(rest[0], str) else kwargs.get("d", "")
            _check_size(sum(len(str(v)) for v in value) + len(sep) * max(0, len(value) - 1))
        return fn(*args, **kwargs)

    return bounded


def _result_size(operator: str, left, right) -> int:
    """Items in ``left * right`` or ``left + right`` for strings and lists (0 for numbers)."""
    seqs = (str, list, tuple)
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, seqs) and isinstance(n, int):
                return len(seq) * max(n, 0)
        return 0
    return len(left) + len(right) if isinstance(left, seqs) and isinstance(right, seqs) else 0


def _line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def _turn_loop(events: list[tuple[int, int, int]]) -> dict[int, tuple[int, int]]:
    """{message index: (start, end)} of the loop whose iterations are the messages and render the
    most text (a loop that only looks at them, such as one finding the last user turn, renders
    none); an iteration ends where the next one starts or the loop ends."""
    by_loop: dict[int, list[tuple[int, int]]] = {}
    for loop_id, pos, index in events:
        by_loop.setdefault(loop_id, []).append((pos, index))
    best, best_size = {}, 0
    for marks in by_loop.values():
        turns = {}
        for (pos, index), (nxt, _) in zip(marks, marks[1:]):
            if index >= 0:
                turns[index] = (pos, nxt)
        size = sum(b - a for a, b in turns.values())
        if size > best_size:
            best, best_size = turns, size
    return best


def builtin_template(name: str, special: dict | None = None) -> ChatTemplate:
    return ChatTemplate(BUILTIN_TEMPLATES[name], f"builtin:{name}", dict(special or {}))


def load_chat_template(spec: str, *, tokenizer_dir: Path | None) -> ChatTemplate:
    """``spec``: "model" (the tokenizer's own: ``chat_template`` of tokenizer_config.json, or a
    chat_template.jinja beside it), a built-in name (chatml, llama3), or a .jinja file. Files beside
    the tokenizer are read only inside its dir (a link leading out is refused), every file bounded
    in size before it is read."""
    from titan_pipe.io.paths import resolve_inside
    from titan_pipe.rules.values import read_json

    config: dict = {}
    fix = "fix the file or pass --chat-template chatml"
    cfg_path = (
        resolve_inside(tokenizer_dir, "tokenizer_config.json", source=tokenizer_dir, what="tokenizer file")
        if tokenizer_dir is not None
        else None
    )
    if cfg_path is not None and cfg_path.is_file():
        config = read_json(cfg_path, what="a tokenizer config", fix=fix)
    special = special_tokens(config)
    if spec in BUILTIN_TEMPLATES:
        return builtin_template(spec, special)
    if spec != "model":
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(
                f"--chat-template {spec!r}: not a file, nor one of model, "
                f"{', '.join(BUILTIN_TEMPLATES)}; give a .jinja file or a built-in name"
            )
        return ChatTemplate(_template_text(path, f"--chat-template {spec!r}"), str(path.resolve()), special)
    jinja = (
        resolve_inside(tokenizer_dir, "chat_template.jinja", source=tokenizer_dir, what="tokenizer file")
        if tokenizer_dir is not None
        else None
    )
    if jinja is not None and jinja.is_file():
        return ChatTemplate(_template_text(jinja, str(jinja)), str(jinja.resolve()), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        where = cfg_path or "the byte tokenizer"
        raise UserError(f"{where}: no chat_template; pass --chat-template chatml (or llama3, or a .jinja file)")
    if len(source) > TEMPLATE_BYTES.hi:
        raise UserError(
            f"{cfg_path}: its chat_template has {len(source):,} characters, over the bound of "
            f"{int(TEMPLATE_BYTES.hi):,} ({TEMPLATE_BYTES.why}); {fix}"
        )
    return ChatTemplate(source, str(cfg_path.resolve()), special)


def _template_text(path: Path, label: str) -> str:
    """A template file's text: bounded in size before it is read, UTF-8, parsed by Jinja once."""
    size = path.stat().st_size
    if size > TEMPLATE_BYTES.hi:
        raise UserError(
            f"{label}: {size:,} bytes, over the bound of {int(TEMPLATE_BYTES.hi):,} for a chat template "
            f"({TEMPLATE_BYTES.why}); give the template itself"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{label}: not UTF-8 text (byte {e.start}); give a .jinja template") from None
    try:
        _compile(text)
    except Exception as e:  # jinja2.TemplateSyntaxError and what the instrumenting parse raises
        raise UserError(
            f"{label}: not a Jinja template ({type(e).__name__}: {_line(e)}); fix it or pass --chat-template chatml"
        ) from None
    return text


def conversation(record, *, fmt: str) -> list[dict]:
    """The messages of one parsed jsonl record; BadRecord naming what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"a {type(record).__name__}, not a JSON object")
    if fmt == "instruction":
        for key in ("system", "input"):  # given, they are part of the prompt: never dropped for their type
            if record.get(key) is not None and not isinstance(record[key], str):
                raise BadRecord(f"'{key}' is a {type(record[key]).__name__}, not a string")
        prompt = record.get("prompt", record.get("instruction"))
        if isinstance(prompt, str) and isinstance(record.get("input"), str) and record["input"].strip():
            prompt = f"{prompt}\n\n{record['input']}"
        response = record.get("response", record.get("output"))
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise BadRecord(f"no prompt/response strings (found keys {sorted(record)})")
        messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRecord(f"no 'messages' list (found keys {sorted(record)})")
    if len(messages) > MAX_MESSAGES:
        raise BadRecord(f"{len(messages):,} messages, over the bound of {MAX_MESSAGES:,} for one conversation")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise BadRecord(f"message {i} has role {role!r}, not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRecord(f"message {i} ({m['role']}) has {'empty' if isinstance(content, str) else 'no'} content")
        chars += len(content)
        if chars > RENDER_CHARS:
            raise BadRecord(
                f"over {RENDER_CHARS:,} characters of content by message {i} (the bound of one "
                "conversation's render); split the conversation"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRecord("no assistant message: nothing to learn from")
    return out


def answer_mask(encoding, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token of a ``tokenizers`` Encoding: 1 where the token overlaps an answer span; the
    tokens of a span found by its first and last characters (``char_to_token``), not by walking every
    token's offsets: the same mask as ``token_mask`` (tests), in O(spans)."""
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        first = next((t for c in range(a, b) if (t := encoding.char_to_token(c)) is not None), None)
        if first is None:
            continue
        last = next(t for c in range(b - 1, a - 1, -1) if (t := encoding.char_to_token(c)) is not None)
        mask[first : last + 1] = 1
    return mask


def token_mask(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 where the token's characters overlap an answer span (spans in order)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    j = 0
    for t, (a, b) in enumerate(offsets):
        while j < len(spans) and a >= spans[j][1]:
            j += 1
        if j == len(spans):
            break
        if b > spans[j][0]:
            mask[t] = 1
    return mask
