"""Checkpoints on disk: atomic, self-checking files, the last two kept.

A checkpoint is one file `checkpoint-<step>.msgpack` holding a magic line, the sha256 of the rest,
and a msgpack payload (flax.serialization) of host arrays plus a JSON description of the run.
It is written to a temporary file in the same directory, fsynced, then renamed over its final name
with `os.replace`, so a crash during a save leaves either the old set of checkpoints or the new
one, never a file that loads wrong; the digest catches any later corruption.

jdp writes only into a directory that holds nothing but its own checkpoints: a directory with
other files is refused (so nothing of the user's is overwritten or pruned), and a directory that
already holds checkpoints is continued only with `resume=True` (`--resume`).
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp.errors import Arg, ConfigError, DataError, check_positive
from jdp.types import PyTree

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

    Leftover temporary files of an interrupted save are ignored, and so is a checkpoint deleted while it is listed
    (the rotation of a job still writing into `directory`, which a reader beside it may race).

    Raises:
      ConfigError: if `directory` is not a directory, or holds anything but jdp checkpoints.
    """
    directory = Path(directory)
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise ConfigError(Arg("checkpoint_dir", directory), " is a file, not a directory; pass a directory.")
    names = [p.name for p in directory.iterdir() if not p.name.startswith(_TMP_PREFIX)]
    foreign = sorted(n for n in names if not _NAME.fullmatch(n) or (directory / n).is_dir())
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            Arg("checkpoint_dir", directory), f" holds files that are not jdp checkpoints ({shown}); jdp writes "
            "only into a new or empty directory or one of its own checkpoint directories. Pass another directory."
        )
    return sorted((directory / n for n in names if (directory / n).is_file()), key=lambda p: p.name, reverse=True)


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where `jdp.train` saves its checkpoints, how often, and whether it continues from the newest.

    Attributes:
      checkpoint_dir: the directory (one run's checkpoints, see the module docstring).
      checkpoint_every: save every this many steps; None: at the end of every epoch.
      resume: continue from the newest intact checkpoint in `checkpoint_dir`, if any; without it, a
        directory that already holds checkpoints is refused (`train` checks the directory when it starts).
    """

    checkpoint_dir: str | os.PathLike
    checkpoint_every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_every is not None:
            check_positive("checkpoint_every", self.checkpoint_every, "number of steps")


def check_options(directory: str | os.PathLike | None, every: int | None, resume: bool) -> Checkpoints | None:
    """The `Checkpoints` of separate options (the CLI's flags), checked early (before any data is loaded).

    Args:
      directory: `checkpoint_dir`, or None for no checkpoints.
      every: `checkpoint_every` (steps between saves), or None for the end of every epoch.
      resume: `resume`.

    Returns:
      The checkpoints, or None without a directory.

    Raises:
      ConfigError: naming the argument that is wrong.
    """
    if directory is None:
        if every is not None:
            check_positive("checkpoint_every", every, "number of steps")
        if resume or every is not None:
            arg = Arg("resume", True) if resume else Arg("checkpoint_every")
            raise ConfigError(arg, " needs ", Arg("checkpoint_dir", "DIR"), ": say where the checkpoints are.")
        return None
    checkpoints = Checkpoints(directory, every, resume)
    check_directory(directory, resume=resume)
    return checkpoints


def check_directory(directory: str | os.PathLike, *, resume: bool) -> None:
    """Fails early if a run may not use `directory` for its checkpoints.

    Raises:
      ConfigError: if `directory` is unusable (see `list_checkpoints`), or already holds
        checkpoints that a run without `resume` would overwrite.
    """
    existing = list_checkpoints(directory)
    if existing and not resume:
        raise ConfigError(
            Arg("checkpoint_dir", directory), f" already holds checkpoints (newest: {existing[0].name}); pass ",
            Arg("resume", True), " to continue that run, or pass a new directory."
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
    from flax import serialization  # Flax takes a quarter of a second to import: only once there is a file

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


def load(path: str | os.PathLike, target: PyTree, check: Callable[[dict[str, Any]], None] | None = None) -> Checkpoint:
    """Reads and verifies one checkpoint, restoring its arrays into the structure of `target`.

    Args:
      path: a checkpoint file.
      target: a pytree with the structure, shapes and dtypes the arrays must have (e.g. freshly
        initialised params and optimizer state); its values are not used.
      check: called with the run's description before the arrays are fitted to `target`, to
        refuse a checkpoint by the setting that differs rather than by the first array that does.

    Raises:
      DataError: if the file is not a complete, intact jdp checkpoint.
      ConfigError: if its arrays do not fit `target` (another model), naming the first leaf.
    """
    from flax import serialization

    path, step, info, saved = _read(path)
    if check is not None:
        check(info)
    _check_fits(path, saved, serialization.to_state_dict(target))
    return Checkpoint(path, step, serialization.from_state_dict(target, saved), info)


def _read(path: str | os.PathLike) -> tuple[Path, int, dict[str, Any], PyTree]:
    """(path, step, the run's description, the saved arrays as a state dict) of an intact checkpoint file.

    Raises:
      DataError: if the file is not a complete, intact jdp checkpoint.
    """
    from flax import serialization

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
        return path, int(match.group(1)), json.loads(content["info"]), content["arrays"]
    except (ValueError, KeyError, TypeError) as e:  # msgpack's and json's errors derive from ValueError
        raise DataError(f"{path} cannot be decoded as a jdp checkpoint: {e}") from None


def latest_info(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The run description saved with the checkpoint `restore_latest` would restore, or None if there is none.

    For settings a resumed run takes from its checkpoint before it builds its model (`formulation="auto"`).
    Damaged checkpoints are skipped here; `restore_latest` reports them.
    """
    for path in list_checkpoints(directory):
        try:
            return _read(path)[2]
        except DataError:
            continue
    return None


def _check_fits(path: Path, saved: PyTree, target: PyTree) -> None:
    """Raises ConfigError unless `saved` has exactly the leaves of `target`, with their shapes and dtypes."""
    have = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(saved)}
    want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(target)}
    if have.keys() != want.keys():
        differ = sorted(have.keys() ^ want.keys())
        raise ConfigError(
            f"{path} holds other arrays than this run's model and optimizer ({', '.join(differ[:4])} differ): "
            "it belongs to another model. Pass a new ", Arg("checkpoint_dir"), "."
        )
    for key, got in have.items():
        if got.shape != want[key].shape or got.dtype != want[key].dtype:
            raise ConfigError(
                f"{path} holds `{key}` as {got.dtype}{list(got.shape)} but this run's model has "
                f"{want[key].dtype}{list(want[key].shape)}: it belongs to another model. Pass a new ",
                Arg("checkpoint_dir"), "."
            )


def restore_latest(directory: str | os.PathLike, target: PyTree,
                   check: Callable[[dict[str, Any]], None] | None = None) -> Checkpoint | None:
    """The newest checkpoint in `directory` that loads intact, or None if there is none.

    A damaged newer checkpoint is skipped with a logged warning in favour of an older intact one.

    Raises:
      ConfigError: as `list_checkpoints`, or if a checkpoint belongs to another model.
      DataError: if checkpoints exist but none of them is intact.
    """
    problems = []
    for path in list_checkpoints(directory):
        try:
            found = load(path, target, check)
        except DataError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            log.warning("skipping a damaged checkpoint: %s", problem)
        return found
    if problems:
        raise DataError(
            "No intact checkpoint in ", Arg("checkpoint_dir", directory), f": {' '.join(problems)} "
            "Remove the damaged files or pass a new directory."
        )
    return None
