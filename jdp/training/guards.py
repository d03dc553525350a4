"""Guards that stop a run whose numbers went wrong, before it wastes hours or saves garbage.

* Non-finite values: a NaN or inf loss, or parameters an update made non-finite (non-finite
  gradients, or an update so large it overflowed) end the run at the step where they appear,
  naming that step and the last good checkpoint to resume from.
* Replica divergence: data parallelism is correct only while every device holds bit-identical
  params and optimizer state; an allreduce that leaves slightly different sums on different
  devices lets the replicas drift apart silently. `check_replicas` compares every device's copy.

Both work on whatever layout the step keeps its arrays in (a leading device axis under `pmap`,
replicated `P()` under `shard_map`): they only look at each array's addressable shards.
"""

from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jdp.errors import TrainingError
from jdp.types import PyTree


@jax.jit
def finite_flags(loss: jax.Array, params: PyTree) -> list[jax.Array]:
    """Whether the loss and each leaf of `params` are finite, computed on the devices.

    Each array is reduced over all but its leading axis, never across it: under `pmap` that axis is
    the device axis, so no device waits for another (a cross-device reduction would be a collective,
    dispatched ahead of the host outside the loop's bounded window, `jdp.parallel.inflight`).

    Params after step t are finite exactly when step t's gradients were finite and its update did
    not overflow, so checking them checks the gradients without taking them out of the step.

    Returns:
      [loss flags, then one flag vector per leaf of `params` in `jax.tree.leaves` order].
    """

    def rows(x: jax.Array) -> jax.Array:
        finite = jnp.isfinite(x)
        return finite.reshape(x.shape[0], -1).all(axis=1) if x.ndim else finite

    return [rows(loss)] + [rows(x) for x in jax.tree.leaves(params)]


def _all_true(flags: jax.Array | np.ndarray) -> bool:
    """Reads this process's shards of `flags` (no collective)."""
    if isinstance(flags, jax.Array):
        return all(bool(np.asarray(s.data).all()) for s in flags.addressable_shards)
    return bool(np.asarray(flags).all())


def leaf_names(tree: PyTree) -> list[str]:
    """Readable names of the leaves of `tree`, in `jax.tree.leaves` order, e.g. "['W1']"."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


def check_finite(flags: Sequence[jax.Array], names: Sequence[str], step: int | str, last_good: Path | None) -> None:
    """Raises TrainingError unless `flags` (from `finite_flags`) are all true.

    Args:
      flags: `finite_flags(loss, params)` of step `step`.
      names: `leaf_names(params)`.
      step: the step (1-based, counted over the whole run) whose loss and update were checked, or a
        range "9–12" of steps run by one compiled call.
      last_good: the newest checkpoint saved, or None if there is none.
    """
    ok = [_all_true(f) for f in flags]
    if all(ok):
        return
    if not ok[0]:
        what = "the loss is not finite (NaN or inf)"
    else:
        bad = [name for name, fine in zip(names, ok[1:]) if not fine]
        what = (f"its update made the parameters {', '.join(bad)} non-finite (non-finite gradients, "
                "or an update too large)")
    where = (f"The last good checkpoint (all values finite) is {last_good}: lower `lr` and rerun, "
             "or continue from it with `resume=True`."
             if last_good is not None else
             "No checkpoint was saved before it: lower `lr` and rerun (with `checkpoint_dir` to keep some).")
    at = f"step {step}" if isinstance(step, int) else f"steps {step} (one compiled call)"
    raise TrainingError(f"Stopped at {at}: {what}. {where}")


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


class Watch:
    """Both guards, run by the training loop after every compiled call of the train step.

    The finite check of a call is dispatched right after it and read `lag` calls later, when the
    loop's window of in-flight steps has already waited for that call: the check never makes the
    host wait for the devices. `flush` reads every pending check (the loop calls it before saving a
    checkpoint, so no checkpoint ever holds a non-finite value).

    Args:
      params: the params (any layout), for the leaf names in messages.
      check_replicas: compare all replicas every this many steps; None: never.
      lag: how many calls a finite check may stay unread.
      same: params -> the part of them every device must hold identically (default: all of them).
      same_opt_state: the same for the optimizer state (a sharded one holds a different slice on
        each device: only its scalars, such as AdamW's step count, are compared).
      comparable: step -> whether the replicas must be identical after it (a local sync mode's
        params are only at syncs); a due check waits for the next such step.
    """

    def __init__(self, params: PyTree, check_replicas: int | None = None, lag: int = 2,
                 same: Callable[[PyTree], PyTree] = lambda params: params,
                 same_opt_state: Callable[[PyTree], PyTree] = lambda opt_state: opt_state,
                 comparable: Callable[[int], bool] = lambda step: True) -> None:
        self._names = leaf_names(params)
        self._same, self._same_opt_state, self._comparable = same, same_opt_state, comparable
        self._every = check_replicas
        self._lag = lag
        self._pending: deque[tuple[int, int, list[jax.Array]]] = deque()
        self._replicas_checked_at = 0
        self.last_good: Path | None = None  # the newest checkpoint saved; set by whoever saves it

    def after_call(self, first: int, last: int, params: PyTree, opt_state: PyTree, loss: jax.Array) -> None:
        """Checks the call that ran steps `first`..`last` (1-based, counted over the run).

        Raises:
          TrainingError: on a non-finite value (of this call or an earlier one), or diverged replicas.
        """
        self._pending.append((first, last, finite_flags(loss, params)))
        while len(self._pending) > self._lag:
            self._check(*self._pending.popleft())
        due = self._every is not None and last // self._every > self._replicas_checked_at // self._every
        if due and self._comparable(last):
            self.flush()
            check_replicas({"params": self._same(params), "opt_state": self._same_opt_state(opt_state)}, last)
            self._replicas_checked_at = last

    def flush(self) -> None:
        """Reads every pending finite check; raises TrainingError as `after_call`."""
        while self._pending:
            self._check(*self._pending.popleft())

    def _check(self, first: int, last: int, flags: list[jax.Array]) -> None:
        check_finite(flags, self._names, last if first == last else f"{first}–{last}", self.last_good)
