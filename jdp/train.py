"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as callbacks.
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jdp import allreduce as allreduce_lib
from jdp import lenet
from jdp.data import Dataset, Split
from jdp.errors import ConfigError
from jdp.inflight import InFlight
from jdp.placement import replicate, split_batch, unreplicate
from jdp.step import make_evaluator, make_train_step, sgd, summed_cross_entropy

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the data and devices)."""

    batch_size: int = 256
    lr: float = 0.2
    epochs: int = 10
    allreduce: str = "psum"
    seed: int = 0
    eval_on: str = "all"  # "all": split evaluation over the devices; "device0": the lesson's way

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`--{name.replace('_', '-')}` must be a positive integer, got {getattr(self, name)}.")
        if not self.lr > 0:
            raise ConfigError(f"`--lr` must be positive, got {self.lr}.")
        if self.eval_on not in ("all", "device0"):
            raise ConfigError(f"`--eval-on` must be `all` or `device0`, got `{self.eval_on}`.")
        allreduce_lib.get(self.allreduce)


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean per-image loss over the epoch's steps
    test_acc: float
    seconds: float  # wall time of the epoch's training loop only


def epoch_batches(split: Split, batch_size: int, key: jax.Array) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of a fresh permutation (the last partial batch is dropped: shapes stay static)."""
    order = np.asarray(jax.random.permutation(key, len(split.labels)))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield split.images[idx], split.labels[idx]


def check_fits(config: TrainConfig, dataset: Dataset, devices: Sequence[jax.Device]) -> None:
    """Raises ConfigError if the batch cannot be split over `devices` or exceeds the train set."""
    k = len(devices)
    if config.batch_size % k:
        raise ConfigError(
            f"Batch size must be divisible by the number of devices: `--batch-size {config.batch_size}` "
            f"over {k} devices. Use a multiple of {k}."
        )
    if config.batch_size > len(dataset.train.labels):
        raise ConfigError(
            f"`--batch-size {config.batch_size}` exceeds the {len(dataset.train.labels)} training images."
        )


def train(
    config: TrainConfig,
    dataset: Dataset,
    devices: Sequence[jax.Device],
    *,
    on_epoch: Callable[[EpochRecord], None] = lambda record: None,
    progress: Callable[[Iterable, int], Iterable] = lambda batches, total: batches,
) -> tuple[PyTree, list[EpochRecord]]:
    """Trains the lesson's LeNet data-parallel on `devices`.

    Args:
      config: hyper-parameters and strategy.
      dataset: host arrays; batches are split over the devices each step.
      devices: where the replicas live.
      on_epoch: called with each epoch's record as soon as it is known.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.

    Returns:
      (params, history): the first replica's params and one record per epoch.
    """
    config.validate()
    check_fits(config, dataset, devices)
    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    optimizer = sgd(config.lr)
    params = lenet.init(init_key)
    state = replicate(params, devices), replicate(optimizer.init(params), devices)
    step = make_train_step(
        summed_cross_entropy(lenet.apply), optimizer, allreduce_lib.get(config.allreduce), devices
    )
    evaluate = make_evaluator(lenet.apply, devices, on_all_devices=config.eval_on == "all")
    steps_per_epoch = len(dataset.train.labels) // config.batch_size
    history = []
    for epoch in range(1, config.epochs + 1):
        batches = epoch_batches(dataset.train, config.batch_size, jax.random.fold_in(data_key, epoch))
        start = time.perf_counter()
        state, losses = _run_epoch(step, state, progress(batches, steps_per_epoch), devices)
        seconds = time.perf_counter() - start
        record = EpochRecord(
            epoch=epoch,
            train_loss=float(sum(np.asarray(l).sum() for l in losses)) / (len(losses) * config.batch_size),
            test_acc=evaluate(state[0], dataset.test.images, dataset.test.labels),
            seconds=seconds,
        )
        history.append(record)
        on_epoch(record)
    return unreplicate(state[0]), history


def _run_epoch(step, state, batches, devices):
    """One pass over `batches`, at most two steps in flight; returns the state and per-step losses."""
    params, opt_state = state
    window, losses = InFlight(limit=2), []
    for images, labels in batches:
        x, y = split_batch(images, labels, devices)
        params, opt_state, loss = step(params, opt_state, x, y)
        window.push(loss)
        losses.append(loss)
    window.drain()
    return (params, opt_state), losses
