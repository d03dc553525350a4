"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as callbacks.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from jdp import models
from jdp.data import Dataset
from jdp.errors import ConfigError, check_positive
from jdp.models import Model, precision
from jdp.parallel import compress as compress_lib
from jdp.parallel import zero
from jdp.parallel.allreduce import Allreduce
from jdp.parallel.layout import check_backend, check_divisible, replicate, to_host, unreplicate
from jdp.parallel.step import make_train_step
from jdp.runtime.devices import AXIS
from jdp.training import checkpoint, guards, optimizers
from jdp.training.evaluate import make_evaluator
from jdp.training.feeders import make_epoch_runner
from jdp.training.keeper import Keeper
from jdp.training.profile import Profiler, check_window
from jdp.training.resume import describe_run

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the data and devices)."""

    batch_size: int = 256
    lr: float = 0.2
    epochs: int = 10
    allreduce: str | Allreduce = "psum"  # a registered name (jdp.allreduce_names()) or your own strategy
    fuse: bool = False  # allreduce the gradients raveled into few buffers instead of one per leaf
    bucket_mb: float | None = None  # with `fuse`: largest bucket in MB; None: one buffer per dtype
    seed: int = 0
    eval_on: str = "all"  # "all": split evaluation over the devices; "device0": the lesson's way
    warmup_steps: int = 0  # ramp the lr linearly from 0 over this many steps (Goyal et al. 2017)
    model: str | Model = "lenet"  # a registered name (jdp.model_names()) or your own Model
    model_impl: str = "fast"  # for model "lenet": a key of jdp.models.lenet_fast.IMPLEMENTATIONS; "reference" is the lesson's
    batchnorm: str | None = None  # for models with BatchNorm: "sync" (default) or "per-replica" (jdp.models)
    steps_per_call: int = 1  # train steps per compiled call (unrolled); > 1 needs a collective strategy
    backend: str = "pmap"  # "pmap" or "shard_map": how the step is mapped over the devices (jdp.parallel.step)
    compress: str = "none"  # a mode of jdp.parallel.compress.MODES: none, bf16, fp16, bf16-wire, fp16-wire, powersgd
    powersgd_rank: int | None = None  # with compress "powersgd": the rank of its factors; None: 1
    optimizer: str = "sgd"  # "sgd" (the lesson's), "momentum" or "adamw" (jdp.training.optimizers)
    momentum: float | None = None  # for "momentum": the trace's decay; None: 0.9
    weight_decay: float | None = None  # sgd/momentum: L2 (None: none); adamw: decoupled (None: 1e-4)
    accumulate: int = 1  # micro-batches per device per step, gradients summed before the one allreduce
    shard_optimizer: bool = False  # ZeRO: optimizer state and reduced gradients split over the devices
    precision: str = "float32"  # "bf16": bfloat16 forward/backward, float32 params, loss, gradients (jdp.models.precision)

    def validate(self) -> None:
        """Raises ConfigError naming the first bad field."""
        for name in ("batch_size", "epochs", "steps_per_call", "accumulate"):
            check_positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.warmup_steps < 0:
            raise ConfigError(f"`--warmup-steps` must be >= 0, got {self.warmup_steps}.")
        if not self.lr > 0:
            raise ConfigError(f"`--lr` must be positive, got {self.lr}.")
        if self.eval_on not in ("all", "device0"):
            raise ConfigError(f"`--eval-on` must be `all` or `device0`, got `{self.eval_on}`.")
        model = self.build_model()
        if model.per_replica_state and self.backend != "pmap":
            raise ConfigError(
                "`--batchnorm per-replica` keeps different statistics on each device, which `--backend shard_map` "
                "cannot hold in its replicated `P()` layout. Use `--backend pmap` or `--batchnorm sync`."
            )
        self.strategy()
        check_backend(self.backend)
        self.build_optimizer()
        if self.shard_optimizer:
            if self.fuse:
                raise ConfigError("`--shard-optimizer` already ravels the gradients into one buffer per dtype; "
                                  "drop `--fuse`/`--bucket-mb`.")
            zero.get(self.allreduce if isinstance(self.allreduce, str) else self.allreduce.name)

    def build_optimizer(self) -> optax.GradientTransformation:
        """The optax optimizer of `optimizer`, `momentum`, `weight_decay`, on the lr schedule."""
        return optimizers.make(self.optimizer, learning_rate(self), momentum=self.momentum,
                               weight_decay=self.weight_decay)

    def build_model(self) -> Model:
        """`model` itself, or the registered model of that name built with `model_impl` and `batchnorm`;
        computing in `precision`."""
        if isinstance(self.model, Model) and self.batchnorm is not None:
            raise ConfigError("`batchnorm` selects a built-in model's BatchNorm; your own `Model` defines its own.")
        return precision.mixed(models.get(self.model, impl=self.model_impl, batchnorm=self.batchnorm), self.precision)

    def strategy(self) -> Allreduce:
        """The allreduce strategy, fused and compressed if asked."""
        return compress_lib.get(self.allreduce, fuse=self.fuse, bucket_mb=self.bucket_mb, compress=self.compress,
                                rank=self.powersgd_rank)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values: a `Model` or `Allreduce` object is recorded by its name."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**values, "model": _name(self.model), "allreduce": _name(self.allreduce)}


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
    check_divisible(config.batch_size, len(devices))
    if config.batch_size % (len(devices) * config.accumulate):
        raise ConfigError(
            f"`--batch-size {config.batch_size}` does not split into {len(devices)} devices × `--accumulate "
            f"{config.accumulate}` equal micro-batches; use a multiple of {len(devices) * config.accumulate}."
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
    profile: Profiler | None = None,
) -> tuple[PyTree, list[EpochRecord]]:
    """Trains `config.model` (the lesson's LeNet by default, or your own `Model`) data-parallel on `devices`.

    Args:
      config: hyper-parameters and strategy.
      dataset: host arrays; batches are split over the devices each step.
      devices: where the replicas live.
      on_epoch: called with each epoch's record as soon as it is known.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.
      checkpoint_dir: save checkpoints here (see `jdp.training.checkpoint`); None: none.
      checkpoint_every: save every this many steps; None: at the end of every epoch.
      resume: continue from the newest intact checkpoint in `checkpoint_dir`, if any.
      check_replicas: every this many steps, stop unless all replicas are bit-identical.
      profile: traces its steps and measures their breakdown (`profile.breakdown` after the run).

    Returns:
      (params, history): the first replica's params and one record per epoch (with a resumed
      run's earlier epochs; the epoch resumed mid-way times only its part run here).

    Raises:
      ConfigError: for a bad setting, or a checkpoint this run cannot resume.
      TrainingError: on a non-finite loss or update, or replicas that diverged (see `jdp.training.guards`).
    """
    config.validate()
    check_fits(config, dataset, devices)
    checkpoint.check_options(checkpoint_dir, checkpoint_every, resume)
    if check_replicas is not None:
        check_positive("--check-replicas", check_replicas, "number of steps")
    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    optimizer = config.build_optimizer()  # the lesson's SGD by default, on the full batch's mean gradient
    model = config.build_model()
    params = model.init(init_key)
    steps_per_epoch = len(dataset.train.labels) // config.batch_size
    if profile is not None:
        check_window(profile.first, profile.last, steps_per_epoch * config.epochs)
    strategy = config.strategy()
    layout = _opt_state_layout(config, optimizer, strategy, models.trainable(model, params), devices)
    keeper = Keeper(
        checkpoint_dir, checkpoint_every,
        describe_run(config.to_dict(), dataset, len(devices), per_device_state=strategy.init is not None)
        if checkpoint_dir is not None else None,
        steps_per_epoch, guards.Watch(params, check_replicas, same=_same_on_every_device(model),
                                      same_opt_state=layout.same),
        lambda tree: unreplicate(tree, config.backend), jax.random.key_data(data_key),
        opt_host_copy=layout.host_copy,
    )
    opt_state = _initial_opt_state(config, optimizer, strategy, models.trainable(model, params),
                                   jax.random.fold_in(init_key, 1), len(devices))
    arrays = {"params": params, "opt_state": opt_state, "data_key": keeper.data_key}
    if resume:
        arrays = keeper.resume(arrays, config.epochs)
    data_key = jax.random.wrap_key_data(arrays["data_key"])
    state = replicate(arrays["params"], devices, config.backend), layout.place(arrays["opt_state"])
    step = make_train_step(model.loss, optimizer, strategy, devices, backend=config.backend, stateful=model.stateful,
                           accumulate=config.accumulate, shard_optimizer=config.shard_optimizer,
                           **({} if profile is None else {"segment": profile.segment}))
    evaluate = make_evaluator(model.apply, devices, on_all_devices=config.eval_on == "all", backend=config.backend)
    if model.per_replica_state:  # one set of statistics before evaluating and saving (see jdp.models)
        average = jax.pmap(models.average_state, axis_name=AXIS, devices=devices, donate_argnums=0)
    run_epoch = make_epoch_runner(step, dataset.train, devices, config.batch_size, config.backend,
                                  steps_per_call=config.steps_per_call, traceable=strategy.where == "inside")
    after_call = keeper.after_call
    if profile is not None:
        profile.at(keeper.step, state)

        def after_call(steps, state, losses):
            keeper.after_call(steps, state, losses)
            profile.at(keeper.step, state)

    for epoch in range(keeper.epoch, config.epochs + 1):
        start = time.perf_counter()
        state, _ = run_epoch(state, jax.random.fold_in(data_key, epoch), progress,
                             start=keeper.batches_done, after_call=after_call)
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
    return unreplicate(state[0], config.backend), [EpochRecord(**r) for r in keeper.history]


def payload_bytes(config: TrainConfig) -> int:
    """Bytes each device hands to the allreduce per step: the gradients, or what `config.compress` sends instead."""
    model = config.build_model()
    grads = jax.eval_shape(lambda: models.trainable(model, model.init(jax.random.key(0))))
    return compress_lib.payload_bytes(grads, config.compress, config.powersgd_rank)


def checkpoint_target(config: TrainConfig, device_count: int = 1) -> PyTree:
    """The structure, shapes and dtypes of the arrays `train` checkpoints, e.g. for `jdp.training.checkpoint.load`.

    `device_count` matters only to a stateful strategy (PowerSGD), whose state is saved per device.
    """
    model = config.build_model()
    params = model.init(jax.random.key(0))
    opt_state = _initial_opt_state(config, config.build_optimizer(), config.strategy(), models.trainable(model, params),
                                   jax.random.key(0), device_count)
    return {"params": params, "opt_state": opt_state, "data_key": jax.random.key_data(jax.random.key(0))}


def _initial_opt_state(config: TrainConfig, optimizer: optax.GradientTransformation, strategy: Allreduce,
                       trainable: PyTree, key: jax.Array, device_count: int) -> PyTree:
    """The optimizer state before step 1, in the host form checkpoints hold: flat when sharded (ZeRO); with a
    stateful strategy's state (PowerSGD's error feedback) for every device beside the optimizer's."""
    if config.shard_optimizer:
        return zero.host_state(optimizer, trainable)
    if strategy.init is None:
        return optimizer.init(trainable)
    return {"optimizer": optimizer.init(trainable),
            "allreduce": compress_lib.init_state(strategy, key, trainable, device_count)}


class _OptStateLayout(NamedTuple):
    """Where the optimizer state lives: replicated like the params, split over the devices (ZeRO), or
    replicated beside a stateful strategy's per-device state (see `jdp.make_train_step`)."""

    place: Callable[[PyTree], PyTree]  # host form -> on the devices
    host_copy: Callable[[PyTree], PyTree]  # on the devices -> host form
    same: Callable[[PyTree], PyTree]  # the part every device must hold identically (the replica check)


def _opt_state_layout(config: TrainConfig, optimizer: optax.GradientTransformation, strategy: Allreduce,
                      trainable: PyTree, devices: Sequence[jax.Device]) -> _OptStateLayout:
    k = len(devices)
    if config.shard_optimizer:
        return _OptStateLayout(lambda state: zero.shard_state(optimizer, state, trainable, devices),
                               lambda state: zero.gather_state(optimizer, state, trainable, k),
                               lambda state: zero.replicated_part(optimizer, state, trainable, k))
    if strategy.init is not None:  # its state differs between devices: placed, saved and checked apart
        return _OptStateLayout(
            lambda state: {"optimizer": replicate(state["optimizer"], devices, config.backend),
                           "allreduce": compress_lib.place_state(state["allreduce"], devices)},
            lambda state: {"optimizer": unreplicate(state["optimizer"], config.backend),
                           "allreduce": jax.tree.map(to_host, state["allreduce"])},
            lambda state: state["optimizer"])
    return _OptStateLayout(lambda state: replicate(state, devices, config.backend),
                           lambda state: unreplicate(state, config.backend), lambda state: state)


def _name(choice: str | Model | Allreduce) -> str:
    return choice if isinstance(choice, str) else choice.name


def _same_on_every_device(model: models.Model) -> Callable[[PyTree], PyTree]:
    """What the replica check compares: everything, except per-replica BatchNorm statistics mid-epoch."""
    if model.per_replica_state:
        return lambda variables: models.trainable(model, variables)
    return lambda variables: variables
