"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as callbacks.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import optax

from jdp import allreduce as allreduce_lib
from jdp import checkpoint, distributed, guards, models
from jdp.data import Dataset
from jdp.errors import ConfigError
from jdp.pipeline import make_epoch_runner
from jdp.placement import AXIS
from jdp.step import make_evaluator, make_train_step, sgd

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the data and devices)."""

    batch_size: int = 256
    lr: float = 0.2
    epochs: int = 10
    allreduce: str = "psum"
    fuse: bool = False  # allreduce the gradients raveled into few buffers instead of one per leaf
    bucket_mb: float | None = None  # with `fuse`: largest bucket in MB; None: one buffer per dtype
    seed: int = 0
    eval_on: str = "all"  # "all": split evaluation over the devices; "device0": the lesson's way
    warmup_steps: int = 0  # ramp the lr linearly from 0 over this many steps (Goyal et al. 2017)
    model: str = "lenet"  # a name of jdp.models.NAMES
    model_impl: str = "fast"  # for model "lenet": a key of jdp.lenet_fast.IMPLEMENTATIONS; "reference" is the lesson's
    batchnorm: str | None = None  # for models with BatchNorm: "sync" (default) or "per-replica" (jdp.models)
    steps_per_call: int = 1  # train steps per compiled call (unrolled); > 1 needs a collective strategy
    backend: str = "pmap"  # "pmap" or "shard_map": how the step is mapped over the devices (jdp.step)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`--{name.replace('_', '-')}` must be a positive integer, got {getattr(self, name)}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"`--warmup-steps` must be >= 0, got {self.warmup_steps}.")
        if not self.lr > 0:
            raise ConfigError(f"`--lr` must be positive, got {self.lr}.")
        if self.eval_on not in ("all", "device0"):
            raise ConfigError(f"`--eval-on` must be `all` or `device0`, got `{self.eval_on}`.")
        model = models.get(self.model, impl=self.model_impl, batchnorm=self.batchnorm)
        if model.per_replica_state and self.backend != "pmap":
            raise ConfigError(
                "`--batchnorm per-replica` keeps different statistics on each device, which `--backend shard_map` "
                "cannot hold in its replicated `P()` layout. Use `--backend pmap` or `--batchnorm sync`."
            )
        if self.steps_per_call < 1:
            raise ConfigError(f"`--steps-per-call` must be a positive integer, got {self.steps_per_call}.")
        allreduce_lib.get(self.allreduce, fuse=self.fuse, bucket_mb=self.bucket_mb)
        distributed.check_backend(self.backend)


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean per-image loss over the epoch's steps
    test_acc: float
    seconds: float  # wall time of the epoch's training loop only


def learning_rate(config: TrainConfig) -> float | optax.Schedule:
    """The constant lr, or a linear warmup from 0 to it over `warmup_steps` steps, then constant."""
    if config.warmup_steps == 0:
        return config.lr
    return optax.linear_schedule(0.0, config.lr, config.warmup_steps)


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
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    check_replicas: int | None = None,
) -> tuple[PyTree, list[EpochRecord]]:
    """Trains `config.model` (the lesson's LeNet by default) data-parallel on `devices`.

    Args:
      config: hyper-parameters and strategy.
      dataset: host arrays; batches are split over the devices each step.
      devices: where the replicas live.
      on_epoch: called with each epoch's record as soon as it is known.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.
      checkpoint_dir: save checkpoints here (see `jdp.checkpoint`); None: none.
      checkpoint_every: save every this many steps; None: at the end of every epoch.
      resume: continue from the newest intact checkpoint in `checkpoint_dir`, if any.
      check_replicas: every this many steps, stop unless all replicas are bit-identical.

    Returns:
      (params, history): the first replica's params and one record per epoch (with a resumed
      run's earlier epochs; the epoch resumed mid-way times only its part run here).

    Raises:
      ConfigError: for a bad setting, or a checkpoint this run cannot resume.
      TrainingError: on a non-finite loss or update, or replicas that diverged (see `jdp.guards`).
    """
    config.validate()
    check_fits(config, dataset, devices)
    checkpoint.check_options(checkpoint_dir, checkpoint_every, resume)
    if check_replicas is not None and check_replicas < 1:
        raise ConfigError(f"`--check-replicas` must be a positive number of steps, got {check_replicas}.")
    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    optimizer = sgd(learning_rate(config))
    model = models.get(config.model, impl=config.model_impl, batchnorm=config.batchnorm)
    params = model.init(init_key)
    steps_per_epoch = len(dataset.train.labels) // config.batch_size
    keeper = checkpoint.Keeper(
        checkpoint_dir, checkpoint_every,
        checkpoint.describe_run(config, dataset, len(devices)) if checkpoint_dir is not None else None,
        steps_per_epoch, guards.Watch(params, check_replicas, same=_same_on_every_device(model)),
        lambda tree: distributed.local_copy(tree, config.backend), jax.random.key_data(data_key),
    )
    arrays = {"params": params, "opt_state": optimizer.init(models.trainable(model, params)), "data_key": keeper.data_key}
    if resume:
        arrays = keeper.resume(arrays, config.epochs)
    data_key = jax.random.wrap_key_data(arrays["data_key"])
    state = tuple(distributed.put_replicated(arrays[t], devices, config.backend) for t in ("params", "opt_state"))
    strategy = allreduce_lib.get(config.allreduce, fuse=config.fuse, bucket_mb=config.bucket_mb)
    step = make_train_step(model.loss, optimizer, strategy, devices, backend=config.backend, stateful=model.stateful)
    evaluate = make_evaluator(model.apply, devices, on_all_devices=config.eval_on == "all", backend=config.backend)
    if model.per_replica_state:  # one set of statistics before evaluating and saving (see jdp.models)
        average = jax.pmap(models.average_state, axis_name=AXIS, devices=devices, donate_argnums=0)
    if config.backend == "pmap" and jax.process_count() == 1:
        run_epoch = make_epoch_runner(step, dataset.train, devices, config.batch_size,
                                      steps_per_call=config.steps_per_call, traceable=strategy.where == "inside")
    else:  # each process feeds its rows of every batch from the host
        run_epoch = distributed.make_epoch_runner(step, dataset.train, devices, config.batch_size, config.backend,
                                                  steps_per_call=config.steps_per_call)
    for epoch in range(keeper.epoch, config.epochs + 1):
        start = time.perf_counter()
        state, _ = run_epoch(state, jax.random.fold_in(data_key, epoch), progress,
                             start=keeper.batches_done, after_call=keeper.after_call)
        seconds = time.perf_counter() - start
        if model.per_replica_state:
            state = (average(state[0]), state[1])
        record = EpochRecord(
            epoch=epoch,
            train_loss=float(keeper.epoch_loss()) / (steps_per_epoch * config.batch_size),
            test_acc=evaluate(state[0], dataset.test.images, dataset.test.labels),
            seconds=seconds,
        )
        keeper.end_epoch(state, dataclasses.asdict(record), last=epoch == config.epochs)
        on_epoch(record)
    return distributed.local_copy(state[0], config.backend), [EpochRecord(**r) for r in keeper.history]


def checkpoint_target(config: TrainConfig) -> PyTree:
    """The structure, shapes and dtypes of the arrays `train` checkpoints, e.g. for `jdp.checkpoint.load`."""
    model = models.get(config.model, impl=config.model_impl, batchnorm=config.batchnorm)
    params = model.init(jax.random.key(0))
    return {"params": params, "opt_state": sgd(learning_rate(config)).init(models.trainable(model, params)),
            "data_key": jax.random.key_data(jax.random.key(0))}


def _same_on_every_device(model: models.Model) -> Callable[[PyTree], PyTree]:
    """What the replica check compares: everything, except per-replica BatchNorm statistics mid-epoch."""
    if model.per_replica_state:
        return lambda variables: models.trainable(model, variables)
    return lambda variables: variables
