"""A dataset written by megatron-core's own IndexedDatasetBuilder trains in titan-pipe's trainer at
dp2 x tp2 on gloo, matches the single-process reference on the same data, and resumes bit-exactly.
(The other direction, megatron-core reading what `data prepare` writes, is in test_data_prepare.)"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from test_data_prepare import import_megatron_indexed
from test_training_parallel import BASE, REL, launch
from titan_pipe.tokens.sources import default_corpus
from training_reference import reference_run

pytestmark = pytest.mark.distributed


def build_with_megatron(prefix) -> None:
    """The shipped corpus, byte ids + eos (257) per document, as megatron-core writes it (uint16)."""
    builder = import_megatron_indexed().IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for f in sorted(default_corpus().glob("*.txt")):
        ids = list(f.read_bytes()) + [257]
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")


def test_megatron_built_dataset_trains_at_dp2_tp2_and_resumes_bit_exactly(tmp_path):
    (tmp_path / "mc").mkdir()
    build_with_megatron(tmp_path / "mc" / "corpus")
    flow = copy.deepcopy(BASE)
    flow["data"] = {"path": str(tmp_path / "mc" / "corpus"), "tokenizer": "byte"}
    flow["train"]["steps"] = 6
    flow["checkpoint"] = {"every": 3, "keep_last": 2}
    layout = {"dp": 2, "tp": 2}
    runs = [
        {"name": "mc", "flow": dict(flow, parallel=layout)},
        {
            "name": "mc_resumed",
            "flow": dict(flow, parallel=layout),
            "resume": True,
            "copy_from": {"run": "mc", "step": 3},
        },
    ]
    res = launch(4, runs, tmp_path / "work")
    full = [r["loss"] for r in res["mc"]["metrics"]]
    resumed = res["mc_resumed"]["metrics"]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == full[3:]  # bit-exact: the same data stream and state
    ref = reference_run(flow, base=tmp_path)["losses"]
    for step, (got, want) in enumerate(zip(full, ref), start=1):
        assert abs(got - want) <= REL * abs(want), f"step {step}: {got} vs single-process {want}"
    assert not (tmp_path / "work" / "runs" / "mc" / "data").exists()  # token data: nothing prepared
