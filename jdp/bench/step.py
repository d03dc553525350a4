"""`jdp bench step`: the lesson's LeNet train step with every allreduce strategy, side by side.

Each strategy is timed per leaf and fused, interleaved in one run, and divided by psum's time
measured in the same run: on a shared machine only such ratios compare. Then `steps` more steps of
each are profiled (`jdp.training.profile`) for the breakdown column: compute, communication and
host milliseconds per step.
"""

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence

import jax

from jdp import data
from jdp.bench.allreduce import add_algorithms_flag, check_algorithms
from jdp.bench.machine import machine, where
from jdp.errors import check_positive
from jdp.flags import add_backend_flag, add_device_flags, check_out_dir, load_plugins, setup_devices
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel.inflight import repeat_step
from jdp.parallel.layout import check_divisible, split_batch
from jdp.training.build import build_run
from jdp.training.config import TrainConfig
from jdp.training.profile import Profiler


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `step` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "step", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="time the LeNet train step with each allreduce algorithm, per leaf and fused, vs psum",
        description="Time the lesson's LeNet train step (SGD, summed loss) with each allreduce algorithm, "
        "per leaf and fused, interleaved in one run; report each as a ratio to psum per leaf.",
    )
    add_device_flags(p)
    add_backend_flag(p)
    add_algorithms_flag(p)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (median reported)")
    p.add_argument("--bucket-mb", type=float, default=None, metavar="M",
                   help="fused configurations use buckets of at most M MB (default: one buffer)")
    p.add_argument("--out", default=None, metavar="DIR", help="write step.json here")
    p.set_defaults(run=run_step_bench)


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
      algorithms: registered strategy names (`jdp.allreduce_names()`).
      batch_size: images per step over all devices.
      steps: steps per timed sample.
      repeats: samples per configuration; the median is reported.
      bucket_mb: bucket size of the fused configurations (None: one buffer per dtype).
      backend: how the step is mapped: "pmap" or "shard_map".

    Returns:
      One row per configuration: algorithm, fused, strategy (its full name), ms_per_step,
      images_per_s, vs_psum (time / psum-per-leaf time; psum is measured even if not asked for),
      samples_ms (every repeat, for the spread) and breakdown (`jdp.training.profile.Breakdown` of
      `steps` profiled steps, as a dict).
    """
    configs = [allreduce.get(name, fuse=fuse, bucket_mb=bucket_mb if fuse else None)
               for name in dict.fromkeys(["psum", *algorithms]) for fuse in (False, True)]
    split = data.synthetic(jax.random.key(0), n_train=batch_size, n_test=1).train
    x, y = split_batch(split.images, split.labels, devices, backend)
    params = lenet.init(jax.random.key(0))
    runs, traces = [], tempfile.TemporaryDirectory(prefix="jdp-bench-step-")
    for strategy in configs:
        profiler = Profiler(f"{traces.name}/{strategy.name}", 1, steps, len(devices), strategy)
        config = TrainConfig(batch_size=batch_size, formulation="reference", allreduce=strategy, backend=backend)
        run = build_run(config, devices)  # the components `train` builds (sgd, lr 0.2), once per strategy
        step = run.step(segment=profiler.segment)
        state = run.placed(*run.initial_state(params, jax.random.key(1)))
        state = _time_steps(step, state, x, y, 2)[0]  # warm-up: compile
        runs.append([step, state, [], profiler])
    for _ in range(repeats):
        for run in runs:
            run[1], seconds = _time_steps(run[0], run[1], x, y, steps)
            run[2].append(seconds / steps)
    with traces:
        for step, state, _, profiler in runs:
            profiler.at(0, state)
            profiler.at(steps, repeat_step(step, state, x, y, steps))
    reference = statistics.median(runs[0][2])
    rows = []
    for strategy, (_, _, samples, profiler) in zip(configs, runs, strict=True):
        t = statistics.median(samples)
        name, _, mode = strategy.name.partition("+")
        rows.append({
            "algorithm": name, "fused": bool(mode), "strategy": strategy.name, "ms_per_step": t * 1e3,
            "images_per_s": batch_size / t, "vs_psum": t / reference, "samples_ms": [u * 1e3 for u in samples],
            "breakdown": profiler.breakdown._asdict(),
        })
    return [r for r in rows if r["algorithm"] in algorithms]


def _time_steps(step, state, x, y, steps: int):
    """Runs `steps` steps, at most two in flight; returns the new state and the seconds taken."""
    start = time.perf_counter()
    state = repeat_step(step, state, x, y, steps)
    return state, time.perf_counter() - start


def format_step_table(rows: Sequence[dict], header: str) -> str:
    lines = [f"# {header}",
             f"# {'algorithm':<12} {'mode':<16} {'ms/step':>9} {'images/s':>9} {'vs psum':>8}  "
             "compute/communication/host ms (profiled)"]
    for r in rows:
        mode = r["strategy"].partition("+")[2] or "per-leaf"
        b = r["breakdown"]
        lines.append(f"  {r['algorithm']:<12} {mode:<16} {r['ms_per_step']:>9.1f} {r['images_per_s']:>9.0f} "
                     f"{r['vs_psum']:>7.2f}x  {b['compute_ms']:.1f}/{b['communication_ms']:.1f}/{b['host_ms']:.1f} "
                     f"({b['source']})")
    return "\n".join(lines)


def run_step_bench(args: argparse.Namespace) -> int:
    for name in ("batch_size", "steps", "repeats"):
        check_positive(name, getattr(args, name))
    allreduce.get("psum", fuse=True, bucket_mb=args.bucket_mb)  # checks `--bucket-mb`
    load_plugins(args.plugin)
    check_algorithms(args.algorithms)
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    check_divisible(args.batch_size, len(devices))
    rows = bench_step(devices, args.algorithms, batch_size=args.batch_size, steps=args.steps,
                      repeats=args.repeats, bucket_mb=args.bucket_mb, backend=args.backend)
    header = (f"jdp bench step: lesson LeNet, batch {args.batch_size} over {where(devices)}, "
              f"median of {args.repeats} repeats of {args.steps} steps, interleaved")
    print(format_step_table(rows, header), flush=True)
    if out is not None:
        record = {"benchmark": "step", **machine(devices), "cpu_devices_simulated": args.cpu_devices,
                  "backend": args.backend, "batch_size": args.batch_size,
                  "steps": args.steps, "repeats": args.repeats, "bucket_mb": args.bucket_mb, "results": rows}
        (out / "step.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out / 'step.json'}")
    return 0
