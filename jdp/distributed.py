"""Beyond one process: jax.distributed start-up, each process's slice of a batch, global arrays.

JAX's multi-process model (one process per host, each driving its local devices): every process
runs the same program, `jax.devices()` lists the devices of all processes, and a global
`jax.Array` is assembled from the shards each process holds. A computation over such arrays is
a collective program; every process must dispatch it, in the same order.

The two train-step backends (see `jdp.step`) lay out arrays differently, and this module places
host data in either layout, in one process or many:

* ``pmap``: a leading device axis of size k, sharded over it: params (k, ...), batch (k, B/k, ...).
* ``shard_map``: the natural shapes: params replicated with `P()`, batch (B, ...) with `P('data')`.

Devices are ordered by (process, id), so process p owns a contiguous block of the mesh and therefore
a contiguous block of rows of every global batch: `process_rows` is the slice it loads.
"""

import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jdp.data import Split
from jdp.errors import ConfigError, DeviceError
from jdp.inflight import InFlight
from jdp.placement import AXIS

PyTree = Any
Backend = Literal["pmap", "shard_map"]
BACKENDS: tuple[Backend, ...] = ("pmap", "shard_map")


def check_backend(backend: str) -> None:
    """Raises ConfigError unless `backend` is one of BACKENDS."""
    if backend not in BACKENDS:
        raise ConfigError(f"Unknown `--backend {backend}`; choose one of: {', '.join(BACKENDS)}.")


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
) -> bool:
    """Joins the multi-process job described by the flags or, without flags, by the cluster.

    Must run before anything starts JAX's backends (like `jdp.devices.simulate_cpu_devices`).
    On CPUs the collectives between processes go through gloo (`jax_cpu_collectives_implementation`,
    whose default is "gloo" in the JAX versions jdp supports, 0.10 to 0.12).

    Args:
      coordinator: "HOST:PORT" of process 0's coordination service (`--coordinator`).
      num_processes: how many processes take part (`--num-processes`).
      process_id: this process's index in [0, num_processes) (`--process-id`).
      environ: the environment to inspect for a cluster (default: os.environ).

    Returns:
      True if jax.distributed was initialised (more than one process), False for a single process.

    Raises:
      ConfigError: for an incomplete or inconsistent set of flags.
      DeviceError: if JAX's backends already started, or the coordinator cannot be joined.
    """
    flags = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    given = {name for name, value in flags.items() if value is not None}
    if num_processes == 1 and given <= {"--num-processes", "--process-id"}:
        if process_id not in (None, 0):
            raise ConfigError(f"`--process-id {process_id}` must be 0 with `--num-processes 1`.")
        return False
    if not given:
        if not cluster_detected(environ):
            return False
        return _initialize({})
    if given != set(flags):
        missing = ", ".join(f"`{name}`" for name in flags if name not in given)
        raise ConfigError(
            f"Multi-process training needs `--coordinator HOST:PORT`, `--num-processes` and `--process-id` "
            f"together; missing {missing}. Give all three (or none, to let a SLURM/MPI job set them)."
        )
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", coordinator):
        raise ConfigError(f"`--coordinator {coordinator}` must be HOST:PORT, e.g. 10.0.0.1:1234.")
    if num_processes < 1:
        raise ConfigError(f"`--num-processes` must be at least 1, got {num_processes}.")
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"`--process-id {process_id}` must be in [0, {num_processes}) for `--num-processes {num_processes}`."
        )
    return _initialize(dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id))


def _initialize(kwargs: dict[str, Any]) -> bool:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DeviceError(
            "Cannot join a multi-process job: JAX already started. Call `jdp.distributed.initialize` "
            "before any JAX computation."
        )
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        where = kwargs.get("coordinator_address", "the cluster's coordinator")
        raise DeviceError(f"Could not join the multi-process job at {where}: {e}") from None
    return True


def global_devices(count: int | None = None, platform: str | None = None) -> list[jax.Device]:
    """All processes' devices, ordered by (process, id); `count` per process if given.

    Every process must use the same number of devices, so that each owns an equal block of rows.

    Raises:
      ConfigError: if `count` < 1.
      DeviceError: if a process has fewer than `count` devices.
    """
    if count is not None and count < 1:
        raise ConfigError(f"`--devices` must be at least 1, got {count}.")
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(platform), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    per_process = min(len(ds) for ds in by_process.values()) if count is None else count
    for process, ds in by_process.items():
        if len(ds) < per_process:
            raise DeviceError(
                f"`--devices {per_process}` asks for more devices than process {process} has ({len(ds)}). "
                f"On a CPU, simulate more with `--cpu-devices {per_process}`."
            )
    return [d for ds in by_process.values() for d in ds[:per_process]]


def mesh(devices: Sequence[jax.Device]) -> Mesh:
    """The 1-D device mesh whose axis is `AXIS`, in the order given."""
    return Mesh(np.asarray(devices), (AXIS,))


def process_rows(batch_size: int, devices: Sequence[jax.Device]) -> slice:
    """The rows of every global batch of `batch_size` that this process loads and feeds.

    Process p holds mesh positions [p·k_p, (p+1)·k_p) and so rows [p·B/P, (p+1)·B/P): the slices
    of all processes tile the batch exactly (no overlap, no row lost), in the same order as on one
    process with all the devices.

    Raises:
      ConfigError: if `batch_size` does not divide evenly over `devices`.
      DeviceError: if this process's devices are not one contiguous block of `devices`.
    """
    if batch_size % len(devices):
        raise ConfigError(
            f"Batch size must be divisible by the number of devices: `--batch-size {batch_size}` over "
            f"{len(devices)} devices. Use a multiple of {len(devices)}."
        )
    per_device = batch_size // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if not mine or mine != list(range(mine[0], mine[0] + len(mine))):
        raise DeviceError(
            f"Process {jax.process_index()}'s devices must form one contiguous block of the step's devices; "
            "order them by process, as `jdp.distributed.global_devices` does."
        )
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def put_replicated(tree: PyTree, devices: Sequence[jax.Device], backend: Backend) -> PyTree:
    """One copy of every leaf on each device, in the layout of `backend`.

    Every process passes the same host values (same seed); each places only its own devices' copies.
    """
    check_backend(backend)
    k = len(devices)
    sharding = NamedSharding(mesh(devices), P(AXIS) if backend == "pmap" else P())

    def put(leaf: Any) -> jax.Array:
        host = np.asarray(leaf)
        if backend == "pmap":
            host = np.broadcast_to(host[None], (k, *host.shape))  # a view: no k-fold host copy
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)


def put_batch(
    images: np.ndarray, labels: np.ndarray, batch_size: int, devices: Sequence[jax.Device], backend: Backend
) -> tuple[jax.Array, jax.Array]:
    """A global batch from this process's rows of it (`process_rows`), in the layout of `backend`.

    Args:
      images, labels: this process's rows of the global batch.
      batch_size: the global batch size B.
      devices: the mesh devices (all processes').
      backend: "pmap" gives (k, B/k, ...); "shard_map" gives (B, ...) sharded over `AXIS`.

    Raises:
      ConfigError: if the arrays do not hold exactly this process's share of rows.
    """
    check_backend(backend)
    rows = process_rows(batch_size, devices)
    if len(images) != rows.stop - rows.start or len(labels) != len(images):
        raise ConfigError(
            f"This process must feed rows [{rows.start}, {rows.stop}) of each global batch of {batch_size}; "
            f"got {len(images)} images and {len(labels)} labels."
        )
    return put_rows(images, batch_size, devices, backend), put_rows(labels, batch_size, devices, backend)


def put_rows(local: np.ndarray, batch_size: int, devices: Sequence[jax.Device], backend: Backend) -> jax.Array:
    """One global array of `batch_size` rows from this process's rows of it (`process_rows`), unchecked."""
    k, sharding, local = len(devices), NamedSharding(mesh(devices), P(AXIS)), np.asarray(local)
    shape = (batch_size, *local.shape[1:])
    if backend == "pmap":
        local = local.reshape(-1, batch_size // k, *local.shape[1:])
        shape = (k, batch_size // k, *local.shape[2:])
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, shape)


def process_batches(
    split: Split, batch_size: int, key: jax.Array, devices: Sequence[jax.Device], skip: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """This process's rows of every batch of `jdp.pipeline.epoch_batches`: the same permutation of
    `key` (identical on every process), batch after batch from batch `skip`, only the rows
    `process_rows` gathered."""
    rows = process_rows(batch_size, devices)
    order = np.asarray(jax.random.permutation(key, len(split.labels)))
    for start in range(skip * batch_size, len(order) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size][rows]
        yield split.images[idx], split.labels[idx]


def make_epoch_runner(
    step: Callable, split: Split, devices: Sequence[jax.Device], batch_size: int, backend: Backend,
    *, steps_per_call: int = 1,
) -> Callable:
    """`run_epoch(state, key, progress, start=0, after_call=None) -> (state, losses)` with the
    contract of `jdp.pipeline.make_epoch_runner`, for any backend and any number of processes:
    each step, every process copies its rows of the batch from the host (`process_batches`) and
    they are assembled into one global batch.

    Raises:
      ConfigError: for `steps_per_call` other than 1 (only the single-process pmap pipeline has it).
    """
    if steps_per_call != 1:
        raise ConfigError(
            f"`--steps-per-call {steps_per_call}` is implemented for `--backend pmap` in a single process; "
            "use `--steps-per-call 1` with `--backend shard_map` or several processes."
        )
    steps = len(split.labels) // batch_size

    def run_epoch(state, key, progress, start=0, after_call=None):
        (params, opt_state), window, losses = state, InFlight(limit=2), []  # bounded: see jdp.inflight
        batches = process_batches(split, batch_size, key, devices, skip=start)
        for images, labels in progress(batches, steps - start):
            x, y = put_batch(images, labels, batch_size, devices, backend)
            params, opt_state, loss = step(params, opt_state, x, y)
            window.push(loss)
            losses.append(loss)
            if after_call is not None:
                after_call(1, (params, opt_state), loss)
        window.drain()
        return (params, opt_state), losses

    return run_epoch


def local_copy(tree: PyTree, backend: Backend) -> PyTree:
    """This process's copy of replicated values (no communication): the host's view of the params."""
    check_backend(backend)

    def first(x: jax.Array) -> jax.Array:
        data = x.addressable_shards[0].data
        return data[0] if backend == "pmap" else data

    return jax.tree.map(first, tree)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a step output on every process, e.g. all k per-device losses.

    With several processes this is a collective (every process must call it): a global array
    (shard_map) is gathered; a process-local one (what `jax.pmap` returns there) is concatenated
    in process order.
    """
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
