"""The reference's linear layers over their stored weights (evaluate/runners/pytorch.StoredLinear):
the float32 values of the whole weight cast at once, bit for bit, without a float32 copy held; and
the plain-read path streamed mode refills its buffer with."""

import pytest
import torch
import torch.nn.functional as F

from test_evaluate_model import debug_model, write_unified
from titan_pipe.evaluate.runners.pytorch import LayeredModel, StoredLinear
from titan_pipe.model.weights import open_weights


def test_banded_linear_equals_the_float32_copy_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((5632, 2048), (2048, 5632), (4096, 1024)):
        for dtype in (torch.bfloat16, torch.float16):
            w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(dtype)
            b = torch.randn(out_f, generator=g)
            lin = StoredLinear(w, b, exact={})
            assert lin.band is not None and lin.band % 64 == 0 and lin.band < out_f  # it does band
            for rows in ((1, 1), (2, 1), (1, 64), (2, 17)):
                x = torch.randn(*rows, in_f, generator=g)
                want = F.linear(x, w.float(), b)
                assert torch.equal(lin(x), want)  # the first call: computed both ways, compared
                assert torch.equal(lin(x), want)  # later calls: banded
            assert all(lin.exact.values())


def test_a_banding_that_differs_falls_back_to_the_whole_cast(monkeypatch):
    """Where a BLAS would round a band differently, the check sees it and every later call casts
    the whole weight: the values stay those of the float32 copy."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(2048, 2048, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(2, 2048, generator=g)
    lin = StoredLinear(w, None, exact={})
    real = StoredLinear._banded
    monkeypatch.setattr(StoredLinear, "_banded", lambda self, x: real(self, x) + 1e-6)
    want = F.linear(x, w.float())
    assert torch.equal(lin(x), want) and torch.equal(lin(x), want)
    assert list(lin.exact.values()) == [False]


def test_streamed_buffer_reads_are_the_stored_bytes(tmp_path):
    """read_into (plain file reads into a reused buffer) gives the stored tensor bit for bit, and the
    streamed reference computes what the resident one computes."""
    model, args = debug_model()
    md = write_unified(model.to(torch.bfloat16), args, tmp_path / "m")
    src = open_weights(md)
    for name in ("layers.1.attention.wq.weight", "output.weight", "layers.0.feed_forward.w2.weight"):
        full = src.full(name)
        out = torch.empty(full.shape, dtype=src.stored_dtype(name))
        assert src.stored_dtype(name) == torch.bfloat16 and torch.equal(src.read_into(name, out), full)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    whole, streamed = (
        LayeredModel.from_path(md, keep=True).run(tokens),
        LayeredModel.from_path(md, keep=False).run(tokens),
    )
    assert torch.equal(whole.logits, streamed.logits)
    assert all(torch.equal(a, b) for a, b in zip(whole.hidden, streamed.hidden))


def _resident_kb(path) -> int:
    """This process's resident kB of its mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_streamed_reference_uses_the_files_pages_and_gives_them_back(tmp_path):
    """Streamed from a unified dir, the reference multiplies its linear weights where the file's pages
    are (SafetensorsWeights.mapped: one madvise faults a tensor's pages in) and takes them out of the
    process after each layer: its greedy tokens and every value equal the plain-read path's and the
    resident model's bit for bit, and once it is done none of the file's pages is resident in it."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("madvise(MADV_POPULATE_READ) and /proc/self/smaps: Linux only")
    model, args = debug_model()
    md = write_unified(model.to(torch.bfloat16), args, tmp_path / "m")
    prompts = [list(range(5, 21)), list(range(30, 42))]
    runs = {}
    for mode in ("mapped", "read", "resident"):
        src = open_weights(md)
        if mode == "read":
            src._maps = None  # what a kernel without MADV_POPULATE_READ gets
        ref = LayeredModel(src, keep=mode == "resident")
        values: dict = {}
        runs[mode] = (ref.greedy(prompts, 5, values=values), values, src)
        if mode == "mapped":
            left = {f: _resident_kb(f) for f in src._maps or {}}
    tokens, values, src = runs["mapped"]
    if src._maps is None:
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14): the plain-read path ran")
    assert src._maps and len(values) == 3 * args.n_layers + 1
    for mode in ("read", "resident"):
        assert torch.equal(runs[mode][0], tokens)
        assert all(torch.equal(runs[mode][1][k], v) for k, v in values.items())
    assert set(left) == set(src._maps) and not any(left.values()), left
