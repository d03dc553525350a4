"""The training loop: epochs of data-parallel steps, timing, evaluation, history.

`train` is the lesson's `train(num_gpus, batch_size, lr)`: it times only the training loop of each
epoch, evaluates test accuracy after each, and returns the history. Printing, progress bars and
files are the caller's (the CLI's) business, passed in as `Hooks`.
"""

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from jdp.data import Dataset
from jdp.errors import JdpError, moved_arguments
from jdp.parallel.evaluate import make_epoch_evaluator
from jdp.parallel.feeders import (
    AUTO,
    MAX_AUTO_STEPS,
    CallPlan,
    auto_steps_per_call,
    make_epoch_runner,
    several_steps_per_call,
    steady_step_seconds,
    step_losses,
    timed_calls,
)
from jdp.parallel.layout import fetch, per_process
from jdp.parallel.tally import place_tally
from jdp.runtime import faults
from jdp.training import checkpoint, formulation
from jdp.training.build import BuiltRun, build_run
from jdp.training.checkpoint import Checkpoints
from jdp.training.config import TrainConfig
from jdp.training.guards import Guards
from jdp.training.hooks import EpochRecord, Hooks
from jdp.types import PyTree


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
    steps_per_epoch = len(dataset.train.labels) // config.batch_size
    last_step = steps_per_epoch * config.epochs
    hooks.check(config, last_step)
    if checkpoints is not None:
        checkpoint.check_directory(checkpoints.checkpoint_dir, resume=checkpoints.resume)
    resumed_from = None if checkpoints is None or not checkpoints.resume else checkpoints.checkpoint_dir
    config, _ = formulation.settle(config, devices, resumed_from, resumed_from is not None)
    run: BuiltRun = build_run(config, devices)
    job = faults.JobWatch(guards.collective_timeout, guards.on_lost)  # a no-op with one process
    keeper, state, data_key = run.start(dataset, checkpoints, guards.check_replicas, job)
    after_call = hooks.after_call(keeper)
    step, model_of = run.loop_step(lambda: keeper.step, last_step, hooks.profile, hooks.stopwatch)
    traceable = run.strategy.inside and not run.sync.local and hooks.stopwatch is None
    auto = config.steps_per_call == AUTO and several_steps_per_call(traceable, config.backend) and hooks.profile is None
    per_call = 1 if config.steps_per_call == AUTO else config.steps_per_call  # auto: 1 until a step is timed
    run_epoch = make_epoch_runner(step, dataset.train, devices, config.batch_size, config.backend,
                                  plan=CallPlan(per_call, traceable), params_kind=run.sync.params_kind)
    evaluate = make_epoch_evaluator(run.model, run.devices, config.backend, on_all_devices=config.eval_on == "all")
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
                                            after_call=timed_calls(after_call, paced) if timing else after_call,
                                            steps_per_call=per_call)
            seconds = time.perf_counter() - start
            if hooks.on_steps is not None:
                per_step = step_losses(losses)
                hooks.on_steps(keeper.step - len(per_step) + 1, per_step / config.batch_size)
            state, test_acc = evaluate(tuple(state), model_of, dataset.test)
            record = EpochRecord(epoch, train_loss=float(keeper.epoch_loss()) / (steps_per_epoch * config.batch_size),
                                 test_acc=test_acc, seconds=seconds, syncs=run.sync.syncs(keeper.step, last_step),
                                 process_step_s=per_process(np.float64(seconds / steps_run)).tolist() if job.active
                                 else None,  # every process's seconds per step (a collective: every process calls it)
                                 steps_per_call=per_call)
            keeper.end_epoch(state, dataclasses.asdict(record), last=epoch == config.epochs)
            hooks.on_epoch(record)
            if timing:  # chosen once, from a timed epoch; the grouping changes no result
                every = None if checkpoints is None else checkpoints.checkpoint_every  # saved at call boundaries
                per_call = auto_steps_per_call(steady_step_seconds(paced), most=every or MAX_AUTO_STEPS)
        final = fetch(model_of(state), "replicated", config.backend)  # a local run ends with a sync: one model
        return final, [EpochRecord(**r) for r in keeper.history]
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError, or ValueError from process_allgather
        if job.active and not isinstance(e, JdpError) and faults.transport_failure(str(e)):  # a process died
            raise job.lost(f"a collective failed ({faults.error_gist(e)})") from None
        raise
    finally:
        job.close()

