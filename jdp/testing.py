"""The checks every allreduce strategy passes, for testing your own before you register it.

    import jax
    import jdp
    from jdp.testing import check_allreduce

    def gather_then_sum(tree, axis_name):
        return jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name).sum(0), tree)

    strategy = jdp.Allreduce("gather_sum", gather_then_sum)
    check_allreduce(strategy)          # raises AssertionError naming the first failing case
    jdp.register_allreduce(strategy)   # now `jdp train --allreduce gather_sum`

On a machine without accelerators, simulate devices first (`jdp.simulate_cpu_devices(8)`).
"""

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp import models
from jdp.errors import ConfigError
from jdp.parallel import collectives
from jdp.parallel import strategy as strategy_lib
from jdp.parallel.layout import map_over_devices, replicate, sharded, split_batch
from jdp.parallel.opt_state import init_sharded
from jdp.parallel.step import make_sharded_step, make_train_step
from jdp.parallel.strategy import Allreduce
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

__all__ = ["check_allreduce"]


MAX_DEFAULT_DEVICES = 8  # the default device counts are 1..min(8, local devices)
SGD_IMAGES_PER_DEVICE = 4
SGD_LEARNING_RATE = 0.2  # the lesson's
SGD_RTOL, SGD_ATOL = 1e-5, 1e-6  # params vs psum's after each step: only the order of the additions differs

_PSUM = Allreduce("psum", collectives.psum)  # the reference, whatever the registry holds under "psum"
HALVES_SLICES = (1, 5)  # c: reduce-scatter buffers of k·c elements


def check_allreduce(
    strategy: Allreduce,
    device_counts: Sequence[int] | None = None,
    *,
    seed: int = 0,
    sgd_steps: int = 3,
) -> None:
    """Checks that `strategy` allreduces like the built-in ones, on every device count.

    `jdp.make_train_step` trusts its strategy to be the one sum of the gradients over the devices,
    and to leave every device with exactly the same bits: a strategy that is slightly off, or
    rounds differently on one device, trains replicas that silently drift apart. This runs the
    checks every built-in strategy (each of `jdp.allreduce_names()`, and their `fused` forms)
    passes, so that a new one can be trusted the same way:

    1. For each device count k (ascending), on a random pytree of float32 and bfloat16 leaves
       (nested dicts, lists and tuples; scalars, size-0 leaves, sizes that k does not divide),
       the result has the input's structure, shapes and dtypes; every device holds bit-identical
       values; and those are the sum over the devices within rounding: compared with the exact
       sum (float64, on the host), |error| ≤ (k−1)·eps·Σ|x_i| elementwise, eps the dtype's
       machine epsilon (`jnp.finfo`: 2^-23 for float32, 2^-7 for bfloat16). That is twice the
       unit roundoff u, so it bounds the rounding of k−1 additions in any order (Higham's
       γ_{k−1} = (k−1)u/(1−(k−1)u)), and of adding in a wider dtype and rounding once.
    2. If it has halves (`reduce_scatter`, `all_gather`), for each k on flat float32 and bfloat16
       buffers of k·c elements: device i's reduce-scatter result is the sum of slice i within the
       same bound, and the all-gather of those slices leaves every device with exactly the slices,
       in device order: reduce-scatter then all-gather is an allreduce, bit-identical on every device.
    3. At the largest device count, `sgd_steps` SGD steps of the lesson's LeNet
       (`jdp.get_model("lenet")`) on synthetic batches of 4 images per device, through
       `jdp.make_train_step` (pmap backend): after every step the params are
       bit-identical on every device and equal to those of the same steps with psum (rtol 1e-5,
       atol 1e-6); for a strategy with halves, the same again with the optimizer sharded
       (`shard_optimizer=True`).

    An "inside" strategy is mapped over the devices as the train step maps it (`jdp.map_over_devices`,
    pmap backend, axis `jdp.AXIS`); an "outside" one is called on
    global arrays of shape (k, ...) with slice i on device i, and must return them laid out the
    same way. Device count k uses the first k of this process's devices. An "inside" strategy
    compiles once per device count, and checking the same `fn` again reuses the compilations.

    Args:
      strategy: the strategy to check, e.g. `jdp.Allreduce("mine", fn)` or `jdp.fused(...)`.
      device_counts: the numbers of devices to check on (checked in ascending order); None means
        every count 1, 2, ..., min(8, this process's devices).
      seed: seeds the random pytrees, the SGD batches and the LeNet params.
      sgd_steps: train steps to compare with psum; 0 skips the training check (it compiles a
        LeNet train step, seconds on a CPU).

    Raises:
      AssertionError: naming the first failing case: strategy, device count, leaf (dtype, path,
        shape) or train step, and what was wrong. An exception raised by the strategy itself is
        reported the same way (chained).
      TypeError: if `strategy` is not an `Allreduce`, or its `fn` is not callable.
      ConfigError: if its `where` is unknown, it has one half only, a device count is not between 1
        and the number of devices, or `sgd_steps` is negative.
    """
    _check_strategy(strategy)
    devices = sorted(jax.local_devices(), key=lambda d: d.id)
    counts = _device_counts(device_counts, len(devices))
    if isinstance(sgd_steps, bool) or not isinstance(sgd_steps, int) or sgd_steps < 0:
        raise ConfigError(f"`sgd_steps` must be a non-negative integer, got {sgd_steps!r}.")
    for k in counts:
        _check_sums(strategy, tuple(devices[:k]), np.random.default_rng([seed, k]))
        if strategy.has_halves:
            _check_halves(strategy, tuple(devices[:k]), np.random.default_rng([seed, k, 1]))
    if sgd_steps:
        _check_training(strategy, tuple(devices[: counts[-1]]), sgd_steps, seed)
        if strategy.has_halves and not strategy.stateful:
            _check_training(strategy, tuple(devices[: counts[-1]]), sgd_steps, seed, shard_optimizer=True)


def _check_strategy(strategy: Any) -> None:
    if not isinstance(strategy, Allreduce):
        hint = " (look one up with `jdp.get_allreduce(name)`)" if isinstance(strategy, str) else ""
        raise TypeError(f"`check_allreduce` takes a `jdp.Allreduce`, got {type(strategy).__name__}{hint}.")
    if not callable(strategy.fn):
        raise TypeError(f"Allreduce `{strategy.name}` has a `fn` that is not callable: {strategy.fn!r}.")
    strategy_lib.check(strategy)


def _device_counts(device_counts: Sequence[int] | None, available: int) -> list[int]:
    if device_counts is None:
        return list(range(1, min(MAX_DEFAULT_DEVICES, available) + 1))
    counts = list(device_counts)
    bad = [k for k in counts if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= available]
    if not counts or bad:
        raise ConfigError(
            f"`device_counts` must be integers between 1 and the {available} devices of this process, got "
            f"{tuple(counts)}. On a CPU, simulate more with `jdp.simulate_cpu_devices(n)` before JAX starts."
        )
    return sorted({int(k) for k in counts})


# --- 1. the sum, bit-identical on every device, on random pytrees ----------------------------


def _random_tree(rng: np.random.Generator, k: int) -> PyTree:
    """Host leaves of shape (k, ...): nested containers, two dtypes, awkward sizes.

    Values are normal times powers of two in [2^-6, 2^6], so that elements of very different
    magnitude are added (a strategy that loses the small ones, or rounds through a narrower
    dtype, is caught).
    """

    def leaf(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        size = (k, *shape)
        return (rng.standard_normal(size) * np.exp2(rng.integers(-6, 7, size))).astype(dtype)

    f32, bf16 = np.float32, jnp.bfloat16
    return {
        "scalar": leaf((), f32),
        "layers": [{"w": leaf((2, 5), f32), "b": leaf((7,), f32)}, {"w": leaf((13,), bf16), "b": leaf((), bf16)}],
        "edge": (leaf((1,), f32), leaf((0,), f32), leaf((3, 0), bf16)),
    }


@lru_cache(maxsize=64)
def _mapped(fn: Any, devices: tuple[jax.Device, ...]) -> Any:
    """An "inside" function `fn(x, axis_name)` mapped over `devices` as the train step maps it (pmap), one
    per (fn, devices), so its compilations are reused."""
    mapped = map_over_devices(lambda tree: (fn(tree, AXIS),), devices, "pmap", ("per_device",), ("per_device",))
    return lambda tree: mapped(tree)[0]


def _run(strategy: Allreduce, fn: Any, tree: PyTree, devices: tuple[jax.Device, ...]) -> PyTree:
    """`fn` (the strategy's sum or one of its halves) on host leaves (k, ...), row i placed on device i."""
    placed = jax.tree.map(lambda leaf: jax.device_put(leaf, sharded(devices)), tree)
    return _mapped(fn, devices)(placed) if strategy.inside else fn(placed)


def _apply(strategy: Allreduce, tree: PyTree, devices: tuple[jax.Device, ...]) -> PyTree:
    return _run(strategy, strategy.fn, tree, devices)


def _check_sums(strategy: Allreduce, devices: tuple[jax.Device, ...], rng: np.random.Generator) -> None:
    k = len(devices)
    tree = _random_tree(rng, k)
    try:
        out = jax.block_until_ready(_apply(strategy, tree, devices))
    except Exception as error:  # find the first leaf it fails on, then report it as a failed check
        raise AssertionError(_raised(strategy, tree, devices, error)) from error
    paths, treedef = jax.tree.flatten_with_path(tree)
    if jax.tree.structure(out) != treedef:
        raise AssertionError(
            f"`{strategy.name}` on {_n(k)}: returned a tree of structure {jax.tree.structure(out)}, "
            f"not its input's {treedef}."
        )
    for (path, x), got in zip(paths, jax.tree.leaves(out), strict=True):
        _check_leaf(strategy, devices, path, x, got)


def _raised(strategy: Allreduce, tree: PyTree, devices: tuple[jax.Device, ...], error: Exception) -> str:
    """The message for a strategy that raised: on which leaf alone it raises, if on one."""
    for path, x in jax.tree.flatten_with_path(tree)[0]:
        try:
            jax.block_until_ready(_apply(strategy, [x], devices))
        except Exception as leaf_error:  # noqa: BLE001 - any exception is the strategy's failure
            error = leaf_error
            where = _leaf(strategy, len(devices), path, x)
            break
    else:
        where = f"`{strategy.name}` on {_n(len(devices))}, on the whole tree (every leaf alone passes)"
    calls = "fn(tree, axis_name) under `jax.pmap`" if strategy.inside else "fn(tree) on (k, ...) arrays"
    hint = f" (an \"{strategy.where}\" strategy is called as {calls})" if isinstance(error, TypeError) else ""
    return f"{where}: raised {type(error).__name__}: {error}{hint}"


def _check_leaf(strategy: Allreduce, devices: tuple[jax.Device, ...], path: Any, x: np.ndarray, got: Any) -> None:
    k = len(devices)
    where = _leaf(strategy, k, path, x)
    if not isinstance(got, jax.Array):
        raise AssertionError(f"{where}: returned a {type(got).__name__}, not a `jax.Array` over the devices.")
    if got.shape != x.shape or got.dtype != x.dtype:
        raise AssertionError(
            f"{where}: returned {got.dtype} of shape {_shape(got.shape[1:])} (with the device axis {got.shape}); "
            "an allreduce must preserve shapes and dtypes."
        )
    rows = _held(got, devices, where)
    _check_identical(rows, where)
    _check_sum(rows[0], x, where)


def _check_identical(rows: list[np.ndarray], where: str) -> None:
    """Every device holds exactly the bits that device 0 holds (NaN included)."""
    first = _bits(rows[0])
    for j, row in enumerate(rows[1:], start=1):
        differ = _bits(row) != first
        if differ.any():
            index = _first(differ)
            raise AssertionError(
                f"{where}: device {j} holds a value that differs from device 0 (first at index {index}: "
                f"{_fmt(row[index])} vs {_fmt(rows[0][index])}, {int(differ.sum())} of {differ.size} elements differ); "
                "every device must hold the same bits, or the replicas drift apart."
            )


def _check_sum(got: np.ndarray, x: np.ndarray, where: str) -> None:
    """`got` is the sum of `x` over its leading (device) axis within (k−1)·eps·Σ|x_i|."""
    k = x.shape[0]
    terms = np.asarray(x, np.float64)
    exact = terms.sum(axis=0)
    finfo = jnp.finfo(x.dtype)
    bound = (k - 1) * float(finfo.eps) * np.abs(terms).sum(axis=0) + float(finfo.tiny)
    result = np.asarray(got, np.float64)
    error = np.abs(result - exact)
    wrong = ~(error <= bound)  # NaN is wrong too
    if wrong.any():
        index = _first(wrong)
        raise AssertionError(
            f"{where}: device 0's result is not the sum over the devices: at index {index} it is "
            f"{_fmt(result[index])}, the exact sum is {_fmt(exact[index])} (error {error[index]:.3g} > bound "
            f"{bound[index]:.3g} = (k−1)·eps·Σ|x_i|; {int(wrong.sum())} of {wrong.size} elements wrong)"
            f"{_diagnose(result, terms, bound)}."
        )


def _diagnose(result: np.ndarray, terms: np.ndarray, bound: np.ndarray) -> str:
    """A guess at what was computed instead of the sum, if it is a common mistake."""
    k, exact = terms.shape[0], terms.sum(axis=0)

    def close(value: np.ndarray) -> bool:
        return bool(np.all(np.abs(result - value) <= bound + np.abs(value) * 2.0**-7))

    if k > 1 and close(exact / k):
        return "; it looks like the mean over the devices, not the sum"
    for j in range(k):
        if close(exact - terms[j]):
            return f"; it looks like the sum without device {j}'s contribution"
    for j in range(k):
        if k > 1 and close(terms[j]):
            return f"; it looks like device {j}'s own value, not reduced"
    if close(np.zeros_like(exact)):
        return "; it is zero"
    return ""


def _held(leaf: jax.Array, devices: tuple[jax.Device, ...], where: str) -> list[np.ndarray]:
    """Slice i of a (k, ...) array as device i holds it, for each i."""
    rows = []
    for i, device in enumerate(devices):
        for shard in leaf.addressable_shards:
            if shard.device != device:
                continue
            index = shard.index[0] if shard.index else slice(None)
            data = np.asarray(shard.data)
            if isinstance(index, int):  # a pmap-style shard: one slice, without its axis
                if index == i:
                    rows.append(data)
                    break
                continue
            start, stop, _ = index.indices(leaf.shape[0])
            if start <= i < stop:
                rows.append(data[i - start])
                break
        else:
            held = sorted({str(s.device) for s in leaf.addressable_shards})
            raise AssertionError(
                f"{where}: device {i} ({device}) does not hold slice {i} of the result (it lives on "
                f"{', '.join(held)}); an \"outside\" strategy must return arrays laid out like its input, "
                "slice i on device i."
            )
    return rows


def _check_halves(strategy: Allreduce, devices: tuple[jax.Device, ...], rng: np.random.Generator) -> None:
    """Reduce-scatter then all-gather, on flat buffers: each slice summed, then every slice everywhere, in order."""
    k = len(devices)
    for dtype in (np.float32, jnp.bfloat16):
        for c in HALVES_SLICES:
            x = (rng.standard_normal((k, k * c)) * np.exp2(rng.integers(-6, 7, (k, k * c)))).astype(dtype)
            where = f"`{strategy.name}`'s halves on {_n(k)}, {np.dtype(dtype).name} buffer of {k * c} elements"
            try:
                mine = jax.block_until_ready(_run(strategy, strategy.reduce_scatter, x, devices))
                whole = jax.block_until_ready(_run(strategy, strategy.all_gather, mine, devices))
            except Exception as error:
                raise AssertionError(f"{where}: raised {type(error).__name__}: {error}") from error
            for got, shape, half in ((mine, (k, c), "reduce_scatter"), (whole, (k, k * c), "all_gather")):
                if not isinstance(got, jax.Array) or got.shape != shape or got.dtype != x.dtype:
                    raise AssertionError(
                        f"{where}: `{half}` returned {getattr(got, 'dtype', type(got).__name__)} of shape "
                        f"{getattr(got, 'shape', '?')}, not {np.dtype(dtype).name} of shape {shape} "
                        "(with the device axis)."
                    )
            slices = _held(mine, devices, f"{where}, `reduce_scatter`")
            for i, row in enumerate(slices):
                _check_sum(row, x[:, i * c:(i + 1) * c], f"{where}: `reduce_scatter`'s slice {i} on device {i}")
            rows = _held(whole, devices, f"{where}, `all_gather`")
            _check_identical(rows, f"{where}: `all_gather`")
            differ = _bits(rows[0]) != _bits(np.concatenate(slices))
            if differ.any():
                index = _first(differ)
                raise AssertionError(
                    f"{where}: `all_gather` does not return every device's slice in device order (first at index "
                    f"{index}: {_fmt(rows[0][index])}, device {index[0] // c}'s slice holds "
                    f"{_fmt(np.concatenate(slices)[index])}), so reduce-scatter then all-gather is not the allreduce."
                )


def _leaf(strategy: Allreduce, k: int, path: Any, x: np.ndarray) -> str:
    dtype, name = np.dtype(x.dtype).name, jax.tree_util.keystr(path)
    return f"`{strategy.name}` on {_n(k)}, {dtype} leaf {name} shape {_shape(x.shape[1:])}"


def _n(k: int) -> str:
    return f"{k} device" + ("s" if k != 1 else "")


def _shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def _fmt(value: Any) -> str:
    return f"{float(value):.9g}"


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


# --- 2. a few train steps of LeNet, against psum ---------------------------------------------


Trajectory = list[list[tuple[str, np.ndarray]]]  # after each step: (param path, device 0's value) per leaf


def _check_training(strategy: Allreduce, devices: tuple[jax.Device, ...], steps: int, seed: int,
                    shard_optimizer: bool = False) -> None:
    reference = _psum_trajectory(devices, steps, seed)
    same = strategy == _PSUM and not shard_optimizer
    got = reference if same else _trajectory(strategy, devices, steps, seed, shard_optimizer)
    for step, (params, want) in enumerate(zip(got, reference, strict=True), start=1):
        for (name, p), (_, w) in zip(params, want, strict=True):
            p64, w64 = p.astype(np.float64), w.astype(np.float64)
            wrong = ~(np.abs(p64 - w64) <= SGD_ATOL + SGD_RTOL * np.abs(w64))
            if wrong.any():
                index = _first(wrong)
                raise AssertionError(
                    f"{_training(strategy, devices, step, shard_optimizer)}: param {name} differs from psum's "
                    f"(first at index {index}: {_fmt(p[index])} vs {_fmt(w[index])}, {int(wrong.sum())} of "
                    f"{wrong.size} elements; "
                    f"rtol {SGD_RTOL:g}, atol {SGD_ATOL:g})."
                )


@lru_cache(maxsize=8)
def _psum_trajectory(devices: tuple[jax.Device, ...], steps: int, seed: int) -> Trajectory:
    return _trajectory(_PSUM, devices, steps, seed)


def _trajectory(strategy: Allreduce, devices: tuple[jax.Device, ...], steps: int, seed: int,
                shard_optimizer: bool = False) -> Trajectory:
    """Device 0's params (flat leaves) after each step, checking the replicas are identical."""
    model = models.get("lenet")
    k = len(devices)
    optimizer = optax.sgd(SGD_LEARNING_RATE)
    params = model.init(jax.random.key(seed))
    rng = np.random.default_rng([seed, k, steps])
    batch = SGD_IMAGES_PER_DEVICE * k
    trajectory = []
    try:
        make = make_sharded_step if shard_optimizer else make_train_step
        step = make(model.loss, optimizer, strategy, list(devices))
        p = replicate(params, devices)
        if shard_optimizer:
            s = init_sharded(optimizer, params, list(devices))
        else:
            s = replicate(optimizer.init(params), devices)
        for number in range(1, steps + 1):
            images = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32)
            labels = rng.integers(0, 10, batch).astype(np.int32)
            p, s, _ = jax.block_until_ready(step(p, s, *split_batch(images, labels, devices)))
            leaves = []
            for path, leaf in jax.tree.flatten_with_path(p)[0]:
                name = jax.tree_util.keystr(path)
                where = f"{_training(strategy, devices, number, shard_optimizer)}: param {name}"
                rows = _held(leaf, devices, where)
                _check_identical(rows, where)
                leaves.append((name, rows[0]))
            trajectory.append(leaves)
    except AssertionError:
        raise
    except Exception as error:
        how = ", shard_optimizer=True" if shard_optimizer else ""
        raise AssertionError(
            f"`{strategy.name}` on {_n(k)}, in `jdp.make_train_step` (LeNet, batch {batch}{how}): raised "
            f"{type(error).__name__}: {error}"
        ) from error
    return trajectory


def _training(strategy: Allreduce, devices: tuple[jax.Device, ...], step: int, shard_optimizer: bool = False) -> str:
    k = len(devices)
    how = "SGD sharded over the devices" if shard_optimizer else "SGD"
    return f"`{strategy.name}` on {_n(k)}, {how} on LeNet (batch {SGD_IMAGES_PER_DEVICE * k}), after step {step}"
