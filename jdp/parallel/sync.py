"""When the replicas meet: every step (the lesson's), or every H steps (local SGD, DiLoCo).

* ``every-step``: the gradients are allreduced every step (`jdp.parallel.step`); the params never differ.
* ``local-sgd`` (Stich 2019; Lin et al. 2020): each device takes H plain steps on its own shard with
  its own params and optimizer state, then the params are averaged over the devices.
* ``diloco`` (Douillard et al. 2023): the same H inner steps from the global params θ; then the
  devices average their parameter changes Δ = θ − θ_i, an outer optimizer (Nesterov momentum) treats
  the average as a gradient and updates θ, and every device starts again from the new θ.

Between syncs the params are `per_device` (row i on device i, different on purpose); a sync sums with
the run's allreduce strategy (any: compressed, fused, stateful, outside), so every device leaves it
with bit-identical params. The outer optimizer's state and θ are part of the optimizer state
(`jdp.parallel.opt_state.OptState`, its "outer" part), checkpointed with it.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax

from jdp.errors import ConfigError
from jdp.parallel.layout import Backend, map_over_devices
from jdp.parallel.opt_state import OptState
from jdp.parallel.strategy import Allreduce
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

SYNC_MODES = ("every-step", "local-sgd", "diloco")
OUTER_OPTIMIZERS = ("nesterov", "sgd")
DEFAULT_EVERY = 16  # H when a local mode is chosen without one
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9}  # Douillard et al. 2023, section 3: outer Nesterov, lr 0.7, momentum 0.9


@dataclasses.dataclass(frozen=True)
class Sync:
    """How often the replicas meet and what they exchange.

    Attributes:
      mode: one of SYNC_MODES.
      every: H, steps between syncs (1 for every-step).
      outer: DiLoCo's outer optimizer (on the averaged parameter change); None otherwise.
    """

    mode: str = "every-step"
    every: int = 1
    outer: "optax.GradientTransformation | None" = None

    @property
    def local(self) -> bool:
        """Whether each device steps alone between syncs (its params are `per_device`)."""
        return self.mode != "every-step"

    @property
    def params_kind(self) -> str:
        """The placement kind of the params between steps (`jdp.parallel.layout`)."""
        return "per_device" if self.local else "replicated"

    def due(self, step: int, last_step: int) -> bool:
        """Whether the replicas sync after `step` (1-based): every H steps, and after the run's last step."""
        return self.local and (step % self.every == 0 or step == last_step)

    def syncs(self, step: int, last_step: int) -> int:
        """How many syncs the first `step` steps of a run of `last_step` steps made."""
        return step // self.every + (step == last_step and step % self.every != 0) if self.local else step


def make_outer_optimizer(name: str, lr: float, momentum: float | None) -> "optax.GradientTransformation":
    """DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's), or SGD (plain, or heavy-ball
    `momentum`). Its "gradient" is the average parameter change θ − θ_i, so lr 1 without momentum sets θ
    to the average of the devices' params."""
    import optax  # here, not at the top: `import jdp` stays light

    if name not in OUTER_OPTIMIZERS:
        raise ConfigError(f"Unknown `outer_optimizer={name}`; choose one of: {', '.join(OUTER_OPTIMIZERS)}.")
    return optax.sgd(lr, momentum=momentum or None, nesterov=name == "nesterov")


def from_settings(mode: str, every: int | None, outer_optimizer: str | None = None, outer_lr: float | None = None,
                  outer_momentum: float | None = None) -> Sync:
    """The `Sync` of these settings (None: the mode's default), checked.

    Raises:
      ConfigError: naming a setting that is unknown, out of range or meaningless for `mode`.
    """
    if mode not in SYNC_MODES:
        raise ConfigError(f"Unknown `sync={mode}`; choose one of: {', '.join(SYNC_MODES)}.")
    if mode == "every-step":
        if every not in (None, 1):
            raise ConfigError(f"`sync_every={every}` needs a local mode: `sync=local-sgd` or `sync=diloco`.")
        every = 1
    elif every is None:
        every = DEFAULT_EVERY
    elif every < 1:
        raise ConfigError(f"`sync_every` must be a positive number of steps, got {every}.")
    outer = {"outer_optimizer": outer_optimizer, "outer_lr": outer_lr, "outer_momentum": outer_momentum}
    if mode != "diloco":
        given = [f"`{name}={value}`" for name, value in outer.items() if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} set(s) DiLoCo's outer optimizer; add `sync=diloco`.")
        return Sync(mode, every)
    name = outer_optimizer or "nesterov"
    lr = DILOCO_OUTER["lr"] if outer_lr is None else outer_lr
    momentum = (DILOCO_OUTER["momentum"] if name == "nesterov" else None) if outer_momentum is None else outer_momentum
    if not lr > 0:
        raise ConfigError(f"`outer_lr` must be positive, got {lr}.")
    if momentum is not None and not 0 <= momentum < 1:
        raise ConfigError(f"`outer_momentum` must be in [0, 1), got {momentum}.")
    if name == "nesterov" and not momentum:
        raise ConfigError("`outer_optimizer=nesterov` needs a momentum in (0, 1); for none, use `outer_optimizer=sgd`.")
    return Sync(mode, every, make_outer_optimizer(name, lr, momentum))


def make_sync(sync: Sync, strategy: Allreduce, opt: OptState, devices: Sequence[jax.Device],
              backend: Backend) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
    """Builds `sync(params, opt_state) -> (params, opt_state)`: the replicas meet (see the module docstring).

    Args:
      sync: a local mode.
      strategy: sums over the devices; "inside" strategies run in the mapped program, "outside" ones
        between two mapped calls, as in the train step.
      opt: the run's optimizer state (its strategy part and DiLoCo's outer part are used here).
      devices, backend: as the train step's.

    Returns:
      sync(params, opt_state): both per-device arrays of the local step, donated; the params come back
      identical on every device.
    """
    import optax  # here, not at the top: `import jdp` stays light

    k = len(devices)

    def sent(params, outer):
        """What each device hands the allreduce: its params, or its change from θ."""
        if sync.outer is None:
            return params
        return jax.tree.map(lambda theta, p: theta - p, outer["params"], params)

    def received(total, outer):
        """The new params (the same on every device) and outer state, from the sum over the devices."""
        mean = jax.tree.map(lambda x: x / k, total)
        if sync.outer is None:
            return mean, outer
        updates, outer_state = sync.outer.update(mean, outer["optimizer"], outer["params"])
        theta = optax.apply_updates(outer["params"], updates)
        return theta, {"params": theta, "optimizer": outer_state}

    if strategy.where == "inside":

        def local_sync(params, opt_state):
            inner, kept = opt.split(opt_state)
            outer = opt.outer(opt_state)
            total, kept = strategy.reduce(sent(params, outer), kept, AXIS)
            params, outer = received(total, outer)
            return params, opt.join(inner, kept, outer)

        return map_over_devices(local_sync, devices, backend, ("per_device", opt.kind), ("per_device", opt.kind),
                                donate=(0, 1))

    if sync.outer is None:  # the params themselves are sent
        p_sent = lambda params, outer: params  # noqa: E731
        p_mean = map_over_devices(lambda total: (received(total, None)[0],), devices, backend, ("per_device",),
                                  ("per_device",), donate=(0,))
        p_received = lambda total, outer: (p_mean(total)[0], None)  # noqa: E731
    else:
        p_change = map_over_devices(lambda params, outer: (sent(params, outer),), devices, backend,
                                    ("per_device", "replicated"), ("per_device",), donate=(0,))
        p_sent = lambda params, outer: p_change(params, outer)[0]  # noqa: E731
        p_received = map_over_devices(received, devices, backend, ("per_device", "replicated"),
                                      ("per_device", "replicated"), donate=(0,))

    def outside_sync(params, opt_state):
        inner, kept = opt.split(opt_state)
        outer = opt.outer(opt_state)
        total, kept = strategy.reduce(p_sent(params, outer), kept)  # explicit transfers between devices
        params, outer = p_received(total, outer)
        return params, opt.join(inner, kept, outer)

    return outside_sync


def make_consensus(sync: Sync, opt: OptState, devices: Sequence[jax.Device],
                   backend: Backend) -> Callable[[PyTree, PyTree], PyTree]:
    """`consensus(params, opt_state)`: the one model of a local run, replicated, to evaluate between syncs:
    the average of the devices' params (local SGD) or θ, the global params of the last sync (DiLoCo).
    (An evaluation's own sum, not counted as the run's communication.)"""
    if sync.outer is not None:
        return lambda params, opt_state: opt.outer(opt_state)["params"]
    k = len(devices)
    mean = map_over_devices(lambda p: (jax.tree.map(lambda x: jax.lax.psum(x, AXIS) / k, p),), devices, backend,
                            ("per_device",), ("replicated",))
    return lambda params, opt_state: mean(params)[0]
