import json
import subprocess
import sys

import pytest

from jdp.cli import main as cli


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jdp", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_contract_flags():
    out = run_cli("train", "--help").stdout
    for flag in ("--devices", "--cpu-devices", "--batch-size", "--lr", "--epochs", "--allreduce",
                 "--dataset", "--data-dir", "--seed", "--out"):
        assert flag in out


def test_train_synthetic_end_to_end(tmp_path):
    result = run_cli("train", "--cpu-devices", "2", "--devices", "2", "--dataset", "synthetic",
                     "--epochs", "2", "--batch-size", "64", "--lr", "0.5", "--allreduce", "manual",
                     "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "%|" not in result.stderr, "progress bars written to a log"  # stderr is a pipe here, not a terminal
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.startswith("epoch")] == [
        ["epoch", "1"], ["epoch", "2"]]  # one line per epoch instead
    last = result.stdout.strip().splitlines()[-2]
    assert last.startswith("test acc: ") and "sec/epoch on [CpuDevice(id=0), CpuDevice(id=1)]" in last
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert history["devices"] == ["CpuDevice(id=0)", "CpuDevice(id=1)"]
    assert history["config"]["allreduce"] == "manual" and history["config"]["batch_size"] == 64
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]
    assert set(history["epochs"][0]) == {"epoch", "train_loss", "test_acc", "seconds"}
    assert isinstance(history["jax_version"], str)
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "10", "--cpu-devices", "4", "--devices", "4"], "divisible by the number of devices"),
        (["--cpu-devices", "2", "--devices", "3"], "more devices than exist"),
        (["--devices", "0"], "`--devices` must be a positive integer, got 0"),
        (["--lr", "-1"], "`--lr` must be positive"),
        (["--epochs", "0"], "`--epochs` must be a positive integer"),
        (["--allreduce", "nope"], "Unknown allreduce strategy `nope`"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code = cli.main(["train", "--dataset", "synthetic", "--epochs", "1", *args]) if "--cpu-devices" not in args \
        else run_cli("train", "--dataset", "synthetic", "--epochs", "1", *args)
    if isinstance(code, int):
        err = capsys.readouterr().err
    else:
        code, err = code.returncode, code.stderr
    assert code == 2
    assert err.strip().count("\n") == 0 and message in err and "Traceback" not in err
