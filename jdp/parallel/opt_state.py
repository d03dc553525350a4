"""The optimizer state of a run: the composite of its components' parts, and everything done with it.

Each part (`Part`) is one component's state with its placement kind; `OptState` composes them. The optimizer's
part is one of three (`OptState.placement`), and the strategy's and the sync algorithm's are there when they
keep state:

* replicated: `optimizer.init(params)`, one copy on every device, like the params;
* sharded (ZeRO, `shard_optimizer=True`): the state of the params raveled into one flat buffer
  per dtype (`jdp.parallel.buckets.Flat`), device i holding slice i of every per-element leaf
  (AdamW's moments) and a copy of every other leaf (AdamW's step count);
* with per-device strategy state (a stateful `Allreduce`, e.g. PowerSGD's error feedback):
  `{"optimizer": <replicated state>, "allreduce": <one state per device>}`;
* local (`jdp.parallel.sync`: local SGD, DiLoCo, yours): one optimizer state per device, each device's
  own, and the sync algorithm's own state if it keeps one (`Sync.state_part`), replicated, under the key
  "outer" (DiLoCo's name for it: the global params θ and the outer optimizer's state),
  `{"optimizer": <per device>, "outer": {"params": θ, "optimizer": <outer state>}}`.

`OptState` is the one place that composes them: the train step splits and joins the state through
it, the loop places it on the devices, checkpoints store its host form, and the replica check
compares its replicated part; each of these asks every part. A new variant is a new `Part`.
"""

import abc
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jdp.errors import moved_arguments
from jdp.parallel.buckets import Flat, plan
from jdp.parallel.layout import Backend, Kinds, copies, fetch, on_per_device, place
from jdp.parallel.strategy import Allreduce
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

_OPTIMIZER, _STRATEGY = "optimizer", "allreduce"  # the parts' keys in the state (what checkpoints hold)
_SYNC = "outer"  # where the sync's own state is kept: DiLoCo's name for it, which its checkpoints hold
_MOVED = {"outer": "`sync_state`: the sync algorithm's own state",
          "has_outer": "`has_sync_state`: the sync algorithm's own state",
          "outer_optimizer": "`sync`, the sync algorithm's part (`Sync.state_part`)",
          "split": "`optimizer_and_strategy`: the optimizer's part and the strategy's",
          "sharded": "`placement`, a `ShardedOptimizer`",
          "local": "`placement`, a `LocalOptimizer`",
          "sync_init": "`sync`, the sync algorithm's part (`Sync.state_part`)",
          "sync_kind": "`sync.kind`, the sync algorithm's part's"}


class Part(abc.ABC):
    """One component's share of the optimizer state: its placement kind and its host form.

    The host form is what checkpoints hold; `rows` turns it into what `jdp.parallel.layout.place` takes for
    `kind` (and `unrows` back, after `fetch`); `replicated` is the part of it, on the devices, that every
    device must hold identically (the replica check): all of a replicated part, None of a per-device one.
    """

    kind: Kinds = "replicated"

    @abc.abstractmethod
    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        """The host form before step 1, for the trainable `params` (`key` seeds what is random)."""

    def rows(self, host: PyTree) -> PyTree:
        return host

    def unrows(self, fetched: PyTree) -> PyTree:
        return fetched

    def replicated(self, state: PyTree) -> PyTree:
        return state


class OptimizerPart(Part):
    """The optimizer's part: where its state lives, and so which step keeps it (`OptState.placement`)."""

    optimizer: "optax.GradientTransformation"


@dataclasses.dataclass(frozen=True)
class ReplicatedOptimizer(OptimizerPart):
    """`optimizer.init(params)`, one copy on every device, like the params."""

    optimizer: "optax.GradientTransformation"

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        return self.optimizer.init(params)


@dataclasses.dataclass(frozen=True)
class LocalOptimizer(OptimizerPart):
    """Each device's own optimizer state (a local sync mode), the same on every device at first."""

    optimizer: "optax.GradientTransformation"
    device_count: int
    kind: Kinds = "per_device"

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        return copies(self.optimizer.init(params), self.device_count)

    def replicated(self, state: PyTree) -> PyTree:
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedOptimizer(OptimizerPart):
    """ZeRO: the state of the params raveled into one flat buffer per dtype (`jdp.parallel.buckets.Flat`),
    device i holding slice i of every per-element leaf (AdamW's moments) and a copy of every other leaf
    (AdamW's step count). The host form is `optimizer.init` of the unpadded buffers, independent of k, so a
    sharded run resumes on any device count."""

    optimizer: "optax.GradientTransformation"
    params: PyTree  # the trainable params or their `jax.ShapeDtypeStruct`s (only the layout is read)
    device_count: int
    kind: Kinds = "per_device"

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        return self.optimizer.init(plan(params, 1).flatten(params))

    def rows(self, host: PyTree) -> PyTree:
        """A row per device: slice i of each per-element leaf, a copy of each other leaf."""
        k = self.device_count
        rows = [_slices(leaf, k) if sliced else copies(leaf, k)
                for leaf, sliced in zip(jax.tree.leaves(host), self._sliced, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(host), rows)

    def unrows(self, fetched: PyTree) -> PyTree:
        """The slices joined and the padding cut; one copy of each other leaf."""
        shapes = [leaf.shape for leaf in self._leaf_shapes(self._flat.sizes)]
        leaves = [row.reshape(-1)[: math.prod(shape)].reshape(shape) if sliced else row[0]
                  for row, sliced, shape in zip(jax.tree.leaves(fetched), self._sliced, shapes, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(fetched), leaves)

    def replicated(self, state: PyTree) -> PyTree:
        return [leaf for leaf, sliced in zip(jax.tree.leaves(state), self._sliced, strict=True) if not sliced]

    @functools.cached_property
    def _flat(self) -> Flat:
        return plan(self.params, self.device_count)

    def _leaf_shapes(self, sizes: tuple[int, ...]) -> list[Any]:
        """The leaves of `optimizer.init` over flat buffers of `sizes` (shapes and dtypes only)."""
        buffers = [jax.ShapeDtypeStruct((n,), dtype) for (dtype, _), n in zip(self._flat.layout, sizes, strict=True)]
        return jax.tree.leaves(jax.eval_shape(self.optimizer.init, buffers))

    @functools.cached_property
    def _sliced(self) -> list[bool]:
        """Per leaf: per-element (a slice per device), or the same on every device. A leaf whose shape
        follows the buffers' length is per-element (AdamW's moments); one whose shape does not is a copy."""
        chunks = self._flat.chunks
        one, other = self._leaf_shapes(chunks), self._leaf_shapes(tuple(c + 1 for c in chunks))
        return [a.shape != b.shape for a, b in zip(one, other, strict=True)]


@dataclasses.dataclass(frozen=True)
class StrategyState(Part):
    """A stateful allreduce strategy's own state (PowerSGD's error feedback): one per device, seeded by the
    key, the same on every device at first."""

    strategy: Allreduce
    device_count: int
    kind: Kinds = "per_device"

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        return copies(jax.device_get(self.strategy.init(key, params)), self.device_count)

    def replicated(self, state: PyTree) -> PyTree:
        return None


@dataclasses.dataclass(frozen=True)
class SyncState(Part):
    """A sync algorithm's own state (`Sync.init`: DiLoCo's θ and outer optimizer state), placed as
    `Sync.state_kind` says; a per-device part is the same on every device at first."""

    init_state: Callable[[PyTree], PyTree]
    device_count: int
    kind: Kinds = "replicated"

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        return on_per_device(lambda leaf: copies(leaf, self.device_count), self.kind, self.init_state(params))

    def replicated(self, state: PyTree) -> PyTree:
        return on_per_device(lambda leaf: None, self.kind, state)


@dataclasses.dataclass(frozen=True, eq=False)
class OptState:
    """How a run keeps its optimizer state: the composite of its components' parts (`parts`).

    Attributes:
      placement: the optimizer's part, which says where its state lives: `ReplicatedOptimizer` (like the
        params), `ShardedOptimizer` (ZeRO: each device 1/k of the per-element state) or `LocalOptimizer`
        (a local sync mode: each device its own). The step that keeps the state follows from it
        (`jdp.parallel.step.make_step`).
      device_count: k, the devices the state is placed on.
      strategy: the allreduce strategy; a stateful one keeps its per-device state here too (`StrategyState`).
      sync: the sync algorithm's part (`Sync.state_part`: DiLoCo's θ and outer optimizer state), or None.
    """

    placement: OptimizerPart
    device_count: int
    strategy: Allreduce | None = None
    sync: "SyncState | None" = None

    def __post_init__(self) -> None:
        if not isinstance(self.placement, OptimizerPart):  # the form before 0.1.0's redesign; see docs/api.md
            raise TypeError("`jdp.OptState(optimizer, params, device_count, sharded=..., local=...)` is now "
                            "`jdp.OptState(placement, device_count, strategy=, sync=)`, the placement one of "
                            "`jdp.ReplicatedOptimizer(optimizer)`, `jdp.ShardedOptimizer(optimizer, params, k)`, "
                            "`jdp.LocalOptimizer(optimizer, k)` (docs/api.md).")

    @property
    def optimizer(self) -> "optax.GradientTransformation":
        """The optax optimizer whose state the placement keeps."""
        return self.placement.optimizer

    @functools.cached_property
    def parts(self) -> dict[str, Part]:
        """The parts, by their key in the state: the optimizer's, then the strategy's and the sync's if any."""
        parts: dict[str, Part] = {_OPTIMIZER: self.placement}
        if self.strategy is not None and self.strategy.stateful:
            parts[_STRATEGY] = StrategyState(self.strategy, self.device_count)
        if self.sync is not None:
            parts[_SYNC] = self.sync
        return parts

    @property
    def per_device_strategy_state(self) -> bool:
        """Whether the state holds the strategy's own state, one per device."""
        return _STRATEGY in self.parts

    @property
    def has_sync_state(self) -> bool:
        """Whether the state holds the sync algorithm's own state (DiLoCo's θ and outer optimizer state)."""
        return _SYNC in self.parts

    @property
    def optimizer_kind(self) -> Kinds:
        """The placement kind of the optimizer's part (`jdp.parallel.layout`)."""
        return self.parts[_OPTIMIZER].kind

    @property
    def kind(self) -> Kinds:
        """The placement kinds of the whole state, a pytree prefix of it."""
        return self._joined({key: part.kind for key, part in self.parts.items()})

    def optimizer_and_strategy(self, state: PyTree) -> tuple[PyTree, PyTree]:
        """(the optimizer's part, the strategy's per-device part or None); on the devices or in a step."""
        parts = self._parts_of(state)
        return parts[_OPTIMIZER], parts.get(_STRATEGY)

    def sync_state(self, state: PyTree) -> PyTree:
        """The sync algorithm's own state (DiLoCo's {"params": θ, "optimizer": outer state}), or None."""
        return self._parts_of(state).get(_SYNC)

    def join(self, optimizer_state: PyTree, strategy_state: PyTree, sync_state: PyTree = None) -> PyTree:
        """The inverse of `optimizer_and_strategy` (and `sync_state`)."""
        given = {_OPTIMIZER: optimizer_state, _STRATEGY: strategy_state, _SYNC: sync_state}
        return self._joined({key: given[key] for key in self.parts})

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        """The state before step 1, in its host form (what checkpoints hold).

        Args:
          params: the trainable params' values.
          key: seeds a stateful strategy's state (the same on every device at first).
        """
        return self._joined({name: part.init(params, key) for name, part in self.parts.items()})

    def place(self, host: PyTree, devices: list[jax.Device], backend: Backend) -> PyTree:
        """The host form → on `devices`, in the layout of `backend`."""
        rows = {name: self.parts[name].rows(part) for name, part in self._parts_of(host).items()}
        return place(self._joined(rows), self.kind, devices, backend)

    def to_host(self, state: PyTree, backend: Backend) -> PyTree:
        """The inverse of `place`: the host form (a collective with several processes)."""
        fetched = self._parts_of(fetch(state, self.kind, backend))
        return self._joined({name: self.parts[name].unrows(part) for name, part in fetched.items()})

    def replicated_part(self, state: PyTree) -> PyTree:
        """The leaves every device must hold identically (what the replica check compares): each part's
        (a local mode's devices each keep their own optimizer state, a sharded one a slice of it)."""
        return self._joined({name: self.parts[name].replicated(part) for name, part in self._parts_of(state).items()})

    def _parts_of(self, state: PyTree) -> dict[str, PyTree]:
        """The state by part: the bare optimizer state when it is the only part, else the dict of parts."""
        return dict(state) if len(self.parts) > 1 else {_OPTIMIZER: state}

    def _joined(self, parts: dict[str, PyTree]) -> PyTree:
        """The inverse of `_parts_of`."""
        return parts if len(self.parts) > 1 else parts[_OPTIMIZER]

    def __getattr__(self, name: str) -> Any:
        if name in _MOVED:  # removed after 0.1.0; see docs/api.md
            raise AttributeError(f"`OptState.{name}` is now {_MOVED[name]}.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


OptState.__init__ = moved_arguments(  # the flags before 0.1.0's redesign; see docs/api.md
    {name: f"the optimizer state is composed of parts: {_MOVED[name]}"
     for name in ("sharded", "local", "sync_init", "sync_kind", "outer_optimizer")}
)(OptState.__init__)


def _slices(leaf: Any, k: int) -> np.ndarray:
    """A flat per-element leaf zero-padded and cut into k rows: row i is device i's slice."""
    host = np.asarray(leaf)
    c = -(-host.size // k) or 1
    return np.pad(host, (0, k * c - host.size)).reshape(k, c)


def init_sharded(optimizer: "optax.GradientTransformation", params: PyTree, devices: list[jax.Device],
                 backend: Backend = "pmap") -> PyTree:
    """The initial optimizer state of `params`, sharded over `devices`: what `make_sharded_step`
    takes as `opt_state` (the counterpart of `jdp.replicate(optimizer.init(params))`)."""
    state = OptState(ShardedOptimizer(optimizer, params, len(devices)), len(devices))
    return state.place(state.init(params, jax.random.key(0)), devices, backend)
