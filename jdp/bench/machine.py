"""What a benchmark's numbers were measured on, recorded beside them (one description for every bench)."""

import os
import platform
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jdp.runtime.machine_kind import cpu_model_and_flags, read_or_empty, vector_isa


def machine(devices: Sequence[jax.Device] = ()) -> dict[str, Any]:
    """The host, the stack, jdp's XLA flags, how busy the machine was, and the devices if given."""
    cpu, flags = cpu_model_and_flags()
    record = {
        "cpu": cpu, "vector_isa": vector_isa(flags), "host_cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(), "jax_version": jax.__version__, "numpy_version": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # jdp's CPU performance flags, unless --no-xla-flags
        "load_average": read_or_empty("/proc/loadavg").split()[:3],
    }
    if devices:
        record.update(devices=[repr(d) for d in devices], platform=devices[0].platform,
                      device_kind=devices[0].device_kind)
    return record


def where(devices: Sequence[jax.Device]) -> str:
    """"8 cpu devices (simulated on one host's CPU cores)", for table headers."""
    simulated = " (simulated on one host's CPU cores)" if devices[0].platform == "cpu" and len(devices) > 1 else ""
    return f"{len(devices)} {devices[0].platform} devices{simulated}"
