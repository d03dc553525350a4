"""Committed float32 baselines of `jdp bench train`, one per machine kind, to report speed-ups against.

A baseline is what `jdp bench train` measured for float32 (global batch 256, the fast LeNet) on one
kind of machine, and the lesson's own PyTorch code timed there in the same hour. The bench prints
every row's images/s over these, so a change to the step shows up as a ratio on the machine the
baseline came from. Absolute speeds on shared machines drift; rerun the baseline's command (its
`source` folder holds the raw output) when a machine kind's figures look off, and commit it here.
"""

from typing import Any, NamedTuple

import jax

from jdp.runtime.machine_kind import Kind, best_match


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


BASELINES: tuple[Baseline, ...] = (
    Baseline(
        machine="2-core AMD EPYC VM, AVX2 only", cpu="AMD EPYC", vector_isa="avx2", host_cpus=2, device_kind="cpu",
        float32_images_per_s={1: 4984.0, 2: 5213.0},  # the faster of two rounds, each fastest of 3
        lesson_images_per_s=2626.0,  # best of 6 epochs, alternating with the two jdp rounds
        measured="2026-12-03, JAX 0.12.0.1, Python 3.13.0",
        source="bf90975:experiments/results/bench-train/baseline-2026-12-03",
    ),
    Baseline(
        machine="2-core AMD EPYC VM with AVX-512 BF16", cpu="AMD EPYC", vector_isa="avx512_bf16", host_cpus=2,
        device_kind="cpu",
        float32_images_per_s={1: 9087.0, 2: 8706.0},  # the fastest of three rounds, each fastest of 3
        lesson_images_per_s=4695.0,  # best of 9 epochs, alternating with the three jdp rounds
        measured="2026-12-03, JAX 0.12.0.1, Python 3.13.0",
        source="experiments/results/bench-train/avx512-bf16",
    ),
    Baseline(  # known from issue 26's measurement only: its CPU model string was not recorded
        machine="2-core Intel Xeon VM with AVX-512 and AMX", cpu=None, vector_isa="amx_bf16", host_cpus=2,
        device_kind="cpu",
        float32_images_per_s={1: 9558.0, 2: 12311.0},  # jdp bench train --cpu-devices 2, quiet
        lesson_images_per_s=6548.0,  # torch 2.13.0+cpu, 2 threads, alternating with jdp
        measured="before 2026-12-04, JAX 0.12.0.1, by issue 26's author",
        source="issue 26 (no raw output committed)",
    ),
)

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
    here = Kind(record["cpu"], record.get("vector_isa", "unknown"), record["host_cpus"], device.device_kind)
    return best_match(BASELINES, lambda b: Kind(b.cpu, b.vector_isa, b.host_cpus, b.device_kind), here)


def ratio(baseline: Baseline | None, devices: int, images_per_s: float) -> float | None:
    """`images_per_s` over the baseline's float32 figure for the same device count, if there is one."""
    if baseline is None or devices not in baseline.float32_images_per_s:
        return None
    return images_per_s / baseline.float32_images_per_s[devices]
