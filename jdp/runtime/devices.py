"""Which devices a run uses, the name of the axis over them, and simulated CPU devices.

Simulation must be configured before JAX initialises its backends (the first `jax.devices()` call
or the first computation), which is why the CLI calls `simulate_cpu_devices` before anything else.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax._src import xla_bridge

from jdp.errors import Arg, DeviceError, check_positive

AXIS = "data"  # the one device-axis name used by every mapped function and collective


def simulate_cpu_devices(n: int) -> None:
    """Makes the CPU backend expose `n` devices (XLA's old `--xla_force_host_platform_device_count`).

    Args:
      n: number of CPU devices to simulate, at least 1.

    Raises:
      ConfigError: if `n` < 1.
      DeviceError: if JAX's backend is already running with a different CPU device count.
    """
    check_positive("n", n)
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceError(
                f"Cannot simulate {n} CPU devices: JAX already started with {have}. "
                "Call `simulate_cpu_devices` before any JAX computation."
            )
        return
    jax.config.update("jax_num_cpu_devices", n)


def select_devices(count: int | None = None, platform: str | None = None) -> list[jax.Device]:
    """The first `count` devices of every process (all of them if None), ordered by (process, id).

    In one process these are its first `count` local devices. With several processes each uses the
    same number, so that each owns one equal, contiguous block of the mesh (and of every batch).

    Args:
      count: devices per process; None means all (the smallest count any process has).
      platform: "cpu", "gpu", "tpu" or None for JAX's default backend.

    Raises:
      ConfigError: if `count` < 1.
      DeviceError: if a process has fewer than `count` devices.
    """
    if count is not None:
        check_positive("count", count)
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(platform), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    per_process = min(len(ds) for ds in by_process.values()) if count is None else count
    for process, ds in by_process.items():
        if len(ds) < per_process:
            where = "this process has" if len(by_process) == 1 else f"process {process} has"
            raise DeviceError(
                Arg("count", per_process), f" asks for more devices than exist: {where} {len(ds)} "
                f"{ds[0].platform} device(s). On a CPU, simulate more before JAX starts: ",
                Arg("cpu_devices", per_process, python=f"simulate_cpu_devices({per_process})"), "."
            )
    return [d for ds in by_process.values() for d in ds[:per_process]]


def describe(devices: Sequence[jax.Device]) -> list[str]:
    """Device names as the lesson prints them, e.g. ["CpuDevice(id=0)", "CpuDevice(id=1)"]."""
    return [repr(d) for d in devices]


def __getattr__(name: str) -> Any:
    if name == "mesh":  # moved after 0.1.0; see docs/api.md
        raise AttributeError("`jdp.runtime.devices.mesh` is now `jdp.parallel.layout.mesh`: placement owns the mesh.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
