"""Compressed allreduce: strategy wrappers that send fewer bytes (`jdp train --compress`).

Like `fused`, each wrapper takes any strategy (inside or outside, fused or not) and returns one,
so compression composes with every algorithm; the wrapped strategy does all the communication.

* ``bf16`` / ``fp16``: cast every leaf before the allreduce, cast the sum back (PyTorch DDP's
  `fp16_compress_hook`). Half the bytes; every addition of the sum rounds to the low dtype.
* ``bf16-wire`` / ``fp16-wire``: jdp's `ring`, sending every chunk in the low dtype but adding in
  float32 at every hop. The same bytes as ``bf16``, one rounding per hop instead of a sum that
  is rounded after every addition: the difference is the cost of low-precision *sums*.
* `quantized` (Streaming DiLoCo's outer gradients, `jdp.parallel.streaming`): each device's buffer
  in bf16, fp8 (e4m3) or int8, scaled so its largest value is the dtype's largest, all-gathered and
  added in float32 on every device: a quarter of the bytes at 8 bits, one rounding per value.
* ``powersgd``: rank-r PowerSGD with error feedback (Vogels, Karimireddy & Jaggi, NeurIPS 2019).
  Each matrix-shaped gradient M (conv kernels as (out, in·h·w)) is sent as two thin factors,
  P = M·Q (n×r) and Q = Mᵀ·P̂ (m×r), instead of n×m values; leaves that would not shrink
  (biases) are sent as they are. What compression loses on a device is kept there, in its error
  state, and added to the next step's gradient, so nothing is lost for good: the sum of the
  applied updates tracks the sum of the true gradients.

Every device ends the step with the same sum, bit for bit: everything a device computes after an
allreduce depends only on allreduced values (P̂ from ΣP, the result from P̂ and ΣQ); only the
error state, which never leaves its device, differs between devices.

References:
  Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
  Distributed Optimization", NeurIPS 2019.
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.errors import Arg, ConfigError, check_positive
from jdp.parallel.cost import cast_cost, gathered
from jdp.parallel.strategy import Allreduce
from jdp.types import PyTree

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}
WIRE_DTYPES = {"float32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "int8": jnp.int8}
_LARGEST = {"fp8": float(jnp.finfo(jnp.float8_e4m3fn).max), "int8": 127.0}  # what the largest |x| is scaled to
MODES = ("none", "bf16", "fp16", "bf16-wire", "fp16-wire", "powersgd")


def low_precision(strategy: Allreduce, dtype: jnp.dtype) -> Allreduce:
    """Wraps `strategy` to allreduce every leaf in `dtype` and cast the sum back to the leaf's dtype."""
    name = f"{strategy.name}+{jnp.dtype(dtype).name}"

    def down(tree):
        # The barrier keeps the rounding: XLA's CPU all-reduce adds bf16 in float32, and with its
        # performance flags XLA then drops the convert pair around it, so psum would round nothing.
        return lax.optimization_barrier(jax.tree.map(lambda x: x.astype(dtype), tree))

    def up(sums, tree):
        return jax.tree.map(lambda s, x: s.astype(x.dtype), sums, tree)

    cost = None if strategy.cost is None else cast_cost(strategy.cost, jnp.dtype(dtype).itemsize / 4)  # of float32
    cast = strategy.local(down)  # outside: one dispatch, each slice cast on its own device
    return strategy.wrapped(name, lambda tree, *axis: up(strategy.fn(cast(tree), *axis), tree), cost=cost,
                            payload=cast_to(dtype))


def cast_to(dtype: jnp.dtype) -> Callable[[PyTree], PyTree]:
    """The payload of a tree sent in `dtype` (`Allreduce.payload`): each leaf's shape, in `dtype`."""
    return lambda grads: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype), grads)


def quantize(x: jax.Array, wire: str) -> tuple[jax.Array, jax.Array]:
    """(`x` in the `wire` dtype of `WIRE_DTYPES`, its float32 scale): fp8 and int8 scaled so that the largest
    |x| is the dtype's largest value (int8 rounded to the nearest integer); float32 and bf16 cast, scale 1."""
    if wire not in _LARGEST:
        return x.astype(WIRE_DTYPES[wire]), jnp.float32(1.0)
    top = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(top > 0, top / _LARGEST[wire], 1.0)
    scaled = jnp.clip(x / scale, -_LARGEST[wire], _LARGEST[wire])  # the division may round past the largest
    return (jnp.round(scaled) if wire == "int8" else scaled).astype(WIRE_DTYPES[wire]), scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 values `q` stands for (`quantize`'s inverse, up to its rounding)."""
    return q.astype(jnp.float32) * scale


def quantized(wire: str) -> Allreduce:
    """The allreduce of Streaming DiLoCo's low-precision outer gradients: each device's leaves quantized
    to `wire`, each with its own scale, all-gathered in that dtype in one buffer (and the scales in a
    second), then dequantized and added in float32, in device order, on every device (so every device
    holds the same sum, bit for bit). Two messages per sum, whatever the leaves: a sync is latency-bound."""
    if wire not in WIRE_DTYPES:
        raise ConfigError(f"Unknown wire dtype `{wire}`; choose one of: {', '.join(WIRE_DTYPES)}.")
    itemsize = jnp.dtype(WIRE_DTYPES[wire]).itemsize

    def fn(tree, axis):
        leaves, structure = jax.tree.flatten(tree)
        if not leaves:
            return tree
        quantized_leaves, scales = zip(*(quantize(x, wire) for x in leaves), strict=True)
        flat = jnp.concatenate([q.reshape(-1) for q in quantized_leaves])
        carried = lax.bitcast_convert_type(flat, jnp.uint8) if itemsize == 1 and wire != "int8" else flat
        everyone = lax.all_gather(carried, axis)  # (k, n): every device's quantized leaves, one buffer
        if carried is not flat:
            everyone = lax.bitcast_convert_type(everyone, flat.dtype)
        all_scales = lax.all_gather(jnp.stack(scales), axis)  # (k, leaves)
        sums, start = [], 0
        for i, x in enumerate(leaves):
            rows = everyone[:, start:start + x.size].reshape(-1, *x.shape)
            sums.append(jnp.sum(dequantize(rows, all_scales[:, i].reshape(-1, *[1] * x.ndim)), axis=0).astype(x.dtype))
            start += x.size
        return jax.tree.unflatten(structure, sums)

    name = f"gather+{wire}"
    return Allreduce(name, fn, cost=gathered(itemsize / 4, name))


# --- PowerSGD ---------------------------------------------------------------------------------


def compressible(shape: Sequence[int], rank: int) -> bool:
    """Whether a leaf of `shape` is sent as rank-`rank` factors: a matrix whose factors are smaller."""
    if len(shape) < 2:
        return False
    n, m = shape[0], int(np.prod(shape[1:]))
    return rank * (n + m) < n * m


def powersgd(strategy: Allreduce, rank: int = 1) -> Allreduce:
    """Wraps `strategy` as rank-`rank` PowerSGD with error feedback: a stateful strategy.

    One device's state is {"error": (E, ...), "q": (Q, ...)}, one entry per compressed leaf in
    `jax.tree.leaves` order: E (n×m) what compression left out of this device's gradient so far,
    Q (m×r) the last step's summed Q, the warm start of this step's power iteration (one step of
    subspace iteration per training step, as in the paper).

    Per device i, for each compressed leaf: M_i = G_i + E_i; P = Σ_i M_i·Q (allreduced, with the
    uncompressed leaves in the same call); P̂ = an orthonormal basis of P's columns (QR);
    Q = Σ_i M_iᵀ·P̂ (allreduced); the sum is P̂·Qᵀ = P̂P̂ᵀ·ΣM_i, exact when rank ≥ rank(ΣM_i);
    E_i ← M_i − P̂·(M_iᵀP̂)ᵀ, so Σ_i E_i is exactly what the sum left out.

    Args:
      strategy: allreduces P, Q and the uncompressed leaves (any strategy, fused or not).
      rank: r, the number of columns of P and Q.

    Raises:
      ConfigError: if `rank` is not positive.
    """
    check_positive("powersgd_rank", rank)

    def init(key: jax.Array, grads: PyTree) -> PyTree:
        big = [x for x in jax.tree.leaves(grads) if compressible(x.shape, rank)]
        keys = jax.random.split(key, max(len(big), 1))
        return {"error": tuple(jnp.zeros(_matrix(x.shape), x.dtype) for x in big),
                "q": tuple(jax.random.normal(k, (_matrix(x.shape)[1], rank), x.dtype) for k, x in zip(keys, big))}

    def step(tree: PyTree, state: PyTree, *axis: str) -> tuple[PyTree, PyTree]:
        return _powersgd_step(tree, state, rank, lambda t: strategy.fn(t, *axis), strategy)

    return strategy.wrapped(f"{strategy.name}+powersgd{rank}", step, init=init,
                            payload=partial(_handed, partial(powersgd, rank=rank)))


def _powersgd_step(tree: PyTree, state: PyTree, rank: int, reduce: Callable[[PyTree], PyTree],
                   strategy: Allreduce) -> tuple[PyTree, PyTree]:
    """One PowerSGD allreduce: two calls of `reduce`, the math between them per device (`strategy.local`,
    on arrays with `strategy.lead` device axes)."""
    local, lead = strategy.local, strategy.lead
    leaves, treedef = jax.tree.flatten(tree)
    big = [i for i, x in enumerate(leaves) if compressible(x.shape[lead:], rank)]
    small = [leaves[i] for i in range(len(leaves)) if i not in big]
    ms, ps = local(_project)(tuple(leaves[i] for i in big), state["error"], state["q"])
    ps, small = reduce((ps, small))  # ΣP and the uncompressed leaves, in one call
    p_hats, qs = local(_back_project)(ms, ps)
    q_sums = reduce(qs)  # ΣQ
    sums, errors = local(_decompress)(ms, p_hats, qs, q_sums)
    out = dict(zip(big, sums)) | dict(zip([i for i in range(len(leaves)) if i not in big], small))
    leaves = [out[i].reshape(x.shape) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, leaves), {"error": errors, "q": q_sums}


def _project(grads, errors, qs):
    """M = G + E (as matrices), and this device's P = M·Q."""
    ms = tuple(g.reshape(e.shape) + e for g, e in zip(grads, errors))
    return ms, tuple(m @ q for m, q in zip(ms, qs))


def _back_project(ms, p_sums):
    """P̂ = orthonormal columns spanning ΣP (the same on every device), and this device's Q = Mᵀ·P̂."""
    p_hats = tuple(jnp.linalg.qr(p)[0] for p in p_sums)
    return p_hats, tuple(m.T @ p for m, p in zip(ms, p_hats))


def _decompress(ms, p_hats, qs, q_sums):
    """The sum P̂·(ΣQ)ᵀ, and the new error M − P̂·Qᵀ: what this device's share of the sum left out."""
    return (tuple(p @ q.T for p, q in zip(p_hats, q_sums)),
            tuple(m - p @ q.T for m, p, q in zip(ms, p_hats, qs)))


def _matrix(shape: Sequence[int]) -> tuple[int, int]:
    return shape[0], int(np.prod(shape[1:]))


# --- choosing and measuring ------------------------------------------------------------------


def check_mode(compress: str, rank: int | None) -> None:
    """Raises ConfigError for an unknown mode, or a rank given to a mode other than `powersgd`."""
    if compress not in MODES:
        raise ConfigError(Arg("compress", compress), f" is not a mode; choose one of: {', '.join(MODES)}.")
    if compress != "powersgd" and rank is not None:
        raise ConfigError(Arg("powersgd_rank", rank), " applies to ", Arg("compress", "powersgd"), " only; add ",
                          Arg("compress", "powersgd"), " or drop ", Arg("powersgd_rank"), ".")


def compressed(strategy: Allreduce, compress: str, rank: int | None = None) -> Allreduce:
    """`strategy` wrapped by the cast or PowerSGD of mode `compress` (`none` and the `-wire` modes, which
    the strategy's own `wire` serves before fusion, leave it as it is); `rank` is PowerSGD's (None: 1)."""
    check_mode(compress, rank)
    if compress == "powersgd":
        return powersgd(strategy, 1 if rank is None else rank)
    if compress in DTYPES:
        return low_precision(strategy, DTYPES[compress])
    return strategy


def __getattr__(name: str) -> Any:
    if name == "get":  # removed after 0.1.0; see docs/api.md
        raise AttributeError("`jdp.parallel.compress.get` is now `jdp.get_allreduce(name, fuse=..., bucket_mb=..., "
                             "compress=..., rank=...)`, the one lookup of a strategy.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def payload_bytes(grads: PyTree, strategy: Allreduce) -> int:
    """Bytes one device hands to the allreduce per step with `strategy`: its `payload` of `grads` (a
    gradient-shaped tree of arrays or `jax.ShapeDtypeStruct`s, one device's), else `grads`. How many times an
    algorithm moves those bytes is its own (ring: 2(k−1)/k of them). A `-wire` strategy sends the float32
    buffer's chunks in its low dtype, so it counts as its cast."""
    if isinstance(strategy, str):  # moved after 0.1.0; see docs/api.md
        raise TypeError("`payload_bytes(grads, compress, rank)` is now `payload_bytes(grads, strategy)`, e.g. "
                        "`jdp.get_allreduce(name, compress=..., rank=...)`: the strategy knows its payload.")
    sent = grads if strategy.payload is None else strategy.payload(grads)
    return sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(sent))


def _handed(wrapper: Callable[[Allreduce], Allreduce], grads: PyTree) -> list[jax.ShapeDtypeStruct]:
    """What `wrapper` hands the strategy it wraps for `grads`: traced (`jax.eval_shape`, nothing runs) around a
    strategy that records what it is given."""
    sent: list[Any] = []

    def record(tree, axis_name):
        sent.extend(jax.tree.leaves(tree))
        return tree

    strategy = wrapper(Allreduce("record", record))
    if not strategy.stateful:
        jax.eval_shape(lambda g: strategy.fn(g, "unused"), grads)
    else:
        jax.eval_shape(lambda g, s: strategy.fn(g, s, "unused"), grads, strategy.init(jax.random.key(0), grads))
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sent]
