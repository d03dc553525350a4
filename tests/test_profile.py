"""`--profile`: the trace of the chosen steps and its breakdown; `jdp bench step`'s breakdown column;
`jdp compare`: one figure and one table of several runs, labelled by what differs."""

import dataclasses
import gzip
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import jdp
from jdp.cli.main import main as jdp_main
from jdp.errors import ConfigError
from jdp.training import profile
from jdp.training.loop import TrainConfig, train
from reference import small_set
from test_compress import tiny_model


def write_trace(path, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "tf_XLAEigen/123"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "python"}}]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + [{"ph": "X", "pid": 1, **e} for e in events]}, f)


def test_op_own_seconds_counts_each_op_once_and_by_kind_sets_collectives_apart(tmp_path):
    """A while loop of 100 µs holding a collective-permute of 30 µs and a fusion of 20 µs: the loop's own
    50 µs are compute, and so is a oneDNN convolution; runtime events (capitalised), Python's ($file.py:line)
    and the python thread's events are not ops."""
    write_trace(tmp_path / "t.json.gz", [
        {"tid": 7, "name": "while.2", "ts": 0, "dur": 100},
        {"tid": 7, "name": "collective-permute.1", "ts": 10, "dur": 30},
        {"tid": 7, "name": "Rendezvous", "ts": 12, "dur": 25},
        {"tid": 7, "name": "fusion.3", "ts": 50, "dur": 20},
        {"tid": 7, "name": "psum.7", "ts": 200, "dur": 40},  # current JAX names an all-reduce by its primitive
        {"tid": 7, "name": "custom-call.8.clone__onednn$convolution", "ts": 250, "dur": 15},  # oneDNN on CPU
        {"tid": 7, "name": "$api.py:2778 block_until_ready", "ts": 270, "dur": 10},
        {"tid": 7, "name": "ThunkExecutor::Execute", "ts": 0, "dur": 300},
        {"tid": 8, "name": "train", "ts": 0, "dur": 1000},
    ])
    own = profile.op_own_seconds(tmp_path / "t.json.gz")
    assert profile.by_kind(own) == pytest.approx({"compute": 85e-6, "communication": 70e-6})
    assert own == pytest.approx({"while.2": 50e-6, "collective-permute.1": 30e-6, "fusion.3": 20e-6, "psum.7": 40e-6,
                                 "custom-call.8.clone__onednn$convolution": 15e-6})
    assert profile.format_heaviest({name: 1e3 * s for name, s in own.items()}, count=2) == "while.2 0.05, psum.7 0.04"


def test_profile_steps_must_be_a_window_of_the_run():
    assert profile.parse_steps("3:12") == (3, 12)
    for bad in ("0:3", "5:4", "3", "a:b"):
        with pytest.raises(ConfigError, match=f"`profile_steps={bad}` must be A:B with 1 <= A <= B"):
            profile.parse_steps(bad)
    with pytest.raises(ConfigError, match="`profile_steps=3:20` goes past the run's 8 steps; choose B <= 8"):
        train(TrainConfig(batch_size=16, epochs=1, model=tiny_model()), small_set(128), jax.devices()[:2],
              hooks=jdp.Hooks(profile=profile.Profiler("unused", 3, 20, 2, jdp.get_allreduce("psum"))))


@pytest.mark.parametrize("name", ["psum", "manual"])
def test_a_profiled_run_writes_a_trace_and_its_breakdown(name, tmp_path, devices):
    config = dataclasses.replace(TrainConfig(batch_size=16, epochs=1, model=tiny_model()), allreduce=name)
    profiler = profile.Profiler(tmp_path, 2, 5, 2, config.strategy())
    train(config, small_set(128), devices[:2], hooks=jdp.Hooks(profile=profiler))
    b = profiler.breakdown
    assert b.steps == 4 and b.source == ("trace" if name == "psum" else "segments")
    assert b.compute_ms > 0 and b.communication_ms > 0
    assert b.wall_ms == pytest.approx(b.compute_ms + b.communication_ms + b.host_ms)
    assert profiler.trace.name == "perfetto_trace.json.gz" and profiler.trace.stat().st_size > 1000
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # what TensorBoard's profiler reads
    if name == "psum":  # the ops of the trace, per step and device, add up to the breakdown's device time
        assert sum(profiler.ops_ms.values()) == pytest.approx(b.compute_ms + b.communication_ms)
    else:
        assert profiler.ops_ms == {}  # an outside strategy is broken down by its timed calls


@pytest.mark.slow
def test_train_cli_prints_the_breakdown(tmp_path, capsys):
    assert jdp_main(["train", "--devices", "2", "--dataset", "synthetic", "--epochs", "1", "--no-progress",
                     "--profile", str(tmp_path), "--profile-steps", "2:4"]) == 0
    out = capsys.readouterr().out
    assert "profile of steps 2-4: " in out and "(over 3 steps, from the trace)" in out
    assert "https://ui.perfetto.dev" in out and f"tensorboard --logdir {tmp_path}" in out
    assert "heaviest ops (ms/step per device): " in out


def test_each_process_of_a_job_traces_into_its_own_folder(tmp_path):
    assert profile.trace_directory(tmp_path, 0, 1) == tmp_path
    assert [profile.trace_directory(tmp_path, i, 2) for i in range(2)] == [tmp_path / "process-0",
                                                                           tmp_path / "process-1"]


@pytest.mark.slow
def test_a_launched_job_profiles_every_process(tmp_path):
    """Two processes tracing into one folder wrote over each other's trace files, and reading one crashed."""
    done = subprocess.run(
        [sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--cpu-devices-per-process", "1",
         "--timeout", "300", "--", "jdp", "train", "--backend", "shard_map", "--dataset", "synthetic",
         "--epochs", "1", "--no-progress", "--profile", str(tmp_path), "--profile-steps", "2:4"],
        capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    for i in range(2):
        assert f"[p{i}] profile of steps 2-4: " in done.stdout
        assert len(list((tmp_path / f"process-{i}").glob("plugins/profile/*/perfetto_trace.json.gz"))) == 1


def test_the_default_window_fits_any_run():
    assert profile.default_window(100) == (3, 12)
    assert profile.default_window(8) == (3, 8)  # `jdp train --dataset synthetic --epochs 1`
    assert profile.default_window(2) == (2, 2)
    for total in range(1, 30):
        first, last = profile.default_window(total)
        profile.check_window(first, last, total)  # never refused


@pytest.mark.slow
def test_train_cli_profiles_a_short_run_without_profile_steps(tmp_path, capsys):
    assert jdp_main(["train", "--devices", "2", "--dataset", "synthetic", "--epochs", "1", "--no-progress",
                     "--profile", str(tmp_path)]) == 0
    assert "profile of steps 3-8: " in capsys.readouterr().out


@pytest.mark.slow
def test_bench_step_has_a_breakdown_column(capsys):
    assert jdp_main(["bench", "step", "--devices", "2", "--batch-size", "8", "--steps", "2", "--repeats", "1",
                     "--algorithms", "manual"]) == 0
    out = capsys.readouterr().out
    assert "compute/communication/host ms (profiled)" in out and out.count("(segments)") == 2


# ---- jdp compare --------------------------------------------------------------------------------

def fake_run(directory, accs, **config):
    directory.mkdir()
    base = {"allreduce": "psum", "compress": "none", "powersgd_rank": None, "out": str(directory), "lr": 0.2}
    epochs = [{"epoch": i + 1, "train_loss": 1.0 / (i + 1), "test_acc": a, "seconds": 2.0} for i, a in enumerate(accs)]
    (directory / "history.json").write_text(json.dumps({"config": base | config, "epochs": epochs,
                                                        "allreduce_payload_bytes": 100}))
    return str(directory)


def test_compare_labels_runs_by_what_differs(tmp_path, capsys):
    runs = [fake_run(tmp_path / "a", [0.5, 0.7]), fake_run(tmp_path / "b", [0.4, 0.6], compress="bf16"),
            fake_run(tmp_path / "c", [0.3, 0.8], compress="powersgd", powersgd_rank=2)]
    assert jdp_main(["compare", *runs, "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "compare.md").read_text()
    assert table in capsys.readouterr().out
    assert "| compress=none | 2 | 0.7000 | 0.7000 | 0.5000 | 2.0 | 100 |" in table
    assert "| compress=powersgd powersgd_rank=2 | 2 | 0.8000 |" in table  # `out` differs too, but says nothing
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000


def test_compare_refuses_a_directory_without_history(tmp_path, capsys):
    assert jdp_main(["compare", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`{tmp_path}` has no readable history.json" in err


# ---- experiments/compression.py ------------------------------------------------------------------

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "compression.py"


def test_compression_experiment_help():
    result = subprocess.run([sys.executable, str(EXPERIMENT), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--quick" in result.stdout and "--reuse" in result.stdout


@pytest.mark.slow
def test_compression_experiment_quick_mode_writes_outputs(tmp_path):
    result = subprocess.run([sys.executable, str(EXPERIMENT), "--quick", "--runs", str(tmp_path / "runs"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "compression.json").read_text())
    assert record["quick"] is True and list(record["runs"]) == ["none", "bf16", "powersgd-r1", "powersgd-r2",
                                                                 "powersgd-r4"]
    sent = [r["allreduce_payload_bytes"] for r in record["runs"].values()]
    assert sent[0] == 2 * sent[1] and sent[2] < sent[3] < sent[4] < sent[1]
    assert (tmp_path / "out" / "compression.md").read_text() in result.stdout
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
