"""What kind of machine this is, as far as speed goes: CPU model, vector instructions, cores, device kind.

Measured speeds (the committed baselines, the formulation table: `jdp.runtime.measurements`) are
keyed by it: VMs that report the same EPYC model with and without AVX-512 run at different speeds
(experiments/results/bench-train/baselines.json). Reading /proc/cpuinfo is the I/O; `matches` and
`best_match` are pure.
"""

import os
import platform
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class MachineKind(NamedTuple):
    """A machine kind. In a known kind (a table's key), `cpu=None` stands for any CPU model with that
    vector ISA and core count: a kind seen only through someone else's measurement, its model string unknown."""

    cpu: str | None  # /proc/cpuinfo's model name
    vector_isa: str  # its widest vector instructions (`vector_isa`)
    host_cpus: int
    device_kind: str  # jax's `device.device_kind` ("cpu", "NVIDIA H200", ...)


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """/proc/cpuinfo's model name and flags (platform.processor() and [] where there is none)."""
    cpuinfo = read_or_empty("/proc/cpuinfo").splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
               platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    return cpu, flags


def vector_isa(flags: Sequence[str]) -> str:
    """The widest vector instructions among /proc/cpuinfo's `flags`, the ones that set a CPU's speed here.

    VMs that report the same CPU model may expose different ones (the same EPYC with or without
    AVX-512), and the kernels of XLA, oneDNN and PyTorch differ accordingly.
    """
    have = set(flags)
    for name in ("amx_bf16", "avx512_bf16", "avx512f", "avx2"):
        if name in have:
            return name
    return "other" if have else "unknown"


def this_kind(device_kind: str) -> MachineKind:
    """This host's kind, for devices of `device_kind`."""
    cpu, flags = cpu_model_and_flags()
    return MachineKind(cpu, vector_isa(flags), os.cpu_count() or 1, device_kind)


def matches(known: MachineKind, kind: MachineKind) -> bool:
    """Whether `kind` (a real machine) is the `known` one (a table's key, whose `cpu` may be None: any)."""
    return known.cpu in (None, kind.cpu) and known[1:] == kind[1:]


def best_match(items: Iterable[T], key: Callable[[T], MachineKind], kind: MachineKind) -> T | None:
    """The first of `items` whose `key` matches `kind`, one naming the CPU model before one that does not."""
    found = [item for item in items if matches(key(item), kind)]
    return next((item for item in found if key(item).cpu is not None), found[0] if found else None)


def read_or_empty(path: str) -> str:
    """A /proc file's text, or "" where there is none (not Linux, a sandbox)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def __getattr__(name: str) -> Any:
    if name == "Kind":  # renamed after 0.1.0 (`Kind` is a placement kind in jdp.parallel.layout); see docs/api.md
        raise AttributeError("`jdp.runtime.machine_kind.Kind` is now `MachineKind`.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
