"""A config built for its devices, once: the model, optimizer, strategy, sync, state layout and step.

`train` (and whoever wants a run's pieces without its loop) calls `build_run`. The components are
`TrainConfig`'s (built and checked once, when the config is made); `build_run` adds what the devices decide.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jdp import models
from jdp.models import Model
from jdp.parallel.layout import copies, fetch, place
from jdp.parallel.opt_state import OptState
from jdp.parallel.step import Segment, TrainStep, check_strategy, make_step
from jdp.parallel.strategy import Allreduce
from jdp.parallel.sync import Sync
from jdp.training.config import TrainConfig
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax


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

    def initial_state(self, variables: PyTree, key: jax.Array) -> tuple[PyTree, PyTree]:
        """(params, opt_state) before step 1, in their host form (what a checkpoint holds): the model's
        `variables` (a local sync: one copy per device, each then its own) and the optimizer state, a
        stateful strategy's seeded by `key`."""
        params = copies(variables, len(self.devices)) if self.sync.local else variables
        return params, self.opt.init(models.trainable(self.model, variables), key)

    def placed(self, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """The host form (`initial_state`, or a checkpoint's) on the devices, as the step takes it."""
        backend = self.config.backend
        return (place(params, self.sync.params_kind, self.devices, backend),
                self.opt.place(opt_state, list(self.devices), backend))

    def to_host(self, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        """The inverse of `placed`: the host form (a collective with several processes)."""
        backend = self.config.backend
        return fetch(params, self.sync.params_kind, backend), self.opt.to_host(opt_state, backend)


def build_run(config: TrainConfig, devices: Sequence[jax.Device]) -> BuiltRun:
    """The run of `config` on `devices`: its components (built once, when `config` was made) and the optimizer
    state's layout for `devices`."""
    check_strategy(config.strategy(), devices, config.backend, config.shard_optimizer)  # the devices' part
    model = config.build_model()
    trainable = jax.eval_shape(lambda: models.trainable(model, model.init(jax.random.key(0))))
    return BuiltRun(config, tuple(devices), model, config.build_optimizer(), config.strategy(), config.build_sync(),
                    config.opt_state(trainable, len(devices)))
