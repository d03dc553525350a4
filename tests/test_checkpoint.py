import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from optax import sgd
from reference import small_set

import jdp
from jdp import data
from jdp.cli import main as cli
from jdp.errors import ConfigError, DataError
from jdp.models import lenet
from jdp.parallel import layout
from jdp.parallel import feeders as pipeline
from jdp.training import checkpoint
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig
from jdp.training.loop import train


def state(seed=0):
    params = lenet.init(jax.random.key(seed))
    return {"params": params, "opt_state": sgd(0.1).init(params), "data_key": jax.random.key_data(jax.random.key(seed))}


def assert_bit_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


# ---- save / load -------------------------------------------------------------------------------

def test_round_trip_is_bit_identical_and_keeps_structure(tmp_path):
    saved = state()
    path = checkpoint.save(tmp_path, 12, saved, {"epoch": 2, "history": [{"epoch": 1, "test_acc": 0.5}]})
    assert path.name == "checkpoint-000000012.msgpack"
    got = checkpoint.load(path, state(seed=1))
    assert got.step == 12 and got.info == {"epoch": 2, "history": [{"epoch": 1, "test_acc": 0.5}]}
    assert jax.tree.structure(got.arrays) == jax.tree.structure(saved)  # optax NamedTuples come back
    assert_bit_identical(got.arrays, saved)


def test_keeps_the_last_two(tmp_path):
    for step in (5, 10, 15, 20):
        checkpoint.save(tmp_path, step, state(), {})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint-000000020.msgpack", "checkpoint-000000015.msgpack"]


def test_crash_during_a_save_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 5, state(), {"step": 5})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.save(tmp_path, 10, state(seed=1), {"step": 10})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_killed_save_leaves_a_temp_file_that_is_ignored_then_removed(tmp_path):
    checkpoint.save(tmp_path, 5, state(), {})
    (tmp_path / ".tmp-checkpoint-abc123").write_bytes(b"half a checkpoint")  # SIGKILL between write and rename
    assert checkpoint.restore_latest(tmp_path, state()).step == 5
    checkpoint.save(tmp_path, 10, state(), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-000000005.msgpack", "checkpoint-000000010.msgpack"]


# ---- restore: newest intact one, clear errors otherwise ------------------------------------------

def test_restore_latest_takes_the_newest(tmp_path):
    checkpoint.save(tmp_path, 5, state(seed=5), {})
    checkpoint.save(tmp_path, 10, state(seed=10), {})
    got = checkpoint.restore_latest(tmp_path, state())
    assert got.step == 10
    assert_bit_identical(got.arrays, state(seed=10))


def test_restore_latest_of_an_empty_or_missing_directory_is_none(tmp_path):
    assert checkpoint.restore_latest(tmp_path, state()) is None
    assert checkpoint.restore_latest(tmp_path / "new", state()) is None


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    checkpoint.save(tmp_path, 5, state(seed=5), {})
    newest = checkpoint.save(tmp_path, 10, state(seed=10), {})
    raw = bytearray(newest.read_bytes())
    raw[-100] ^= 1  # one flipped bit
    newest.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="jdp.training.checkpoint"):
        got = checkpoint.restore_latest(tmp_path, state())
    assert got.step == 5
    assert "checkpoint-000000010.msgpack is corrupt" in caplog.text


@pytest.mark.parametrize("content", [b"", b"garbage", checkpoint.MAGIC + b"x" * 40])
def test_no_intact_checkpoint_is_a_clear_error_and_nothing_is_touched(tmp_path, content):
    bad = tmp_path / "checkpoint-000000007.msgpack"
    bad.write_bytes(content)
    with pytest.raises(DataError, match=r"No intact checkpoint in `checkpoint_dir=.*`: .*checkpoint-000000007"):
        checkpoint.restore_latest(tmp_path, state())
    assert bad.read_bytes() == content


def test_a_checkpoint_of_another_model_is_refused_naming_the_leaf(tmp_path):
    other = state()
    other["params"]["W3"] = np.zeros((800, 64), np.float32)
    checkpoint.save(tmp_path, 5, other, {})
    with pytest.raises(ConfigError, match=r"holds `\['params'\]\['W3'\]` as float32\[800, 64\] but this run's "
                                          r"model has float32\[800, 128\]"):
        checkpoint.restore_latest(tmp_path, state())


def test_a_checkpoint_with_other_leaves_is_refused(tmp_path):
    other = state()
    other["params"]["W5"] = np.zeros(3, np.float32)
    checkpoint.save(tmp_path, 5, other, {})
    with pytest.raises(ConfigError, match=r"other arrays .*\['params'\]\['W5'\] differ"):
        checkpoint.restore_latest(tmp_path, state())


# ---- which directories a run may use -------------------------------------------------------------

def test_foreign_files_are_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files that are not jdp checkpoints \(notes.txt\)"):
        checkpoint.check_directory(tmp_path, resume=True)
    with pytest.raises(ConfigError, match="not jdp checkpoints"):
        checkpoint.save(tmp_path, 1, state(), {})
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_checkpoint_deleted_while_listed_is_skipped_and_a_directory_of_its_name_is_foreign(tmp_path, monkeypatch):
    """A reader beside a running job (its rotation deletes old checkpoints) lists a name, then finds the file gone:
    it was a checkpoint, not a foreign file (the race once stopped tests/test_faults.py's killer thread)."""
    checkpoint.save(tmp_path, 8, state(), {})
    listed = Path.iterdir

    def listed_then_deleted(self):  # the listing still holds step 4's checkpoint, which no longer exists
        yield from listed(self)
        yield self / "checkpoint-000000004.msgpack"

    monkeypatch.setattr(Path, "iterdir", listed_then_deleted)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-000000008.msgpack"]
    monkeypatch.undo()
    (tmp_path / "checkpoint-000000009.msgpack").mkdir()
    with pytest.raises(ConfigError, match=r"not jdp checkpoints \(checkpoint-000000009.msgpack\)"):
        checkpoint.list_checkpoints(tmp_path)


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        checkpoint.check_directory(tmp_path / "f", resume=False)


def test_existing_checkpoints_need_resume(tmp_path):
    checkpoint.check_directory(tmp_path, resume=False)  # empty: fine
    checkpoint.check_directory(tmp_path / "new", resume=False)  # missing: fine, created on the first save
    checkpoint.save(tmp_path, 5, state(), {})
    with pytest.raises(ConfigError, match=r"already holds checkpoints \(newest: checkpoint-000000005.msgpack\); "
                                          r"pass `resume=True`"):
        checkpoint.check_directory(tmp_path, resume=False)
    checkpoint.check_directory(tmp_path, resume=True)


# ---- resume through the real training loop --------------------------------------------------------

FLAGS = ["--dataset", "synthetic", "--epochs", "2", "--batch-size", "32", "--lr", "0.1", "--no-progress",
         "--checkpoint-every", "3", "--no-xla-flags"]  # 2048 images: 64 steps per epoch, 128 in all


def final_state(directory, config=TrainConfig(lr=0.1)):
    return checkpoint.restore_latest(directory, checkpoint_target(config, device_count=2))


# The lesson's SGD, and AdamW with its state sharded over the devices (ZeRO: the checkpoint holds it gathered).
SHARDED_ADAMW = ["--optimizer", "adamw", "--lr", "0.001", "--shard-optimizer"]
# DiLoCo with H = 5: killed after a checkpoint at a multiple of 3, mostly mid-interval (devices' params differ).
DILOCO = ["--sync", "diloco", "--sync-every", "5"]
RUNS = {"sgd": ([], TrainConfig(lr=0.1)),
        "sharded-adamw": (SHARDED_ADAMW, TrainConfig(lr=0.001, optimizer="adamw", shard_optimizer=True)),
        "diloco": (DILOCO, TrainConfig(lr=0.1, sync=jdp.DiLoCo(every=5)))}


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_killed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(run, tmp_path, devices, capsys):
    """SIGKILL a real `jdp train` process mid-epoch, `--resume` it: the final params, optimizer state and
    history equal an uninterrupted run's, bit for bit. (The resumed and the uninterrupted run use the CLI
    in this process, on 2 of its 8 devices, to spare two JAX start-ups. The killed process is configured
    alike: 8 simulated devices and no XLA performance flags, which this process, started by pytest, lacks;
    XLA's CPU code rounds differently under those flags.)"""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    extra, config = RUNS[run]
    proc = subprocess.Popen([sys.executable, "-m", "jdp", "train", "--cpu-devices", "8", "--devices", "2", *FLAGS,
                             *extra, "--checkpoint-dir", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # lowest: on a loaded machine the polling below still runs in time
    deadline = time.monotonic() + 600
    while not any(int(p.name[11:20]) >= 72 for p in killed.glob("checkpoint-*.msgpack")):  # in epoch 2
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    interrupted = final_state(killed, config)
    assert 72 <= interrupted.step < 128 and 0 < interrupted.info["position"]["batches_done"] < 64  # mid-epoch

    assert cli.main(["train", "--devices", "2", *FLAGS, *extra, "--checkpoint-dir", str(killed), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert f"resuming from {interrupted.path} (step {interrupted.step}, epoch 2" in err
    assert out.count("epoch   2") == 1 and "epoch   1" not in out
    assert cli.main(["train", "--devices", "2", *FLAGS, *extra, "--checkpoint-dir", str(whole)]) == 0

    a, b = final_state(whole, config), final_state(killed, config)
    assert a.step == b.step == 128
    assert_bit_identical(a.arrays, b.arrays)
    timing = ("seconds", "steps_per_call")  # measured: each run its own (auto picks from the step time)
    strip = lambda history: [{k: v for k, v in r.items() if k not in timing} for r in history]  # noqa: E731
    assert strip(a.info["history"]) == strip(b.info["history"])  # same losses and accuracies too
    assert len(checkpoint.list_checkpoints(killed)) == checkpoint.KEEP


CONFIG = TrainConfig(batch_size=16, lr=0.1, epochs=1, seed=0)


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """A checkpoint directory holding the end of a 1-epoch run of CONFIG on 2 devices (8 steps)."""
    folder = tmp_path_factory.mktemp("one_epoch")
    train(CONFIG, small_set(128), jax.devices()[:2], checkpoints=jdp.Checkpoints(folder))
    return folder


def test_resume_refuses_another_batch_size_seed_or_dataset(one_epoch, tmp_path, devices):
    shutil.copytree(one_epoch, tmp_path, dirs_exist_ok=True)
    other = data.synthetic(jax.random.key(1), n_train=128, n_test=32)
    for config, dataset, k, message in [
        (dataclasses.replace(CONFIG, batch_size=32), small_set(128), 2, "`batch_size=32` differs from the checkpoint's 16"),
        (dataclasses.replace(CONFIG, seed=1), small_set(128), 2, "`seed=1` differs from the checkpoint's 0"),
        (CONFIG, other, 2, "was written for another dataset"),
        (CONFIG, small_set(128), 3, "divisible by the number of devices"),  # as for a fresh run
    ]:
        with pytest.raises(ConfigError, match=message):
            train(dataclasses.replace(config, epochs=2), dataset, devices[:k],
                  checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint-000000008.msgpack"]


@pytest.mark.slow
def test_resume_on_another_device_count_continues_the_same_math(one_epoch, tmp_path, devices, caplog):
    """Each device sums its shard's gradients, the allreduce sums those, the update divides by the FULL batch:
    the update is the same for any device count dividing the batch, up to float rounding order."""
    whole, _ = train(dataclasses.replace(CONFIG, epochs=2), small_set(128), devices[:2])
    shutil.copytree(one_epoch, tmp_path, dirs_exist_ok=True)
    with caplog.at_level(logging.INFO, logger="jdp"):
        resumed, history = train(dataclasses.replace(CONFIG, epochs=2), small_set(128), devices[:4],
                                 checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert "resuming on 4 devices instead of the checkpoint's 2: each update is the same sum" in caplog.text
    assert [r.epoch for r in history] == [1, 2]
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_resumed_epoch_skips_exactly_the_batches_done(devices):
    """The host-fed pipelines (single- and multi-process) resume an epoch at batch `skip` of the same order."""
    key = jax.random.key(3)
    whole = list(pipeline.epoch_batches(small_set(128).train, 16, key))
    for batches in (pipeline.epoch_batches(small_set(128).train, 16, key, skip=3),
                    pipeline.epoch_batches(small_set(128).train, 16, key, skip=3, rows=layout.process_rows(16, devices[:2]))):
        rest = list(batches)
        assert len(rest) == len(whole) - 3
        for (x, y), (x0, y0) in zip(rest, whole[3:], strict=True):
            np.testing.assert_array_equal(x, x0)
            np.testing.assert_array_equal(y, y0)
