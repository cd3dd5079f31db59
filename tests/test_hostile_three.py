"""Hostile input, round three: what the fine-tuning data path, resumes and a new user meet.

By class (issue 46): wrong training targets (chat records and templates that would mark the wrong
tokens, or none), files that point elsewhere (data.json names, tokenizer side files), unbounded work
(templates that loop or grow, files and records past their bounds), parses of untrusted input that
must end in one line (JSON records, DCP .metadata, provenance), resumes that must check what they
load (sha256, size, presence), the weak cases made exact, and the new user's path. Every case runs
in one process on tiny real data; each asserts the exact refusal (or the exact right result), so a
case that regresses fails.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import THINKING_TEMPLATE, chat_records, train_tokenizer, write_jsonl
from convert_writers import model_args, native_state, write_dcp, write_hf
from test_untrusted_input import cli, copy, edit_json, refused, snapshot
from titan_pipe.config import ConvertConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.tokens import chat
from titan_pipe.tokens.chat import BadRecord, ChatTemplate, conversation, load_chat_template

CONV = [{"role": "user", "content": "one plus two"}, {"role": "assistant", "content": "three"}]


# --- fixtures (once per module) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, tok) -> Path:
    from titan_pipe.training.prepare import prepare

    base = tmp_path_factory.mktemp("chatdata")
    src = write_jsonl(base / "chat.jsonl", chat_records(60))
    prepare(
        sources=[src], out_dir=base / "prepared", tokenizer=str(tok), records="chat", progress=False, val_fraction=0.1
    )
    return base / "prepared"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("ckpt")
    args = model_args()
    hf = write_hf(native_state(args), args, base / "hf")
    convert_checkpoint(hf, base / "titan", ConvertConfig(tp=2, pp=2))
    return base


# --- wrong training targets: records ------------------------------------------------------------

BIG = "x " * (chat.RENDER_CHARS // 2 + 8)


@pytest.mark.parametrize(
    "record,fmt,expect",
    [
        ([1, 2], "chat", "a list, not a JSON object"),
        ({"text": "hi"}, "chat", "no 'messages' list"),
        ({"messages": []}, "chat", "no 'messages' list"),
        ({"messages": [{"role": "hacker", "content": "x"}, *CONV]}, "chat", "has role 'hacker'"),
        ({"messages": [{"role": "user", "content": "  "}, CONV[1]]}, "chat", "message 0 (user) has empty content"),
        (
            {"messages": [CONV[0], {"role": "assistant", "content": None}]},
            "chat",
            "message 1 (assistant) has no content",
        ),
        ({"messages": [CONV[0], {"role": "assistant", "content": ["x"]}]}, "chat", "has no content"),
        ({"messages": [CONV[0], CONV[0]]}, "chat", "no assistant message"),
        ({"messages": [CONV[0], {"role": "assistant", "content": BIG}]}, "chat", "characters of content by message 1"),
        ({"prompt": "p", "response": "r", "system": 7}, "instruction", "'system' is a int, not a string"),
        ({"instruction": "p", "output": "r", "input": ["x"]}, "instruction", "'input' is a list, not a string"),
        ({"instruction": "p"}, "instruction", "no prompt/response strings"),
    ],
    ids=[
        "list",
        "no-messages",
        "empty-messages",
        "bad-role",
        "blank-content",
        "null-content",
        "list-content",
        "no-answer",
        "huge-content",
        "int-system",
        "list-input",
        "no-response",
    ],
)
def test_bad_records_are_refused_by_name(record, fmt, expect):
    with pytest.raises(BadRecord) as e:
        conversation(record, fmt=fmt)
    assert expect in str(e.value)


def test_too_many_messages_are_refused_before_any_is_read():
    msgs = [CONV[0], CONV[1]] * (chat.MAX_MESSAGES // 2 + 1)
    with pytest.raises(BadRecord, match="over the bound of 65,536"):
        conversation({"messages": msgs}, fmt="chat")


# --- wrong training targets / unbounded work: templates -----------------------------------------

TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    "source,expect",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + TURNS, "took over"),
        ("{% for i in range(999) %}{{ 'y' * 9999 }}{% endfor %}" + TURNS, "output passed"),
        ("{{ 'x' * 10**9 }}" + TURNS, "builds a value of"),
        ("{{ 'ab' ~ ('c' * 3000000) ~ ('d' * 3000000) }}" + TURNS, "builds a value of"),
        ("{{ 'x' | center(10**8) }}" + TURNS, "builds a value of"),
        ("{{ 'x'.ljust(10**8) }}" + TURNS, "builds a value of"),
        ("{{ 2 ** 99999999 }}" + TURNS, "to the power 99999999"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}" + TURNS, "recurses without end"),
        ("{{ raise_exception('system role not supported') }}" + TURNS, "system role not supported"),
        ("{{ 1 / 0 }}" + TURNS, "ZeroDivisionError"),
        ("{{ messages[9]['content'].upper() }}" + TURNS, "the chat template failed"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}" + TURNS, "the chat template failed"),
        ("{{ cycler.__init__.__globals__.os.system('touch /tmp/pwned-titan') }}" + TURNS, "the chat template failed"),
    ],
    ids=[
        "loop",
        "long-output",
        "repeat",
        "concat",
        "center",
        "ljust",
        "power",
        "recursion",
        "raise",
        "div0",
        "undefined",
        "mro-escape",
        "globals-escape",
    ],
)
def test_templates_that_loop_grow_fail_or_escape_end_in_one_bad_record(source, expect, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    with pytest.raises(BadRecord) as e:
        ChatTemplate(source, "test").answer_spans(CONV)
    assert expect in str(e.value) and "\n" not in str(e.value)
    assert not Path("/tmp/pwned-titan").exists()


@pytest.mark.parametrize(
    "source,expect",
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "writes no generation prompt"),
        (
            "{{ messages[0]['content'] }}{{ messages[1]['content'] }}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "not rendered by a loop",
        ),
    ],
    ids=["no-generation-prompt", "no-loop"],
)
def test_templates_whose_answers_cannot_be_found_are_refused_not_guessed(source, expect):
    with pytest.raises(BadRecord, match=expect):
        ChatTemplate(source, "test").answer_spans(CONV)


def test_reasoning_content_in_every_answer_marks_no_user_token(tok):
    """Multi-turn, every answer with its reasoning: the answer spans hold each assistant text after
    its header and never a character of a user or system turn."""
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(4):
        msgs += [
            {"role": "user", "content": f"what is {i} plus {i}"},
            {"role": "assistant", "content": f"<think>\nadd {i}\n</think>\n\nthe answer is {2 * i}"},
        ]
    text, spans = ChatTemplate(THINKING_TEMPLATE, "test").answer_spans(msgs)
    marked = "".join(text[a:b] for a, b in spans)
    assert len(spans) == 4 and all(f"the answer is {2 * i}" in marked for i in range(4))
    assert "what is" not in marked and "be brief" not in marked and "<|im_start|>user" not in marked


# --- template files: bounded, UTF-8, Jinja, inside the tokenizer dir ------------------------------


def test_a_template_file_past_the_bound_is_not_read(tmp_path):
    big = tmp_path / "big.jinja"
    with open(big, "wb") as f:
        f.truncate(3 * 2**30)  # sparse: 3 GB on paper, nothing on disk
    with pytest.raises(UserError, match=r"3,221,225,472 bytes, over the bound"):
        load_chat_template(str(big), tokenizer_dir=None)


@pytest.mark.parametrize(
    "data,expect",
    [
        (b"{{ messages }}\xff\xfe", "not UTF-8 text"),
        (b"{% for m in messages %}", "not a Jinja template"),
    ],
    ids=["not-utf8", "not-jinja"],
)
def test_template_files_that_are_not_templates(tmp_path, data, expect):
    (tmp_path / "t.jinja").write_bytes(data)
    with pytest.raises(UserError, match=expect):
        load_chat_template(str(tmp_path / "t.jinja"), tokenizer_dir=None)


def test_an_inline_template_past_the_bound(tmp_path, tok):
    d = copy(tok, tmp_path / "tok")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(chat_template="x" * (2**20 + 1)))
    with pytest.raises(UserError, match="its chat_template has 1,048,577 characters, over the bound"):
        load_chat_template("model", tokenizer_dir=d)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json"])
def test_tokenizer_side_files_linked_out_of_the_dir_are_refused(tmp_path, tok, name):
    from titan_pipe.tokens.tokenizer import HFTokenizer, tokenizer_files

    d = copy(tok, tmp_path / "tok")
    secret = tmp_path / "secret.txt"
    secret.write_text('{"eos_token": "<|im_end|>"}')
    if (d / name).exists():
        (d / name).unlink()
    (d / name).symlink_to(secret)
    with pytest.raises(UserError, match="outside"):
        if name == "special_tokens_map.json":
            tokenizer_files(HFTokenizer(d / "tokenizer.json"))
        else:
            load_chat_template("model", tokenizer_dir=d)


def test_a_tokenizer_json_past_its_bound_is_not_read(tmp_path, tok):
    from titan_pipe.tokens.tokenizer import HFTokenizer

    d = copy(tok, tmp_path / "tok")
    with open(d / "tokenizer.json", "r+b") as f:
        f.truncate(600 * 2**20)
    with pytest.raises(UserError, match="600 MiB, over the bound of 512 MiB"):
        HFTokenizer(d / "tokenizer.json")


def test_an_eos_token_missing_from_the_vocab_is_refused_not_replaced(tmp_path, tok):
    from titan_pipe.tokens.tokenizer import HFTokenizer

    d = copy(tok, tmp_path / "tok")
    edit_json(d / "tokenizer_config.json", lambda c: c.update(eos_token="<|eot|>"))
    with pytest.raises(UserError, match=r"eos_token '<\|eot\|>' is not in .*vocabulary"):
        HFTokenizer(d / "tokenizer.json")


# --- data.json: names confined to the data dir, fields typed ------------------------------------


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("prefix", "../other/tokens", "is not a file name inside the data dir"),
        ("prefix", "/etc/tokens", "is not a file name inside the data dir"),
        ("prefix", ".hidden", "is not a file name inside the data dir"),
        ("loss_mask", "../other/tokens.lossmask", "is not 'tokens.lossmask'"),
        ("n_tokens", "12", "not a titan-pipe data record"),
        ("n_tokens", True, "not a titan-pipe data record"),
        ("tokenizer", ["byte"], "not a titan-pipe data record"),
        ("split", {"n_train": -4}, "not a titan-pipe data record"),
    ],
    ids=[
        "dotdot-prefix",
        "absolute-prefix",
        "hidden-prefix",
        "dotdot-mask",
        "string-count",
        "bool-count",
        "list-tokenizer",
        "negative-split",
    ],
)
def test_data_json_values_that_point_out_or_lie_about_their_type(tmp_path, chat_data, field, value, expect):
    from titan_pipe.tokens.record import DataRecord

    d = copy(chat_data, tmp_path / "data")
    edit_json(d / "data.json", lambda r: r.update({field: value}))
    with pytest.raises(UserError, match=expect):
        DataRecord.load(d)
    line = refused(tmp_path, "data", "inspect", d, expect=("data.json", "prepare"))
    assert expect.split()[0] in line or "data record" in line


def test_an_index_whose_pointers_disagree_with_its_lengths(tmp_path, chat_data):
    from titan_pipe.tokens.indexed import IndexedTokens

    d = copy(chat_data, tmp_path / "data")
    idx = d / "tokens.idx"
    raw = bytearray(idx.read_bytes())
    # after the 34-byte header: n int32 lengths, then n int64 pointers; move the second pointer only
    # (the .bin's size still matches the last one)
    n = int(np.frombuffer(raw[18:26], dtype=np.int64)[0])
    at = 34 + 4 * n + 8
    ptr = int(np.frombuffer(raw[at : at + 8], dtype=np.int64)[0])
    raw[at : at + 8] = np.int64(ptr + 2).tobytes()
    idx.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="starts at byte"):
        IndexedTokens(d / "tokens").verify()


# --- the loss mask: counted before training, kept whole ------------------------------------------


def test_an_all_zero_loss_mask_trains_nothing_and_is_refused(tmp_path, chat_data):
    from titan_pipe.tokens.dataset import open_source
    from titan_pipe.tokens.packing import DocumentLoader

    d = copy(chat_data, tmp_path / "data")
    mask = d / "tokens.lossmask"
    mask.write_bytes(bytes(mask.stat().st_size))
    with pytest.raises(UserError, match="marks no"):
        DocumentLoader(open_source(d, val_fraction=0.1), seq_len=32, global_batch=2)


def test_a_broken_loss_mask_is_prepared_again_not_reused(tmp_path, tok):
    from titan_pipe.training.prepare import prepare

    src = write_jsonl(tmp_path / "chat.jsonl", chat_records(20))
    first = prepare(sources=[src], out_dir=tmp_path / "d", tokenizer=str(tok), records="chat", progress=False)
    good = (tmp_path / "d" / "tokens.lossmask").read_bytes()
    (tmp_path / "d" / "tokens.lossmask").write_bytes(good[:-3])
    again = prepare(sources=[src], out_dir=tmp_path / "d", tokenizer=str(tok), records="chat", progress=False)
    assert not first.reused and not again.reused
    assert (tmp_path / "d" / "tokens.lossmask").read_bytes() == good
    assert prepare(sources=[src], out_dir=tmp_path / "d", tokenizer=str(tok), records="chat", progress=False).reused


def test_merging_a_part_without_a_mask_with_one_that_has_it(tmp_path, chat_data):
    """Either order: the mask is never dropped for all parts because the first lacked one."""
    bare = copy(chat_data, tmp_path / "bare")
    (bare / "tokens.lossmask").unlink()
    edit_json(bare / "data.json", lambda r: r.update(loss_mask=None))
    for order in ([bare, chat_data], [chat_data, bare]):
        refused(tmp_path, "data", "merge", *order, "-o", tmp_path / "m", expect="loss masks", out=tmp_path / "m")


# --- records past their bounds, and JSON that would raise -------------------------------------


@pytest.mark.parametrize(
    "line,expect",
    [
        ('{"text": "a \\ud800 b"}', "escape"),
        ("[" * 200_000 + "]" * 200_000, "nested deeper"),
        ('{"messages": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper"),
    ],
    ids=["lone-surrogate", "deep-array", "deep-messages"],
)
def test_json_lines_that_would_raise_are_one_line(tmp_path, tok, line, expect):
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad.jsonl").write_text(line + "\n")
    fmt = "chat" if "messages" in line else "text"
    refused(
        src,
        "data",
        "prepare",
        src / "bad.jsonl",
        "-o",
        tmp_path / "out",
        "--tokenizer",
        tok / "tokenizer.json",
        "--format",
        fmt,
        expect=(expect, "bad.jsonl"),
        out=tmp_path / "out",
    )


def test_one_record_past_the_bound_is_refused_before_it_is_tokenized(tmp_path, tok, monkeypatch):
    from titan_pipe.tokens import sources

    bound = 64 * 2**10
    monkeypatch.setattr(sources, "RECORD_BYTES", dataclasses.replace(sources.RECORD_BYTES, hi=bound))
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "big.jsonl", [{"text": "one two " * (bound // 4)}])
    got, text = cli("data", "prepare", src / "big.jsonl", "-o", tmp_path / "out", "--tokenizer", "byte")
    assert got == 1 and "over the limit of 65536 bytes" in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


# --- untrusted .metadata and provenance --------------------------------------------------------


@pytest.fixture(scope="module")
def dcp(tmp_path_factory) -> Path:
    args = model_args()
    return write_dcp(native_state(args), args, tmp_path_factory.mktemp("dcp") / "tt", full=True)


def _mutate_first(md, kind: str):
    tensors = [v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")]
    if kind == "chunk-outside":
        c = tensors[0].chunks[0]
        tensors[0].chunks[0] = type(c)(offsets=type(c.offsets)([10**6] * len(c.offsets)), sizes=c.sizes)
    elif kind == "not-a-dict":
        md.state_dict_metadata = list(md.state_dict_metadata.items())
    elif kind == "path-int":
        key = next(iter(md.storage_data))
        info = md.storage_data[key]
        md.storage_data[key] = type(info)(relative_path=7, offset=info.offset, length=info.length)
    elif kind == "negative-length":
        key = next(iter(md.storage_data))
        info = md.storage_data[key]
        md.storage_data[key] = type(info)(relative_path=info.relative_path, offset=info.offset, length=-5)


@pytest.mark.parametrize("kind", ["chunk-outside", "not-a-dict", "path-int", "negative-length"])
def test_malformed_dcp_metadata_is_one_line(tmp_path, dcp, kind):
    src = copy(dcp, tmp_path / "tt")
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)  # this test's own file: torch's classes
    _mutate_first(md, kind)
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    refused(tmp_path, "convert", src, "-o", tmp_path / "out", expect=(".metadata",), out=tmp_path / "out")


@pytest.mark.parametrize(
    "path,value",
    [
        (("source", "step"), "x"),
        (("tokenizer", "tokenizer"), 5),
        (("output", "files"), 5),
    ],
    ids=["step-string", "tokenizer-int", "files-int"],
)
def test_tampered_provenance_is_one_line(tmp_path, ckpt, path, value):
    from titan_pipe.records.provenance import Provenance

    model = tmp_path / "model"
    if not (ckpt / "model").exists():
        convert_checkpoint(ckpt / "titan", ckpt / "model")
    copy(ckpt / "model", model)
    prov = model / "provenance.json"
    doc = json.loads(prov.read_text())
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    prov.write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        Provenance.load(model)
    assert prov.name in str(e.value) and path[-1] in str(e.value)


# --- resume / init_from check what they load ----------------------------------------------------


@pytest.mark.parametrize(
    "damage,expect",
    [
        ("flip", "sha256"),
        ("truncate", "bytes, but"),
        ("remove", "missing"),
    ],
    ids=["flipped-byte", "truncated", "missing"],
)
def test_init_from_and_resume_check_every_shard_against_its_manifest(tmp_path, ckpt, damage, expect):
    from titan_pipe.model.weights import open_weights
    from titan_pipe.training.preflight import files_problem

    src = copy(ckpt / "titan", tmp_path / "titan")
    shard = src / "model" / "pp0-tp1.safetensors"
    raw = bytearray(shard.read_bytes())
    if damage == "flip":
        raw[-1] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif damage == "truncate":
        shard.write_bytes(bytes(raw[:-16]))
    else:
        shard.unlink()
    before = snapshot(tmp_path)
    w = open_weights(src)
    with pytest.raises(UserError) as e:
        for name in w.names():
            w.full(name)
    assert expect in str(e.value) and "pp0-tp1.safetensors" in str(e.value)
    pre = files_problem("init_from", src)
    assert (pre is None) == (damage == "flip")  # presence and size before the launch; sha256 as each rank reads
    assert snapshot(tmp_path) == before


# --- the new user's path ------------------------------------------------------------------------


def test_validate_refuses_what_a_stage_would_refuse_later(tmp_path):
    assert cli("init", tmp_path / "p")[0] == 0
    flow = tmp_path / "p" / "flow.yaml"
    text = flow.read_text()
    flow.write_text(re.sub(r"(?m)^device: \w+", "device: npu", text))
    got, out = cli("validate", flow)
    assert got == 2 and "[npu]" in out and "device: npu" in out, out
    assert cli("validate", flow, "--elsewhere")[0] == 0
    assert "format: text" in text and "tokenizer: byte" in text
    flow.write_text(text.replace("format: text", "format: chat").replace("mode: pretrain", "mode: sft"))
    got, out = cli("validate", flow)
    assert got == 2 and "byte" in out and "chat" in out, out


def test_init_names_each_run_after_its_directory(tmp_path):
    from titan_pipe.config import load_flow

    for name in ("alpha", "beta"):
        assert cli("init", tmp_path / name)[0] == 0
    a, b = (load_flow(tmp_path / n / "flow.yaml") for n in ("alpha", "beta"))
    assert (a.name, b.name) == ("alpha", "beta") and a.run_dir() != b.run_dir()


def test_plan_reads_at_80_columns(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    got, out = cli("plan", "--model", "llama3_8b", "--devices", "16", "--device", "ascend910b")
    assert got == 0, out
    assert "…" not in out and max(len(ln) for ln in out.splitlines()) <= 80, out


def test_the_launcher_speaks_during_a_silent_start(tmp_path):
    from titan_pipe.training.stream import stream_process

    console = io.StringIO()
    rc = stream_process(["sleep", "6"], env=None, log_path=tmp_path / "log", console=console, live=False)
    assert rc == 0 and console.getvalue().strip(), "6 s of silence"


def test_the_report_headline_says_its_verdict_once():
    from titan_pipe.evaluate.report import headline

    status, text = headline({"passed": True, "verdict": {"text": "PASS: 12 comparisons within tolerance"}})
    assert status == "PASS" and not text.startswith("PASS") and "12 comparisons" in text


# --- Prefect: names and servers ------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["../x", "a/b", "", "-x", "n" * 101])
def test_schedule_names_that_are_not_names(tmp_path, name):
    refused(
        tmp_path,
        "schedule",
        REPO / "examples" / "tiny" / "flow.yaml",
        "--cron",
        "0 2 * * *",
        "--name",
        name,
        code=2,
        expect="is not a deployment name",
    )


def test_a_prefect_api_url_that_answers_but_is_not_prefect(tmp_path, ckpt, monkeypatch):
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = b"<html>welcome to nginx</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/api"
        monkeypatch.setenv("PREFECT_API_URL", url)
        refused(
            tmp_path,
            "convert",
            ckpt / "hf",
            "-o",
            tmp_path / "out",
            "--flow",
            out=tmp_path / "out",
            expect=(f"PREFECT_API_URL {url} answers, but is not a Prefect API", "welcome to nginx"),
        )
    finally:
        server.shutdown()


# --- a diverging run stops with one line, before the NaN reaches a checkpoint ---------------------


def test_a_diverging_run_stops_before_writing_nan_weights(tmp_path):
    """lr 1000 on the debug model: the loss leaves the finite numbers within a few steps. Training
    stops at the first non-finite gradient norm with one line naming the step and the fix; every
    checkpoint left holds finite weights (what a fine-tune deployed with PASS must never hold)."""
    import subprocess
    import sys

    import yaml
    from safetensors.torch import load_file

    runs = tmp_path / "runs"
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "d",
                "runs_dir": str(runs),
                "device": "cpu",
                "model": {"flavour": "debug"},
                "train": {
                    "steps": 8,
                    "batch_size": 2,
                    "seq_len": 16,
                    "warmup_steps": 0,
                    "optimizer": {"name": "adamw", "lr": 1000.0},
                },
                "parallel": {"dp": 1, "tp": 1, "pp": 1},
                "checkpoint": {"every": 1, "keep_last": 8},
            }
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "titan_pipe.cli", "train", str(flow)], capture_output=True, text=True, timeout=600
    )
    out = r.stdout + r.stderr
    errs = [ln for ln in out.splitlines() if ln.startswith("error")]
    assert r.returncode == 1 and len(errs) == 1 and "Traceback" not in out.split("error")[-1], out
    assert "training diverged" in errs[0] and "train.optimizer.lr (now 1000)" in errs[0], errs[0]
    step = int(errs[0].split("step ")[1].split(":")[0])
    kept = sorted((runs / "d" / "checkpoints").glob("step-*"))
    assert kept and int(kept[-1].name.split("-")[1]) == step - 1, (kept, step)
    for f in (kept[-1] / "model").glob("*.safetensors"):
        assert all(t.isfinite().all() for t in load_file(f).values()), f


# --- two pieces read from the same stored bytes ---------------------------------------------------


def test_a_manifest_reading_one_stored_tensor_for_two_pieces(tmp_path, ckpt):
    """The tp1 half of the embedding pointed at the tp0 half's tensor: shapes agree, so without the
    check the converted model would hold the first half twice (how an expert gets duplicated)."""
    from titan_pipe.model.weights import open_weights

    src = copy(ckpt / "titan", tmp_path / "titan")

    def alias(m):
        chunks = m["params"]["tok_embeddings.weight"]["chunks"]
        chunks[1].update(file=chunks[0]["file"], key=chunks[0]["key"])

    edit_json(src / "manifest.json", alias)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("reads 'tok_embeddings.weight' of model/pp0-tp0.safetensors", "already holds"),
    )
    with pytest.raises(UserError, match="already holds tok_embeddings.weight"):
        open_weights(src)


def test_dcp_entries_reading_the_same_bytes(tmp_path, dcp):
    src = copy(dcp.parent, tmp_path / "tt") / dcp.name  # with the params.json beside it
    with open(src / ".metadata", "rb") as f:
        md = pickle.load(f)  # this test's own file: torch's classes
    by_len: dict = {}
    for key, info in md.storage_data.items():
        if hasattr(md.state_dict_metadata[key.fqn], "chunks"):  # tensors (the train state's bytes are not read)
            by_len.setdefault((info.relative_path, info.length), []).append(key)
    a, b = next(keys for keys in by_len.values() if len(keys) > 1)[:2]
    md.storage_data[b] = type(md.storage_data[b])(
        relative_path=md.storage_data[a].relative_path,
        offset=md.storage_data[a].offset,
        length=md.storage_data[a].length,
    )
    with open(src / ".metadata", "wb") as f:
        pickle.dump(md, f)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("are located on overlapping bytes", ".metadata is corrupted"),
    )


# --- a failed run: its error once, and no retry of what a rank refused ---------------------------


class _State:
    def __init__(self, exc):
        self.exc = exc

    def result(self):
        raise self.exc


@pytest.mark.parametrize(
    "exc,retry",
    [
        ("RankRefused", False),
        ("StageFailed", True),
        ("UserError", False),
        ("KeyboardInterrupt", False),
        ("RuntimeError", True),
    ],
)
def test_only_a_crash_is_retried_never_an_error_a_rank_named(exc, retry):
    import builtins

    from titan_pipe import errors
    from titan_pipe.flows.train_to_deploy import retryable

    cls = getattr(errors, exc, None) or getattr(builtins, exc)
    assert retryable(None, None, _State(cls("x"))) is retry


def test_a_rank_failure_record_makes_the_launch_error_one_that_is_not_retried(tmp_path):
    from titan_pipe.errors import RankRefused
    from titan_pipe.io.faults import OutputFault
    from titan_pipe.run_dir import RunDir
    from titan_pipe.training.failure import launch_failure
    from titan_pipe.training.rank_records import RECORDS_ENV, write_failure

    run = RunDir(tmp_path / "r")
    log = tmp_path / "train.log"
    records = tmp_path / "records"
    log.write_text("step 1/4 | loss 6.4\nKilled\n")
    assert not isinstance(launch_failure(1, run, 0.0, 0, log, records), RankRefused)  # no record: a crash
    # a line that looks like one is no record (nothing parses the ranks' text)
    log.write_text("[default0]:step 1/4 | loss 6.4\n[default0]:error: step 2: training diverged\n")
    assert not isinstance(launch_failure(1, run, 0.0, 0, log, records), RankRefused)
    env = {RECORDS_ENV: str(records), "RANK": "3"}
    write_failure("error", "step 2: training diverged", env)
    err = launch_failure(1, run, 0.0, 0, log, records)
    assert isinstance(err, RankRefused) and str(err).endswith("step 2: training diverged") and err.exit_code == 1
    # torchrun's root-cause rank's record wins over an earlier one from another rank
    write_failure("fault", "no space left on device writing step-000002", {**env, "RANK": "0"})
    log.write_text(log.read_text() + TORCHRUN_ROOT_CAUSE)
    err = launch_failure(1, run, 0.0, 0, log, records)
    assert isinstance(err, OutputFault) and str(err).startswith("no space left on device writing step-000002")
    # a record of an earlier torchrun attempt does not explain the last one
    write_failure("error", "attempt 1 failed", {**env, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert str(launch_failure(1, run, 0.0, 0, log, records)).endswith("attempt 1 failed")
    # a foreign or broken file in the dir is no record
    (records / "rank-1.json").write_text('{"rank": "1", "kind": "error"')
    (records / "rank-7.json").write_text('{"rank": 7, "kind": "oops", "message": "x"}')
    assert str(launch_failure(1, run, 0.0, 0, log, records)).startswith("no space left")


TORCHRUN_ROOT_CAUSE = """
Root Cause (first observed failure):
[0]:
  time      : 2026-12-07_05:10:00
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
"""


def test_the_console_drops_prefects_repeats_of_what_run_prints_itself():
    import logging

    from titan_pipe.flows.logs import _NoRepeats

    def rec(name, level, msg):
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    f = _NoRepeats()
    assert not f.filter(rec("prefect.task_runs", logging.ERROR, "Finished in state Failed('x')"))
    assert not f.filter(rec("prefect.flow_runs", logging.ERROR, "Encountered exception during execution: x"))
    assert not f.filter(rec("prefect.task_runs", logging.ERROR, "Task run failed with exception: x"))
    assert f.filter(rec("prefect.task_runs", logging.INFO, "Task run failed with exception: x - Retry 1/2 will start"))
    assert f.filter(rec("prefect.task_runs", logging.INFO, "prepared: 60 documents"))
    assert f.filter(rec("titan_pipe", logging.ERROR, "Finished in state Failed('x')"))
    crash = rec("prefect.task_runs", logging.ERROR, "Task run failed with exception: RuntimeError('bug')")
    crash.exc_info = (RuntimeError, RuntimeError("bug"), None)  # a bug's traceback is shown, once
    assert f.filter(crash)


# --- a training's prepared data is not replaced under it -----------------------------------------


def test_data_prepare_refuses_a_dir_a_training_reads(tmp_path, tok, chat_data):
    """The launcher holds read_lock on each prepared dir the ranks read; two trainings share it,
    `data prepare -o` that dir stops at once naming the training, and after it the lock file is gone."""
    from titan_pipe.processes.run_lock import RunDirBusy, path_lock, read_lock

    d = copy(chat_data, tmp_path / "data")
    src = write_jsonl(tmp_path / "src" / "chat.jsonl", chat_records(10, seed=3))
    with read_lock(d, what="titan-pipe train a"), read_lock(d, what="titan-pipe train b"):
        refused(
            tmp_path / "data",
            "data",
            "prepare",
            src,
            "-o",
            d,
            "--tokenizer",
            tok / "tokenizer.json",
            "--format",
            "chat",
            expect=(f"{d}: in use by PID {os.getpid()} (titan-pipe train b, which reads it)",),
        )
        with pytest.raises(RunDirBusy, match="in use by PID"):
            with path_lock(d, what="titan-pipe merge"):
                pass
    assert not (tmp_path / ".data.lock").exists()
    with path_lock(d, what="titan-pipe prepare"):
        with pytest.raises(RunDirBusy, match=f"{d}: being written by PID {os.getpid()} \\(titan-pipe prepare\\)"):
            with read_lock(d, what="titan-pipe train c"):
                pass
    got, text = cli("data", "prepare", src, "-o", d, "--tokenizer", tok / "tokenizer.json", "--format", "chat")
    assert got == 0, text


def test_the_launcher_reads_prepared_data_under_its_lock(tmp_path, chat_data):
    from titan_pipe.config import load_flow
    from titan_pipe.processes.run_lock import RunDirBusy, path_lock
    from titan_pipe.training.launch import reading_data

    flow = tmp_path / "flow.yaml"
    flow.write_text(f"name: x\ndevice: cpu\ndata: {{path: {chat_data}, tokenizer: byte}}\n")
    cfg = load_flow(flow)
    with reading_data(cfg, flow):
        with pytest.raises(RunDirBusy, match="titan-pipe train x, which reads it"):
            with path_lock(chat_data, what="titan-pipe prepare"):
                pass


# --- a flow's errors name its keys, not the flags of another command ------------------------------


def test_a_flows_data_error_names_the_flow_key_not_the_flag(tmp_path, tok):
    from titan_pipe.config import load_flow
    from titan_pipe.tokens.spec import data_spec
    from titan_pipe.training.prepare import prepare_spec

    d = copy(tok, tmp_path / "tok")
    edit_json(d / "tokenizer_config.json", lambda c: c.pop("chat_template"))
    write_jsonl(tmp_path / "chat.jsonl", chat_records(5))
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        f"name: x\ndevice: cpu\ndata: {{path: chat.jsonl, tokenizer: {d}, format: chat}}\ntrain: {{mode: sft}}\n"
    )
    spec = data_spec(load_flow(flow).data, base=tmp_path)
    with pytest.raises(UserError) as e:
        prepare_spec(spec, tmp_path / "out", progress=False)
    assert "set data.chat_template: chatml" in str(e.value) and "--chat-template" not in str(e.value)


@pytest.mark.parametrize(
    "flag,value,expect",
    [
        ("--max-memory", "lots", "--max-memory: 'lots' is not a size; write e.g. 8GB, 512MB or 6GiB (got 'lots')"),
        ("--batches", "-5", "--batches -5: must be >= 1"),
    ],
)
def test_evaluate_flags_are_checked_before_anything_is_loaded(tmp_path, ckpt, flag, value, expect):
    line = refused(
        tmp_path,
        "evaluate",
        "-o",
        tmp_path / "rep",
        "--model-dir",
        ckpt / "hf",
        flag,
        value,
        expect=expect,
        out=tmp_path / "rep",
    )
    assert "loading" not in line


@pytest.mark.parametrize(
    "line,hidden",
    [
        (
            "E1206 19:47:28.386000 1518 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
            "local_rank: 0 (pid: 1524) of binary: /usr/bin/python3",
            True,
        ),
        ("Traceback (most recent call last):", True),
        ("[default0]:error: step 2: training diverged", False),
        ("[default0]:step 1/4 | loss 6.3788", False),
    ],
)
def test_torchruns_own_failure_report_stays_in_train_log(line, hidden):
    from titan_pipe.training.failure import torchrun_report

    assert torchrun_report(line + "\n") is hidden


def test_validate_reads_the_template_from_the_flows_dir_and_names_the_key(tmp_path, tok):
    """validate prepares small chat data as the data stage will: a template path is read from the
    flow's dir (it was read from the working dir), and what is wrong names data.chat_template."""
    proj = tmp_path / "proj"
    write_jsonl(proj / "chat.jsonl", chat_records(40))
    (proj / "t.jinja").write_text(THINKING_TEMPLATE)
    text = (
        f"name: x\ndevice: cpu\nmodel: {{flavour: debug, vocab_size: 320}}\n"
        f"data: {{path: chat.jsonl, tokenizer: {tok}, format: chat, chat_template: t.jinja}}\n"
        "train: {mode: sft, steps: 2, batch_size: 2, seq_len: 256}\nparallel: {dp: 1, tp: 1, pp: 1}\n"
    )
    (proj / "flow.yaml").write_text(text)
    got, out = cli("validate", proj / "flow.yaml")
    assert got == 0, out
    (proj / "flow.yaml").write_text(text.replace("t.jinja", "gone.jinja"))
    got, out = cli("validate", proj / "flow.yaml")
    assert got == 2 and "data.chat_template: " in out and "--chat-template" not in out, out


@pytest.mark.parametrize("argv,todo", [(("--sft", "--device", "cpu"), True), ((), False)])
def test_init_says_what_to_fill_in_before_validate(tmp_path, argv, todo):
    got, out = cli("init", tmp_path / "p", *argv)
    assert got == 0 and ("fill in the lines marked FILL IN" in out) is todo, out
    assert ("FILL IN" in (tmp_path / "p" / "flow.yaml").read_text()) is todo


# --- what `data prepare` takes as flags, a flow takes as keys -------------------------------------


def _chat_flow(tmp_path, tok, extra: str) -> Path:
    write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        f"name: x\ndevice: cpu\nmodel: {{flavour: debug, vocab_size: 320}}\n"
        f"data: {{path: chat.jsonl, tokenizer: {tok}, format: chat{extra}}}\n"
        "train: {mode: sft, steps: 2, batch_size: 2, seq_len: 256}\nparallel: {dp: 1, tp: 1, pp: 1}\n"
    )
    return flow


def test_a_flows_max_tokens_leaves_long_conversations_out(tmp_path, tok):
    from titan_pipe.config import load_flow
    from titan_pipe.tokens.spec import data_spec
    from titan_pipe.training.prepare import prepare_spec

    flow = _chat_flow(tmp_path, tok, ", max_tokens: 128, max_bad_fraction: 0.9")
    r = prepare_spec(data_spec(load_flow(flow).data, base=tmp_path), tmp_path / "out", progress=False)
    assert 0 < r.record.bad_records < 40 and r.record.n_documents == 40 - r.record.bad_records
    assert "longer than the window of 128" in r.record.bad_examples[0]
    flow = _chat_flow(tmp_path, tok, ", max_tokens: 128, max_bad_fraction: 0.01")
    with pytest.raises(UserError, match=r"\(data.max_bad_fraction\)") as e:
        prepare_spec(data_spec(load_flow(flow).data, base=tmp_path), tmp_path / "out2", progress=False)
    assert "--max" not in str(e.value)


@pytest.mark.parametrize(
    "extra,expect",
    [
        (", max_tokens: 512", "data.max_tokens: 512 is over train.seq_len 256"),
        (", max_tokens: 1", "max_tokens"),
    ],
)
def test_validate_checks_the_flows_max_tokens(tmp_path, tok, extra, expect):
    got, out = cli("validate", _chat_flow(tmp_path, tok, extra))
    assert got == 2 and expect in out, out


def test_max_tokens_on_plain_text_is_refused(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text("name: x\ndevice: cpu\ndata: {max_tokens: 100}\n")
    got, out = cli("validate", flow)
    assert got == 2 and "data.max_tokens: 100 applies to chat/instruction records" in out, out
