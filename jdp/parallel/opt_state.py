"""The optimizer state of a run: which of three variants it is, and everything done with it.

* replicated: `optimizer.init(params)`, one copy on every device, like the params;
* sharded (ZeRO, `shard_optimizer=True`): the state of the params raveled into one flat buffer
  per dtype (`jdp.parallel.buckets.Flat`), device i holding slice i of every per-element leaf
  (AdamW's moments) and a copy of every other leaf (AdamW's step count);
* with per-device strategy state (a stateful `Allreduce`, e.g. PowerSGD's error feedback):
  `{"optimizer": <replicated state>, "allreduce": <one state per device>}`;
* local (`jdp.parallel.sync`: local SGD, DiLoCo, yours): one optimizer state per device, each device's
  own, and the sync algorithm's own state if it keeps one (`Sync.init`), replicated, under the key
  "outer" (DiLoCo's name for it: the global params θ and the outer optimizer's state),
  `{"optimizer": <per device>, "outer": {"params": θ, "optimizer": <outer state>}}`.

`OptState` is the one place that knows them: the train step splits and joins the state through
it, the loop places it on the devices, checkpoints store its host form, and the replica check
compares its replicated part. The host form of the sharded state is `optimizer.init` of the
unpadded flat buffers, independent of k, so a sharded run resumes on any device count.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jdp.parallel.buckets import Flat, plan
from jdp.parallel.layout import Backend, Kinds, copies, fetch, place
from jdp.parallel.strategy import Allreduce
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

_SYNC_KEY = "outer"  # where the sync's own state is kept: DiLoCo's name for it, which its checkpoints hold
_MOVED = {"outer": "sync_state", "has_outer": "has_sync_state", "outer_optimizer": "sync_init"}


@dataclasses.dataclass(frozen=True, eq=False)
class OptState:
    """How a run keeps its optimizer state (see the module docstring for the three variants).

    Attributes:
      optimizer: the optax optimizer.
      params: the trainable params, or their `jax.ShapeDtypeStruct`s (the sharded variant's layout;
        None where only the kinds, `split` and `join` are used, as in the train step).
      device_count: k, the devices the state is placed on.
      sharded: ZeRO: each device holds 1/k of the per-element state.
      strategy: the allreduce strategy; a stateful one keeps its per-device state here too.
      local: a local sync mode (`jdp.parallel.sync`): each device keeps its own optimizer state.
      sync_init: params -> the sync algorithm's own state (`Sync.init`), which the state holds too;
        None: none.
      sync_kind: its placement kinds (`Sync.state_kind`, a pytree prefix of it): replicated, or with a
        part each device keeps for itself (Streaming DiLoCo's error feedback) `per_device`.
    """

    optimizer: "optax.GradientTransformation"
    params: PyTree
    device_count: int
    sharded: bool = False
    strategy: Allreduce | None = None
    local: bool = False
    sync_init: Callable[[PyTree], PyTree] | None = None
    sync_kind: Kinds = "replicated"

    @property
    def per_device_strategy_state(self) -> bool:
        """Whether the state holds the strategy's own state, one per device."""
        return self.strategy is not None and self.strategy.stateful

    @property
    def has_sync_state(self) -> bool:
        """Whether the state holds the sync algorithm's own state (DiLoCo's θ and outer optimizer state)."""
        return self.sync_init is not None

    @property
    def optimizer_kind(self) -> Kinds:
        """The placement kind of the optimizer's part (`jdp.parallel.layout`)."""
        return "per_device" if self.sharded or self.local else "replicated"

    @property
    def kind(self) -> Kinds:
        """The placement kinds of the whole state, a pytree prefix of it."""
        if not (self.per_device_strategy_state or self.has_sync_state):
            return self.optimizer_kind
        return self.join(self.optimizer_kind, "per_device", self.sync_kind)

    def split(self, state: PyTree) -> tuple[PyTree, PyTree]:
        """(the optimizer's part, the strategy's per-device part or None); on the devices or in a step."""
        if self.per_device_strategy_state or self.has_sync_state:
            return state["optimizer"], state.get("allreduce")
        return state, None

    def sync_state(self, state: PyTree) -> PyTree:
        """The sync algorithm's own state (DiLoCo's {"params": θ, "optimizer": outer state}), or None."""
        return state[_SYNC_KEY] if self.has_sync_state else None

    def join(self, optimizer_state: PyTree, strategy_state: PyTree, sync_state: PyTree = None) -> PyTree:
        """The inverse of `split` (and `sync_state`)."""
        if not (self.per_device_strategy_state or self.has_sync_state):
            return optimizer_state
        return {"optimizer": optimizer_state,
                **({"allreduce": strategy_state} if self.per_device_strategy_state else {}),
                **({_SYNC_KEY: sync_state} if self.has_sync_state else {})}

    def init(self, params: PyTree, key: jax.Array) -> PyTree:
        """The state before step 1, in its host form (what checkpoints hold).

        Args:
          params: the trainable params' values.
          key: seeds a stateful strategy's state (the same on every device at first).
        """
        k = self.device_count
        optimizer_state = self.optimizer.init(plan(params, 1).flatten(params) if self.sharded else params)
        if self.local:  # every device starts from the same state, then keeps its own
            optimizer_state = copies(optimizer_state, k)
        strategy_state = None
        if self.per_device_strategy_state:
            one = jax.device_get(self.strategy.init(key, params))  # the same on every device at first
            strategy_state = copies(one, k)
        sync_state = None
        if self.has_sync_state:  # a per-device part: the same on every device at first
            sync_state = jax.tree.map(lambda kind, part: copies(part, k) if kind == "per_device" else part,
                                      self.sync_kind, self.sync_init(params))
        return self.join(optimizer_state, strategy_state, sync_state)

    def place(self, host: PyTree, devices: list[jax.Device], backend: Backend) -> PyTree:
        """The host form → on `devices`, in the layout of `backend`."""
        (optimizer_state, strategy_state), sync_state = self.split(host), self.sync_state(host)
        if self.sharded:  # a row per device: slice i of each per-element leaf, a copy of each other leaf
            k = self.device_count
            rows = [_slices(leaf, k) if sliced else copies(leaf, k)
                    for leaf, sliced in zip(jax.tree.leaves(optimizer_state), self._sliced, strict=True)]
            optimizer_state = jax.tree.unflatten(jax.tree.structure(optimizer_state), rows)
        return place(self.join(optimizer_state, strategy_state, sync_state), self.kind, devices, backend)

    def to_host(self, state: PyTree, backend: Backend) -> PyTree:
        """The inverse of `place`: the host form (a collective with several processes)."""
        host = fetch(state, self.kind, backend)
        (optimizer_state, strategy_state), sync_state = self.split(host), self.sync_state(host)
        if self.sharded:  # the slices joined and the padding cut; one copy of each other leaf
            shapes = [leaf.shape for leaf in self._leaf_shapes(self._flat.sizes)]
            rows = jax.tree.leaves(optimizer_state)
            leaves = [row.reshape(-1)[: math.prod(shape)].reshape(shape) if sliced else row[0]
                      for row, sliced, shape in zip(rows, self._sliced, shapes, strict=True)]
            optimizer_state = jax.tree.unflatten(jax.tree.structure(optimizer_state), leaves)
        return self.join(optimizer_state, strategy_state, sync_state)

    def replicated_part(self, state: PyTree) -> PyTree:
        """The leaves every device must hold identically (what the replica check compares): a local
        mode's devices each keep their own optimizer state, the sync's own state is the same everywhere."""
        optimizer_state, _ = self.split(state)
        if self.local:
            return jax.tree.map(lambda kind, part: None if kind == "per_device" else part, self.sync_kind,
                                self.sync_state(state))
        if not self.sharded:
            return optimizer_state
        return [leaf for leaf, sliced in zip(jax.tree.leaves(optimizer_state), self._sliced, strict=True)
                if not sliced]

    def __getattr__(self, name: str) -> Any:
        if name in _MOVED:  # removed after 0.1.0; see docs/api.md
            raise AttributeError(f"`OptState.{name}` is now `{_MOVED[name]}`: the sync algorithm's own state.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @functools.cached_property
    def _flat(self) -> Flat:
        return plan(self.params, self.device_count)

    def _leaf_shapes(self, sizes: tuple[int, ...]) -> list[Any]:
        """The leaves of `optimizer.init` over flat buffers of `sizes` (shapes and dtypes only)."""
        buffers = [jax.ShapeDtypeStruct((n,), dtype) for (dtype, _), n in zip(self._flat.layout, sizes, strict=True)]
        return jax.tree.leaves(jax.eval_shape(self.optimizer.init, buffers))

    @functools.cached_property
    def _sliced(self) -> list[bool]:
        """Per leaf of the sharded state: per-element (a slice per device), or the same on every device.

        A leaf whose shape follows the buffers' length is per-element (AdamW's moments); one whose
        shape does not is a copy (AdamW's step count).
        """
        chunks = self._flat.chunks
        one, other = self._leaf_shapes(chunks), self._leaf_shapes(tuple(c + 1 for c in chunks))
        return [a.shape != b.shape for a, b in zip(one, other, strict=True)]


def _slices(leaf: Any, k: int) -> np.ndarray:
    """A flat per-element leaf zero-padded and cut into k rows: row i is device i's slice."""
    host = np.asarray(leaf)
    c = -(-host.size // k) or 1
    return np.pad(host, (0, k * c - host.size)).reshape(k, c)


def init_sharded(optimizer: "optax.GradientTransformation", params: PyTree, devices: list[jax.Device],
                 backend: Backend = "pmap") -> PyTree:
    """The initial optimizer state of `params`, sharded over `devices`: what `make_sharded_step`
    takes as `opt_state` (the counterpart of `jdp.replicate(optimizer.init(params))`)."""
    state = OptState(optimizer, params, len(devices), sharded=True)
    return state.place(state.init(params, jax.random.key(0)), devices, backend)
