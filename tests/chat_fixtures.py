"""Small real chat data for the fine-tuning tests: a byte-level BPE tokenizer with ChatML's special
tokens and a chat template of its own in tokenizer_config.json, and chat / instruction jsonl."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "what",
    "is",
    "plus",
    "the",
    "answer",
    "hello",
    "thanks",
    "again",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A template written for these tests in the shape of Qwen3's: ChatML turns, and the last answer after
# the last user turn gets an (empty) think block the earlier answers do not: rendering a conversation
# up to an answer is then not a prefix of the whole, which the answer finder must handle.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def sentence(i: int, n: int = 6) -> str:
    return " ".join(WORDS[(i * 7 + j * 5) % len(WORDS)] for j in range(n))


def train_tokenizer(out: Path, *, template: str = THINKING_TEMPLATE) -> Path:
    """A real byte-level BPE tokenizer.json + tokenizer_config.json (eos <|im_end|>, the template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([sentence(i, 12) + " <think> </think> user assistant system" for i in range(300)], trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
            }
        )
    )
    return out


def chat_records(n: int, *, seed: int = 0) -> list[dict]:
    """n conversations: 1-3 user/assistant exchanges, some with a system message, varied lengths."""
    out = []
    for i in range(n):
        k = i + seed * 1000
        msgs = [{"role": "system", "content": "be brief " + sentence(k, 2)}] if k % 3 == 0 else []
        for t in range(1 + k % 3):
            msgs.append({"role": "user", "content": sentence(k + t, 3 + (k + t) % 5)})
            msgs.append({"role": "assistant", "content": sentence(k * 3 + t, 2 + (k * 5 + t) % 7)})
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
