"""`formulation="auto"`: the LeNet formulation measured fastest on this kind of machine, chosen reproducibly.

The table maps a machine kind (CPU model, vector ISA, cores, device kind: `jdp.runtime.machine_kind`)
and a device count to the formulation `jdp bench formulations --write-table` measured fastest there.
jdp ships entries for the kinds measured so far (`committed()`, read from
experiments/results/formulations/table.json, each entry citing its measurement);
`--write-table` adds this machine's to a user cache (`$JDP_CACHE_DIR/formulations.json`, else
`~/.cache/jdp/formulations.json`), whose entry wins over a committed one of the same kind and count.
A kind or device count in neither table gets `fast`, the formulation every run had before `auto`.

`choose` is pure: (machine kind, device count, table) -> entry. `resolve` does the I/O (the machine,
the cache) and `settle` applies it to a `TrainConfig`: a resumed run takes the formulation its
checkpoint records, whatever the table or the machine says now, so rounding never changes mid-run.
"""

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from jdp.errors import Arg, ConfigError, DataError
from jdp.models.lenet_fast import FORMULATIONS
from jdp.runtime import measurements
from jdp.runtime.machine_kind import MachineKind, best_match, this_kind

if TYPE_CHECKING:
    import jax

AUTO, DEFAULT = "auto", "fast"
CACHE_ENV, CACHE_FILE = "JDP_CACHE_DIR", "formulations.json"


class Entry(NamedTuple):
    """The fastest formulation measured on `devices` devices of a machine kind, and where that was measured."""

    kind: MachineKind
    devices: int
    formulation: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return {**self.kind._asdict(), "devices": self.devices, "formulation": self.formulation,
                "source": self.source}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "Entry":
        return cls(MachineKind(value["cpu"], value["vector_isa"], int(value["host_cpus"]), value["device_kind"]),
                   int(value["devices"]), value["formulation"], value["source"])


COMMITTED_TABLE = "formulations/table.json"  # under experiments/results/


@functools.cache
def committed() -> tuple[Entry, ...]:
    """The entries jdp ships: the machine kinds measured so far (`jdp.runtime.measurements`).

    Raises:
      DataError: if the committed table is damaged.
    """
    return tuple(_checked(measurements.read(COMMITTED_TABLE, "entries"), measurements.RESULTS / COMMITTED_TABLE))


class Choice(NamedTuple):
    """The formulation a run uses, what was asked for, and where the answer came from."""

    formulation: str
    requested: str
    source: str

    def to_json(self) -> dict[str, str]:
        return self._asdict()


def check(name: str) -> None:
    """Raises ConfigError unless `name` is `auto` or a formulation jdp trains."""
    if name != AUTO and name not in FORMULATIONS:
        raise ConfigError(Arg("formulation"), f" must be {AUTO} or one of {', '.join(FORMULATIONS)}, got `{name}`.")


def choose(kind: MachineKind, devices: int, table: Sequence[Entry]) -> Entry | None:
    """The table's entry for `devices` devices of machine `kind`, or None; the first such entry wins,
    one naming the CPU model before one known by vector ISA and cores alone."""
    return best_match((e for e in table if e.devices == devices), lambda e: e.kind, kind)


def cache_path() -> Path:
    """Where `jdp bench formulations --write-table` keeps this user's measured entries."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jdp"
    return Path(root) / CACHE_FILE


def read_cache(path: Path | None = None) -> list[Entry]:
    """The user's measured entries ([] if there is no cache file).

    Raises:
      DataError: if the file exists but is not a formulation table.
    """
    path = path or cache_path()
    if not path.exists():
        return []
    try:
        values = json.loads(path.read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a formulation table ({e}); delete it or write it again with "
                        "`jdp bench formulations --write-table`.") from None
    return _checked(values, path)


def _checked(values: Sequence[Any], path: Path) -> list[Entry]:
    """The entries of a formulation table read from `path`, each naming a formulation jdp trains.

    Raises:
      DataError: naming `path`, if an entry is malformed or names another formulation.
    """
    try:
        entries = [Entry.from_json(value) for value in values]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a formulation table ({e}); delete it or write it again with "
                        "`jdp bench formulations --write-table`.") from None
    for entry in entries:
        if entry.formulation not in FORMULATIONS:
            raise DataError(f"{path} names a formulation jdp does not train, `{entry.formulation}`; delete it or "
                            "write it again with `jdp bench formulations --write-table`.")
    return entries


def write_entry(entry: Entry, path: Path | None = None) -> Path:
    """Adds `entry` to the user's cache, replacing the one of the same kind and device count; returns the file."""
    path = path or cache_path()
    kept = [e for e in read_cache(path) if (e.kind, e.devices) != (entry.kind, entry.devices)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"entries": [e.to_json() for e in [entry, *kept]]}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def resolve(requested: str, kind: MachineKind, devices: int, cache: Sequence[Entry] = ()) -> Choice:
    """What `requested` means for `devices` devices of machine `kind`: itself, or for `auto` the cache's
    entry, else the committed one, else `fast`. Pure: the caller reads the machine and the cache."""
    check(requested)
    if requested != AUTO:
        return Choice(requested, requested, "given")
    entry = choose(kind, devices, cache)
    if entry is not None:
        return Choice(entry.formulation, AUTO, f"user table ({CACHE_FILE}): {entry.source}")
    entry = choose(kind, devices, committed())
    if entry is not None:
        return Choice(entry.formulation, AUTO, f"committed table: {entry.source}")
    return Choice(DEFAULT, AUTO, f"default: no measurement for {devices} device(s) of this machine kind")


def settle(config: Any, devices: Sequence["jax.Device"], checkpoint_dir: str | os.PathLike | None = None,
           resume: bool = False) -> tuple[Any, Choice]:
    """`config` with `formulation="auto"` replaced by what this run uses, and that choice.

    Args:
      config: the run's settings, a `jdp.training.config.TrainConfig` (which imports this module).
      devices: the devices it trains on (their count and kind pick the table's entry).
      checkpoint_dir, resume: as `jdp.train`'s. A run resuming a checkpoint takes the formulation
        recorded with it, whatever the table or this machine says now.
    """
    from jdp.training import checkpoint
    from jdp.training.resume import settings

    if config.formulation != AUTO:
        return config, Choice(config.formulation, config.formulation, "given")
    saved = checkpoint.latest_info(checkpoint_dir) if resume and checkpoint_dir is not None else None
    if saved is not None:
        choice = Choice(settings(saved["run"]["config"])["formulation"], AUTO, "the checkpoint resumed")
    elif config.model != "lenet":
        choice = Choice(DEFAULT, AUTO, f"default: `model={config.to_dict()['model']}` has one formulation")
    else:
        choice = resolve(AUTO, this_kind(devices[0].device_kind), len(devices), read_cache())
    return dataclasses.replace(config, formulation=choice.formulation), choice


def __getattr__(name: str) -> Any:
    if name == "COMMITTED":  # removed after 0.1.0; see docs/api.md
        raise AttributeError("`jdp.training.formulation.COMMITTED` is now `committed()`, read from "
                             f"experiments/results/{COMMITTED_TABLE}.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
