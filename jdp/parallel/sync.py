"""When the replicas meet: every step (the lesson's), or every H steps (local SGD, DiLoCo, your own).

* ``every-step``: the gradients are allreduced every step (`jdp.parallel.step`); the params never differ.
* ``local-sgd`` (Stich 2019; Lin et al. 2020): each device takes H plain steps on its own shard with
  its own params and optimizer state, then the params are averaged over the devices.
* ``diloco`` (Douillard et al. 2023): the same H inner steps from the global params θ; then the
  devices average their parameter changes Δ = θ − θ_i, an outer optimizer (Nesterov momentum) treats
  the average as a gradient and updates θ, and every device starts again from the new θ.

A sync algorithm is a `Sync` value: its name, H, and per-device functions saying what each device
sends, what it makes of the mean over the devices, the state the algorithm keeps and the model to
evaluate. `register` makes one a name of `--sync` (a `--plugin` file can hold a whole algorithm:
docs/architecture.md's recipe). An algorithm whose devices meet over parts of the model, at
different steps, subclasses `Sync` and overrides its schedule and meetings (`meetings`, `send`,
`receive`): Streaming DiLoCo, `jdp.parallel.streaming`. Between syncs the params are `per_device` (row i on device i,
different on purpose); a sync sums with the run's allreduce strategy (any: compressed, fused,
stateful, outside), so every device leaves it with bit-identical params. The algorithm's own state
(DiLoCo's θ and outer optimizer state) is part of the optimizer state
(`Sync.state_part`, `jdp.parallel.opt_state.OptState.sync_state`), checkpointed with it.
"""

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jdp.errors import Arg, ConfigError, Message, moved_arguments
from jdp.parallel.layout import Backend, Kinds, map_over_devices
from jdp.parallel.opt_state import OptState, SyncState
from jdp.parallel.strategy import Allreduce
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

OUTER_OPTIMIZERS = ("nesterov", "sgd")
DEFAULT_EVERY = 16  # H when a local mode is chosen without one
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9}  # Douillard et al. 2023, section 3: outer Nesterov, lr 0.7, momentum 0.9


@dataclasses.dataclass(frozen=True)
class Sync:
    """A sync algorithm: how often the replicas meet and what they make of it.

    Each function runs on every device, inside the mapped program; `state` is the algorithm's own
    state (replicated: the same on every device; None without `init`).

    Attributes:
      name: what `--sync` and `TrainConfig(sync=...)` call it.
      every: H, steps between syncs (and a sync after the run's last step).
      received: (mean, state) -> (params, state): at a sync, the params every device continues from
        and the new state, from the mean over the devices of what they sent. None: no meeting, the
        gradients are allreduced in every step (`every-step`, the one such algorithm).
      sent: (params, state) -> what each device hands the allreduce; None: its params.
      init: params -> the state before step 1; None: no state.
      model: state -> the one model to evaluate (and `train` to return); None: the replicas' mean.

    A subclass's own fields are its settings (`DiLoCo`'s outer optimizer, Streaming DiLoCo's fragments), which
    `get` sets by name (the CLI's `--outer-lr`, ...).

    A subclass may meet differently (`jdp.parallel.streaming`): overriding `meetings` (which meetings follow a
    step), `send` and `receive` (what one meeting sends and makes of the mean), `reducer` (what sums it),
    `agrees_after`, `syncs` and `payload_fraction` (what the run reports).
    """

    name: str
    every: int = DEFAULT_EVERY
    received: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None = dataclasses.field(default=None, repr=False)
    sent: Callable[[PyTree, PyTree], PyTree] | None = dataclasses.field(default=None, repr=False)
    init: Callable[[PyTree], PyTree] | None = dataclasses.field(default=None, repr=False)
    model: Callable[[PyTree], PyTree] | None = dataclasses.field(default=None, repr=False)

    @property
    def local(self) -> bool:
        """Whether each device steps alone between syncs (its params are `per_device`)."""
        return self.received is not None

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

    def meetings(self, step: int, last_step: int) -> tuple[Hashable, ...]:
        """The meetings after `step`, in order: each a key that `send` and `receive` are given (and a
        program compiled once per key); () for none. Here: one meeting of the whole model when `due`."""
        return ("all",) if self.due(step, last_step) else ()

    def agrees_after(self, step: int, last_step: int) -> bool:
        """Whether every device holds the same params after `step` (what `check_replicas` compares then)."""
        return self.due(step, last_step)

    @property
    def state_kind(self) -> Kinds:
        """The placement kinds of its state, a pytree prefix of it: the same on every device."""
        return "replicated"

    def state_part(self, device_count: int) -> SyncState | None:
        """Its share of the optimizer state on `device_count` devices, placed as `state_kind` says; None
        without `init`."""
        return None if self.init is None else SyncState(self.init, device_count, self.state_kind)

    @property
    def payload_fraction(self) -> float:
        """The bytes one sync hands the allreduce, as a fraction of a float32 copy of the model."""
        return 1.0

    @property
    def sends_params(self) -> bool:
        """Whether each device sends its params as they are (an outside strategy then needs no call before it)."""
        return self.sent is None

    def send(self, params: PyTree, state: PyTree, key: Hashable) -> PyTree | None:
        """What each device hands the allreduce at the meeting `key` (None: nothing, a meeting without a sum)."""
        return params if self.sent is None else self.sent(params, state)

    def receive(self, mean: PyTree | None, params: PyTree, state: PyTree,
                key: Hashable) -> tuple[PyTree, PyTree]:
        """(the params each device continues from, the new state), from the mean over the devices of what
        they sent at the meeting `key`, and the device's own params."""
        return self.received(mean, state)

    def reducer(self, strategy: Allreduce) -> Allreduce:
        """What sums what the devices send: the run's allreduce strategy."""
        return strategy


Sync.__init__ = moved_arguments({"configure": "a `Sync` subclass's fields are its settings, as `jdp.DiLoCo`'s"})(
    Sync.__init__)  # type: ignore[method-assign]  # moved after 0.1.0


def _mean_of_replicas(mean: PyTree, state: PyTree) -> tuple[PyTree, PyTree]:
    """Local SGD's meeting: every device continues from the mean of the devices' params."""
    return mean, state


def outer_optimizer_of(name: str | None = None, lr: float | None = None,
                      momentum: float | None = None) -> Callable[[], "optax.GradientTransformation"]:
    """DiLoCo's outer optimizer, checked: SGD with Nesterov momentum (the paper's), or SGD (plain, or
    heavy-ball `momentum`); None: the paper's settings. Returned as a builder, called where it is used
    (`import jdp` stays light: no optax).

    Raises:
      ConfigError: naming an outer setting that is unknown or out of range.
    """
    name = name or "nesterov"
    if name not in OUTER_OPTIMIZERS:
        raise ConfigError("Unknown ", Arg("outer_optimizer", name), f"; choose one of: {', '.join(OUTER_OPTIMIZERS)}.")
    lr = DILOCO_OUTER["lr"] if lr is None else lr
    momentum = (DILOCO_OUTER["momentum"] if name == "nesterov" else None) if momentum is None else momentum
    if not lr > 0:
        raise ConfigError(Arg("outer_lr"), f" must be positive, got {lr}.")
    if momentum is not None and not 0 <= momentum < 1:
        raise ConfigError(Arg("outer_momentum"), f" must be in [0, 1), got {momentum}.")
    if name == "nesterov" and not momentum:
        raise ConfigError(Arg("outer_optimizer", "nesterov"), " needs a momentum in (0, 1); for none, use ",
                          Arg("outer_optimizer", "sgd"), ".")

    def outer():
        import optax

        return optax.sgd(lr, momentum=momentum or None, nesterov=name == "nesterov")

    return outer


def _made_from_settings() -> Any:
    """A field a `Sync` subclass makes from its settings in `__post_init__`: no argument, not compared or shown."""
    return dataclasses.field(default=None, init=False, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class DiLoCo(Sync):
    """DiLoCo (Douillard et al. 2023) with its outer optimizer: `DiLoCo(every=16)`, `DiLoCo(outer_lr=1.0)`. Its
    settings are its fields (`outer_optimizer_of`'s; None: the paper's), checked when it is made. Its
    "gradient" is the average parameter change θ − θ_i, so `outer_lr` 1 without momentum sets θ to the
    average of the devices' params. Its state: {"params": θ, "optimizer": the outer optimizer's state}.

    Raises:
      ConfigError: naming an outer setting that is unknown or out of range.
    """

    name: str = "diloco"
    received: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]] | None = _made_from_settings()
    sent: Callable[[PyTree, PyTree], PyTree] | None = _made_from_settings()
    init: Callable[[PyTree], PyTree] | None = _made_from_settings()
    model: Callable[[PyTree], PyTree] | None = _made_from_settings()
    outer_optimizer: str | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer: Callable[[], "optax.GradientTransformation"] | None = _made_from_settings()

    def __post_init__(self) -> None:
        outer = outer_optimizer_of(self.outer_optimizer, self.outer_lr, self.outer_momentum)
        for name, value in (("outer", outer), ("init", partial(_diloco_state, outer=outer)), ("sent", _change_from_theta),
                            ("received", partial(_outer_step, outer=outer)), ("model", global_params)):
            object.__setattr__(self, name, value)


def _diloco_state(params: PyTree, outer: Callable) -> PyTree:
    return {"params": params, "optimizer": outer().init(params)}


def _change_from_theta(params: PyTree, state: PyTree) -> PyTree:
    """What each device sends: its change from θ."""
    return jax.tree.map(lambda theta, p: theta - p, state["params"], params)


def _outer_step(mean_change: PyTree, state: PyTree, outer: Callable) -> tuple[PyTree, PyTree]:
    """The outer step on θ, which every device starts from again."""
    import optax

    updates, outer_state = outer().update(mean_change, state["optimizer"], state["params"])
    theta = optax.apply_updates(state["params"], updates)
    return theta, {"params": theta, "optimizer": outer_state}


def global_params(state: PyTree) -> PyTree:
    """DiLoCo's model to evaluate: θ, the global params of the last sync."""
    return state["params"]


EVERY_STEP = Sync("every-step", 1)
_SYNCS: dict[str, Sync] = {  # built-ins first, then what users register
    "every-step": EVERY_STEP,
    "local-sgd": Sync("local-sgd", DEFAULT_EVERY, _mean_of_replicas),
    "diloco": DiLoCo(),
}


def check(sync: Sync) -> Sync:
    """`sync` if it is a well-formed `Sync`, else a ConfigError saying what is wrong."""
    if not isinstance(sync, Sync):
        raise ConfigError(Arg("sync"), f" must be a registered name or a `jdp.Sync`, got {type(sync).__name__}.")
    if not isinstance(sync.name, str) or not sync.name:
        raise ConfigError(f"A `jdp.Sync` needs a name to be known by, got {sync.name!r}.")
    if not sync.local and sync != EVERY_STEP:
        raise ConfigError(f"The sync `{sync.name}` has no `received`: what the devices make of the mean at a sync. "
                          "(Only `every-step`, which allreduces every step, meets no other way.)")
    if not isinstance(sync.every, int) or sync.every < 1:
        raise ConfigError(Arg("sync_every"), f" must be a positive number of steps, got {sync.every}.")
    return sync


def register(sync: Sync, *, replace: bool = False) -> Sync:
    """Makes `sync` available by name to `--sync NAME` and `TrainConfig(sync=NAME)`.

    Returns:
      The sync algorithm as registered.

    Raises:
      ConfigError: if it is not a well-formed `Sync`, or its name is taken (unless `replace`).
    """
    check(sync)
    if sync.name in _SYNCS and not replace:
        raise ConfigError(f"A sync algorithm named `{sync.name}` is registered already; pass `replace=True`.")
    _SYNCS[sync.name] = sync
    return sync


def names(*, local: bool | None = None) -> tuple[str, ...]:
    """The registered sync algorithms' names, built-ins first; only the local (or not) ones if `local` is given."""
    return tuple(name for name, sync in _SYNCS.items() if local in (None, sync.local))


def get(sync: "str | Sync", every: int | None = None, **settings: object) -> Sync:
    """The `Sync` of these settings, checked: a registered name or a `Sync`, with `every` for its H
    (None: its own) and `settings` for its fields (DiLoCo's outer optimizer, Streaming DiLoCo's fragments,
    ...; a None one: its own). The one lookup of a sync algorithm by name.

    Raises:
      ConfigError: naming a setting that is unknown, out of range or meaningless for `sync`.
    """
    if isinstance(sync, str) and sync not in _SYNCS:
        raise ConfigError("Unknown ", Arg("sync", sync), f"; choose one of: {', '.join(_SYNCS)} (or register your own "
                          "with `jdp.register_sync`, loaded with `--plugin MODULE`).")
    chosen = _SYNCS[sync] if isinstance(sync, str) else check(sync)
    if every is not None and not chosen.local and every != 1:
        raise ConfigError(Arg("sync_every", every), " needs a local mode: ",
                          _either(Arg("sync", name) for name in names(local=True)), ".")
    given = {name: value for name, value in settings.items() if value is not None}
    for name, value in given.items():
        if name not in settings_of(chosen):
            owners = _either(Arg("sync", other) for other in _SYNCS if name in settings_of(_SYNCS[other]))
            raise ConfigError(Arg(name, value), " is a setting of ", owners or "no registered sync algorithm",
                              ", not of ", Arg("sync", chosen.name), ".")
    if (every is None or not chosen.local) and not given:
        return chosen
    every = chosen.every if every is None or not chosen.local else every
    return check(dataclasses.replace(chosen, every=every, **given))  # a subclass's fields, checked when made


def _either(args: Iterable[Arg]) -> Message:
    """The `args` joined by " or " (empty if there are none)."""
    parts = []
    for arg in args:
        parts += [" or ", arg] if parts else [arg]
    return Message(*parts)


def settings_of(sync: Sync) -> tuple[str, ...]:
    """The names of `sync`'s settings besides H: the fields its class adds to `Sync`."""
    base = {field.name for field in dataclasses.fields(Sync)}
    return tuple(field.name for field in dataclasses.fields(sync) if field.init and field.name not in base)


def recorded(sync: Sync) -> dict[str, object]:
    """`sync` as a run records it (`TrainConfig.to_dict`, a checkpoint's settings): its name, H as `sync_every`
    (None for `every-step`) and every registered sync's settings, `sync`'s own values where it has them, else None."""
    keys = dict.fromkeys(name for other in _SYNCS.values() for name in settings_of(other))
    return {"sync": sync.name, "sync_every": sync.every if sync.local else None,
            **{key: getattr(sync, key, None) for key in keys}}


class SyncPrograms(NamedTuple):
    """A local sync mode's programs on the devices (`make_sync`)."""

    meet: Callable[[PyTree, PyTree, Hashable], tuple[PyTree, PyTree]]  # the replicas meet (`Sync.meetings`' key)
    consensus: Callable[[PyTree, PyTree], PyTree]  # the one model of (params, opt_state), replicated


def make_sync(sync: Sync, strategy: Allreduce, opt: OptState, devices: Sequence[jax.Device],
              backend: Backend) -> SyncPrograms:
    """Builds the programs of a local sync mode: `meet(params, opt_state, key) -> (params, opt_state)`, the
    replicas meet (see `Sync`), and `consensus(params, opt_state)`, the one model to evaluate between syncs.

    Args:
      sync: a local mode.
      strategy: the run's; `sync.reducer(strategy)` sums over the devices: an "inside" one in the mapped
        program, an "outside" one between two mapped calls, as in the train step.
      opt: the run's optimizer state (its strategy part and the sync's own state are used here).
      devices, backend: as the train step's.

    Returns:
      meet(params, opt_state, key): the meeting `key` of `sync.meetings` (a program compiled once per key),
      on the per-device arrays of the local step, donated; consensus: see `_consensus`.
    """
    consensus = _consensus(sync, opt, devices, backend)
    k, reducer = len(devices), sync.reducer(strategy)

    def received(total, params, state, key):
        mean = None if total is None else jax.tree.map(lambda x: x / k, total)
        return sync.receive(mean, params, state, key)

    def meeting(params, opt_state, send, reduce, receive):
        """One meeting from its three pieces: what each device sends, the sum, what each makes of it."""
        (inner, kept), state = opt.optimizer_and_strategy(opt_state), opt.sync_state(opt_state)
        sent, total = send(params, state), None
        if sent is not None:
            total, kept = reduce(sent, kept)
        params, state = receive(total, params, state)
        return params, opt.join(inner, kept, state)

    def inside(key):  # one mapped program: the sum is a collective in it
        local_sync = partial(meeting, send=lambda params, state: sync.send(params, state, key),
                             reduce=lambda sent, kept: reducer.reduce(sent, kept, AXIS),
                             receive=lambda total, params, state: received(total, params, state, key))
        return map_over_devices(local_sync, devices, backend, ("per_device", opt.kind), ("per_device", opt.kind),
                                donate=(0, 1))

    def outside(key):  # mapped calls around the sum, whose transfers run between them
        kinds = ("per_device", sync.state_kind)  # the params (or what is sent), the sync's state
        if sync.sends_params:  # no call before the transfers
            p_sent = lambda params, state: params  # noqa: E731
        else:
            p_sent_call = map_over_devices(lambda params, state: (sync.send(params, state, key),), devices, backend,
                                           kinds, ("per_device",))
            p_sent = lambda params, state: p_sent_call(params, state)[0]  # noqa: E731
        p_received = map_over_devices(lambda total, params, state: received(total, params, state, key), devices,
                                      backend, ("per_device", *kinds), kinds, donate=(0, 1))
        return partial(meeting, send=p_sent, reduce=reducer.reduce, receive=p_received)

    programs: dict[Hashable, Callable] = {}

    def meet(params, opt_state, key):
        if key not in programs:
            programs[key] = (inside if reducer.inside else outside)(key)
        return programs[key](params, opt_state)

    return SyncPrograms(meet, consensus)


def _consensus(sync: Sync, opt: OptState, devices: Sequence[jax.Device],
               backend: Backend) -> Callable[[PyTree, PyTree], PyTree]:
    """`consensus(params, opt_state)`: the one model of a local run, replicated, to evaluate between syncs:
    `sync.model` of its state (DiLoCo: θ, the global params of the last sync), else the average of the
    devices' params (local SGD; an evaluation's own sum, not counted as the run's communication)."""
    if sync.model is not None:
        model = map_over_devices(lambda state: (sync.model(state),), devices, backend, (sync.state_kind,),
                                 ("replicated",))
        return lambda params, opt_state: model(opt.sync_state(opt_state))[0]
    k = len(devices)
    mean = map_over_devices(lambda p: (jax.tree.map(lambda x: jax.lax.psum(x, AXIS) / k, p),), devices, backend,
                            ("per_device",), ("replicated",))
    return lambda params, opt_state: mean(params)[0]


_MOVED = {"SYNC_MODES": "`names()` (`jdp.sync_names()`), read from the registry of sync algorithms",
          "make_outer_optimizer": "`outer_optimizer_of(name, lr, momentum)`, a builder of the optax optimizer",
          "diloco": "`DiLoCo(every, outer_optimizer=, outer_lr=, outer_momentum=)` (`jdp.DiLoCo`), whose fields are its "
                    "settings",
          "from_settings": "`get(sync, every, **settings)` (`jdp.get_sync`)",
          "make_consensus": "`make_sync(...).consensus`: `make_sync` builds both programs of a local sync mode"}


def __getattr__(name: str):
    if name in _MOVED:  # removed after 0.1.0; see docs/api.md
        raise AttributeError(f"`jdp.parallel.sync.{name}` is now {_MOVED[name]}.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
