"""Chat and instruction records rendered with a chat template, and which characters are answers.

A record is a conversation: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI style) or
an instruction pair ``{"prompt": ..., "response": ...}`` (``system`` optional; ``instruction`` /
``input`` / ``output`` as Alpaca names them are read too). It is rendered to text by a Jinja chat
template exactly as transformers' ``apply_chat_template`` renders it (same environment: sandboxed,
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception``, the special
tokens of tokenizer_config.json as variables), so the tokens equal ``apply_chat_template``'s.

The loss targets are the assistant turns: the characters a template marks with
``{% generation %}`` when it has such blocks (what transformers' ``return_assistant_tokens_mask``
reads), otherwise each assistant turn found by rendering the conversation up to it: the turn starts
where ``render(messages[:i], add_generation_prompt=True)`` ends and runs to where
``render(messages[:i + 1])`` ends (aligned back onto the whole conversation when a template renders
a last turn differently, as Qwen3's adds an empty think block to the last answer). A token is a
target when it overlaps a target span (transformers' rule).
"""
from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError
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
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}


class BadRecord(ValueError):
    """A record that cannot be trained on; the message says why (counted and named by prepare)."""


_tracking: ContextVar = ContextVar("titan_pipe_generation_spans", default=None)


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


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
        return _compile(self.source).render(messages=messages, tools=None, documents=None,
                                            add_generation_prompt=add_generation_prompt, **self.special)

    def _render_marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _tracking.set((blocks, spans))
        try:
            for piece in _compile(self.source).generate(messages=messages, tools=None, documents=None,
                                                        add_generation_prompt=False, **self.special):
                blocks.append(piece)
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
                text = self.render(messages)
                spans = [self._turn_span(text, messages, i) for i, m in enumerate(messages)
                         if m["role"] == "assistant"]
        except BadRecord:
            raise
        except jinja2.exceptions.TemplateError as e:
            raise BadRecord(f"the chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise BadRecord(f"the chat template failed: {type(e).__name__}: {e}") from None
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            raise BadRecord("the chat template renders no answer text (an assistant turn is empty?)")
        return text, spans

    def _turn_span(self, text: str, messages: list[dict], i: int) -> tuple[int, int]:
        prompt = self.render(messages[:i], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise BadRecord(f"the chat template renders the prompt of message {i} differently once the answer "
                            "follows; mark its answers with {% generation %} blocks or use a built-in template")
        start = len(prompt)
        upto = self.render(messages[:i + 1])
        if text.startswith(upto) and len(upto) > start:
            return start, len(upto)
        return start, start + _aligned_end(upto[start:], text[start:])


def _aligned_end(turn: str, rest: str) -> int:
    """Where ``turn`` (a turn as rendered when last) ends inside ``rest`` (the conversation from the
    turn's start): the end of the last block of ``turn`` that ``rest`` holds in the same order."""
    from difflib import SequenceMatcher

    blocks = [b for b in SequenceMatcher(None, turn, rest[:len(turn) + 256], autojunk=False).get_matching_blocks()
              if b.size]
    if not blocks:
        raise BadRecord("the answer's text is not found in the rendered conversation")
    last = blocks[-1]
    return last.b + last.size


def builtin_template(name: str, special: dict | None = None) -> ChatTemplate:
    return ChatTemplate(BUILTIN_TEMPLATES[name], f"builtin:{name}", dict(special or {}))


def load_chat_template(spec: str, *, tokenizer_dir: Path | None) -> ChatTemplate:
    """``spec``: "model" (the tokenizer's own: ``chat_template`` of tokenizer_config.json, or a
    chat_template.jinja beside it), a built-in name (chatml, llama3), or a .jinja file."""
    config: dict = {}
    cfg_path = tokenizer_dir / "tokenizer_config.json" if tokenizer_dir is not None else None
    if cfg_path is not None and cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise UserError(f"{cfg_path}: not valid JSON ({e}); fix the file or pass --chat-template chatml") from None
        if not isinstance(config, dict):
            raise UserError(f"{cfg_path}: a JSON {type(config).__name__}, not an object; fix the file or pass "
                            "--chat-template chatml")
    special = special_tokens(config)
    if spec in BUILTIN_TEMPLATES:
        return builtin_template(spec, special)
    if spec != "model":
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--chat-template {spec!r}: not a file, nor one of model, "
                            f"{', '.join(BUILTIN_TEMPLATES)}; give a .jinja file or a built-in name")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path.resolve()), special)
    jinja = tokenizer_dir / "chat_template.jinja" if tokenizer_dir is not None else None
    if jinja is not None and jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"), str(jinja.resolve()), special)
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        where = cfg_path or "the byte tokenizer"
        raise UserError(f"{where}: no chat_template; pass --chat-template chatml (or llama3, or a .jinja file)")
    return ChatTemplate(source, str(cfg_path.resolve()), special)


def conversation(record, *, fmt: str) -> list[dict]:
    """The messages of one parsed jsonl record; BadRecord naming what is wrong."""
    if not isinstance(record, dict):
        raise BadRecord(f"a {type(record).__name__}, not a JSON object")
    if fmt == "instruction":
        prompt = record.get("prompt", record.get("instruction"))
        if isinstance(prompt, str) and isinstance(record.get("input"), str) and record["input"].strip():
            prompt = f"{prompt}\n\n{record['input']}"
        response = record.get("response", record.get("output"))
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise BadRecord(f"no prompt/response strings (found keys {sorted(record)})")
        messages = ([{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else [])
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRecord(f"no 'messages' list (found keys {sorted(record)})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise BadRecord(f"message {i} has role {role!r}, not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadRecord(f"message {i} ({m['role']}) has {'empty' if isinstance(content, str) else 'no'} content")
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
        mask[first:last + 1] = 1
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
