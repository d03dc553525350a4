"""The allreduce strategy as a value: a named algorithm and what else it can do.

A strategy runs in one of two places, and so is called in one of two ways:

* ``inside`` the mapped step, as collectives over the device axis: ``fn(tree, axis_name)``,
  called on each device's local tree (no leading device axis).
* ``outside`` it, between two mapped functions, moving buffers with explicit ``jax.device_put``:
  ``fn(tree)``, where every leaf is a global array of shape (k, ...) with slice i on device i
  (the lesson's allreduce: gradients leave the device computation, are copied, summed, copied back).

Beyond the sum, a strategy may declare capabilities, which the step and the wrappers read instead
of recognising strategies by name:

* halves, ``reduce_scatter`` and ``all_gather``: what `make_sharded_step`
  (ZeRO) calls with the optimizer update between them;
* per-device state, ``init``: kept on each device from one step to the next (PowerSGD's error
  feedback), which the step carries in its optimizer state (`jdp.parallel.opt_state`);
* a low-precision ``wire``: the same algorithm sending a narrower dtype but adding in the buffer's own;
* a ``cost`` (`jdp.parallel.cost.Cost`): its messages and bytes per device for k devices, per link
  level, which `jdp predict` and the fit of `jdp bench allreduce` read (wrappers transform it).
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jdp.errors import Arg, ConfigError
from jdp.parallel.cost import Cost
from jdp.types import PyTree

Where = Literal["inside", "outside"]
PLACES: tuple[Where, ...] = ("inside", "outside")


class Allreduce(NamedTuple):
    """A named allreduce algorithm: what `jdp.make_train_step` calls to sum the gradients.

    Attributes:
      name: what the CLI calls it (with `+fused` / `+bucketsM` when wrapped by `fused`).
      fn: the algorithm. "inside": `fn(tree, axis_name) -> tree`, traced in the mapped step on each
        device's local tree, built from collectives over `axis_name`. "outside": `fn(tree) -> tree`,
        called between mapped functions on global arrays of shape (k, ...) with slice i on device i.
      where: "inside" or "outside".
      init: None for a stateless strategy. A stateful one keeps state on each device between steps:
        `init(key, grads)` builds one device's initial state from a gradient-shaped tree, and `fn`
        takes and returns it: `fn(tree, state, axis_name) -> (tree, state)` inside,
        `fn(tree, state) -> (tree, state)` outside, there with every state leaf (k, ...).
      reduce_scatter: None, or the first half of the sum. Inside: `(flat, axis_name) -> mine`, a 1-D
        buffer of k·c elements in, the c elements [i·c, (i+1)·c) of the sum out on device i (the
        contract of `lax.psum_scatter(..., tiled=True)`). Outside: (k, k·c) in, (k, c) out.
      all_gather: None, or the second half. Inside: `(mine, axis_name) -> flat`, device i's c
        elements in, all k·c in device order out (`lax.all_gather(..., tiled=True)`). Outside:
        (k, c) in, (k, k·c) out. A reduce-scatter then an all-gather is an allreduce.
      wire: None, or `wire(dtype) -> Allreduce`: the same algorithm sending every message in `dtype`
        but adding in the buffer's own dtype (`--compress bf16-wire`).
      cost: None, or its `jdp.parallel.cost.Cost`: `cost.terms(k, leaf_bytes, per_node)`, the
        messages and bytes one device sends (and adds) per link level for k devices; what
        `jdp predict` prices a strategy by. The wrappers (`fused`, `low_precision`, `wire`) carry it.
      payload: None, or `payload(grads) -> tree`: what one device hands the wire for a gradient-shaped tree
        (shapes and dtypes; None: the tree itself). The compressions set it (`payload_bytes` counts it).
    """

    name: str
    fn: Callable[..., PyTree]
    where: Where = "inside"
    init: Callable[[jax.Array, PyTree], PyTree] | None = None
    reduce_scatter: Callable[..., jax.Array] | None = None
    all_gather: Callable[..., jax.Array] | None = None
    wire: Callable[[jnp.dtype], "Allreduce"] | None = None
    cost: Cost | None = None
    payload: Callable[[PyTree], PyTree] | None = None

    def __repr__(self) -> str:  # its functions say nothing printed: the name spells the strategy and its wrappers
        return f"Allreduce({self.name!r}, where={self.where!r})"

    @property
    def inside(self) -> bool:
        """Whether it runs inside the mapped step, as collectives (traceable in `jax.jit`), or between mapped
        functions, on global (k, ...) arrays."""
        return self.where == "inside"

    @property
    def lead(self) -> int:
        """How many leading device axes the arrays `fn` takes have: 0 inside (one device's), 1 outside."""
        return 0 if self.inside else 1

    def local(self, fn: Callable) -> Callable:
        """`fn` of one device's arrays, made to run on what `self.fn` takes: `fn` itself inside the mapped
        step; outside, batched over the device axis and compiled, so each device computes on its own slice
        in one dispatch (no communication)."""
        return fn if self.inside else jax.jit(jax.vmap(fn))

    def wrapped(self, name: str, fn: Callable[..., PyTree], *, init: Callable | None = None,
                cost: Cost | None = None, payload: Callable[[PyTree], PyTree] | None = None) -> "Allreduce":
        """A wrapper's strategy (fusion, compression): `fn(tree, *axis)` (or `fn(tree, state, *axis)` with
        `init`) in this strategy's place, calling it as `self.fn(..., *axis)`: `axis` is the axis name
        inside and empty outside, so a wrapper is written once for both places. `payload`: what the wrapper
        hands this strategy for a gradient tree (None: the tree), which then hands on its own payload of it."""
        handed = payload if self.payload is None else (
            self.payload if payload is None else lambda grads: self.payload(payload(grads)))
        return Allreduce(name, fn, self.where, init=init, cost=cost, payload=handed)

    @property
    def has_halves(self) -> bool:
        """Whether it splits into a reduce-scatter and an all-gather (what ZeRO needs)."""
        return self.reduce_scatter is not None and self.all_gather is not None

    @property
    def stateful(self) -> bool:
        """Whether it keeps state on each device between steps."""
        return self.init is not None

    def reduce(self, tree: Any, state: Any, *axis: str) -> tuple[Any, Any]:
        """(the sum of `tree` over the devices, the strategy's new per-device state, None if it keeps none)."""
        if not self.stateful:
            return self.fn(tree, *axis), None
        return self.fn(tree, state, *axis)


def check(strategy: Any) -> Allreduce:
    """Returns `strategy` if it is a well-formed `Allreduce`.

    Raises:
      ConfigError: if it is not an `Allreduce`, its `where` is unknown, or it has one half only.
    """
    if not isinstance(strategy, Allreduce):
        raise ConfigError(Arg("allreduce"), f" takes a `jdp.Allreduce`, got {type(strategy).__name__}.")
    if strategy.where not in PLACES:
        raise ConfigError(f"Allreduce `{strategy.name}` has `where={strategy.where!r}`; use \"inside\" or \"outside\".")
    if (strategy.reduce_scatter is None) != (strategy.all_gather is None):
        raise ConfigError(f"Allreduce `{strategy.name}` has one half only; give both `reduce_scatter` and "
                          "`all_gather`, or neither.")
    return strategy

