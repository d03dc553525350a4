"""`jdp train --tensorboard DIR`: the tags and values read back from the event files, with TensorBoard's
own reader (no TensorFlow), agree with the run's history; `jdp compare` reads the same runs."""

import json
import sys

import jax
import numpy as np
import pytest

import jdp
from jdp.cli import compare
from jdp.cli import main as cli
from jdp.cli.errors import in_flags, option_flags
from jdp.errors import ConfigError
from jdp.training.config import TrainConfig
from jdp.training.loop import train

pytest.importorskip("tensorboard")
from jdp.training.tensorboard import TensorBoardWriter, read_run, read_scalars  # noqa: E402

STEPS_PER_EPOCH, EPOCHS, WARMUP, LR = 8, 2, 5, 0.2  # synthetic: 2048 images, batch 256


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-epoch CLI run on 2 devices with --tensorboard and --out: (event dir, history.json)."""
    board, out = tmp_path_factory.mktemp("board"), tmp_path_factory.mktemp("out")
    assert cli.main(["train", "--devices", "2", "--dataset", "synthetic", "--epochs", str(EPOCHS), "--no-progress",
                     "--warmup-steps", str(WARMUP), "--lr", str(LR), "--allreduce", "ring",
                     "--tensorboard", str(board), "--out", str(out)]) == 0
    return board, json.loads((out / "history.json").read_text()), out


def test_scalars_read_back_agree_with_the_run(run):
    board, history, _ = run
    scalars = read_scalars(board)
    total = STEPS_PER_EPOCH * EPOCHS
    assert set(scalars) == {"train/loss", "train/learning_rate", "epoch/train_loss", "epoch/test_accuracy",
                            "epoch/seconds", "epoch/step_time_ms", "comm/allreduce_bytes_per_step",
                            "comm/allreduce_bytes_total"}
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == list(range(1, total + 1))
    losses = np.array([v for _, v in scalars["train/loss"]])
    epoch_ends = [STEPS_PER_EPOCH * e for e in range(1, EPOCHS + 1)]
    assert [s for s, _ in scalars["epoch/train_loss"]] == epoch_ends
    for e, record in enumerate(history["epochs"]):
        # the epoch's loss is the mean of its steps' losses
        assert losses[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH].mean() == pytest.approx(record["train_loss"],
                                                                                               rel=1e-5)
        assert scalars["epoch/test_accuracy"][e][1] == pytest.approx(record["test_acc"])
        assert scalars["epoch/seconds"][e][1] == pytest.approx(record["seconds"], rel=1e-6)
        assert scalars["epoch/step_time_ms"][e][1] == pytest.approx(1e3 * record["seconds"] / STEPS_PER_EPOCH,
                                                                    rel=1e-5)
    lrs = [v for _, v in scalars["train/learning_rate"]]
    assert lrs == pytest.approx([LR * min(s - 1, WARMUP) / WARMUP for s in steps])  # the update's own lr
    sent = history["allreduce_payload_bytes"]
    assert [v for _, v in scalars["comm/allreduce_bytes_per_step"]] == [sent] * EPOCHS
    assert [v for _, v in scalars["comm/allreduce_bytes_total"]] == [sent * s for s in epoch_ends]


def test_config_is_text_and_hparams_and_compare_reads_the_run(run):
    """One test for the rest of the run's checks, so that the CLI run is made once per test worker."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    board, history, out = run
    events = event_accumulator.EventAccumulator(str(board), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    text = tensor_util.make_ndarray(events.Tensors("config")[0].tensor_proto).item().decode()
    assert "| allreduce | \"ring\" |" in text and f"| warmup_steps | {WARMUP} |" in text
    assert read_run(board)["config"] == {k: v for k, v in history["config"].items() if v is not None}  # lists too

    _, table = compare.compare([out, board])
    rows = table.splitlines()[2:]
    assert len(rows) == 2 and rows[0].split("|")[2:] == rows[1].split("|")[2:]  # same numbers from both


@pytest.mark.parametrize("options", [{"steps_per_call": 3}, pytest.param({"backend": "shard_map"},
                                                                         marks=pytest.mark.slow)],
                         ids=["chunked", "shard_map"])
def test_steps_losses_cover_every_step_of_chunked_calls_and_shard_map(options, devices):
    data, seen = jdp.synthetic_dataset(jax.random.key(0), 128, 32), []
    _, history = train(TrainConfig(batch_size=32, lr=0.1, epochs=2, **options), data, devices[:2],
                       hooks=jdp.Hooks(on_steps=lambda first, losses: seen.append((first, np.asarray(losses)))))
    assert [first for first, _ in seen] == [1, 5] and all(len(losses) == 4 for _, losses in seen)
    for (_, losses), record in zip(seen, history):
        assert losses.mean() == pytest.approx(record.train_loss, rel=1e-5)  # the epoch's loss: its steps' mean


def test_without_the_tensorboard_package_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match=r"needs the 'tensorboard' package \(no TensorFlow\): "
                                          r"pip install 'jdp\[tensorboard\]'") as raised:
        TensorBoardWriter(tmp_path, {}, 0.1, 0)
    parser = cli.build_parser()  # the CLI names the flag, and the package stays a package
    said = in_flags(raised.value, option_flags(parser, parser.parse_args(["train"])))
    assert said.startswith(f"`--tensorboard {tmp_path}` needs the 'tensorboard' package"), said


def test_a_resumed_run_continues_the_step_axis_in_the_same_directory(tmp_path, devices):
    data = jdp.synthetic_dataset(jax.random.key(0), 128, 32)
    for epochs in (1, 2):  # epoch 1, then resumed from its checkpoint for epoch 2
        writer = TensorBoardWriter(tmp_path / "board", {"epochs": epochs}, 0.1, 1000)
        train(TrainConfig(batch_size=32, lr=0.1, epochs=epochs), data, devices[:2],
              checkpoints=jdp.Checkpoints(tmp_path / "ckpt", resume=epochs == 2),
              hooks=jdp.Hooks(on_epoch=writer.epoch, on_steps=writer.steps))
        writer.close()
    scalars = read_scalars(tmp_path / "board")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 9))
    assert scalars["comm/allreduce_bytes_total"] == [(4, 4000.0), (8, 8000.0)]
    assert [s for s, _ in scalars["epoch/step_time_ms"]] == [4, 8]
