"""The resume policy: which checkpoints a run may continue, and what it must tell the user.

A checkpoint stores a description of the run that wrote it (`describe_run`): its settings, its
data's fingerprint and its device count. A run that resumes compares its own description with it
(`check_resumable`): what defines the data order must match; anything else may change, with a note.
"""

import hashlib
from typing import Any

import jax
import numpy as np

from jdp.errors import Arg, ConfigError
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel import sync as sync_lib

# What a resumed run must share with the checkpoint: the data order is a permutation per epoch drawn
# from the seed, walked in batches of batch_size, so `position` means nothing under other values.
MUST_MATCH = ("batch_size", "seed")
# What a resumed run must share with the checkpoint because it defines the optimizer state's arrays.
SAME_STATE = ("optimizer", "shard_optimizer", "sync", "outer_optimizer")
# Settings added after the first checkpoints were written, with the value those runs had.
ADDED = {"optimizer": "sgd", "momentum": None, "weight_decay": None, "accumulate": 1, "shard_optimizer": False,
         "precision": "float32", "sync": "every-step", "sync_every": None, "outer_optimizer": None,
         "outer_lr": None, "outer_momentum": None, "formulation": "fast"}
# The strategy's settings before the strategy value carried them (its name spells them now).
STRATEGY_SETTINGS = ("fuse", "bucket_mb", "compress", "powersgd_rank")
# Settings renamed since: old name -> new name (`model_impl` became `formulation`, its values kept).
RENAMED = {"model_impl": "formulation"}
# What may change without a note: how many epochs to run, and how the test set is evaluated.
FREE = ("epochs", "eval_on")


def dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    """Sizes and a sha256 of the training and test arrays: the same data gives the same fingerprint."""
    digest = hashlib.sha256()
    for array in (*dataset.train, *dataset.test):
        digest.update(np.ascontiguousarray(array).data)
    return {"train": len(dataset.train.labels), "test": len(dataset.test.labels), "sha256": digest.hexdigest()}


def describe_run(config: dict[str, Any], dataset: Any, device_count: int,
                 per_device_state: bool = False) -> dict[str, Any]:
    """What `check_resumable` compares: the run's settings (JSON values), its data, device and process count.

    `per_device_state`: the allreduce strategy keeps state of its own on each device (PowerSGD's
    error feedback), which the checkpoint then holds once per device.
    """
    return {
        "config": config,
        "devices": device_count,
        "processes": jax.process_count(),
        "per_device_state": per_device_state,
        "dataset": dataset_fingerprint(dataset),
        "jax_version": jax.__version__,
    }


def settings(config: dict[str, Any]) -> dict[str, Any]:
    """A run's saved settings under today's names, with the values of settings added since filled in, and a
    sync setting saved as None (the sync's own, before a sync value recorded its settings) as that value."""
    values = _one_strategy({**ADDED, **{RENAMED.get(name, name): value for name, value in config.items()}})
    try:
        own = sync_lib.recorded(sync_lib.get(values["sync"]))
    except ConfigError:  # a sync of a --plugin this process has not loaded: compared as saved
        return values
    return {**values, **{name: value for name, value in own.items() if values.get(name) is None}}


def _one_strategy(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the strategy settings of runs before the strategy value (`fuse`, `bucket_mb`, `compress`,
    `powersgd_rank`) folded into the strategy's name, as a run records it now (`ring+bfloat16+fused`)."""
    flat = {name: values.pop(name) for name in STRATEGY_SETTINGS if name in values}
    if not flat:
        return values
    try:
        values["allreduce"] = allreduce_lib.get(values["allreduce"], fuse=bool(flat.get("fuse")),
                                                bucket_mb=flat.get("bucket_mb"), compress=flat.get("compress") or "none",
                                                rank=flat.get("powersgd_rank")).name
    except ConfigError:  # a strategy of a --plugin this process has not loaded: compared by its name alone
        pass
    return values


def check_same_state(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuses a checkpoint whose optimizer state is of another kind (`optimizer`, `shard_optimizer`, `sync`, ...).

    Checked before the arrays are read, so the error names the flag, not the first array that differs.
    The device count may change under `shard_optimizer`: the state is stored unsliced (`jdp.parallel.opt_state`);
    it may not with an allreduce that keeps state per device (`compress=powersgd`), nor under a local sync
    mode, whose params and optimizer state are saved per device.

    Raises:
      ConfigError: naming the setting that differs.
    """
    old, new = settings(saved["config"]), settings(current["config"])
    for name in SAME_STATE:
        if old[name] != new[name]:
            raise ConfigError(
                "This run has ", _shown(name, new[name]), " but the checkpoint has ", _shown(name, old[name]),
                ": their optimizer states hold other arrays. Resume with the checkpoint's setting, or pass a new ",
                Arg("checkpoint_dir"), "."
            )
    had = saved.get("per_device_state", saved["config"].get("compress") == "powersgd")  # from before the field
    has = current.get("per_device_state", False)
    if had != has:
        raise ConfigError(
            "This run's allreduce (", _strategy(new), f") {'keeps' if has else 'keeps no'} state per device, the "
            "checkpoint's (", _strategy(old), f") {'does' if had else 'does not'}: their optimizer states hold other "
            "arrays. Resume with the checkpoint's setting, or pass a new ", Arg("checkpoint_dir"), "."
        )
    if has and saved["devices"] != current["devices"]:
        raise ConfigError(
            "The checkpoint holds ", _strategy(old), f"'s state for each of {saved['devices']} devices; this run has "
            f"{current['devices']}. Resume on {saved['devices']} devices, or pass a new ", Arg("checkpoint_dir"), "."
        )


def _strategy(config: dict[str, Any]) -> Arg:
    if config.get("sync", "every-step") != "every-step":
        return Arg("sync", config["sync"])
    return Arg("allreduce", config.get("allreduce"))


def _shown(name: str, value: Any) -> Arg:
    return Arg(name, bool(value) if name == "shard_optimizer" else value)


def check_resumable(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Refuses to resume a checkpoint under a run that would make it mean something else.

    A different model is caught by `load` (shapes); a different dataset, batch size or seed here. Any
    other setting may change (e.g. a lower `lr` after a NaN): the run continues from the same
    state, but is then not bit-identical to an uninterrupted one. So may the device count: every
    device sums its shard's gradients, the allreduce sums those, and the update divides by the full
    batch, so the update is the same for any count dividing the batch; only the order of float
    additions changes (a count that does not divide the batch is refused as for a fresh run). So
    may the process count: the same sums, exchanged between processes instead of within one.

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
            "same `--dataset`, `--data-dir` and `--seed`, or pass a new ", Arg("checkpoint_dir"), "."
        )
    old, new = settings(saved["config"]), settings(current["config"])
    for name in MUST_MATCH:
        if old.get(name) != new.get(name):
            raise ConfigError(
                Arg(name, new.get(name)), f" differs from the checkpoint's {old.get(name)}: the data order to resume "
                "is defined by the batch size and seed. Resume with the checkpoint's value, or pass a new ",
                Arg("checkpoint_dir"), "."
            )
    notes = [
        f"resuming with `--{name.replace('_', '-')} {new.get(name)}` instead of the checkpoint's {old.get(name)}: "
        "the run goes on from the saved state under the new setting (not bit-identical to an uninterrupted run)"
        for name in sorted(old.keys() | new.keys())
        if name not in FREE and old.get(name) != new.get(name)
    ]
    if saved.get("processes", 1) != current.get("processes", 1):  # checkpoints from before the field: 1
        notes.append(
            f"resuming in {current.get('processes', 1)} process(es) instead of the checkpoint's "
            f"{saved.get('processes', 1)}: the same sums, exchanged between processes instead of within one "
            "(their float additions may be grouped otherwise)"
        )
    if saved["devices"] != current["devices"]:
        notes.append(
            f"resuming on {current['devices']} devices instead of the checkpoint's {saved['devices']}: each update is "
            "the same sum over the full batch, only the order of float additions differs (close to, not bit-identical "
            "with, an uninterrupted run)"
        )
    return notes
