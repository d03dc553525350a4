import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jdp.cli import main as cli
from jdp.cli.errors import in_flags, option_flags
from jdp.errors import Arg, ConfigError

ROOT = Path(__file__).resolve().parents[1]


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
    assert history["config"]["formulation"] == "fast"  # `auto`, pinned to fast for tests (tests/conftest.py)
    assert history["formulation"]["requested"] == "auto"
    assert result.stdout.startswith("formulation: fast (user table (formulations.json): tests/conftest.py: pinned)\n")
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]
    assert set(history["epochs"][0]) == {"epoch", "train_loss", "test_acc", "seconds", "syncs", "bytes_sent", "steps_per_call"}
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
        (["--steps-per-call", "0"], "`--steps-per-call` must be a positive integer, got 0"),
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


def test_steps_per_call_is_a_number_or_auto_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["train", "--dataset", "synthetic", "--steps-per-call", "many"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.strip().count("\n") == 0
    assert "--steps-per-call: expected a number of steps or auto, got 'many'" in err


def test_the_arguments_an_error_is_about_are_printed_as_the_commands_flags():
    parser = cli.build_parser()
    options = option_flags(parser, parser.parse_args(["train"]))
    error = ConfigError(Arg("accumulate", 5), " cuts each device's 12 rows into uneven micro-batches; ",
                        Arg("shard_optimizer"), " needs ", Arg("allreduce", "psum"), ". ", Arg("shard_optimizer", True),
                        ", ", Arg("fuse", False), ", ", Arg("unknown_name", 3), "; `accumulate=5` is text.")
    assert str(error) == (
        "`accumulate=5` cuts each device's 12 rows into uneven micro-batches; `shard_optimizer` needs "
        "`allreduce=psum`. `shard_optimizer=True`, `fuse=False`, `unknown_name=3`; `accumulate=5` is text.")
    assert in_flags(error, options) == (
        "`--accumulate 5` cuts each device's 12 rows into uneven micro-batches; `--shard-optimizer` needs "
        "`--allreduce psum`. `--shard-optimizer`, `no --fuse`, `unknown_name=3`; `accumulate=5` is text.")
    assert error.arguments[0] == Arg("accumulate", 5) and len(error.arguments) == 6
    bench = parser.parse_args(["bench", "allreduce"])  # the flags of the subcommand that ran, not of `train`
    assert in_flags(ConfigError(Arg("repeats"), " must be a positive integer; ", Arg("accumulate", 5)),
                    option_flags(parser, bench)) == "`--repeats` must be a positive integer; `accumulate=5`"


def cli_names_in_error_text(root: Path, dests: set[str]) -> list[str]:
    """`file:line` of each string inside a jdp error's constructor that names one of `dests` in backticks
    (`accumulate`, `accumulate=5`) as text instead of as an `Arg`: the CLI would print it as Python spells it."""
    import ast
    import re

    named = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)(=[^`]*)?`")
    errors = {"JdpError", "ConfigError", "DataError", "DeviceError", "TrainingError", "ProcessLostError"}
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in errors):
                continue
            text = "".join(part.value for arg in node.args for part in ast.walk(arg)
                           if isinstance(part, ast.Constant) and isinstance(part.value, str))
            if any(m.group(1) in dests for m in named.finditer(text)):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_errors_name_the_cli_settings_they_are_about_as_args(tmp_path):
    """No jdp error writes a setting that has a CLI flag as text: text is never rewritten, so it would stay Python."""
    dests, parsers = set(), [cli.build_parser()]
    while parsers:  # every option of every (sub)command
        for action in parsers.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings:
                dests.add(action.dest)
    assert "accumulate" in dests and "repeats" in dests
    assert cli_names_in_error_text(ROOT / "jdp", dests) == []
    (tmp_path / "jdp").mkdir()
    (tmp_path / "jdp" / "m.py").write_text('def f(n):\n    raise ConfigError(f"`accumulate={n}` is too big")\n')
    assert cli_names_in_error_text(tmp_path / "jdp", dests) == ["jdp/m.py:2"]  # the check sees one


def test_a_library_error_is_reported_with_the_flag(capsys):
    assert cli.main(["train", "--dataset", "synthetic", "--accumulate", "0"]) == 2
    assert "`--accumulate` must be a positive integer, got 0" in capsys.readouterr().err
    assert cli.main(["bench", "train", "--dataset", "synthetic", "--rounds", "0"]) == 2
    assert "`--rounds` must be a positive integer, got 0" in capsys.readouterr().err


def test_train_flags_are_the_fields_of_train_config():
    """`run_train` builds `TrainConfig(**{field: args.field})`: every field needs a `jdp train` flag of that dest."""
    import dataclasses

    from jdp.training.config import TrainConfig

    train = cli.build_parser().parse_args(["train"])
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= set(vars(train))
    # the same defaults, but the CLI's formulation is `auto` (this machine's fastest), the library's `fast`
    assert TrainConfig(**{f.name: getattr(train, f.name) for f in dataclasses.fields(TrainConfig)}) == TrainConfig(
        formulation="auto")
