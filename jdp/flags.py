"""Flags that `jdp train` and the benchmarks share, and what they set up before JAX starts.

Below both the CLI (`jdp.cli`) and the benchmarks (`jdp.bench`), so that the benchmarks never
import the CLI. Choices come from the library's own constants, so a flag offers exactly what the
library accepts. Errors name the flags' destinations (`plugin=...`, `out=...`), which the CLI
prints as the flags (`--plugin ...`, `--out ...`), as for every `jdp.errors.JdpError`.
"""

import argparse
import importlib
import os
import tempfile
from pathlib import Path

from jdp.errors import Arg, ConfigError, DeviceError, check_positive
from jdp.parallel.allreduce import names as allreduce_names
from jdp.parallel.compress import MODES
from jdp.parallel.layout import BACKENDS
from jdp.training.optimizers import OPTIMIZERS


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), like every other jdp error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`.\n")


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """`--devices`, `--cpu-devices`, `--no-xla-flags` and `--plugin`: what `setup_devices` and `load_plugins` read."""
    parser.add_argument("--devices", type=int, default=None, help="number of devices to use (default: all)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="simulate N CPU devices (set before JAX starts); for machines without accelerators")
    parser.add_argument("--no-xla-flags", action="store_true",
                        help="do not set jdp's XLA performance flags (see jdp/runtime/xla_flags.py; "
                        "also JDP_NO_XLA_FLAGS=1)")
    add_plugin_flag(parser)


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
    """`--plugin MODULE` (repeatable): what `load_plugins` imports."""
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (repeatable): it may register models and allreduce strategies "
                        "with jdp.register_model / jdp.register_allreduce")


def add_job_flags(parser: argparse.ArgumentParser) -> None:
    """`--coordinator`, `--num-processes`, `--process-id`: a multi-process job (`jdp launch` appends them)."""
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="multi-process: address of process 0's coordination service (with --num-processes "
                        "and --process-id; none of the three inside a SLURM/MPI job: detected)")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-process: processes in the job")
    parser.add_argument("--process-id", type=int, default=None, help="multi-process: this process's index, from 0")


def add_backend_flag(parser: argparse.ArgumentParser) -> None:
    """`--backend`: one of `jdp.parallel.layout.BACKENDS`."""
    parser.add_argument("--backend", default="pmap", choices=BACKENDS,
                        help="map the step with jax.pmap, or jax.jit(jax.shard_map) over a 1-D mesh")


def add_compress_flags(parser: argparse.ArgumentParser) -> None:
    """`--compress` and `--powersgd-rank`: how the allreduce compresses what it sends (jdp.parallel.compress)."""
    parser.add_argument("--compress", default="none", choices=MODES,
                        help="compress the allreduce: cast to bf16/fp16 (sums in that dtype), send bf16/fp16 but add "
                        f"in float32 at each hop (-wire, --allreduce {' or '.join(allreduce_names(wire=True))}), or rank-R "
                        "PowerSGD with error feedback")
    parser.add_argument("--powersgd-rank", type=int, default=None, metavar="R",
                        help="with --compress powersgd: the rank of its factors (default 1)")


def add_optimizer_flags(parser: argparse.ArgumentParser) -> None:
    """`--optimizer`, `--momentum`, `--weight-decay`, `--accumulate`, `--shard-optimizer` (see docs/optimizers.md)."""
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS,
                        help="optax optimizer on the full-batch mean gradient; sgd is the lesson's")
    parser.add_argument("--momentum", type=float, default=None,
                        help="--optimizer momentum: the trace's decay (default 0.9)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="sgd/momentum: L2 term added to the gradient (default none); adamw: decoupled "
                        "weight decay (default 1e-4, optax's)")
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="N micro-batches per device per step: gradients summed locally, one allreduce, "
                        "one update (the math of the whole batch, the activation memory of 1/N of it)")
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="ZeRO-2: reduce-scatter the gradients, each device updates its 1/k slice with its "
                        "1/k of the optimizer state, all-gather the params (any --allreduce with those halves: "
                        f"{', '.join(allreduce_names(halves=True))}, or a plugin's)")


def add_steps_per_call_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--steps-per-call S`: a positive number, or auto (`jdp.parallel.feeders.AUTO`, the default)."""
    parser.add_argument("--steps-per-call", type=_steps_per_call, default="auto", metavar="S", help=help)


def _steps_per_call(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or auto, got {text!r}") from None


def load_plugins(modules: list[str]) -> None:
    """Imports each `--plugin` module (they register their models and strategies when imported).

    Raises:
      ConfigError: if a module cannot be imported.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(Arg("plugin", name), f" cannot be imported: {e}. Is it on PYTHONPATH?") from None


def setup_devices(args: argparse.Namespace) -> list:
    """Sets XLA flags and simulated CPU devices, joins a multi-process job if there is one, then
    selects the devices (this is where JAX starts): with several processes, `--devices` of each."""
    from jdp.runtime import devices, distributed, faults, xla_flags

    for name in ("cpu_devices", "devices"):  # the library calls them `n` and `count`: named here as the flags
        if getattr(args, name) is not None:
            check_positive(name, getattr(args, name))
    xla_flags.enable(disabled=args.no_xla_flags)  # XLA reads its flags once, when the backend starts
    if args.cpu_devices is not None:
        devices.simulate_cpu_devices(args.cpu_devices)
    job = [getattr(args, name, None) for name in ("coordinator", "num_processes", "process_id")]
    if job[0] is not None or (not any(v is not None for v in job) and distributed.cluster_detected()):
        faults.send_native_logs_to(native_log_path(getattr(args, "out", None), job[2]))
    distributed.initialize(*job, heartbeat_s=faults.heartbeat_seconds(getattr(args, "collective_timeout", None)))
    try:
        return devices.select_devices(args.devices)
    except DeviceError as e:  # select_devices' `count` is what `--devices` sets
        raise DeviceError(*(Arg("devices", part.value) if isinstance(part, Arg) and part.name == "count" else part
                            for part in e.parts)) from None


def native_log_path(out: str | None, process_id: int | None) -> Path:
    """Where a multi-process job's C++ logs (XLA's, gloo's) go: `--out`, else the temporary directory."""
    folder = Path(out) if out is not None and Path(out).is_dir() else Path(tempfile.gettempdir())
    return folder / f"jdp-native-p{process_id if process_id is not None else os.getpid()}.log"


def check_out_dir(out: str | None) -> Path | None:
    """`--out DIR`, created if missing; None if not given.

    Raises:
      ConfigError: if it cannot be created or written to.
    """
    if out is None:
        return None
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(Arg("out", out), f" cannot be created: {e.strerror}.") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(Arg("out", out), " is not writable.")
    return path
