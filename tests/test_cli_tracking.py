"""`--flow` on a stage command: the same library call, tracked as a Prefect flow run."""
import os
import subprocess
import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from safetensors.torch import load_file
from typer.testing import CliRunner

from titan_pipe.cli import app
from convert_writers import model_args, native_state, write_hf


def test_convert_with_flow_is_tracked_and_gives_the_same_bytes(prefect_harness, tmp_path):
    args = model_args()
    src = write_hf(native_state(args), args, tmp_path / "hf")
    runner = CliRunner()
    plain = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    tracked = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "tracked"), "--flow"])
    assert tracked.exit_code == 0, tracked.output
    a = load_file(tmp_path / "plain" / "model.safetensors")
    b = load_file(tmp_path / "tracked" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["titan-pipe-convert-cli"])))
    assert len(runs) == 1 and runs[0].state.is_completed()


def test_bad_input_under_flow_is_one_line_and_a_failed_run(tmp_path):
    # A real process (its own temporary Prefect server): CliRunner's captured streams and
    # Prefect's console log handlers do not mix.
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    r = subprocess.run([sys.executable, "-m", "titan_pipe.cli", "convert", str(tmp_path / "nope"),
                        "-o", str(tmp_path / "x"), "--flow"], capture_output=True, text=True, env=env,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"error {tmp_path / 'nope'}: does not exist" in out
    assert "Finished in state Failed" in out and "Traceback" not in out
    assert not (tmp_path / "x").exists()
