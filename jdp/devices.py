"""Choosing devices, and simulating several CPU devices on a machine without accelerators.

Simulation must be configured before JAX initialises its backends (the first `jax.devices()` call
or the first computation), which is why the CLI calls `simulate_cpu_devices` before anything else.
"""

from collections.abc import Sequence

import jax
from jax._src import xla_bridge

from jdp.errors import ConfigError, DeviceError

Device = jax.Device


def simulate_cpu_devices(n: int) -> None:
    """Makes the CPU backend expose `n` devices (the old `--xla_force_host_platform_device_count`).

    Args:
      n: number of CPU devices to simulate, at least 1.

    Raises:
      ConfigError: if `n` < 1.
      DeviceError: if JAX's backend is already running with a different CPU device count.
    """
    if n < 1:
        raise ConfigError(f"`--cpu-devices` must be at least 1, got {n}.")
    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceError(
                f"Cannot simulate {n} CPU devices: JAX already started with {have}. "
                "Call `simulate_cpu_devices` before any JAX computation."
            )
        return
    jax.config.update("jax_num_cpu_devices", n)


def select_devices(count: int | None = None, platform: str | None = None) -> list[Device]:
    """Returns the first `count` local devices of `platform` (default: JAX's default backend).

    Args:
      count: how many devices to use; None means all of them.
      platform: "cpu", "gpu", "tpu" or None for the default backend.

    Raises:
      ConfigError: if `count` < 1.
      DeviceError: if fewer than `count` devices exist.
    """
    available = jax.local_devices(backend=platform)
    if count is None:
        return list(available)
    if count < 1:
        raise ConfigError(f"`--devices` must be at least 1, got {count}.")
    if count > len(available):
        kind = available[0].platform if available else platform
        raise DeviceError(
            f"`--devices {count}` asks for more devices than exist: this process has "
            f"{len(available)} {kind} device(s). On a CPU, simulate more with `--cpu-devices {count}`."
        )
    return list(available[:count])


def describe(devices: Sequence[Device]) -> list[str]:
    """Device names as the lesson prints them, e.g. ["CpuDevice(id=0)", "CpuDevice(id=1)"]."""
    return [repr(d) for d in devices]
