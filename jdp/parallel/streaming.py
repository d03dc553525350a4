"""Streaming DiLoCo (Douillard et al. 2025): DiLoCo synced a fragment at a time, applied late, in few bits.

DiLoCo (`jdp.parallel.sync.DiLoCo`) sends the whole model every H steps: its peak traffic is the
model's size. Streaming DiLoCo changes three things, each a setting here:

* **fragments** (F): the params, raveled in leaf order, are cut into F slices of equal size (the
  paper groups layers; equal slices keep every sync the same size whatever the layers weigh).
  Fragment p meets after the steps t ≡ (p + 1)·H/F (mod H): F syncs of 1/F of the model each per H
  steps, staggered, so the peak traffic is 1/F of DiLoCo's. Each fragment has its own outer
  optimizer state; the outer step is DiLoCo's, on that fragment.
* **sync_delay** (TAU): a fragment's outer step, sent after step t, is applied after step t + TAU, merged
  with what the device learnt meanwhile: θ_p ← α·θ_p(local) + (1 − α)·θ_p(outer), α the **mixing**
  factor (the paper's 0.5). Where communication overlaps computation, TAU steps hide the sync's time.
  At TAU = 0 the fragment is replaced by the outer result, as in DiLoCo.
* **outer_dtype**: the outer gradients cross the wire as float32 (the run's allreduce strategy), or
  as bf16, fp8 (e4m3) or int8, each device's quantized with its own scale, all-gathered and added in
  float32 (`jdp.parallel.compress.quantized`). With **error_feedback**, what quantizing lost of a
  device's outer gradient is kept on that device and added to its next one for that fragment.

After the run's last step every fragment meets at once and is replaced (one model, as DiLoCo ends).
With F = 1, TAU = 0 and float32 it is DiLoCo, bit for bit.

Reference:
  Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
  Lunch", arXiv:2501.18512, 2025 (Algorithm 2; the mixing factor, section 2.3).
"""

import dataclasses
import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jdp.errors import Arg, ConfigError
from jdp.parallel.compress import WIRE_DTYPES, dequantize, quantize, quantized
from jdp.parallel.layout import Kinds
from jdp.parallel.strategy import Allreduce
from jdp.parallel.sync import DEFAULT_EVERY, DiLoCo, register
from jdp.types import PyTree

DEFAULT_FRAGMENTS = 4
DEFAULT_MIXING = 0.5  # Douillard et al. 2025, section 2.3: α = 0.5
FINAL = "final"  # the meeting after the run's last step: every fragment, replaced

Slices = tuple[tuple[int, int, int], ...]  # one fragment: (leaf index, start, stop) of raveled leaves


def fragment_slices(sizes: list[int], fragments: int) -> tuple[Slices, ...]:
    """The F fragments of params whose leaves have `sizes` elements: F equal runs of the raveled params
    (the last fragment one element longer or shorter at most), each as slices of the leaves it covers."""
    total, offsets = sum(sizes), np.cumsum([0, *sizes])
    bounds = [total * p // fragments for p in range(fragments + 1)]
    return tuple(
        tuple((i, int(max(lo, offsets[i]) - offsets[i]), int(min(hi, offsets[i + 1]) - offsets[i]))
              for i in range(len(sizes)) if max(lo, offsets[i]) < min(hi, offsets[i + 1]))
        for lo, hi in zip(bounds, bounds[1:]))


def _fragments(tree: PyTree, fragments: int) -> tuple[Slices, ...]:
    return fragment_slices([int(np.size(x)) for x in jax.tree.leaves(tree)], fragments)


def pieces(tree: PyTree, slices: Slices) -> tuple[jax.Array, ...]:
    """The 1-D pieces of `tree`'s leaves that one fragment covers."""
    leaves = jax.tree.leaves(tree)
    return tuple(jnp.ravel(leaves[i])[start:stop] for i, start, stop in slices)


def with_pieces(tree: PyTree, slices: Slices, values: tuple[jax.Array, ...]) -> PyTree:
    """`tree` with one fragment's pieces replaced by `values`."""
    leaves = list(jax.tree.leaves(tree))
    for (i, start, stop), value in zip(slices, values, strict=True):
        if start == 0 and stop == np.size(leaves[i]):
            leaves[i] = value.reshape(np.shape(leaves[i]))
        else:
            leaves[i] = jnp.ravel(leaves[i]).at[start:stop].set(value).reshape(np.shape(leaves[i]))
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCo(DiLoCo):
    """Streaming DiLoCo's schedule and meetings (the module docstring): `StreamingDiLoCo(every=16, fragments=4)`.
    Its settings are its fields and DiLoCo's outer optimizer's, each checked when it is made (and by
    `dataclasses.replace`).

    Its state: {"params": θ, the global params, "optimizer": (the outer optimizer's state of each fragment)},
    and with error feedback "error": each device's own, the params' shape.
    """

    name: str = "streaming-diloco"
    fragments: int = DEFAULT_FRAGMENTS
    sync_delay: int = 0
    mixing: float = DEFAULT_MIXING
    outer_dtype: str = "float32"
    error_feedback: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()  # DiLoCo's outer optimizer, checked
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ConfigError(Arg("fragments"), f" must be a positive number, got {self.fragments}.")
        if self.every % self.fragments:
            raise ConfigError(Arg("sync_every", self.every), " does not split into ", Arg("fragments", self.fragments),
                              " syncs evenly; use a multiple of it.")
        if not isinstance(self.sync_delay, int) or not 0 <= self.sync_delay < self.every:
            raise ConfigError(Arg("sync_delay"), " must be in [0, ", Arg("sync_every"),
                              f"={self.every}), got {self.sync_delay}.")
        if not 0 <= self.mixing <= 1:
            raise ConfigError(Arg("mixing"), f" must be in [0, 1], got {self.mixing}.")
        if self.outer_dtype not in WIRE_DTYPES:
            raise ConfigError("Unknown ", Arg("outer_dtype", self.outer_dtype),
                              f"; choose one of: {', '.join(WIRE_DTYPES)}.")
        if self.error_feedback and self.outer_dtype == "float32":
            raise ConfigError(Arg("error_feedback", True), " keeps what quantizing the outer gradients loses; with ",
                              Arg("outer_dtype", "float32"), " nothing is. Add a narrower ", Arg("outer_dtype"),
                              " or drop it.")
        object.__setattr__(self, "init", functools.partial(_initial_state, fragments=self.fragments,
                                                           outer=self.outer, error_feedback=self.error_feedback))

    @property
    def local(self) -> bool:
        return True

    @property
    def stride(self) -> int:
        """Steps between two fragment syncs: H/F."""
        return self.every // self.fragments

    def meetings(self, step: int, last_step: int) -> tuple[Hashable, ...]:
        """The merge of the fragment sent TAU steps ago, then the send of the fragment due; after the
        run's last step, the final meeting of every fragment."""
        if step == last_step:
            return (FINAL,)
        sent_before = step - self.sync_delay
        merge = (("merge", self._due(sent_before)),) if self.sync_delay and sent_before > 0 and \
            sent_before % self.stride == 0 else ()
        return (*merge, *((("send", self._due(step)),) if step % self.stride == 0 else ()))

    def _due(self, step: int) -> int:
        """The fragment that meets after `step` (a multiple of H/F): p for step ≡ (p + 1)·H/F (mod H)."""
        return (step % self.every // self.stride - 1) % self.fragments

    def agrees_after(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.fragments == 1 and self.sync_delay == 0 and step % self.every == 0)

    def syncs(self, step: int, last_step: int) -> int:
        """Fragment syncs (each 1/F of the model) in the first `step` steps; the final meeting counts F."""
        regular = step // self.stride
        return regular if step < last_step else regular - (step % self.stride == 0) + self.fragments

    @property
    def state_kind(self) -> Kinds:
        """θ and the outer states are the same everywhere; the error feedback is each device's own."""
        if not self.error_feedback:
            return "replicated"
        return {"params": "replicated", "optimizer": "replicated", "error": "per_device"}

    @property
    def payload_fraction(self) -> float:
        return jnp.dtype(WIRE_DTYPES[self.outer_dtype]).itemsize / 4 / self.fragments

    @property
    def sends_params(self) -> bool:
        return False

    def send(self, params: PyTree, state: PyTree, key: Hashable) -> tuple | None:
        """The change θ − θ_i of the fragments that meet, one tuple of pieces each; None at a merge."""
        if key != FINAL and key[0] == "merge":
            return None
        frags = _fragments(params, self.fragments)
        return tuple(self._outer_gradient(params, state, frags[p]) for p in self._meeting(key))

    def _outer_gradient(self, params: PyTree, state: PyTree, fragment: Slices) -> tuple[jax.Array, ...]:
        """This device's θ − θ_i over `fragment`, plus what quantizing it lost before (error feedback)."""
        change = tuple(theta - mine for theta, mine in zip(pieces(state["params"], fragment),
                                                           pieces(params, fragment), strict=True))
        if not self.error_feedback:
            return change
        return tuple(c + e for c, e in zip(change, pieces(state["error"], fragment), strict=True))

    def receive(self, mean: tuple | None, params: PyTree, state: PyTree, key: Hashable) -> tuple[PyTree, PyTree]:
        """The outer step on each fragment sent, then its local params replaced (TAU = 0, or the final
        meeting) or left to be merged TAU steps later; at a merge, the local params mixed with θ's."""
        import optax

        frags, theta, outer_states = _fragments(params, self.fragments), state["params"], list(state["optimizer"])
        error = state.get("error")
        if key != FINAL and key[0] == "merge":
            mine, outer = pieces(params, frags[key[1]]), pieces(theta, frags[key[1]])
            mixed = tuple(self.mixing * a + (1 - self.mixing) * b for a, b in zip(mine, outer, strict=True))
            return with_pieces(params, frags[key[1]], mixed), state
        for p, change in zip(self._meeting(key), mean, strict=True):
            if error is not None:  # what the wire lost of this device's outer gradient, kept for the next send
                sent = self._outer_gradient(params, state, frags[p])
                error = with_pieces(error, frags[p], tuple(x - dequantize(*quantize(x, self.outer_dtype))
                                                           for x in sent))
            updates, outer_states[p] = self.outer().update(change, outer_states[p], pieces(theta, frags[p]))
            theta = with_pieces(theta, frags[p], optax.apply_updates(pieces(theta, frags[p]), updates))
            if key == FINAL or self.sync_delay == 0:
                params = with_pieces(params, frags[p], pieces(theta, frags[p]))
        kept = {"params": theta, "optimizer": tuple(outer_states)}
        return params, kept if error is None else {**kept, "error": error}

    def reducer(self, strategy: Allreduce) -> Allreduce:
        """The run's strategy for float32 outer gradients; for a narrower `outer_dtype`, the quantized all-gather.

        Raises:
          ConfigError: for a strategy with per-device state: its state is shaped as the whole model, and
            each meeting here sends a fragment.
        """
        if strategy.stateful:
            raise ConfigError(Arg("allreduce", strategy.name), " keeps per-device state shaped as the whole model; ",
                              Arg("sync", self.name), " sends one fragment at a time. Use a stateless strategy.")
        return strategy if self.outer_dtype == "float32" else quantized(self.outer_dtype)

    def _meeting(self, key: Hashable) -> range:
        """The fragments a meeting sends: all at the final one, else the one it names."""
        return range(self.fragments) if key == FINAL else range(key[1], key[1] + 1)


def _initial_state(params: PyTree, fragments: int, outer: Callable, error_feedback: bool) -> PyTree:
    state = {"params": params,
             "optimizer": tuple(outer().init(pieces(params, f)) for f in _fragments(params, fragments))}
    return {**state, "error": jax.tree.map(jnp.zeros_like, params)} if error_feedback else state


def streaming_diloco(every: int = DEFAULT_EVERY, **settings: object) -> StreamingDiLoCo:
    """Streaming DiLoCo with H = `every` and `settings` (the fields of `StreamingDiLoCo`: `fragments`,
    `sync_delay`, `mixing`, `outer_dtype`, and DiLoCo's `outer_optimizer`, `outer_lr`, `outer_momentum`).

    Raises:
      ConfigError: naming a setting that is out of range.
    """
    return StreamingDiLoCo(every=every, **settings)


register(streaming_diloco())
