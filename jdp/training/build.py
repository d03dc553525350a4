"""A config built for its devices, once: the model, optimizer, strategy, sync, state layout and step.

`train` (and whoever wants a run's pieces without its loop) calls `build_run`. The components come
from `TrainConfig`'s `build_*` methods, which its own checks also use; `build_run` composes them once.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax

from jdp import models
from jdp.models import Model
from jdp.parallel.layout import copies, fetch, place
from jdp.parallel.opt_state import OptState
from jdp.parallel.step import Segment, TrainStep, make_local_step, make_sharded_step, make_train_step
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
        """The train step: a local mode's (`make_local_step`), the sharded one, or the lesson's.

        `segment` wraps an "outside" strategy's calls (see `make_train_step`); a local step has none.
        """
        config, hooks = self.config, {} if segment is None else {"segment": segment}
        if self.sync.local:
            return make_local_step(self.model, self.opt, self.devices, config.backend, accumulate=config.accumulate)
        make = make_sharded_step if config.shard_optimizer else make_train_step
        return make(self.model, self.optimizer, self.strategy, self.devices, config.backend,
                    accumulate=config.accumulate, **hooks)

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
    """Builds every component of `config` once, the optimizer state's layout for `devices` included."""
    model, optimizer, sync = config.build_model(), config.build_optimizer(), config.build_sync()
    strategy = config.strategy()
    trainable = jax.eval_shape(lambda: models.trainable(model, model.init(jax.random.key(0))))
    opt = OptState(optimizer, trainable, len(devices), sharded=config.shard_optimizer, strategy=strategy,
                   local=sync.local, sync_init=sync.init,
                   sync_kind=sync.state_kind)
    return BuiltRun(config, tuple(devices), model, optimizer, strategy, sync, opt)
