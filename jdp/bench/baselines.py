"""Committed float32 baselines of `jdp bench train`, one per machine kind, to report speed-ups against.

A baseline is what `jdp bench train` measured for float32 (global batch 256, the fast LeNet) on one
kind of machine, and the lesson's own PyTorch code timed there in the same hour. The bench prints
every row's images/s over these, so a change to the step shows up as a ratio on the machine the
baseline came from. The table is data, experiments/results/bench-train/baselines.json
(`jdp.runtime.measurements`): absolute speeds on shared machines drift; rerun the baseline's
command (its `source` folder holds the raw output) when a machine kind's figures look off, and
update its entry there.
"""

import functools
from typing import Any, NamedTuple

import jax

from jdp.errors import DataError
from jdp.runtime import measurements
from jdp.runtime.machine_kind import MachineKind, best_match


class Baseline(NamedTuple):
    machine: str  # how tables name it
    cpu: str | None  # /proc/cpuinfo's model name, as `jdp.bench.machine.machine()` records it; None: any model
    vector_isa: str  # its widest vector instructions (`jdp.bench.machine.vector_isa`): same model, other speed
    host_cpus: int
    device_kind: str  # jax's `device.device_kind` ("cpu", "NVIDIA H200", ...)
    float32_images_per_s: dict[int, float]  # devices -> images/s of jdp's epoch loop, float32
    lesson_images_per_s: float | None  # the lesson's PyTorch code, best epoch, same machine and hour
    measured: str  # date and stack
    source: str  # where the raw output is committed
    how: str = ""  # which rounds and epochs the figures are


TABLE = "bench-train/baselines.json"  # under experiments/results/


@functools.cache
def committed() -> tuple[Baseline, ...]:
    """The committed baselines, one per machine kind measured so far.

    Raises:
      DataError: if the committed table is damaged.
    """
    try:
        return tuple(Baseline(**{**value, "float32_images_per_s": {
            int(k): float(v) for k, v in value["float32_images_per_s"].items()}})
            for value in measurements.read(TABLE, "baselines"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DataError(f"{measurements.RESULTS / TABLE} is not a table of baselines ({e}); restore it from git.") from None


# The batch a baseline was measured with; another batch gets no ratio, nor the lesson's formulation (a
# baseline times jdp's own step: `fast`, the formulation every kind had before `--formulation auto`).
BATCH_SIZE, NOT_COMPARED = 256, ("reference",)


def find(record: dict[str, Any], device: jax.Device, *, batch_size: int, formulation: str) -> Baseline | None:
    """The baseline of the machine `record` (`jdp.bench.machine.machine()`) describes, for `device`'s kind.

    A baseline naming its CPU model is preferred to one known only by vector ISA and core count.
    None if no baseline was committed for that machine kind or the bench runs other settings.
    """
    if batch_size != BATCH_SIZE or formulation in NOT_COMPARED:
        return None
    here = MachineKind(record["cpu"], record.get("vector_isa", "unknown"), record["host_cpus"], device.device_kind)
    return best_match(committed(), lambda b: MachineKind(b.cpu, b.vector_isa, b.host_cpus, b.device_kind), here)


def ratio(baseline: Baseline | None, devices: int, images_per_s: float) -> float | None:
    """`images_per_s` over the baseline's float32 figure for the same device count, if there is one."""
    if baseline is None or devices not in baseline.float32_images_per_s:
        return None
    return images_per_s / baseline.float32_images_per_s[devices]


def __getattr__(name: str) -> Any:
    if name == "BASELINES":  # removed after 0.1.0; see docs/api.md
        raise AttributeError(f"`jdp.bench.baselines.BASELINES` is now `committed()`, read from experiments/results/{TABLE}.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
