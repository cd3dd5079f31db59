"""The one dtype table: names, aliases and the torch-valued tables built on first use."""

import subprocess
import sys

import pytest
import torch

from titan_pipe.rules.dtypes import parse_dtype
from titan_pipe.errors import UserError


def test_parse_dtype_in_a_fresh_interpreter():
    # The torch-valued tables are built lazily (module __getattr__); parse_dtype must not depend on
    # another caller having touched them first, so run it where nothing else has.
    code = (
        "from titan_pipe.rules.dtypes import parse_dtype; import torch; "
        "assert parse_dtype('bf16') is torch.bfloat16 and parse_dtype('float16') is torch.float16; "
        "assert parse_dtype('keep') is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "name,expected",
    [("float32", torch.float32), ("fp16", torch.float16), ("bfloat16", torch.bfloat16), ("auto", None), (None, None)],
)
def test_parse_dtype_names(name, expected):
    assert parse_dtype(name) is expected


def test_parse_dtype_refuses_an_unknown_name():
    with pytest.raises(UserError, match="'int8' is not one of float32, float16, bfloat16"):
        parse_dtype("int8")
