"""The one epoch runner: it feeds the train step an epoch of batches, from one of two feeders.

The lesson's loop copies every batch from the host and waits on Python between steps. Here, when
the training set fits, one copy of it lives on every device for the whole run (Fashion-MNIST is
188 MB as float32); each epoch the permutation is drawn ON the devices from the epoch's key, and
each step every device gathers its own rows of the batch from its copy. Nothing crosses host →
device per step; the only host syncs are the bounded in-flight window (`jdp.parallel.inflight`). With
`steps_per_call` S > 1 one compiled call runs S steps, so Python dispatches once per S steps. On a
CPU the S steps are unrolled in the program: XLA's CPU backend runs the convolutions inside a while
loop many times slower than outside one (docs/performance.md). Elsewhere (a GPU) they are a
`lax.scan`, whose compile time does not grow with S. Each call also folds its losses and a finite
check into the run's tally on the devices (`jdp.parallel.tally`), in the same compiled call where it can:
nothing is read back per step.

When the set does not fit, or the step is mapped with `shard_map` or spans several processes,
batches are copied from the host one call ahead of the call that uses them (double buffering):
each process copies only its rows of every batch (`jdp.parallel.layout.process_rows`).

Both paths visit exactly the batches of `epoch_batches`: the same permutation in the same order,
the last partial batch dropped, device i receiving rows [i·B/k, (i+1)·B/k) of each batch.
"""

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.data import Split
from jdp.errors import Arg, ConfigError, check_positive
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import (
    Backend,
    Kinds,
    map_over_devices,
    place_step_batches,
    process_rows,
    replicate,
    split_batch,
    to_host,
)
from jdp.parallel.step import TrainStep
from jdp.parallel.tally import Fold, Tally, make_fold
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

AUTO = "auto"  # steps_per_call chosen from the measured time of a step (`auto_steps_per_call`)
CALL_SECONDS = 4e-3  # auto: calls of about this long keep the per-call work a few percent of the time
MAX_AUTO_STEPS = 16  # auto: at most this many steps per call (an unrolled call compiles in time ∝ its steps)

Carry = tuple[PyTree, PyTree, Tally]  # (params, opt_state, tally) on the devices
Progress = Callable[[Iterable, int], Iterable]
# after_call(steps, carry): called after each compiled call of `steps` steps is dispatched (guards, checkpoints)
AfterCall = Callable[[int, Carry], None]
# run_epoch(carry, key, progress, start=0, after_call=None, steps_per_call=None) -> (carry, losses): losses the
# per-device losses of each call, (k,) or (k, S), still on the devices
EpochRunner = Callable[..., tuple[Carry, list[jax.Array]]]


def epoch_batches(
    split: Split, batch_size: int, key: jax.Array, skip: int = 0, rows: slice = slice(None)
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of a fresh permutation (the last partial batch is dropped: shapes stay static).

    The first `skip` batches are left out (a run resumed mid-epoch has trained on them). Only the
    `rows` of each batch are gathered (a process's share, `process_rows`); the permutation drawn
    from `key` is the same on every process.
    The permutation is drawn and read here, before the first batch is asked for (outside the loop's steps).
    """
    order = np.asarray(jax.random.permutation(key, len(split.labels)))

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(skip * batch_size, len(order) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size][rows]
            yield split.images[idx], split.labels[idx]

    return batches()


def fits_on_devices(split: Split, devices: Sequence[jax.Device], fraction: float = 0.25) -> bool:
    """Whether one copy of `split` per device takes at most `fraction` of the memory it would use.

    Simulated CPU devices share the host's RAM, so there the copies of all local devices count
    against it; an accelerator's copy counts against its own memory.
    """
    per_device = split.images.nbytes + split.labels.nbytes
    local = [d for d in devices if d.process_index == jax.process_index()]
    if local[0].platform == "cpu":
        return per_device * len(local) <= fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = (local[0].memory_stats() or {}).get("bytes_limit")
    return limit is not None and per_device <= fraction * limit


def auto_steps_per_call(step_seconds: float, most: int = MAX_AUTO_STEPS) -> int:
    """Steps per call for steps of `step_seconds` each: the power of 2 that makes a call last about CALL_SECONDS,
    at most `most`. A step of a few milliseconds (the LeNet on a CPU) keeps 1: nothing to amortise."""
    steps = 1
    while 2 * steps <= min(most, MAX_AUTO_STEPS) and 2 * steps * step_seconds <= CALL_SECONDS:
        steps *= 2
    return steps


def timed_calls(after_call: AfterCall, paced: list[tuple[float, int]]) -> AfterCall:
    """`after_call`, also noting in `paced` when each call's dispatch returned and how many steps it ran."""

    def timed(steps: int, carry: tuple) -> None:
        after_call(steps, carry)
        paced.append((time.perf_counter(), steps))

    return timed


def steady_step_seconds(paced: list[tuple[float, int]], skipped: int = 2, least: int = 8) -> float:
    """Seconds per step of an epoch's calls after the first `skipped` (they compile), from `paced` (`timed_calls`):
    at most 2 calls are in flight, so dispatches return at the pace the devices finish them. Infinite with
    fewer than `least` calls to time."""
    if len(paced) < skipped + least:
        return float("inf")
    (first, _), (last, _) = paced[skipped - 1], paced[-1]
    return (last - first) / sum(steps for _, steps in paced[skipped:])


def step_losses(losses: list[jax.Array]) -> np.ndarray:
    """The summed loss of each step, from the per-device losses of each call ((k,) or (k, S)): one read."""
    if not losses:
        return np.zeros(0, np.float32)
    return to_host(jnp.concatenate([loss.reshape(len(loss), -1) for loss in losses], axis=1)).sum(axis=0)


def several_steps_per_call(traceable: bool, backend: Backend) -> bool:
    """Whether a call may run several steps: a step traceable inside `jax.jit`, mapped by `pmap`, in one process."""
    return traceable and _single_pmap(backend)


def _single_pmap(backend: Backend) -> bool:
    return backend == "pmap" and jax.process_count() == 1


class CallPlan(NamedTuple):
    """How an epoch's steps become compiled calls, and where their batches come from.

    Attributes:
      steps_per_call: steps per compiled call; > 1 needs `traceable`, `pmap` and one process.
      traceable: whether the step can be traced inside `jax.jit` (a collective allreduce strategy);
        otherwise every step is its own call.
      resident: keep the training set on the devices (`pmap` in one process only); None: if it
        `fits_on_devices` there, else copy batches from the host.
    """

    steps_per_call: int = 1
    traceable: bool = True
    resident: bool | None = None


def make_epoch_runner(step: TrainStep, split: Split, devices: Sequence[jax.Device], batch_size: int,
                      backend: Backend = "pmap", *, plan: CallPlan = CallPlan(),
                      params_kind: Kinds = "replicated") -> EpochRunner:
    """Builds `run_epoch(state, key, progress)`, which trains one epoch over `split`.

    Args:
      step: the train step of `jdp.make_train_step` for `backend`.
      split: the training images and labels, on the host (every process holds all of them).
      devices: the devices of the step, in its order (of one process or several).
      batch_size: the global batch B, a multiple of len(devices).
      backend: the step's layout, "pmap" or "shard_map".
      plan: how the steps become calls (`CallPlan`: steps per call, traceable, resident data).
      params_kind: the layout kind of the params the step returns ("per_device" for a local sync mode).

    Returns:
      run_epoch(carry, key, progress, start=0, after_call=None) -> (carry, losses). `carry` is
      (params, opt_state, tally); params and opt_state are donated. `key` draws the epoch's permutation;
      `progress(iterable, total)` wraps the calls (e.g. a progress bar). The epoch starts at batch `start`;
      `after_call(steps, carry)` is called after each call's dispatch; `steps_per_call` overrides the
      plan's for this epoch (how the steps are grouped into calls does not change what they compute).
      `losses`: each call's per-device losses on the devices, (k,) or (k, S); the tally holds their sums.

    Raises:
      ConfigError: for settings the feeders cannot run (named by their flags).
    """
    traceable, resident = plan.traceable, plan.resident
    single_pmap = _single_pmap(backend)
    if resident and not single_pmap:
        raise ConfigError("Data resident on the devices needs ", Arg("backend", "pmap"), " in a single process.")
    steps = len(split.labels) // batch_size

    def calls(start: int, steps_per_call: int | None) -> tuple[int, list[int]]:
        """The steps per call (`steps_per_call`, None: the plan's), and the steps of each call of an epoch from
        batch `start`: that many each, then what is left."""
        per_call = _checked_steps_per_call(plan.steps_per_call if steps_per_call is None else steps_per_call,
                                           traceable, backend)
        left = steps - start
        return per_call, [per_call] * (left // per_call) + [left % per_call] * bool(left % per_call)

    calls(0, None)  # refuses a plan the feeders cannot run, now

    if resident is None:
        resident = single_pmap and fits_on_devices(split, devices)
    parts = Parts(step, make_fold(devices, backend, params_kind), unrolled=devices[0].platform == "cpu")
    if resident:
        return _resident_runner(parts, split, devices, batch_size, calls, traceable)
    return _host_runner(parts, split, devices, batch_size, backend, calls)


def _checked_steps_per_call(steps_per_call: int, traceable: bool, backend: Backend) -> int:
    """`steps_per_call`, or a ConfigError naming why the feeders cannot run that many steps in one call."""
    check_positive("steps_per_call", steps_per_call)
    if steps_per_call > 1 and not traceable:
        raise ConfigError(
            Arg("steps_per_call", steps_per_call), " runs several steps in one compiled call, which needs a collective "
            "allreduce strategy (traceable inside `jax.jit`). Use ", Arg("steps_per_call", 1), " or ",
            Arg("allreduce", "psum"), "."
        )
    if steps_per_call > 1 and not several_steps_per_call(traceable, backend):
        raise ConfigError(
            Arg("steps_per_call", steps_per_call), " is implemented for ", Arg("backend", "pmap"),
            " in a single process; use ", Arg("steps_per_call", 1), " with ", Arg("backend", "shard_map"),
            " or several processes."
        )
    return steps_per_call


class Parts(NamedTuple):
    """What one compiled call is made of: the train step, the tally's fold, and how S steps are repeated."""

    step: TrainStep
    fold: Fold
    unrolled: bool  # repeat S steps unrolled (CPU) or as a `lax.scan` (elsewhere)

    def one(self, carry: Carry, x: jax.Array, y: jax.Array) -> tuple[Carry, jax.Array]:
        """One step as its own call, then the fold as another (a step that cannot be traced inside `jax.jit`)."""
        params, opt_state, tally = carry
        params, opt_state, loss = self.step(params, opt_state, x, y)  # donates the params it was given
        return (params, opt_state, self.fold(tally, None, params, loss)), loss

    def steps(self, carry: Carry, xs: Any, length: int, fetch: Callable | None = None) -> tuple[Carry, jax.Array]:
        """`length` train steps and the fold, traced: over the leading axis of `xs`, or, with `fetch`,
        `fetch(t) -> (x, y, t)` from a batch index carried in `xs`. Returns the carry and the losses (k, S)."""

        def body(inner, batch):
            params, opt_state, t = inner
            if fetch is None:
                x, y = batch
            else:
                x, y, t = fetch(t)
            params, opt_state, loss = self.step(params, opt_state, x, y)
            return (params, opt_state, t), loss

        entered, opt_state, tally = carry
        t = xs if fetch is not None else None
        if self.unrolled:  # see the module docstring
            inner, losses = (entered, opt_state, t), []
            for i in range(length):
                inner, loss = body(inner, None if fetch is not None else jax.tree.map(lambda x: x[i], xs))
                losses.append(loss)
            losses = jnp.stack(losses, axis=1)
        else:
            inner, losses = lax.scan(body, (entered, opt_state, t), None if fetch is not None else xs, length=length)
            losses = jnp.moveaxis(losses, 0, 1)
        params, opt_state, t = inner
        return (params, opt_state, self.fold(tally, entered, params, losses), t), losses


def _resident_runner(parts, split, devices, batch_size, calls, traceable) -> EpochRunner:
    n, local = len(split.labels), batch_size // len(devices)
    images, labels = replicate(split.images, devices), replicate(split.labels, devices)  # once per run

    def local_order(key_data):  # the same key on every device draws the same permutation everywhere
        return jax.random.permutation(jax.random.wrap_key_data(key_data), n), jnp.zeros((), jnp.int32)

    def local_fetch(images, labels, order, t):
        """This device's rows of batch t: order[t·B + i·B/k : t·B + (i+1)·B/k]."""
        rows = lax.dynamic_slice_in_dim(order, t * batch_size + lax.axis_index(AXIS) * local, local)
        return images[rows], labels[rows], t + 1

    everywhere = ("replicated",) * 4
    p_order = map_over_devices(local_order, devices, "pmap", everywhere[:1], everywhere[:2])
    p_fetch = map_over_devices(local_fetch, devices, "pmap", everywhere, ("batch", "batch", "replicated"))

    def chunk(state, tally, images, labels, order, t, *, length):  # the tally is not donated: the guards read old ones
        (params, opt_state, tally, t), losses = parts.steps(
            (*state, tally), t, length, fetch=lambda t: p_fetch(images, labels, order, t))
        return params, opt_state, tally, t, losses

    p_chunk = jax.jit(chunk, static_argnames="length", donate_argnums=0)

    def run_epoch(carry: Carry, key: jax.Array, progress: Progress, start: int = 0,
                  after_call: AfterCall | None = None,
                  steps_per_call: int | None = None) -> tuple[Carry, list[jax.Array]]:
        order, t = p_order(replicate(jax.random.key_data(key), devices))
        position = {"t": t + start}  # the next batch's index, on the devices

        def run_call(carry, length):
            params, opt_state, tally = carry
            if traceable:
                params, opt_state, tally, position["t"], loss = p_chunk(
                    (params, opt_state), tally, images, labels, order, position["t"], length=length)
                return (params, opt_state, tally), loss
            x, y, position["t"] = p_fetch(images, labels, order, position["t"])
            return parts.one(carry, x, y)

        _, calls_left = calls(start, steps_per_call)
        return _run_calls(carry, progress(calls_left, len(calls_left)), run_call, after_call)

    return run_epoch


def _host_runner(parts, split, devices, batch_size, backend, calls) -> EpochRunner:
    k = len(devices)
    rows = process_rows(batch_size, devices)  # this process's share of every batch

    def chunk(state, tally, xs, ys):
        (params, opt_state, tally, _), losses = parts.steps((*state, tally), (xs, ys), len(xs))
        return params, opt_state, tally, losses

    p_chunk = jax.jit(chunk, donate_argnums=0)

    def placed(key: jax.Array, start: int, lengths: list[int],
               chunked: bool) -> Iterator[tuple[int, jax.Array, jax.Array]]:
        batches = epoch_batches(split, batch_size, key, skip=start, rows=rows)

        def calls_of_batches() -> Iterator[tuple[int, jax.Array, jax.Array]]:
            for length in lengths:
                group = [next(batches) for _ in range(length)]
                if not chunked:
                    yield 1, *split_batch(*group[0], devices, backend)
                    continue
                xs = np.stack([x for x, _ in group]).reshape(length, k, batch_size // k, *split.images.shape[1:])
                ys = np.stack([y for _, y in group]).reshape(length, k, batch_size // k)
                yield length, place_step_batches(xs, devices), place_step_batches(ys, devices)

        return calls_of_batches()

    def run_epoch(carry: Carry, key: jax.Array, progress: Progress, start: int = 0,
                  after_call: AfterCall | None = None,
                  steps_per_call: int | None = None) -> tuple[Carry, list[jax.Array]]:
        per_call, lengths = calls(start, steps_per_call)
        chunked = per_call > 1

        def run_call(carry, call):
            _, xs, ys = call
            if not chunked:
                return parts.one(carry, xs, ys)
            params, opt_state, tally = carry
            *carry, loss = p_chunk((params, opt_state), tally, xs, ys)
            return tuple(carry), loss

        work = progress(_one_ahead(placed(key, start, lengths, chunked)), len(lengths))
        return _run_calls(carry, work, run_call, after_call, steps=lambda call: call[0])

    return run_epoch


def _run_calls(carry: Carry, work: Iterable[Any], run_call: Callable[[Carry, Any], tuple[Carry, jax.Array]],
               after_call: AfterCall | None, steps: Callable[[Any], int] = lambda length: length
               ) -> tuple[Carry, list[jax.Array]]:
    """The loop both runners share: one compiled call per item of `work`, at most 2 in flight, nothing read back.

    `run_call(carry, item) -> (carry, losses)`; `steps(item)`: how many steps it ran.
    """
    window, losses = InFlight(limit=2), []
    for item in work:
        carry, loss = run_call(carry, item)
        window.push(loss)
        losses.append(loss)
        if after_call is not None:
            after_call(steps(item), carry)
    window.drain()
    return carry, losses


def _one_ahead(items: Iterable[Any]) -> Iterator[Any]:
    """Yields each item after producing the next: the copy of batch t+1 starts before step t runs."""
    items = iter(items)
    current = next(items, None)
    while current is not None:
        following = next(items, None)
        yield current
        current = following
