"""A config built for its devices, once: the model, optimizer, strategy, sync, state layout and step.

`train` (and whoever wants a run's pieces without its loop) calls `build_run`. The components are
`TrainConfig`'s (built and checked once, when the config is made); `build_run` adds what the devices decide.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax

from jdp import models
from jdp.data import Dataset
from jdp.models import Model
from jdp.parallel.layout import copies, fetch, place
from jdp.parallel.opt_state import LocalOptimizer, OptimizerPart, OptState, ReplicatedOptimizer, ShardedOptimizer
from jdp.parallel.step import Segment, TrainStep, make_step
from jdp.parallel.strategy import Allreduce
from jdp.parallel.sync import Sync, make_sync
from jdp.runtime.faults import JobWatch
from jdp.training.checkpoint import Checkpoints
from jdp.training.config import TrainConfig
from jdp.training.guards import Watch
from jdp.training.keeper import Keeper
from jdp.training.resume import describe_run
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

    from jdp.training.profile import Profiler
    from jdp.training.stragglers import Stopwatch


@dataclasses.dataclass(frozen=True)
class BuiltRun:
    """Every component of a run, built from its config for its devices.

    Attributes:
      config: the settings it was built from.
      devices: where the replicas live.
      model, optimizer, strategy, sync: the config's components (`TrainConfig.build_model`, ...).
      opt: how the optimizer state is kept (replicated, sharded, per device): its layout and placement.
    """

    config: TrainConfig
    devices: tuple[jax.Device, ...]
    model: Model
    optimizer: "optax.GradientTransformation"
    strategy: Allreduce
    sync: Sync
    opt: OptState

    def step(self, segment: Segment | None = None) -> TrainStep:
        """The train step that keeps `opt` (`jdp.parallel.step.make_step`). `segment` wraps an "outside"
        strategy's calls (see `make_train_step`)."""
        hooks = {} if segment is None else {"segment": segment}
        return make_step(self.model, self.opt, self.devices, self.config.backend, accumulate=self.config.accumulate,
                         **hooks)

    def loop_step(self, steps_done: Callable[[], int], last_step: int, profile: "Profiler | None" = None,
                  stopwatch: "Stopwatch | None" = None) -> tuple[TrainStep, Callable[[tuple[PyTree, PyTree]], PyTree]]:
        """The step the training loop calls, and the one model of a state to evaluate.

        A local sync mode's replicas meet after the steps it names (`steps_done()` counts the steps run
        before the call), and its model is their consensus; every other step keeps one model, replicated.
        A stopwatch times each step and each sync; a profile's segments wrap an outside strategy's calls.
        """
        step = self.step(None if profile is None else profile.segment)
        if stopwatch is not None:
            step = stopwatch.step(step, lambda: steps_done() + 1)
        if not self.sync.local:
            return step, lambda state: state[0]
        programs = make_sync(self.sync, self.strategy, self.opt, self.devices, self.config.backend)
        meet = programs.meet if stopwatch is None else stopwatch.sync(programs.meet)

        def step_then_sync(params, opt_state, images, labels):
            params, opt_state, loss = step(params, opt_state, images, labels)
            for key in self.sync.meetings(steps_done() + 1, last_step):
                params, opt_state = meet(params, opt_state, key)
            return params, opt_state, loss

        return step_then_sync, lambda state: programs.consensus(*state)

    def start(self, dataset: Dataset, checkpoints: Checkpoints | None, check_replicas: int | None,
              job: JobWatch) -> tuple[Keeper, tuple[PyTree, PyTree], jax.Array]:
        """The run's keeper, its (params, opt_state) placed on the devices and its data-order key: from the
        seed, or from the newest checkpoint when resuming."""
        config, model, sync, opt = self.config, self.model, self.sync, self.opt
        init_key, data_key = jax.random.split(jax.random.key(config.seed))
        params = model.init(init_key)
        start, opt_state = self.initial_state(params, jax.random.fold_in(init_key, 1))
        steps_per_epoch = len(dataset.train.labels) // config.batch_size
        last_step = steps_per_epoch * config.epochs
        watch = Watch(params, check_replicas, same=_same_on_every_device(model), same_opt_state=opt.replicated_part,
                      comparable=lambda step: not sync.local or sync.agrees_after(step, last_step))
        described = None if checkpoints is None else describe_run(
            config.to_dict(), dataset, len(self.devices), per_device_state=opt.per_device_strategy_state or sync.local)
        keeper = Keeper(checkpoints, described=described, steps_per_epoch=steps_per_epoch, watch=watch,
                        host_copy=self.to_host, data_key=jax.random.key_data(data_key), job=job)
        arrays = {"params": start, "opt_state": opt_state, "data_key": keeper.data_key}
        if checkpoints is not None and checkpoints.resume:
            arrays = keeper.resume(arrays, config.epochs)
        return keeper, self.placed(arrays["params"], arrays["opt_state"]), jax.random.wrap_key_data(arrays["data_key"])

    def initial_state(self, variables: PyTree, key: jax.Array) -> tuple[PyTree, PyTree]:
        """(params, opt_state) before step 1, in their host form: `host_state` of this run's model, state layout
        and sync."""
        return host_state(self.model, self.opt, self.sync, variables, key)

    def placed(self, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """The host form (`initial_state`, or a checkpoint's) on the devices, as the step takes it."""
        backend = self.config.backend
        return (place(params, self.sync.params_kind, self.devices, backend),
                self.opt.place(opt_state, list(self.devices), backend))

    def to_host(self, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """The inverse of `placed`: the host form (a collective with several processes)."""
        backend = self.config.backend
        return fetch(params, self.sync.params_kind, backend), self.opt.to_host(opt_state, backend)


def _same_on_every_device(model: Model) -> Callable[[PyTree], PyTree]:
    """What the replica check compares: everything, except per-replica BatchNorm statistics mid-epoch."""
    if model.per_replica_state:
        return lambda variables: models.trainable(model, variables)
    return lambda variables: variables


def build_run(config: TrainConfig, devices: Sequence[jax.Device]) -> BuiltRun:
    """The run of `config` on `devices`: its components (built once, when `config` was made) and the optimizer
    state's layout for `devices`. Whether the strategy reaches `devices` is checked when the step is made."""
    model = config.build_model()
    trainable = jax.eval_shape(lambda: models.trainable(model, model.init(jax.random.key(0))))
    return BuiltRun(config, tuple(devices), model, config.build_optimizer(), config.strategy(), config.build_sync(),
                    opt_state_of(config, trainable, len(devices)))


def opt_state_of(config: TrainConfig, trainable: PyTree, device_count: int) -> OptState:
    """How a run of `config` keeps its optimizer state for `trainable` params on `device_count` devices: the one
    place that decides where the optimizer's state lives (sharded, each device's own, or replicated), composed
    with the strategy's and the sync algorithm's parts."""
    optimizer, sync = config.build_optimizer(), config.build_sync()
    if config.shard_optimizer:
        placement: OptimizerPart = ShardedOptimizer(optimizer, trainable, device_count)
    elif sync.local:
        placement = LocalOptimizer(optimizer, device_count)
    else:
        placement = ReplicatedOptimizer(optimizer)
    return OptState(placement, device_count, config.strategy(), sync.state_part(device_count))


def checkpoint_target(config: TrainConfig, device_count: int = 1) -> PyTree:
    """The structure, shapes and dtypes of the arrays `train` checkpoints, e.g. for `jdp.training.checkpoint.load`.

    `device_count` matters only to what is saved per device: a stateful strategy's state (PowerSGD), and
    a local sync mode's params and optimizer state.
    """
    model, key = config.build_model(), jax.random.key(0)
    variables = model.init(key)
    opt = opt_state_of(config, models.trainable(model, variables), device_count)
    params, opt_state = host_state(model, opt, config.build_sync(), variables, key)
    return {"params": params, "opt_state": opt_state, "data_key": jax.random.key_data(key)}


def host_state(model: Model, opt: OptState, sync: Sync, variables: PyTree, key: jax.Array) -> tuple[PyTree, PyTree]:
    """(params, opt_state) before step 1, in their host form (what a checkpoint holds): the model's `variables`
    (a local sync: one copy per device, each then its own) and the optimizer state, a stateful strategy's seeded
    by `key`."""
    params = copies(variables, opt.device_count) if sync.local else variables
    return params, opt.init(models.trainable(model, variables), key)
