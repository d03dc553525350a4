"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as callbacks.
"""

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdp import models
from jdp.data import Dataset
from jdp.errors import ConfigError, JdpError, check_positive
from jdp.parallel.layout import copies, fetch, map_over_devices, place, to_host
from jdp.parallel.step import TrainStep
from jdp.parallel.sync import make_consensus, make_sync
from jdp.runtime import faults
from jdp.training import checkpoint, formulation, guards
from jdp.training.build import BuiltRun, build_run
from jdp.training.config import TrainConfig
from jdp.training.evaluate import make_evaluator
from jdp.training.feeders import make_epoch_runner
from jdp.training.keeper import Keeper
from jdp.training.profile import Profiler, check_window
from jdp.training.resume import describe_run
from jdp.training.stragglers import Stopwatch
from jdp.training.tally import place_tally
from jdp.types import PyTree


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean per-image loss over the epoch's steps
    test_acc: float
    seconds: float  # wall time of the epoch's training loop only
    syncs: int | None = None  # allreduces of the model since the run began: every step, or a local mode's syncs


def train(
    config: TrainConfig,
    dataset: Dataset,
    devices: Sequence[jax.Device],
    *,
    on_epoch: Callable[[EpochRecord], None] = lambda record: None,
    on_steps: Callable[[int, np.ndarray], None] | None = None,
    progress: Callable[[Iterable, int], Iterable] = lambda batches, total: batches,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    check_replicas: int | None = None,
    profile: Profiler | None = None,
    stopwatch: Stopwatch | None = None,
    collective_timeout: float | None = None,
    on_lost: Callable[[str], None] = faults.end_process,
) -> tuple[PyTree, list[EpochRecord]]:
    """Trains `config.model` (the lesson's LeNet by default, or your own `Model`) data-parallel on `devices`.

    Args:
      config: hyper-parameters and strategy (checked when it was made). `formulation="auto"` is settled
        here (`jdp.training.formulation.settle`): the checkpoint's formulation when resuming, else this
        machine kind's fastest measured one; the checkpoints record the name used.
      dataset: host arrays; batches are split over the devices each step.
      devices: where the replicas live.
      on_epoch: called with each epoch's record as soon as it is known.
      on_steps: called before `on_epoch` with the number (from 1) of the epoch's first step run here
        and each such step's mean per-image loss (e.g. `jdp.training.tensorboard.TensorBoardWriter.steps`).
        With several processes, pass it on every process: the losses are gathered from all of them.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.
      checkpoint_dir: save checkpoints here (see `jdp.training.checkpoint`); None: none.
      checkpoint_every: save every this many steps; None: at the end of every epoch.
      resume: continue from the newest intact checkpoint in `checkpoint_dir`, if any.
      check_replicas: every this many steps, stop unless all replicas are bit-identical.
      profile: traces its steps and measures their breakdown (`profile.breakdown` after the run).
      stopwatch: delays the straggler's process before its steps and times every step and sync to
        completion (`stopwatch.report()` after the run; see `jdp.training.stragglers`).
      collective_timeout: with several processes, give the job up when no step finished for this
        many seconds (None: automatic, see `jdp.runtime.faults.collective_limit`).
      on_lost: with several processes, called with the line naming a stalled process; it must end
        this process, whose main thread waits inside a collective (default: print it, exit 75).

    Returns:
      (params, history): the first replica's params and one record per epoch (with a resumed
      run's earlier epochs; the epoch resumed mid-way times only its part run here).

    Raises:
      ConfigError: for a setting that does not fit the data or devices, or a checkpoint this run cannot resume.
      TrainingError: on a non-finite loss or update, or replicas that diverged (see `jdp.training.guards`).
      ProcessLostError: when a collective failed because another process of the job died.
    """
    config.check_fits(len(dataset.train.labels), len(devices))
    checkpoint.check_options(checkpoint_dir, checkpoint_every, resume)
    config, _ = formulation.settle(config, devices, checkpoint_dir, resume)  # "auto": this machine's, or the checkpoint's
    if check_replicas is not None:
        check_positive("check_replicas", check_replicas, "number of steps")
    if collective_timeout is not None and not collective_timeout > 0:
        raise ConfigError(f"`collective_timeout` must be a positive number of seconds, got {collective_timeout}.")
    run = build_run(config, devices)
    model, sync, opt = run.model, run.sync, run.opt
    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    params = model.init(init_key)
    steps_per_epoch = len(dataset.train.labels) // config.batch_size
    last_step = steps_per_epoch * config.epochs
    if profile is not None:
        check_window(profile.first, profile.last, last_step)
    if stopwatch is not None:
        stopwatch.straggler.check(jax.process_count())
        if config.steps_per_call != 1:
            raise ConfigError(f"`steps_per_call={config.steps_per_call}` runs several steps in one call; a simulated "
                              "straggler delays and times each step: use `steps_per_call=1`.")
    job = faults.JobWatch(collective_timeout, on_lost)  # a no-op with one process
    keeper = Keeper(
        checkpoint_dir, checkpoint_every,
        describe_run(config.to_dict(), dataset, len(devices),
                     per_device_state=opt.per_device_strategy_state or opt.local)
        if checkpoint_dir is not None else None,
        steps_per_epoch, guards.Watch(params, check_replicas, same=_same_on_every_device(model),
                                      same_opt_state=opt.replicated_part,
                                      comparable=lambda step: not sync.local or sync.due(step, last_step)),
        lambda tree: fetch(tree, sync.params_kind, config.backend), jax.random.key_data(data_key),
        opt_host_copy=lambda state: opt.to_host(state, config.backend), job=job,
    )
    arrays = {"params": copies(params, len(devices)) if sync.local else params,  # local: each device's own
              "opt_state": opt.init(models.trainable(model, params), jax.random.fold_in(init_key, 1)),
              "data_key": keeper.data_key}
    if resume:
        arrays = keeper.resume(arrays, config.epochs)
    data_key = jax.random.wrap_key_data(arrays["data_key"])
    state = (place(arrays["params"], sync.params_kind, devices, config.backend),
             opt.place(arrays["opt_state"], devices, config.backend))
    step, model_of = _wired_step(run, keeper, last_step, profile, stopwatch)
    evaluate = make_evaluator(model.apply, devices, on_all_devices=config.eval_on == "all", backend=config.backend)
    if model.per_replica_state:  # one set of statistics before evaluating and saving (see jdp.models)
        average = map_over_devices(lambda variables: (models.average_state(variables),), devices, config.backend,
                                   ("per_device",), ("per_device",), donate=(0,))
    run_epoch = make_epoch_runner(step, dataset.train, devices, config.batch_size, config.backend,
                                  steps_per_call=config.steps_per_call, params_kind=sync.params_kind,
                                  traceable=run.strategy.where == "inside" and not sync.local and stopwatch is None)
    after_call = keeper.after_call
    if profile is not None:
        profile.at(keeper.step, state)

        def after_call(steps, carry):
            keeper.after_call(steps, carry)
            profile.at(keeper.step, carry[:2])

    leaves = len(jax.tree.leaves(params))
    try:
        for epoch in range(keeper.epoch, config.epochs + 1):
            tally = place_tally(keeper.start_epoch(len(devices), leaves), devices, config.backend)
            start = time.perf_counter()
            (*state, _), losses = run_epoch((*state, tally), jax.random.fold_in(data_key, epoch), progress,
                                            start=keeper.batches_done, after_call=after_call)
            seconds = time.perf_counter() - start
            state = tuple(state)
            if on_steps is not None:
                per_step = step_losses(losses)
                on_steps(keeper.step - len(per_step) + 1, per_step / config.batch_size)
            if model.per_replica_state:
                state = (average(state[0])[0], state[1])
            record = EpochRecord(
                epoch=epoch,
                train_loss=float(keeper.epoch_loss()) / (steps_per_epoch * config.batch_size),
                test_acc=evaluate(model_of(state), dataset.test.images, dataset.test.labels),
                seconds=seconds,
                syncs=sync.syncs(keeper.step, last_step),
            )
            keeper.end_epoch(state, dataclasses.asdict(record), last=epoch == config.epochs)
            on_epoch(record)
        final = fetch(model_of(state), "replicated", config.backend)  # a local run ends with a sync: one model
        return final, [EpochRecord(**r) for r in keeper.history]
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError, or ValueError from process_allgather
        if job.active and not isinstance(e, JdpError) and faults.transport_failure(str(e)):  # a process died
            raise job.lost(f"a collective failed ({faults.error_gist(e)})") from None
        raise
    finally:
        job.close()


def _wired_step(run: BuiltRun, keeper: Keeper, last_step: int, profile: Profiler | None,
                stopwatch: Stopwatch | None) -> tuple[TrainStep, Callable[[tuple[PyTree, PyTree]], PyTree]]:
    """The step the loop calls, and the one model of a state to evaluate.

    A local sync mode's replicas meet after the steps it is due (`keeper.step` counts them), and its
    model is their consensus; every other step keeps one model, replicated. A stopwatch times each step
    and each sync; a profile's segments wrap an outside strategy's calls.
    """
    config, sync = run.config, run.sync
    step = run.step(None if profile is None else profile.segment)
    if stopwatch is not None:
        step = stopwatch.step(step, lambda: keeper.step + 1)
    if not sync.local:
        return step, lambda state: state[0]
    meet = make_sync(sync, run.strategy, run.opt, run.devices, config.backend)
    if stopwatch is not None:
        meet = stopwatch.sync(meet)

    def step_then_sync(params, opt_state, images, labels):  # the loop counts the steps: `keeper.step` before it
        params, opt_state, loss = step(params, opt_state, images, labels)
        if sync.due(keeper.step + 1, last_step):
            params, opt_state = meet(params, opt_state)
        return params, opt_state, loss

    consensus = make_consensus(sync, run.opt, run.devices, config.backend)
    return step_then_sync, lambda state: consensus(*state)


def step_losses(losses: list[jax.Array]) -> np.ndarray:
    """The summed loss of each step, from the per-device losses of each call ((k,) or (k, S)): one read."""
    if not losses:
        return np.zeros(0, np.float32)
    return to_host(jnp.concatenate([loss.reshape(len(loss), -1) for loss in losses], axis=1)).sum(axis=0)


def _same_on_every_device(model: models.Model) -> Callable[[PyTree], PyTree]:
    """What the replica check compares: everything, except per-replica BatchNorm statistics mid-epoch."""
    if model.per_replica_state:
        return lambda variables: models.trainable(model, variables)
    return lambda variables: variables
