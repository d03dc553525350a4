"""TensorBoard scalars of a training run, written with TensorBoard's own event writer (no TensorFlow).

`jdp train --tensorboard DIR` writes one events file into DIR (`tensorboard --logdir DIR`, or
several runs' parent folder, shows them side by side):

| tag | x: step | value |
|---|---|---|
| `train/loss` | each step | the step's mean per-image loss (summed over the devices, / batch size) |
| `train/learning_rate` | each step | the lr of that step's update |
| `epoch/train_loss`, `epoch/test_accuracy` | the epoch's last step | as `jdp.EpochRecord` |
| `epoch/seconds`, `epoch/step_time_ms` | the epoch's last step | the epoch's training loop, and that / its steps |
| `comm/allreduce_bytes_per_step` | the epoch's last step | bytes each device has handed to the allreduce per step so far (a local `--sync` mode: once per H steps) |
| `comm/allreduce_bytes_total` | the epoch's last step | bytes each device has handed to the allreduce so far |
| `config` (text), HPARAMS | 0 | the run's settings, as a table and as the hparams plugin's session |

A resumed run writes a new events file into the same DIR; TensorBoard shows the steps of both.
"""

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jdp.errors import Arg, ConfigError

LearningRate = float | Callable[[int], Any]  # a constant, or an optax schedule of the update count


class TensorBoardWriter:
    """Writes a run's scalars, config and hparams into `directory` as TensorBoard events.

    Give `steps` to `jdp.train` as `on_steps` and `epoch` as `on_epoch` (or call it from yours).

    Args:
      directory: the run's log dir (created if missing).
      config: the run's settings as JSON values (e.g. `TrainConfig.to_dict()`).
      learning_rate: the constant lr, or its schedule of the update count from 0.
      payload_bytes: bytes each device hands to one allreduce of the model, every step or every sync
        (`jdp.training.config.payload_bytes`).

    Raises:
      ConfigError: if the `tensorboard` package is not installed.
    """

    def __init__(self, directory: str | Path, config: dict[str, Any], learning_rate: LearningRate,
                 payload_bytes: int) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ConfigError(Arg("tensorboard", directory), " needs the 'tensorboard' package (no TensorFlow): "
                              "pip install 'jdp[tensorboard]'.") from None
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(directory))
        self._learning_rate, self._payload_bytes = learning_rate, payload_bytes
        self._last_step, self._steps_run = 0, 0  # the newest step written, and the epoch's steps so far
        self._config(config)

    def steps(self, first: int, losses: Sequence[float]) -> None:
        """Each step's mean loss and lr, the first of them being step `first` (counted from 1)."""
        for step, loss in enumerate(losses, start=first):
            lr = self._learning_rate if isinstance(self._learning_rate, float) else self._learning_rate(step - 1)
            self._scalars(step, {"train/loss": float(loss), "train/learning_rate": float(lr)})
        self._last_step, self._steps_run = first + len(losses) - 1, self._steps_run + len(losses)

    def epoch(self, record: Any) -> None:
        """An epoch's `jdp.EpochRecord`, at its last step: after `steps` gave that epoch's steps."""
        step, steps = self._last_step, max(self._steps_run, 1)
        syncs = step if record.syncs is None else record.syncs  # allreduces of the model so far
        self._scalars(step, {
            "epoch/train_loss": record.train_loss, "epoch/test_accuracy": record.test_acc,
            "epoch/seconds": record.seconds, "epoch/step_time_ms": 1e3 * record.seconds / steps,
            "comm/allreduce_bytes_per_step": self._payload_bytes * syncs / max(step, 1),
            "comm/allreduce_bytes_total": self._payload_bytes * syncs,
        })
        self._steps_run = 0
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._event(step, summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                                                     for tag, value in values.items()]))

    def _config(self, config: dict[str, Any]) -> None:
        import numpy as np
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.hparams import summary_v2 as hparams
        from tensorboard.plugins.text import metadata as text
        from tensorboard.util import tensor_util

        rows = ["| setting | value |", "|---|---|"] + [f"| {k} | {json.dumps(v)} |" for k, v in config.items()]
        self._event(0, summary_pb2.Summary(value=[summary_pb2.Summary.Value(
            tag="config", metadata=text.create_summary_metadata(display_name="config", description=""),
            tensor=tensor_util.make_tensor_proto(np.array("\n".join(rows), dtype=object)))]))
        self._event(0, hparams.hparams_pb({k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
                                           for k, v in config.items() if v is not None}))

    def _event(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto import event_pb2

        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))


def read_scalars(directory: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the events files in `directory`: tag -> [(step, value)], in step order.

    Raises:
      ConfigError: if the `tensorboard` package is not installed.
    """
    events = _load(directory)
    return {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def read_run(directory: str | Path) -> dict[str, Any]:
    """A run written by `TensorBoardWriter` as `jdp train --out`'s history.json has it: {"config", "epochs"}.

    Raises:
      ConfigError: if `directory` holds no such run, or the `tensorboard` package is not installed.
    """
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = _load(directory)
    try:
        sessions = events.PluginTagToContent("hparams")
    except KeyError:  # no hparams written
        sessions = {}
    scalars = {tag: sorted((e.step, e.value) for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}
    if "_hparams_/session_start_info" not in sessions or "epoch/test_accuracy" not in scalars:
        raise ConfigError(f"`{directory}` holds no run written by `jdp train --tensorboard`.")
    hparams = plugin_data_pb2.HParamsPluginData.FromString(sessions["_hparams_/session_start_info"])
    config = {k: _value(v) for k, v in sorted(hparams.session_start_info.hparams.items())}
    columns = {"train_loss": "epoch/train_loss", "test_acc": "epoch/test_accuracy", "seconds": "epoch/seconds"}
    columns["bytes_sent"] = "comm/allreduce_bytes_total"
    epochs = [{"epoch": i + 1, **{name: scalars[tag][i][1] for name, tag in columns.items()}}
              for i in range(len(scalars["epoch/test_accuracy"]))]
    return {"config": config, "epochs": epochs, "bytes_per_step": scalars["comm/allreduce_bytes_per_step"][-1][1]}


def _value(value: Any) -> Any:
    """An hparam's value as written: protobuf keeps every number as a double, and lists were written as JSON."""
    got = getattr(value, value.WhichOneof("kind"))
    if isinstance(got, str) and got.startswith(("[", "{")):
        return json.loads(got)
    return int(got) if isinstance(got, float) and got.is_integer() else got


def _load(directory: str | Path) -> Any:
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise ConfigError(f"Reading `{directory}`'s TensorBoard events needs the 'tensorboard' package: "
                          "pip install 'jdp[tensorboard]'.") from None
    events = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0,
                                                                               event_accumulator.TENSORS: 0})
    events.Reload()
    return events
