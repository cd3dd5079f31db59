"""The answers of a chat conversation (the fine-tuning loss mask) found from a template without
{% generation %} blocks equal transformers' return_assistant_tokens_mask on the same template with
the answers marked by hand: multi-turn, with reasoning content (a Qwen3-shaped template that drops
earlier turns' reasoning and keeps the last's), a system message, and the project's own fixture
template over 300 conversations. Templates whose turns cannot be found are refused, not guessed."""

from __future__ import annotations

import pytest

from chat_fixtures import THINKING_TEMPLATE, chat_records, sentence, train_tokenizer
from titan_pipe.tokens.chat import BadRecord, ChatTemplate, answer_mask

# Qwen3's shape (written for these tests): the system turn first, the index of the last user turn
# found by a reversed loop that renders nothing, reasoning taken from reasoning_content or from a
# <think> block in the content, kept only for the answers after the last user turn.
_HEAD = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=messages|length - 1, seen=false) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.seen and message['role'] == 'user' %}{%- set ns.seen = true %}{%- set ns.last_query = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message['content'] %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{%- set reasoning = '' %}"
    "{%- if message['reasoning_content'] is string %}{%- set reasoning = message['reasoning_content'] %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
)
_TAIL = "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
QWEN3_SHAPED = (
    _HEAD
    + (
        "{%- if loop.index0 > ns.last_query %}"
        "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}"
        "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
    )
    + _TAIL
)
QWEN3_MARKED = (
    _HEAD
    + (
        "{{- '<|im_start|>assistant\\n' }}{%- generation %}"
        "{%- if loop.index0 > ns.last_query %}"
        "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}"
        "{%- else %}{{- content }}{%- endif %}"
        "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    )
    + _TAIL
)

# The fixture template (an empty think block on the answers after the last user turn), marked by hand.
THINKING_MARKED = THINKING_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}",
)


def reasoning_records(n: int) -> list[dict]:
    """Multi-turn conversations whose answers carry reasoning: as a <think> block in the content
    (even i) or as reasoning_content (odd i); some with a system turn, some ending in a tool-free
    second answer after the last user turn."""
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "think then answer " + sentence(i, 2)}] if i % 3 == 0 else []
        for t in range(2 + i % 2):
            msgs.append({"role": "user", "content": sentence(i + t, 3 + t)})
            answer, why = sentence(i * 5 + t, 2 + t), sentence(i * 7 + t, 3)
            if i % 2 == 0:
                msgs.append({"role": "assistant", "content": f"<think>\n{why}\n</think>\n\n{answer}"})
            else:
                msgs.append({"role": "assistant", "content": answer, "reasoning_content": why})
        if i % 4 == 1:
            msgs.append({"role": "assistant", "content": "and " + sentence(i, 2)})
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = train_tokenizer(tmp_path_factory.mktemp("answers") / "tok")
    return Tokenizer.from_file(str(d / "tokenizer.json")), AutoTokenizer.from_pretrained(str(d))


def _ours(tok, template: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    text, spans = ChatTemplate(template, "test").answer_spans(messages)
    enc = tok.encode(text, add_special_tokens=False)
    return enc.ids, answer_mask(enc, spans).tolist()


def _transformers(hf, marked: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = hf.apply_chat_template(
        messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize(
    "template,marked,conversations",
    [
        (QWEN3_SHAPED, QWEN3_MARKED, lambda: reasoning_records(60)),
        (QWEN3_SHAPED, QWEN3_MARKED, lambda: [r["messages"] for r in chat_records(60, seed=2)]),
        (THINKING_TEMPLATE, THINKING_MARKED, lambda: [r["messages"] for r in chat_records(300)]),
    ],
    ids=["qwen3-shaped-reasoning", "qwen3-shaped-plain", "fixture-300"],
)
def test_answers_without_generation_blocks_equal_transformers_mask_with_them(
    tokenizers, template, marked, conversations
):
    tok, hf = tokenizers
    for i, msgs in enumerate(conversations()):
        ids, mask = _ours(tok, template, msgs)
        want_ids, want_mask = _transformers(hf, marked, msgs)
        assert ids == want_ids, f"conversation {i}: tokens"
        assert mask == want_mask, f"conversation {i}: mask {mask} != transformers' {want_mask}"
        assert sum(mask) > 0
        # the marked template through our own reader of generation blocks gives the same mask
        assert _ours(tok, marked, msgs)[1] == want_mask


def test_no_user_token_is_ever_an_answer(tokenizers):
    """The sweep's finding: user-turn tokens marked as answers. Every user content's tokens are
    outside the mask, every answer's inside, on the reasoning conversations."""
    tok, _ = tokenizers
    for msgs in reasoning_records(40):
        text, spans = ChatTemplate(QWEN3_SHAPED, "test").answer_spans(msgs)
        for m in msgs:
            at = text.find("<|im_start|>" + m["role"] + "\n" + m["content"]) if m["role"] == "user" else -1
            if at >= 0:
                a, b = at, at + len(m["content"]) + 13
                assert not any(x < b and a < y for x, y in spans), (m, spans)
        answers = [m["content"].split("</think>")[-1].strip() for m in msgs if m["role"] == "assistant"]
        assert all(any(ans in text[x:y] for x, y in spans) for ans in answers)


@pytest.mark.parametrize(
    "template,why",
    [
        ("{{ messages | map(attribute='content') | join('\\n') }}", "not rendered by a loop over the messages"),
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "no generation prompt"),
        (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | upper }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            "content is not in the text its turn renders",
        ),
    ],
    ids=["no-loop", "no-generation-prompt", "content-rewritten"],
)
def test_templates_whose_turns_cannot_be_found_are_refused(template, why):
    msgs = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"}]
    with pytest.raises(BadRecord, match=why) as e:
        ChatTemplate(template, "test").answer_spans(msgs)
    assert "{% generation %}" in str(e.value) and "\n" not in str(e.value)
