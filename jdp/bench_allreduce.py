"""`jdp bench allreduce` and `jdp bench step`: every allreduce strategy, measured side by side in one run.

`bench allreduce` follows nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): a buffer of
S bytes on each of k devices summed in t seconds (median over repeats, after a warm-up) has
algbw = S / t and busbw = algbw · 2(k−1)/k. busbw is what each link of a bandwidth-optimal ring
carries, so it can be compared across device counts and with the hardware's link bandwidth.
Each buffer holds small integers, so every order of summation gives the exact sum: `#wrong`
counts the elements, on every device, that differ from it (it must be 0).

`bench step` times the lesson's LeNet train step with each strategy, per leaf and fused, and
divides by psum's time measured in the same run: on a shared machine only such ratios compare.
"""

import argparse
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jdp import allreduce, data, distributed, lenet
from jdp.errors import ConfigError
from jdp.inflight import InFlight
from jdp.placement import AXIS, device_axis_sharding
from jdp.step import make_train_step, sgd, summed_cross_entropy

DEFAULT_SIZES = "4KiB..64MiB"
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_ITEMSIZE = 4  # the buffers are float32, as the gradients


def add_parser(
    benchmarks: argparse._SubParsersAction, add_device_flags: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Adds `allreduce` and `step` to the `jdp bench` subcommands."""
    names = list(allreduce.STRATEGIES)
    formatter = argparse.ArgumentDefaultsHelpFormatter
    p = benchmarks.add_parser(
        "allreduce", formatter_class=formatter,
        help="time each allreduce algorithm over buffer sizes (nccl-tests' algbw and busbw)",
        description="Time each allreduce algorithm on one float32 buffer per device, for each size: median "
        "over repeats after a warm-up, algbw = S/t, busbw = algbw·2(k−1)/k, #wrong = elements not equal "
        "to the exact sum on some device.",
    )
    add_device_flags(p)
    p.add_argument("--backend", default="pmap", choices=list(distributed.BACKENDS),
                   help="map the inside algorithms with jax.pmap or jax.jit(jax.shard_map)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="bytes per device: LO..HI (each ×4 the last) or a comma list; units B, KiB, MiB, GiB")
    p.add_argument("--algorithms", nargs="+", default=names, choices=names, metavar="NAME",
                   help=f"any of: {' '.join(names)}")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per algorithm and size (median reported)")
    p.add_argument("--out", default=None, metavar="DIR", help="write allreduce.json and allreduce.png here")
    p.set_defaults(run=run_allreduce_bench)

    p = benchmarks.add_parser(
        "step", formatter_class=formatter,
        help="time the LeNet train step with each allreduce algorithm, per leaf and fused, vs psum",
        description="Time the lesson's LeNet train step (SGD, summed loss) with each allreduce algorithm, "
        "per leaf and fused, interleaved in one run; report each as a ratio to psum per leaf.",
    )
    add_device_flags(p)
    p.add_argument("--backend", default="pmap", choices=list(distributed.BACKENDS),
                   help="map the step with jax.pmap or jax.jit(jax.shard_map) (see `jdp train --help`)")
    p.add_argument("--algorithms", nargs="+", default=names, choices=names, metavar="NAME",
                   help=f"any of: {' '.join(names)}")
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (median reported)")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="M",
                   help="fused configurations use buckets of at most M MB (default: one buffer)")
    p.add_argument("--out", default=None, metavar="DIR", help="write step.json here")
    p.set_defaults(run=run_step_bench)


# --- parsing -----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """`4KiB` → 4096 bytes; a whole number of float32 elements.

    Raises:
      ConfigError: for an unknown unit, or a size that is not a positive multiple of 4 bytes.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text)
    if not match:
        raise ConfigError(
            f"`--sizes` has `{text}`, not a size: write a number with a unit B, KiB, MiB or GiB, e.g. 4KiB."
        )
    size = int(match.group(1)) * _UNITS[match.group(2) or ""]
    if size < _ITEMSIZE or size % _ITEMSIZE:
        raise ConfigError(f"`--sizes` has `{text}`: a buffer must be a positive multiple of 4 bytes (float32).")
    return size


def parse_sizes(text: str) -> list[int]:
    """`LO..HI` → LO, 4·LO, 16·LO, … up to HI (nccl-tests' -b/-e/-f with f = 4); or `A,B,C`.

    Raises:
      ConfigError: for a malformed size or a range whose end is below its start.
    """
    if ".." in text:
        low, high = (parse_size(part) for part in text.split("..", 1))
        if high < low:
            raise ConfigError(f"`--sizes {text}`: the range ends below where it starts; write LO..HI.")
        sizes = [low]
        while sizes[-1] * 4 <= high:
            sizes.append(sizes[-1] * 4)
        return sizes
    return [parse_size(part) for part in text.split(",")]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"`--{name.replace('_', '-')}` must be a positive integer, got {value}.")


# --- bench allreduce ---------------------------------------------------------------------------


def bench_allreduce(
    devices: Sequence[jax.Device],
    sizes: Sequence[int],
    algorithms: Sequence[str],
    *,
    repeats: int = 5,
    min_seconds: float = 0.02,
    backend: str = "pmap",
) -> list[dict]:
    """Times each algorithm on one float32 buffer per device, for each size.

    For every size, each algorithm is first run once to compile and check (#wrong), then timed
    once to choose how many back-to-back calls make a sample of at least `min_seconds`; the timed
    samples then alternate between algorithms, so a slow phase of a shared machine hits them all.

    Args:
      devices: the k devices the buffers live on.
      sizes: bytes per device.
      algorithms: names in `allreduce.STRATEGIES`, per leaf (one buffer: fusing changes nothing).
      repeats: timed samples per algorithm and size; the median is reported.
      min_seconds: the least duration of one sample.
      backend: how the inside algorithms are mapped: "pmap" or "shard_map".

    Returns:
      One row per (size, algorithm): algorithm, devices, size_bytes, count, dtype, time_us,
      algbw_gbps, busbw_gbps (GB = 1e9 bytes), wrong, iters, samples_us (every repeat, for the spread).
    """
    k = len(devices)
    sharding = device_axis_sharding(devices)
    runners = {name: _runner(allreduce.get(name), devices, backend) for name in algorithms}
    rows = []
    for size in sizes:
        count = size // _ITEMSIZE
        x = jax.jit(_ramp, static_argnums=(0, 1), out_shardings=sharding)(k, count)
        wrong, iters = {}, {}
        for name, run in runners.items():
            wrong[name] = int(_count_wrong(run(x)))  # warm-up: compiles, and checks the sum
            once = _seconds_per_call(run, x, 1)
            iters[name] = max(1, min(1000, math.ceil(min_seconds / max(once, 1e-9))))
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(repeats):
            for name, run in runners.items():
                samples[name].append(_seconds_per_call(run, x, iters[name]))
        for name in runners:
            t = statistics.median(samples[name])
            algbw = size / t / 1e9
            rows.append({
                "algorithm": name, "devices": k, "size_bytes": size, "count": count, "dtype": "float32",
                "time_us": t * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (k - 1) / k,
                "wrong": wrong[name], "iters": iters[name], "samples_us": [u * 1e6 for u in samples[name]],
            })
        del x
    return rows


def _runner(strategy: allreduce.Allreduce, devices: Sequence[jax.Device],
            backend: str = "pmap") -> Callable[[jax.Array], jax.Array]:
    """x (k, n) sharded over `devices` → its allreduce, however the strategy runs."""
    if strategy.where == "outside":
        return strategy.fn
    if backend == "pmap":
        return jax.pmap(lambda local: strategy.fn(local, AXIS), axis_name=AXIS, devices=devices)
    return jax.jit(jax.shard_map(  # as in jdp.step: check_vma=False, the strategy is the one reduction
        lambda row: strategy.fn(row[0], AXIS)[None], mesh=distributed.mesh(devices),
        in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False,
    ))


def _ramp(k: int, count: int) -> jax.Array:
    """Row d, element j: (j mod 251) + d. Small integers: every summation order is exact in float32."""
    j = jnp.arange(count, dtype=jnp.int32) % 251
    return (j[None, :] + jnp.arange(k, dtype=jnp.int32)[:, None]).astype(jnp.float32)


@jax.jit
def _count_wrong(out: jax.Array) -> jax.Array:
    """Elements, over all devices' rows, that differ from the exact sum of `_ramp`'s rows."""
    k, count = out.shape
    j = jnp.arange(count, dtype=jnp.int32) % 251
    expected = (k * j + k * (k - 1) // 2).astype(jnp.float32)
    return jnp.sum(out != expected[None, :])


def _seconds_per_call(run: Callable[[jax.Array], jax.Array], x: jax.Array, iters: int) -> float:
    """Mean wall time of `iters` back-to-back calls, at most two in flight (see jdp.inflight)."""
    window = InFlight(limit=2)
    start = time.perf_counter()
    for _ in range(iters):
        window.push(run(x))
    window.drain()
    return (time.perf_counter() - start) / iters


def format_allreduce_table(rows: Sequence[dict], header: str) -> str:
    """nccl-tests' columns, one row per (size, algorithm), a blank line between sizes."""
    lines = [
        f"# {header}",
        f"#{'size':>11} {'count':>10}  {'type':<6} {'algorithm':<12} "
        f"{'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}",
        f"#{'(B)':>11} {'(elements)':>10}  {'':<6} {'':<12} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}",
    ]
    previous = None
    for r in rows:
        if previous is not None and r["size_bytes"] != previous:
            lines.append("")
        previous = r["size_bytes"]
        lines.append(f" {r['size_bytes']:>11} {r['count']:>10}  {'float':<6} {r['algorithm']:<12} "
                     f"{r['time_us']:>10.1f} {r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} {r['wrong']:>7}")
    return "\n".join(lines)


def run_allreduce_bench(args: argparse.Namespace) -> int:
    from jdp import cli, plot

    sizes = parse_sizes(args.sizes)
    _check_positive(repeats=args.repeats)
    out = cli._check_out_dir(args.out)
    devices = cli.setup_devices(args)
    rows = bench_allreduce(devices, sizes, args.algorithms, repeats=args.repeats, backend=args.backend)
    header = (f"jdp bench allreduce: {_where(devices)}, float32 sum, "
              f"median of {args.repeats} repeats after a warm-up")
    print(format_allreduce_table(rows, header), flush=True)
    if out is not None:
        record = {"benchmark": "allreduce", **_machine(devices, args), "repeats": args.repeats, "results": rows}
        (out / "allreduce.json").write_text(json.dumps(record, indent=2) + "\n")
        title = f"allreduce on {len(devices)} {devices[0].platform} devices, float32, median of {args.repeats}"
        plot.busbw_vs_size(rows, out / "allreduce.png", title=title)
        print(f"wrote {out / 'allreduce.json'} and {out / 'allreduce.png'}")
    return 0


# --- bench step --------------------------------------------------------------------------------


def bench_step(
    devices: Sequence[jax.Device],
    algorithms: Sequence[str],
    *,
    batch_size: int = 256,
    steps: int = 5,
    repeats: int = 5,
    bucket_mb: float | None = None,
    backend: str = "pmap",
) -> list[dict]:
    """Times the LeNet train step with each algorithm, per leaf and fused, interleaved.

    Every configuration trains its own replicas on the same batch; after two warm-up steps
    (compilation), each repeat times `steps` steps of every configuration in turn.

    Args:
      devices: the k devices; `batch_size` must be divisible by k.
      algorithms: names in `allreduce.STRATEGIES`.
      batch_size: images per step over all devices.
      steps: steps per timed sample.
      repeats: samples per configuration; the median is reported.
      bucket_mb: bucket size of the fused configurations (None: one buffer per dtype).
      backend: how the step is mapped: "pmap" or "shard_map".

    Returns:
      One row per configuration: algorithm, fused, strategy (its full name), ms_per_step,
      images_per_s, vs_psum (time / psum-per-leaf time; psum is measured even if not asked for) and
      samples_ms (every repeat, for the spread).
    """
    configs = [allreduce.get(name, fuse=fuse, bucket_mb=bucket_mb if fuse else None)
               for name in dict.fromkeys(["psum", *algorithms]) for fuse in (False, True)]
    split = data.synthetic(jax.random.key(0), n_train=batch_size, n_test=1).train
    x, y = distributed.put_batch(split.images, split.labels, batch_size, devices, backend)
    optimizer = sgd(0.2)
    params = lenet.init(jax.random.key(0))
    loss_fn = summed_cross_entropy(lenet.apply)
    runs = []
    for strategy in configs:
        step = make_train_step(loss_fn, optimizer, strategy, devices, backend=backend)
        state = tuple(distributed.put_replicated(t, devices, backend) for t in (params, optimizer.init(params)))
        state = _time_steps(step, state, x, y, 2)[0]  # warm-up: compile
        runs.append([step, state, []])
    for _ in range(repeats):
        for run in runs:
            run[1], seconds = _time_steps(run[0], run[1], x, y, steps)
            run[2].append(seconds / steps)
    reference = statistics.median(runs[0][2])
    rows = []
    for strategy, (_, _, samples) in zip(configs, runs, strict=True):
        t = statistics.median(samples)
        name, _, mode = strategy.name.partition("+")
        rows.append({
            "algorithm": name, "fused": bool(mode), "strategy": strategy.name, "ms_per_step": t * 1e3,
            "images_per_s": batch_size / t, "vs_psum": t / reference, "samples_ms": [u * 1e3 for u in samples],
        })
    return [r for r in rows if r["algorithm"] in algorithms]


def _time_steps(step, state, x, y, steps: int):
    """Runs `steps` steps, at most two in flight; returns the new state and the seconds taken."""
    params, opt_state = state
    window = InFlight(limit=2)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
        window.push(loss)
    window.drain()
    jax.block_until_ready((params, opt_state))
    return (params, opt_state), time.perf_counter() - start


def format_step_table(rows: Sequence[dict], header: str) -> str:
    lines = [f"# {header}",
             f"# {'algorithm':<12} {'mode':<16} {'ms/step':>9} {'images/s':>9} {'vs psum':>8}"]
    for r in rows:
        mode = r["strategy"].partition("+")[2] or "per-leaf"
        lines.append(f"  {r['algorithm']:<12} {mode:<16} {r['ms_per_step']:>9.1f} {r['images_per_s']:>9.0f} "
                     f"{r['vs_psum']:>7.2f}x")
    return "\n".join(lines)


def run_step_bench(args: argparse.Namespace) -> int:
    from jdp import cli

    _check_positive(batch_size=args.batch_size, steps=args.steps, repeats=args.repeats)
    allreduce.get("psum", fuse=True, bucket_mb=args.bucket_mb)  # checks `--bucket-mb`
    out = cli._check_out_dir(args.out)
    devices = cli.setup_devices(args)
    if args.batch_size % len(devices):
        raise ConfigError(
            f"Batch size must be divisible by the number of devices: `--batch-size {args.batch_size}` "
            f"over {len(devices)} devices. Use a multiple of {len(devices)}."
        )
    rows = bench_step(devices, args.algorithms, batch_size=args.batch_size, steps=args.steps,
                      repeats=args.repeats, bucket_mb=args.bucket_mb, backend=args.backend)
    header = (f"jdp bench step: lesson LeNet, batch {args.batch_size} over {_where(devices)}, "
              f"median of {args.repeats} repeats of {args.steps} steps, interleaved")
    print(format_step_table(rows, header), flush=True)
    if out is not None:
        record = {"benchmark": "step", **_machine(devices, args), "batch_size": args.batch_size,
                  "steps": args.steps, "repeats": args.repeats, "bucket_mb": args.bucket_mb, "results": rows}
        (out / "step.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out / 'step.json'}")
    return 0


# --- shared ------------------------------------------------------------------------------------


def _where(devices: Sequence[jax.Device]) -> str:
    simulated = " (simulated on one host's CPU cores)" if devices[0].platform == "cpu" else ""
    return f"{len(devices)} {devices[0].platform} devices{simulated}"


def _machine(devices: Sequence[jax.Device], args: argparse.Namespace) -> dict:
    """What the numbers were measured on, for the JSON record."""
    return {
        "devices": [repr(d) for d in devices], "platform": devices[0].platform,
        "device_kind": devices[0].device_kind, "cpu_devices_simulated": args.cpu_devices, "backend": args.backend,
        "host_cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
        "jax_version": jax.__version__, "numpy_version": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # jdp's CPU performance flags, unless --no-xla-flags
    }
