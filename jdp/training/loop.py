"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as `Hooks`.
"""

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jdp import models
from jdp.data import Dataset, Split
from jdp.errors import ConfigError, JdpError, moved_arguments
from jdp.parallel.layout import fetch, map_over_devices, per_process, to_host
from jdp.parallel.step import TrainStep
from jdp.parallel.sync import make_consensus, make_sync
from jdp.runtime import faults
from jdp.training import checkpoint, formulation, guards
from jdp.training.checkpoint import Checkpoints
from jdp.training.build import BuiltRun, build_run
from jdp.training.config import TrainConfig
from jdp.training.evaluate import make_evaluator
from jdp.training.feeders import (
    AUTO,
    MAX_AUTO_STEPS,
    CallPlan,
    auto_steps_per_call,
    make_epoch_runner,
    several_steps_per_call,
)
from jdp.training.guards import Guards
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
    process_step_s: list[float] | None = None  # with several processes: each one's seconds per step, in process order
    steps_per_call: int = 1  # the epoch's train steps per compiled call (`steps_per_call="auto"` chooses it)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a caller sees of a run as it goes, and the instruments it runs with; side effects are theirs.

    Attributes:
      on_epoch: called with each epoch's record as soon as it is known.
      on_steps: called before `on_epoch` with the number (from 1) of the epoch's first step run here
        and each such step's mean per-image loss (e.g. `jdp.training.tensorboard.TensorBoardWriter.steps`).
        With several processes, pass it on every process: the losses are gathered from all of them.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.
      profile: traces its steps and measures their breakdown (`profile.breakdown` after the run).
      stopwatch: delays the straggler's process before its steps and times every step and sync to
        completion (`stopwatch.report()` after the run; see `jdp.training.stragglers`).
    """

    on_epoch: Callable[[EpochRecord], None] = lambda record: None
    on_steps: Callable[[int, np.ndarray], None] | None = None
    progress: Callable[[Iterable, int], Iterable] = lambda batches, total: batches
    profile: Profiler | None = None
    stopwatch: Stopwatch | None = None

    def check(self, config: TrainConfig, steps: int) -> None:
        """Raises ConfigError for a profile window beyond the run's `steps`, or a stopwatch it cannot run with."""
        if self.profile is not None:
            check_window(self.profile.first, self.profile.last, steps)
        if self.stopwatch is not None:
            self.stopwatch.straggler.check(jax.process_count())
            if config.steps_per_call not in (1, AUTO):
                raise ConfigError(f"`steps_per_call={config.steps_per_call}` runs several steps in one call; a "
                                  "simulated straggler delays and times each step: use `steps_per_call=1`.")

    def after_call(self, keeper: Keeper) -> Callable[[int, tuple], None]:
        """What runs after each compiled call: the keeper's guards and checkpoints, then the profile's marks."""
        if self.profile is None:
            return keeper.after_call

        def after_call(steps, carry):
            keeper.after_call(steps, carry)
            self.profile.at(keeper.step, carry[:2])

        return after_call


@moved_arguments({name: f"`{group}={type_name}({name}=...)`" for group, type_name, names in (
    ("checkpoints", "jdp.Checkpoints", ("checkpoint_dir", "checkpoint_every", "resume")),
    ("hooks", "jdp.Hooks", ("on_epoch", "on_steps", "progress", "profile", "stopwatch")),
    ("guards", "jdp.Guards", ("check_replicas", "collective_timeout", "on_lost"))) for name in names})
def train(config: TrainConfig, dataset: Dataset, devices: Sequence[jax.Device], *,
          checkpoints: Checkpoints | None = None, hooks: Hooks = Hooks(),
          guards: Guards = Guards()) -> tuple[PyTree, list[EpochRecord]]:
    """Trains `config.model` (the lesson's LeNet by default, or your own `Model`) data-parallel on `devices`.

    Args:
      config: hyper-parameters and components (checked when it was made). `formulation="auto"` is settled
        here (`jdp.training.formulation.settle`): the checkpoint's formulation when resuming, else this
        machine kind's fastest measured one; the checkpoints record the name used.
      dataset: host arrays; batches are split over the devices each step.
      devices: where the replicas live.
      checkpoints: where to save checkpoints, how often, whether to resume (`jdp.Checkpoints`); None: none.
      hooks: what the caller sees as the run goes (`jdp.Hooks`: each epoch's record, each step's loss,
        a progress bar, a profile, a stopwatch).
      guards: the replica check and the multi-process watch (`jdp.Guards`).

    Returns:
      (params, history): the first replica's params and one record per epoch (with a resumed
      run's earlier epochs; the epoch resumed mid-way times only its part run here).

    Raises:
      ConfigError: for a setting that does not fit the data or devices, or a checkpoint this run cannot resume.
      TrainingError: on a non-finite loss or update, or replicas that diverged (see `jdp.training.guards`).
      ProcessLostError: when a collective failed because another process of the job died.
    """
    config.check_fits(len(dataset.train.labels), len(devices))
    if checkpoints is not None:
        checkpoint.check_directory(checkpoints.checkpoint_dir, resume=checkpoints.resume)
    resumed_from = None if checkpoints is None or not checkpoints.resume else checkpoints.checkpoint_dir
    config, _ = formulation.settle(config, devices, resumed_from, resumed_from is not None)
    run, steps_per_epoch = build_run(config, devices), len(dataset.train.labels) // config.batch_size
    last_step = steps_per_epoch * config.epochs
    hooks.check(config, last_step)
    job = faults.JobWatch(guards.collective_timeout, guards.on_lost)  # a no-op with one process
    keeper, state, data_key = _started(run, dataset, checkpoints, guards.check_replicas, job)
    step, model_of = _wired_step(run, keeper, last_step, hooks.profile, hooks.stopwatch)
    traceable = run.strategy.inside and not run.sync.local and hooks.stopwatch is None
    auto = config.steps_per_call == AUTO and several_steps_per_call(traceable, config.backend) and hooks.profile is None
    per_call = 1 if config.steps_per_call == AUTO else config.steps_per_call  # auto: 1 until a step is timed
    run_epoch = make_epoch_runner(step, dataset.train, devices, config.batch_size, config.backend,
                                  plan=CallPlan(per_call, traceable), params_kind=run.sync.params_kind)
    evaluate, after_call = _epoch_end(run), hooks.after_call(keeper)
    if hooks.profile is not None:
        hooks.profile.at(keeper.step, state)
    leaves = len(jax.tree.leaves(state[0]))
    try:
        for epoch in range(keeper.epoch, config.epochs + 1):
            tally = place_tally(keeper.start_epoch(len(devices), leaves), devices, config.backend)
            start, steps_run, paced = time.perf_counter(), steps_per_epoch - keeper.batches_done, []
            timing = auto and per_call == 1  # the calls are timed only while auto has not chosen
            (*state, _), losses = run_epoch((*state, tally), jax.random.fold_in(data_key, epoch), hooks.progress,
                                            start=keeper.batches_done,
                                            after_call=_timed(after_call, paced) if timing else after_call,
                                            steps_per_call=per_call)
            seconds = time.perf_counter() - start
            if hooks.on_steps is not None:
                per_step = step_losses(losses)
                hooks.on_steps(keeper.step - len(per_step) + 1, per_step / config.batch_size)
            state, test_acc = evaluate(tuple(state), model_of, dataset.test)
            record = EpochRecord(epoch, train_loss=float(keeper.epoch_loss()) / (steps_per_epoch * config.batch_size),
                                 test_acc=test_acc, seconds=seconds, syncs=run.sync.syncs(keeper.step, last_step),
                                 process_step_s=_step_seconds_everywhere(job, seconds / steps_run),
                                 steps_per_call=per_call)
            keeper.end_epoch(state, dataclasses.asdict(record), last=epoch == config.epochs)
            hooks.on_epoch(record)
            if timing:  # chosen once, from a timed epoch; the grouping changes no result
                every = None if checkpoints is None else checkpoints.checkpoint_every  # saved at call boundaries
                per_call = auto_steps_per_call(_steady_step_seconds(paced), most=every or MAX_AUTO_STEPS)
        final = fetch(model_of(state), "replicated", config.backend)  # a local run ends with a sync: one model
        return final, [EpochRecord(**r) for r in keeper.history]
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError, or ValueError from process_allgather
        if job.active and not isinstance(e, JdpError) and faults.transport_failure(str(e)):  # a process died
            raise job.lost(f"a collective failed ({faults.error_gist(e)})") from None
        raise
    finally:
        job.close()


def _started(run: BuiltRun, dataset: Dataset, checkpoints: Checkpoints | None, check_replicas: int | None,
             job: faults.JobWatch) -> tuple[Keeper, tuple[PyTree, PyTree], jax.Array]:
    """The run's keeper, its (params, opt_state) placed on the devices and its data-order key: from the
    seed, or from the newest checkpoint when resuming."""
    config, model, sync, opt, k = run.config, run.model, run.sync, run.opt, len(run.devices)
    init_key, data_key = jax.random.split(jax.random.key(config.seed))
    params = model.init(init_key)
    last_step = len(dataset.train.labels) // config.batch_size * config.epochs
    watch = guards.Watch(params, check_replicas, same=_same_on_every_device(model), same_opt_state=opt.replicated_part,
                         comparable=lambda step: not sync.local or sync.agrees_after(step, last_step))
    described = None if checkpoints is None else describe_run(
        config.to_dict(), dataset, k, per_device_state=opt.per_device_strategy_state or opt.local)
    keeper = Keeper(checkpoints, described=described, steps_per_epoch=len(dataset.train.labels) // config.batch_size,
                    watch=watch, host_copy=run.to_host, data_key=jax.random.key_data(data_key), job=job)
    start, opt_state = run.initial_state(params, jax.random.fold_in(init_key, 1))
    arrays = {"params": start, "opt_state": opt_state, "data_key": keeper.data_key}
    if checkpoints is not None and checkpoints.resume:
        arrays = keeper.resume(arrays, config.epochs)
    return keeper, run.placed(arrays["params"], arrays["opt_state"]), jax.random.wrap_key_data(arrays["data_key"])


def _epoch_end(run: BuiltRun) -> Callable[[tuple[PyTree, PyTree], Callable, Split], tuple[tuple, float]]:
    """`evaluate(state, model_of, test) -> (state, test accuracy)` after each epoch: per-replica statistics
    averaged first (one set before evaluating and saving, see `jdp.models`), then the one model evaluated."""
    config, model = run.config, run.model
    accuracy = make_evaluator(model.apply, run.devices, on_all_devices=config.eval_on == "all",
                              backend=config.backend)
    if model.per_replica_state:
        average = map_over_devices(lambda variables: (models.average_state(variables),), run.devices,
                                   config.backend, ("per_device",), ("per_device",), donate=(0,))

    def evaluate(state, model_of, test):
        if model.per_replica_state:
            state = (average(state[0])[0], state[1])
        return state, accuracy(model_of(state), test.images, test.labels)

    return evaluate

def _wired_step(run: BuiltRun, keeper: Keeper, last_step: int, profile: Profiler | None,
                stopwatch: Stopwatch | None) -> tuple[TrainStep, Callable[[tuple[PyTree, PyTree]], PyTree]]:
    """The step the loop calls, and the one model of a state to evaluate.

    A local sync mode's replicas meet after the steps it names (`keeper.step` counts them), and its
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
        for key in sync.meetings(keeper.step + 1, last_step):
            params, opt_state = meet(params, opt_state, key)
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


def _step_seconds_everywhere(job: faults.JobWatch, mine: float) -> list[float] | None:
    """Every process's seconds per step in process order (a collective: every process calls it); None with
    one process. A slowed job shows here (history.json)."""
    return per_process(np.float64(mine)).tolist() if job.active else None


def _timed(after_call: Callable[[int, tuple], None], paced: list[tuple[float, int]]) -> Callable[[int, tuple], None]:
    """`after_call`, also noting in `paced` when each call's dispatch returned and how many steps it ran."""

    def timed(steps: int, carry: tuple) -> None:
        after_call(steps, carry)
        paced.append((time.perf_counter(), steps))

    return timed


def _steady_step_seconds(paced: list[tuple[float, int]], skipped: int = 2, least: int = 8) -> float:
    """Seconds per step of an epoch's calls after the first `skipped` (they compile), from `paced` (`_timed`):
    at most 2 calls are in flight, so dispatches return at the pace the devices finish them. Infinite with
    fewer than `least` calls to time."""
    if len(paced) < skipped + least:
        return float("inf")
    (first, _), (last, _) = paced[skipped - 1], paced[-1]
    return (last - first) / sum(steps for _, steps in paced[skipped:])
