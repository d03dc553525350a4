"""Checkpoints on disk: atomic, self-checking files, the last two kept.

A checkpoint is one file `checkpoint-<step>.msgpack` holding a magic line, the sha256 of the rest,
and a msgpack payload (flax.serialization) of host arrays plus a JSON description of the run.
It is written to a temporary file in the same directory, fsynced, then renamed over its final name
with `os.replace`, so a crash during a save leaves either the old set of checkpoints or the new
one, never a file that loads wrong; the digest catches any later corruption.

jdp writes only into a directory that holds nothing but its own checkpoints: a directory with
other files is refused (so nothing of the user's is overwritten or pruned), and a directory that
already holds checkpoints is continued only with `--resume`.
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import serialization

from jdp import distributed
from jdp.errors import ConfigError, DataError

PyTree = Any

KEEP = 2  # checkpoints kept: the newest and, should it be damaged later, the one before
MAGIC = b"jdp-checkpoint v1\n"
_NAME = re.compile(r"checkpoint-(\d{9})\.msgpack")
_TMP_PREFIX = ".tmp-checkpoint-"

log = logging.getLogger(__name__)


class Checkpoint(NamedTuple):
    """A checkpoint read back from disk.

    Attributes:
      path: the file it came from.
      step: optimizer steps completed when it was written.
      arrays: host (numpy) arrays, in the pytree structure of the target given to `load`.
      info: the JSON description of the run saved with it.
    """

    path: Path
    step: int
    arrays: PyTree
    info: dict[str, Any]


def path_for(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives in `directory`."""
    return Path(directory) / f"checkpoint-{step:09d}.msgpack"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoint files in `directory`, newest (highest step) first; [] if it does not exist.

    Leftover temporary files of an interrupted save are ignored.

    Raises:
      ConfigError: if `directory` is not a directory, or holds anything but jdp checkpoints.
    """
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError(f"`--checkpoint-dir {directory}` is a file, not a directory; pass a directory.")
    names = [p.name for p in directory.iterdir() if not p.name.startswith(_TMP_PREFIX)]
    foreign = sorted(n for n in names if not (_NAME.fullmatch(n) and (directory / n).is_file()))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"`--checkpoint-dir {directory}` holds files that are not jdp checkpoints ({shown}); jdp writes "
            "only into a new or empty directory or one of its own checkpoint directories. Pass another directory."
        )
    return sorted((directory / n for n in names), key=lambda p: p.name, reverse=True)


def check_options(directory: str | os.PathLike | None, every: int | None, resume: bool) -> None:
    """Fails early on checkpoint options a run cannot use (before any data is loaded).

    Args:
      directory: `--checkpoint-dir`, or None for no checkpoints.
      every: `--checkpoint-every` (steps between saves), or None for the end of every epoch.
      resume: `--resume`.

    Raises:
      ConfigError: naming the flag that is wrong.
    """
    if every is not None and every < 1:
        raise ConfigError(f"`--checkpoint-every` must be a positive number of steps, got {every}.")
    if directory is None:
        if resume or every is not None:
            flag = "--resume" if resume else "--checkpoint-every"
            raise ConfigError(f"`{flag}` needs `--checkpoint-dir DIR`: say where the checkpoints are.")
        return
    check_directory(directory, resume=resume)


def check_directory(directory: str | os.PathLike, *, resume: bool) -> None:
    """Fails early if a run may not use `directory` for its checkpoints.

    Raises:
      ConfigError: if `directory` is unusable (see `list_checkpoints`), or already holds
        checkpoints that a run without `resume` would overwrite.
    """
    existing = list_checkpoints(directory)
    if existing and not resume:
        raise ConfigError(
            f"`--checkpoint-dir {directory}` already holds checkpoints (newest: {existing[0].name}); "
            "pass `--resume` to continue that run, or pass a new directory."
        )


def save(directory: str | os.PathLike, step: int, arrays: PyTree, info: dict[str, Any], *, keep: int = KEEP) -> Path:
    """Writes the checkpoint of `step` atomically, then deletes all but the newest `keep`.

    Args:
      directory: created if missing; must pass `list_checkpoints`.
      step: optimizer steps completed; names the file.
      arrays: a pytree of arrays (device arrays are fetched to the host).
      info: JSON-serialisable description of the run (restored as is).
      keep: how many checkpoints to keep, at least 1.

    Returns:
      The path of the new checkpoint.
    """
    directory = Path(directory)
    list_checkpoints(directory)  # refuses a directory holding foreign files before writing there
    directory.mkdir(parents=True, exist_ok=True)
    payload = serialization.msgpack_serialize({
        "info": json.dumps(info),
        "arrays": serialization.to_state_dict(jax.tree.map(np.asarray, jax.device_get(arrays))),
    })
    target = path_for(directory, step)
    tmp = directory / f"{_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:  # a new file with the usual permissions (mkstemp's are 0600)
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink()
    for stale in directory.glob(_TMP_PREFIX + "*"):  # left by a save that was killed
        stale.unlink(missing_ok=True)
    return target


def _fsync_directory(directory: Path) -> None:
    """Makes the rename durable (POSIX: a rename is recorded in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike, target: PyTree) -> Checkpoint:
    """Reads and verifies one checkpoint, restoring its arrays into the structure of `target`.

    Args:
      path: a checkpoint file.
      target: a pytree with the structure, shapes and dtypes the arrays must have (e.g. freshly
        initialised params and optimizer state); its values are not used.

    Raises:
      DataError: if the file is not a complete, intact jdp checkpoint.
      ConfigError: if its arrays do not fit `target` (another model), naming the first leaf.
    """
    path = Path(path)
    match = _NAME.fullmatch(path.name)
    if match is None:
        raise DataError(f"{path} is not named like a jdp checkpoint (checkpoint-<9-digit step>.msgpack).")
    raw = path.read_bytes()
    header = len(MAGIC) + hashlib.sha256().digest_size
    if not raw.startswith(MAGIC) or len(raw) < header:
        raise DataError(f"{path} is not a jdp checkpoint (it lacks the `jdp-checkpoint v1` header).")
    payload = raw[header:]
    if hashlib.sha256(payload).digest() != raw[len(MAGIC):header]:
        raise DataError(f"{path} is corrupt: its contents do not match the checksum written with them.")
    try:
        content = serialization.msgpack_restore(payload)
        info, saved = json.loads(content["info"]), content["arrays"]
    except (ValueError, KeyError, TypeError) as e:  # msgpack's and json's errors derive from ValueError
        raise DataError(f"{path} cannot be decoded as a jdp checkpoint: {e}") from None
    _check_fits(path, saved, serialization.to_state_dict(target))
    return Checkpoint(path, int(match.group(1)), serialization.from_state_dict(target, saved), info)


def _check_fits(path: Path, saved: PyTree, target: PyTree) -> None:
    """Raises ConfigError unless `saved` has exactly the leaves of `target`, with their shapes and dtypes."""
    have = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(saved)}
    want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(target)}
    if have.keys() != want.keys():
        differ = sorted(have.keys() ^ want.keys())
        raise ConfigError(
            f"{path} holds other arrays than this run's model and optimizer ({', '.join(differ[:4])} differ): "
            "it belongs to another model. Pass a new `--checkpoint-dir`."
        )
    for key, got in have.items():
        if got.shape != want[key].shape or got.dtype != want[key].dtype:
            raise ConfigError(
                f"{path} holds `{key}` as {got.dtype}{list(got.shape)} but this run's model has "
                f"{want[key].dtype}{list(want[key].shape)}: it belongs to another model. Pass a new `--checkpoint-dir`."
            )


# What a resumed run must share with the checkpoint: the data order is a permutation per epoch drawn
# from the seed, walked in batches of batch_size, so `position` means nothing under other values.
MUST_MATCH = ("batch_size", "seed")
# What may change without a note: how many epochs to run, and how the test set is evaluated.
FREE = ("epochs", "eval_on")


def dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    """Sizes and a sha256 of the training and test arrays: the same data gives the same fingerprint."""
    digest = hashlib.sha256()
    for array in (*dataset.train, *dataset.test):
        digest.update(np.ascontiguousarray(array).data)
    return {"train": len(dataset.train.labels), "test": len(dataset.test.labels), "sha256": digest.hexdigest()}


def describe_run(config: Any, dataset: Any, device_count: int) -> dict[str, Any]:
    """What `check_resumable` compares: the run's settings (a dataclass), its data and device count."""
    return {
        "config": dataclasses.asdict(config),
        "devices": device_count,
        "dataset": dataset_fingerprint(dataset),
        "jax_version": jax.__version__,
    }


def check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Refuses to resume a checkpoint under a run that would make it mean something else.

    A different model is caught by `load` (shapes); a different dataset, batch size or seed here. Any
    other setting may change (e.g. a lower `--lr` after a NaN): the run continues from the same
    state, but is then not bit-identical to an uninterrupted one. So may the device count: every
    device sums its shard's gradients, the allreduce sums those, and the update divides by the full
    batch, so the update is the same for any count dividing the batch; only the order of float
    additions changes (a count that does not divide the batch is refused as for a fresh run).

    Args:
      saved: the `run` description stored with the checkpoint.
      current: the same description of the run that wants to resume.

    Returns:
      Notes, one per setting that changed, to tell the user.

    Raises:
      ConfigError: naming the setting that may not change.
    """
    if saved["dataset"] != current["dataset"]:
        have, want = saved["dataset"], current["dataset"]
        raise ConfigError(
            f"The checkpoint was written for another dataset ({have['train']} training images, sha256 "
            f"{have['sha256'][:12]}…) than this run's ({want['train']}, {want['sha256'][:12]}…). Resume with the "
            "same `--dataset`, `--data-dir` and `--seed`, or pass a new `--checkpoint-dir`."
        )
    old, new = saved["config"], current["config"]
    for name in MUST_MATCH:
        if old.get(name) != new.get(name):
            raise ConfigError(
                f"`--{name.replace('_', '-')} {new.get(name)}` differs from the checkpoint's {old.get(name)}: the "
                "data order to resume is defined by the batch size and seed. Resume with the checkpoint's value, "
                "or pass a new `--checkpoint-dir`."
            )
    notes = [
        f"resuming with `--{name.replace('_', '-')} {new.get(name)}` instead of the checkpoint's {old.get(name)}: "
        "the run goes on from the saved state under the new setting (not bit-identical to an uninterrupted run)"
        for name in sorted(old.keys() | new.keys())
        if name not in FREE and old.get(name) != new.get(name)
    ]
    if saved["devices"] != current["devices"]:
        notes.append(
            f"resuming on {current['devices']} devices instead of the checkpoint's {saved['devices']}: each update is "
            "the same sum over the full batch, only the order of float additions differs (close to, not bit-identical "
            "with, an uninterrupted run)"
        )
    return notes


def restore_latest(directory: str | os.PathLike, target: PyTree) -> Checkpoint | None:
    """The newest checkpoint in `directory` that loads intact, or None if there is none.

    A damaged newer checkpoint is skipped with a logged warning in favour of an older intact one.

    Raises:
      ConfigError: as `list_checkpoints`, or if a checkpoint belongs to another model.
      DataError: if checkpoints exist but none of them is intact.
    """
    problems = []
    for path in list_checkpoints(directory):
        try:
            found = load(path, target)
        except DataError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            log.warning("skipping a damaged checkpoint: %s", problem)
        return found
    if problems:
        raise DataError(
            f"No intact checkpoint in `--checkpoint-dir {directory}`: {' '.join(problems)} "
            "Remove the damaged files or pass a new directory."
        )
    return None


class Keeper:
    """Where a training run is, its guards after every call, and the checkpoints saved of it.

    `train` reports each compiled call (`after_call`) and each finished epoch (`end_epoch`). The
    position (step, epoch, batches of it done) and the epoch's running loss are what a resumed run
    needs to continue exactly: the loss is summed in float32 in the same order as uninterrupted.

    Checkpoints are saved every `every` steps (at the first call boundary at or after each multiple)
    and after the last epoch; without `every`, after every epoch. Only process 0 writes.

    Args:
      directory: `--checkpoint-dir`, or None to save nothing.
      every: `--checkpoint-every`, or None.
      run: `describe_run` of this run (stored with each checkpoint), or None without a directory.
      steps_per_epoch: batches per epoch.
      watch: the guards to run after every call (see `jdp.guards.Watch`).
      host_copy: replicated device arrays -> this process's host copy (e.g. `jdp.distributed.local_copy`).
      data_key: the key data of the run's data-order PRNG key (saved with every checkpoint).
    """

    def __init__(self, directory: str | os.PathLike | None, every: int | None, run: dict[str, Any] | None,
                 steps_per_epoch: int, watch: Any, host_copy: Any, data_key: np.ndarray) -> None:
        self.directory, self.every, self.run, self.data_key = directory, every, run, data_key
        self.steps_per_epoch, self.watch, self._host_copy = steps_per_epoch, watch, host_copy
        self.step, self.epoch, self.batches_done = 0, 1, 0
        self.history: list[dict[str, Any]] = []
        self._loss_sum, self._losses = np.float32(0.0), []
        self._saved_at = 0

    def resume(self, target: PyTree, epochs: int) -> PyTree:
        """Restores the newest intact checkpoint into `target`'s structure, or returns `target` if none.

        Raises:
          ConfigError: if the checkpoint belongs to another run (see `check_resumable`) or ends
            after `epochs`.
          DataError: if no checkpoint is intact.
        """
        found = restore_latest(self.directory, target)
        if found is None:
            log.info("no checkpoint in %s yet: starting at step 0", self.directory)
            return target
        notes = check_resumable(found.info["run"], self.run)
        position = found.info["position"]
        self.step, self.epoch, self.batches_done = position["step"], position["epoch"], position["batches_done"]
        self._loss_sum, self.history = np.float32(position["loss_sum"]), found.info["history"]
        self._saved_at, self.watch.last_good, self.data_key = self.step, found.path, found.arrays["data_key"]
        if epochs < self.epoch - (self.batches_done == 0):
            raise ConfigError(
                f"`--epochs {epochs}` ends before {found.path} (step {self.step}, epoch {self.epoch}): "
                f"pass `--epochs {self.epoch - (self.batches_done == 0)}` or more."
            )
        for note in notes:
            log.info(note)
        log.info("resuming from %s (step %d, epoch %d, %d of %d batches done)",
                 found.path, self.step, self.epoch, self.batches_done, self.steps_per_epoch)
        return found.arrays

    def after_call(self, steps: int, state: tuple[PyTree, PyTree], losses: Any) -> None:
        """Counts a call of `steps` steps, runs the guards, and saves if a checkpoint is due mid-epoch."""
        self.step, self.batches_done = self.step + steps, self.batches_done + steps
        self._losses.append(losses)
        self.watch.after_call(self.step - steps + 1, self.step, *state, losses)
        if self.every is not None and self.batches_done < self.steps_per_epoch and self._due():
            self._save(state)

    def epoch_loss(self) -> np.float32:
        """The summed loss of the current epoch's steps so far (waits for them)."""
        for losses in self._losses:
            self._loss_sum = self._loss_sum + distributed.to_host(losses).sum()
        self._losses = []
        return self._loss_sum

    def end_epoch(self, state: tuple[PyTree, PyTree], record: dict[str, Any], last: bool) -> None:
        """Records a finished epoch; saves if a checkpoint is due or it was the `last`."""
        self.watch.flush()
        self.history.append(record)
        self.epoch, self.batches_done, self._loss_sum, self._losses = self.epoch + 1, 0, np.float32(0.0), []
        if self.every is None or last or self._due():
            self._save(state)

    def _due(self) -> bool:
        return self.step // self.every > self._saved_at // self.every

    def _save(self, state: tuple[PyTree, PyTree]) -> None:
        if self.directory is None:
            return
        self.watch.flush()  # never save a non-finite value
        params, opt_state = state
        arrays = {"params": self._host_copy(params), "opt_state": self._host_copy(opt_state),
                  "data_key": self.data_key}
        info = {
            "position": {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done,
                         "loss_sum": float(self.epoch_loss())},
            "history": self.history,
            "run": self.run,
        }
        if jax.process_index() == 0:
            save(self.directory, self.step, arrays, info)
        self.watch.last_good, self._saved_at = path_for(self.directory, self.step), self.step
