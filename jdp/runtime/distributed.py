"""Joining a multi-process job: `jax.distributed` start-up from flags or a SLURM/MPI environment.

JAX's multi-process model (one process per host, each driving its local devices): every process
runs the same program, `jax.devices()` lists the devices of all processes, and a global
`jax.Array` is assembled from the shards each process holds (see `jdp.parallel.layout`). A
computation over such arrays is a collective program; every process must dispatch it, in the
same order.
"""

import os
import re
from typing import Any

import jax

from jdp.errors import Arg, ConfigError, DeviceError, check_positive


def cluster_detected(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment is a multi-process job that `jax.distributed.initialize()` detects.

    Only launchers that say how many processes they started count (SLURM's `srun`, Open MPI's
    `mpirun`): a single-task job stays single-process without a coordinator.
    """
    env = os.environ if environ is None else environ
    for count in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if env.get(count, "1").isdigit() and int(env.get(count, "1")) > 1:
            return True
    return False


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    environ: dict[str, str] | None = None,
    heartbeat_s: int | None = None,
) -> bool:
    """Joins the multi-process job described by the arguments or, without any, by the cluster.

    Must run before anything starts JAX's backends (like `jdp.simulate_cpu_devices`).
    On CPUs the collectives between processes go through gloo (`jax_cpu_collectives_implementation`,
    whose default is "gloo" in the JAX versions jdp supports, 0.10 to 0.12).

    Args:
      coordinator: "HOST:PORT" of process 0's coordination service (`--coordinator`).
      num_processes: how many processes take part (`--num-processes`).
      process_id: this process's index in [0, num_processes) (`--process-id`).
      environ: the environment to inspect for a cluster (default: os.environ).
      heartbeat_s: seconds after which the coordination service declares a silent process dead and
        aborts the others (None: JAX's default, 100); `jdp.runtime.faults.heartbeat_seconds` keeps
        it above the collective timeout, so that jdp's one line comes first.

    Returns:
      True if jax.distributed was initialised (more than one process), False for a single process.

    Raises:
      ConfigError: for an incomplete or inconsistent set of arguments.
      DeviceError: if JAX's backends already started, or the coordinator cannot be joined.
    """
    job = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    given = {name for name, value in job.items() if value is not None}
    if num_processes == 1 and given <= {"num_processes", "process_id"}:
        if process_id not in (None, 0):
            raise ConfigError(Arg("process_id", process_id), " must be 0 with ", Arg("num_processes", 1), ".")
        return False
    if not given:
        if not cluster_detected(environ):
            return False
        return _initialize({}, heartbeat_s)
    if given != set(job):
        missing = [part for name in job if name not in given for part in (", ", Arg(name))][1:]
        raise ConfigError(
            "Multi-process training needs ", Arg("coordinator"), " (HOST:PORT), ", Arg("num_processes"), " and ",
            Arg("process_id"), " together; missing ", *missing,
            ". Give all three (or none, to let a SLURM/MPI job set them)."
        )
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", coordinator):
        raise ConfigError(Arg("coordinator", coordinator), " must be HOST:PORT, e.g. 10.0.0.1:1234.")
    check_positive("num_processes", num_processes)
    if not 0 <= process_id < num_processes:
        raise ConfigError(Arg("process_id", process_id), f" must be in [0, {num_processes}) for ",
                          Arg("num_processes", num_processes), ".")
    return _initialize(dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id),
                       heartbeat_s)


def _initialize(kwargs: dict[str, Any], heartbeat_s: int | None) -> bool:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DeviceError(
            "Cannot join a multi-process job: JAX already started. Call `jdp.runtime.distributed.initialize` "
            "before any JAX computation."
        )
    try:
        jax.distributed.initialize(**kwargs, **({} if heartbeat_s is None else {"heartbeat_timeout_seconds": heartbeat_s}))
    except (RuntimeError, ValueError) as e:
        where = kwargs.get("coordinator_address", "the cluster's coordinator")
        raise DeviceError(f"Could not join the multi-process job at {where}: {e}") from None
    return True
