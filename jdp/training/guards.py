"""Guards that stop a run whose numbers went wrong, before it wastes hours or saves garbage.

* Non-finite values: a NaN or inf loss, or parameters an update made non-finite (non-finite
  gradients, or an update so large it overflowed) end the run, naming the step where they
  appeared and the last good checkpoint to resume from. The check runs on the devices inside the
  training call (`jdp.parallel.tally`) and is read back rarely, so it never stalls the loop.
* Replica divergence: data parallelism is correct only while every device holds bit-identical
  params and optimizer state; an allreduce that leaves slightly different sums on different
  devices lets the replicas drift apart silently. `check_replicas` compares every device's copy.

Both work on whatever layout the step keeps its arrays in (a leading device axis under `pmap`,
replicated `P()` under `shard_map`): they only look at each array's addressable shards.
"""

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdp.errors import Arg, ConfigError, Message, ProcessLostError, TrainingError, check_positive
from jdp.parallel.tally import Tally, read_local
from jdp.runtime import faults
from jdp.types import PyTree


@dataclasses.dataclass(frozen=True)
class Guards:
    """The checks of a run beyond its non-finite values (always on): its replicas and its processes.

    Attributes:
      check_replicas: every this many steps, stop unless all replicas are bit-identical; None: never.
      collective_timeout: with several processes, give the job up when no step finished for this
        many seconds (None: automatic, see `jdp.runtime.faults.collective_limit`).
      on_lost: with several processes, called with the `ProcessLostError` whose message is the line naming
        a stalled process; it must end this process, whose main thread waits inside a collective (default:
        print it, exit 75).
    """

    check_replicas: int | None = None
    collective_timeout: float | None = None
    on_lost: Callable[[ProcessLostError], None] = faults.end_process

    def __post_init__(self) -> None:
        if self.check_replicas is not None:
            check_positive("check_replicas", self.check_replicas, "number of steps")
        if self.collective_timeout is not None and not self.collective_timeout > 0:
            raise ConfigError(Arg("collective_timeout"), " must be a positive number of seconds, got "
                              f"{self.collective_timeout}.")


def leaf_names(tree: PyTree) -> list[str]:
    """Readable names of the leaves of `tree`, in `jax.tree.leaves` order, e.g. "['W1']"."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def check_finite(tally: Tally, names: Sequence[str], last_good: Path | None) -> None:
    """Raises TrainingError if `tally` (a host copy, `jdp.parallel.tally.read_local`) saw a non-finite value.

    Params after step t are finite exactly when step t's gradients were finite and its update did
    not overflow, so the tally's check of the params checks the gradients without taking them out of the step.

    Args:
      tally: this process's rows of the run's tally.
      names: `leaf_names(params)`.
      last_good: the newest checkpoint saved, or None if there is none.
    """
    bad = np.flatnonzero(tally.bad_to > 0)
    if not len(bad):
        return
    row = bad[np.argmin(tally.bad_from[bad])]  # the device that saw it first
    first, last, finite = int(tally.bad_from[row]), int(tally.bad_to[row]), tally.finite[row]
    if not finite[0]:
        raise _stopped(first, last, "the loss is not finite (NaN or inf)", last_good)
    raise _stopped(first, last, _made_non_finite(names, finite[1:]), last_good)


def params_finite(params: PyTree) -> np.ndarray:
    """Whether each leaf of `params` (any layout; every device's copy) is finite: one small read."""
    return np.asarray(_leaves_finite(params).addressable_data(0))


@jax.jit
def _leaves_finite(params: PyTree) -> jax.Array:
    return jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(params)])


def _made_non_finite(names: Sequence[str], finite: Sequence[bool]) -> str:
    leaves = [name for name, fine in zip(names, finite, strict=True) if not fine]
    return (f"its update made the parameters {', '.join(leaves)} non-finite (non-finite gradients, "
            "or an update too large)")


def _stopped(first: int, last: int, what: str, last_good: Path | None, span: str = "one compiled call"
             ) -> TrainingError:
    where = (Message(f"The last good checkpoint (all values finite) is {last_good}: lower ", Arg("lr"),
                     " and rerun, or continue from it with ", Arg("resume", True), ".")
             if last_good is not None else
             Message("No checkpoint was saved before it: lower ", Arg("lr"), " and rerun (with ", Arg("checkpoint_dir"),
                     " to keep some)."))
    at = f"step {last}" if first == last else f"steps {first}–{last} ({span})"
    return TrainingError(f"Stopped at {at}: {what}. ", where)


def check_replicas(tree: PyTree, step: int) -> None:
    """Raises TrainingError unless every device's copy of every leaf of `tree` is bit-identical.

    Copies are compared as bytes (a NaN equals itself, -0.0 differs from 0.0). The error names the
    leaf and the device(s) whose copy differs from the majority, so a single corrupted device
    stands out even when it is device 0.

    Args:
      tree: replicated arrays, e.g. {"params": ..., "opt_state": ...} as the step holds them.
      step: the step after which they were taken, for the message.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
        copies = [np.asarray(s.data).reshape(-1) for s in shards]  # (1, *s) under pmap, s under shard_map
        groups: dict[bytes, list[int]] = {}
        for i, copy in enumerate(copies):
            groups.setdefault(copy.tobytes(), []).append(i)
        if len(groups) == 1:
            continue
        majority = max(groups.values(), key=len)
        odd = [i for i in range(len(shards)) if i not in majority]
        ref, first = copies[majority[0]], copies[odd[0]]
        differ = int((ref.view(np.uint8).reshape(len(ref), -1) != first.view(np.uint8).reshape(len(ref), -1))
                     .any(axis=1).sum())
        gap = float(np.nanmax(np.abs(ref.astype(np.float64) - first.astype(np.float64)), initial=0.0))
        raise TrainingError(
            f"Replicas diverged by step {step}: `{jax.tree_util.keystr(path)}` on "
            f"{', '.join(repr(shards[i].device) for i in odd)} differs from the copy that {len(majority)} of "
            f"{len(shards)} devices hold, e.g. {shards[majority[0]].device!r} ({differ} of {ref.size} values, "
            f"max |difference| {gap:.3g}). Every device must hold identical params and optimizer state: "
            "an allreduce that leaves different sums on different devices breaks data parallelism."
        )


class Cadence(NamedTuple):
    """How often `Watch` reads the run's tally: at most once per `every_steps` steps and `every_seconds`
    seconds (both must have passed), the tally of `lag` calls back; `clock` gives the seconds."""

    every_steps: int = 64
    every_seconds: float = 1.0
    lag: int = 2
    clock: Callable[[], float] = time.monotonic


class Watch:
    """Both guards, run by the training loop after every compiled call of the train step.

    Every call folds its finite check into the run's tally on the devices (`jdp.parallel.tally`); the
    watch reads a tally rarely (`Cadence`), the one of `lag` calls ago, which the loop's window of
    in-flight calls has already waited for: reading never makes the host wait for the devices. `flush` reads
    the newest tally and checks the params themselves (the loop calls it before saving a checkpoint and at
    the end of each epoch, so no checkpoint ever holds a non-finite value).

    Args:
      params: the params (any layout), for the leaf names in messages.
      check_replicas: compare all replicas every this many steps; None: never.
      read: how often to read a tally.
      same: params -> the part of them every device must hold identically (default: all of them).
      same_opt_state: the same for the optimizer state (a sharded one holds a different slice on
        each device: only its scalars, such as AdamW's step count, are compared).
      comparable: step -> whether the replicas must be identical after it (a local sync mode's
        params are only at syncs); a due check waits for the next such step.
    """

    def __init__(self, params: PyTree, check_replicas: int | None = None, *, read: Cadence = Cadence(),
                 same: Callable[[PyTree], PyTree] = lambda params: params,
                 same_opt_state: Callable[[PyTree], PyTree] = lambda opt_state: opt_state,
                 comparable: Callable[[int], bool] = lambda step: True) -> None:
        self._names = leaf_names(params)
        self._same, self._same_opt_state, self._comparable = same, same_opt_state, comparable
        self._every, self._cadence = check_replicas, read
        self._recent: deque[Tally] = deque(maxlen=read.lag + 1)
        self._read_step, self._read_time = 0, read.clock()
        self._replicas_checked_at = 0
        self._step = 0  # the last step of the last call seen
        self._params_checked_at: int | None = None  # the last step whose params were all finite
        self.reads = 0  # tallies read so far
        self.last_good: Path | None = None  # the newest checkpoint saved; set by whoever saves it

    def after_call(self, first: int, last: int, params: PyTree, opt_state: PyTree, tally: Tally) -> None:
        """Checks after the call that ran steps `first`..`last` (1-based, counted over the run) and left `tally`.

        Raises:
          TrainingError: on a non-finite value (of this call or an earlier one), or diverged replicas.
        """
        self._recent.append(tally)
        if self._params_checked_at is None:  # a run starts (or resumes from a checkpoint) with finite params
            self._params_checked_at = first - 1
        self._step = last
        cadence = self._cadence
        due = last - self._read_step >= cadence.every_steps and cadence.clock() - self._read_time >= cadence.every_seconds
        if due and len(self._recent) == self._recent.maxlen:
            self._read(self._recent[0])
        replicas_due = self._every is not None and last // self._every > self._replicas_checked_at // self._every
        if replicas_due and self._comparable(last):
            self.flush(params)
            check_replicas({"params": self._same(params), "opt_state": self._same_opt_state(opt_state)}, last)
            self._replicas_checked_at = last

    def flush(self, params: PyTree | None = None) -> None:
        """Reads the newest tally (waits for its call), then checks `params`, the run's params now; raises
        TrainingError as `after_call`, or naming the steps since the params were last checked."""
        if self._recent:
            self._read(self._recent[-1])
        self._recent.clear()
        if params is None:
            return
        finite = params_finite(params)
        if not finite.all():
            raise _stopped((self._params_checked_at or 0) + 1, self._step, _made_non_finite(self._names, finite),
                           self.last_good, span="since the parameters were last checked")
        self._params_checked_at = self._step

    def _read(self, tally: Tally) -> None:
        host = read_local(tally)
        self.reads += 1
        self._read_step, self._read_time = int(host.step.max()), self._cadence.clock()
        check_finite(host, self._names, self.last_good)
