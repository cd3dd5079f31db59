"""DCP .metadata read into stand-ins (pipeline/weights/readers/dcp_metadata.py): the same content torch's own
classes load, without importing torch.distributed.checkpoint at all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_writers import model_args, native_state, write_dcp
from titan_pipe.rules.dtypes import DTYPE_NAMES

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp")
    args = model_args()
    return write_dcp(native_state(args), args, base / "tt", full=True)


def test_the_stand_ins_hold_what_torchs_classes_hold(dcp_ckpt):
    import pickle

    from titan_pipe.weights.readers.dcp import read_metadata

    ours = read_metadata(dcp_ckpt)
    with open(dcp_ckpt / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # a file this test wrote: torch's own classes
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    for fqn, t in theirs.state_dict_metadata.items():
        o = ours.state_dict_metadata[fqn]
        assert hasattr(o, "chunks") == hasattr(t, "chunks"), fqn
        if hasattr(t, "chunks"):
            assert o.properties.dtype == DTYPE_NAMES[t.properties.dtype] and tuple(o.size) == tuple(t.size)
            assert [(tuple(c.offsets), tuple(c.sizes)) for c in o.chunks] == [
                (tuple(c.offsets), tuple(c.sizes)) for c in t.chunks
            ]
    assert len(ours.storage_data) == len(theirs.storage_data)
    for idx, info in theirs.storage_data.items():
        from titan_pipe.weights.readers.dcp_metadata import MetadataIndex

        mine = ours.storage_data[MetadataIndex(idx.fqn, idx.offset)]
        assert (mine.relative_path, mine.offset, mine.length) == (info.relative_path, info.offset, info.length)


def test_convert_of_a_dcp_checkpoint_never_imports_torch(dcp_ckpt, tmp_path):
    """Neither torch.distributed.checkpoint nor torch itself (~1.2 s of a 1 GB conversion's ~2.7 s
    process): the metadata's torch.Size and dtypes load as tuples and dtype codes, the chunks are
    located in their torch.save archives without torch, and the bytes move by kernel copies and
    scatters (this checkpoint's q/k rows are reordered from interleaved RoPE on the way). The
    output equals the one a torch-importing process writes, byte for byte."""
    code = (
        "import sys\n"
        "from titan_pipe.convert.api import convert_checkpoint\n"
        f"convert_checkpoint({str(dcp_ckpt)!r}, {str(tmp_path / 'out')!r})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=TESTS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
    from titan_pipe.convert.api import convert_checkpoint

    convert_checkpoint(dcp_ckpt, tmp_path / "in-process")  # torch is imported here (pytest, the fixture)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "in-process" / "model.safetensors"
    ).read_bytes()


def test_the_storage_and_dtype_tables_are_torchs_own():
    """The written-out tables the torch-free readers use agree with torch's."""
    from titan_pipe.weights.readers.dcp_metadata import DTYPE_CODES, OTHER_DTYPES, torch_global
    from titan_pipe.weights.readers.torch_save import STORAGE_DTYPES

    theirs = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}
    for name, code in STORAGE_DTYPES.items():
        assert DTYPE_NAMES[theirs[name]] == code, name
    assert {DTYPE_NAMES[d] for d in theirs.values() if d in DTYPE_NAMES} == set(STORAGE_DTYPES.values())
    for name, code in DTYPE_CODES.items():
        assert DTYPE_NAMES[getattr(torch, name)] == code and torch_global(name) == code
    assert all(isinstance(getattr(torch, n, None), torch.dtype) for n in OTHER_DTYPES if hasattr(torch, n))
    assert torch_global("Size") is tuple and torch_global("load") is None and torch_global("save") is None


def test_a_pickle_naming_anything_else_is_still_refused(tmp_path):
    import pickle

    from titan_pipe.weights.readers.dcp import read_metadata
    from titan_pipe.errors import UserError

    (tmp_path / ".metadata").write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(UserError, match="refusing to load subprocess.Popen"):
        read_metadata(tmp_path)
    torch.save({}, tmp_path / "x.pt")  # a torch pickle with its own globals: refused too
    (tmp_path / ".metadata").write_bytes((tmp_path / "x.pt").read_bytes())
    with pytest.raises(UserError):
        read_metadata(tmp_path)
