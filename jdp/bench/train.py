"""`jdp bench train`: jdp's training epoch against the compute floor, measured in one run.

For each precision (float32, bf16) and device count k (1, 2 and all of them) at the same global batch:

(a) epoch: jdp's training loop (`jdp.parallel.feeders.make_epoch_runner` driving `jdp.make_train_step`,
    exactly what `jdp train` times) over `--steps` batches of the training set;
(b) floor: the same compiled step called `--steps` times on one batch already on the devices, with the
    same bounded in-flight window: all the loop could hope for;
(c) overhead = a / b; (d) images/s of (a);
(e) achieved FLOP/s = the lesson's model FLOPs per image × images/s, as a fraction of a matmul peak of
    the same precision measured in the same run;
(f) each k's epoch time relative to 1 device's (same precision);
(g) images/s relative to the committed float32 baseline of this machine kind (`jdp.bench.baselines`),
    and to the lesson's PyTorch code measured on that machine kind, where one is committed;
(h) the fraction of the peak that twice the lesson's images/s would need: above 100%, 2x is out of reach.

Each round times floor and epoch of every device count and precision in turn, and each keeps its
fastest, so load from other processes on a shared machine biases them alike; compare ratios from
one run, not absolute figures.
"""

import argparse
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jdp import data
from jdp.bench import baselines
from jdp.bench.machine import machine
from jdp.errors import Arg, ConfigError, check_positive
from jdp.flags import add_device_flags, check_out_dir, load_plugins, setup_devices
from jdp.models import lenet, precision
from jdp.models.lenet_fast import FORMULATIONS
from jdp.parallel.feeders import CallPlan, make_epoch_runner
from jdp.parallel.inflight import repeat_step
from jdp.parallel.layout import split_batch
from jdp.parallel.tally import place_tally, start
from jdp.runtime.machine_kind import this_kind
from jdp.training.build import build_run
from jdp.training.config import TrainConfig
from jdp.training.formulation import read_cache, resolve

FULL_EPOCH_IMAGES = 60_000  # Fashion-MNIST's training set: sec/epoch is extrapolated to it
TARGETS = {"max_overhead_1_2_devices": 1.10, "min_images_per_s_1_device": 3300.0, "max_k_vs_1_device": 1.3}


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `train` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "train", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="time jdp's training epoch against the compute floor on 1, 2 and all devices",
        description="Time jdp's training loop against the same compiled step looped over pre-placed data "
        "(the compute floor), report overhead, images/s, FLOP/s as a fraction of a matmul peak measured "
        "in the same run, and 1 vs 2 vs all devices at the same global batch.",
    )
    add_device_flags(p)
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    p.add_argument("--steps", type=int, default=40, help="batches per timed epoch and floor (sec/epoch extrapolated)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each timing floor and epoch of every device count and precision in turn (min kept)")
    p.add_argument("--formulation", "--model-impl", default="auto", choices=["auto", *FORMULATIONS],
                   help="LeNet formulation, resolved per device count as `jdp train` does (auto: the fastest measured "
                   "for this machine kind, else fast)")
    p.add_argument("--steps-per-call", type=int, default=1, metavar="S", help="train steps per compiled call")
    p.add_argument("--precision", default="float32,bf16", metavar="P[,P]",
                   help=f"compute precisions to time, comma-separated, each a row per device count ({', '.join(precision.PRECISIONS)})")
    p.add_argument("--dataset", default="fashion_mnist", choices=[d for d in data.DATASETS if d != "tfds"],
                   help="training images to time on (their values do not change the timing)")
    p.add_argument("--data-dir", default=None, help="folder with the four IDX files (default: as `jdp train`)")
    p.add_argument("--out", default=None, metavar="DIR", help="write bench_train.json here")
    p.set_defaults(run=run_train_bench)


def flops_per_image() -> float:
    """FLOPs of one forward and backward pass of the lesson's LeNet, counted on its own math.

    Forward: 2 FLOPs per multiply-add of each convolution (26²·20 outputs of 3·3·1, 9²·50 outputs of
    5·5·20) and dense layer; backward ≈ 2 × forward (input and weight gradients), ≈ 13.5 MFLOP in all.
    The fast formulation skips outputs the pooling drops, so it does less than this useful work.
    """
    conv1 = 26 * 26 * 20 * (3 * 3 * 1)
    conv2 = 9 * 9 * 50 * (5 * 5 * 20)
    dense = 800 * 128 + 128 * 10
    return 3 * 2 * float(conv1 + conv2 + dense)


def matmul_peak(device: jax.Device, n: int = 1024, repeats: int = 10, precision_name: str = "float32") -> float:
    """Best FLOP/s of an n×n by n×n matmul in `precision_name`'s dtype on `device`, compiled and warmed up first."""
    dtype = precision.PRECISIONS[precision_name] or jnp.float32
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n)).astype(dtype), device)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, a))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


Round = Callable[[int], dict[str, float]]  # round(r) -> one floor and one epoch time, wall-clock and CPU


def prepare(
    devices: Sequence[jax.Device],
    split: data.Split,
    *,
    batch_size: int,
    steps: int,
    formulation: str = "fast",
    steps_per_call: int = 1,
    precision_name: str = "float32",
) -> Round:
    """Compiles jdp's epoch loop and the compute floor on `devices` in `precision_name`; returns one timed round.

    `round(r)` runs `steps` steps of the floor, then `steps` of the epoch loop (permutation r + 1), and
    returns {"floor_s", "epoch_s", "floor_cpu_s", "epoch_cpu_s"}: wall-clock and CPU time (this process,
    all threads). The state carries over from round to round, as in training.
    """
    config = TrainConfig(batch_size=batch_size, formulation=formulation, precision=precision_name)  # sgd, lr 0.2
    run = build_run(config, devices)  # the components `train` builds, once
    step = run.step()
    part = data.Split(split.images[:steps * batch_size], split.labels[:steps * batch_size])
    run_epoch = make_epoch_runner(step, part, devices, batch_size, plan=CallPlan(steps_per_call))
    x, y = split_batch(part.images[:batch_size], part.labels[:batch_size], devices)
    params = lenet.init(jax.random.key(0))
    state = run.placed(*run.initial_state(params, jax.random.key(1)))
    tally = place_tally(start(0, [0.0] * len(devices), len(jax.tree.leaves(params))), devices, "pmap")

    def floor(state, count):
        return repeat_step(step, state, x, y, count)

    def epoch(state, seed):
        (*state, _), _ = run_epoch((*state, tally), jax.random.key(seed), lambda calls, total: calls)
        return jax.block_until_ready(tuple(state))

    state = epoch(floor(state, 2), 0)  # compile both

    def timed_round(r: int) -> dict[str, float]:
        nonlocal state
        times = {}
        for name, run in (("floor", lambda s: floor(s, steps)), ("epoch", lambda s: epoch(s, r + 1))):
            start, cpu = time.perf_counter(), time.process_time()
            state = run(state)
            times[f"{name}_s"] = time.perf_counter() - start
            times[f"{name}_cpu_s"] = time.process_time() - cpu
        return times

    return timed_round


class Timing(NamedTuple):
    """How each configuration is timed: `steps` batches of `batch_size` per measurement, the fastest of `rounds`."""

    batch_size: int = 256
    steps: int = 40
    rounds: int = 3


def bench_train(
    devices: Sequence[jax.Device],
    split: data.Split,
    *,
    timing: Timing = Timing(),
    formulations: Mapping[int, str] | None = None,
    steps_per_call: int = 1,
    precisions: Sequence[str] = ("float32",),
    baseline: baselines.Baseline | None = None,
) -> dict[str, Any]:
    """Measures 1, 2 and len(devices) devices (those dividing `timing.batch_size`) in each precision, and the ratios.

    Every (device count, precision) is compiled first; then each round times all of them in turn, so
    load from other processes and the machine's drift over the run bias them alike. `formulations`:
    device count -> the LeNet formulation timed there (`fast` for a count it does not name).

    Returns:
      {"matmul_peak_flops": {precision: FLOP/s}, "flops_per_image", "results": [one row per precision and
      device count], "targets" (on the float32 rows, if any), "baseline" (the committed one used, or None)}.
    """
    batch_size, steps, rounds = timing
    counts = device_counts(len(devices), batch_size)
    formulations = {k: (formulations or {}).get(k, "fast") for k in counts}
    peaks = {name: matmul_peak(devices[0], precision_name=name) for name in precisions}
    per_image = flops_per_image()
    configs = [(k, name) for k in counts for name in precisions]
    timed = {(k, name): prepare(devices[:k], split, batch_size=batch_size, steps=steps, formulation=formulations[k],
                                steps_per_call=steps_per_call, precision_name=name) for k, name in configs}
    times = {config: {"epoch_s": [], "floor_s": [], "epoch_cpu_s": [], "floor_cpu_s": []} for config in configs}
    for r in range(rounds):
        for config in configs:
            for key, value in timed[config](r).items():
                times[config][key].append(value)
    rows = []
    for k, name in configs:
        t = times[k, name]
        epoch_s, floor_s = min(t["epoch_s"]), min(t["floor_s"])
        images_per_s = steps * batch_size / epoch_s
        rows.append({
            "precision": name, "devices": k, "formulation": formulations[k], **t, "overhead": epoch_s / floor_s,
            "overhead_cpu": min(t["epoch_cpu_s"]) / min(t["floor_cpu_s"]), "images_per_s": images_per_s,
            "floor_images_per_s": steps * batch_size / floor_s,
            "sec_per_epoch": epoch_s / steps * (FULL_EPOCH_IMAGES // batch_size),
            "achieved_flops": per_image * images_per_s, "fraction_of_peak": per_image * images_per_s / peaks[name],
        })
    for row in rows:
        first = next(r for r in rows if r["precision"] == row["precision"])
        row["vs_1_device"] = row["sec_per_epoch"] / first["sec_per_epoch"]
        row["vs_baseline"] = baselines.ratio(baseline, row["devices"], row["images_per_s"])
        lesson = None if baseline is None else baseline.lesson_images_per_s
        row["vs_lesson"] = None if lesson is None else row["images_per_s"] / lesson
        row["twice_lesson_fraction_of_peak"] = (None if lesson is None
                                                else 2 * lesson * per_image / peaks[row["precision"]])
    float32_rows = [r for r in rows if r["precision"] == "float32"]
    return {"matmul_peak_flops": peaks, "flops_per_image": per_image, "results": rows,
            "targets": check_targets(float32_rows) if float32_rows else {},
            "baseline": None if baseline is None else baseline._asdict()}


def device_counts(available: int, batch_size: int) -> list[int]:
    """The device counts the bench times: 1, 2 and all, those that divide the batch."""
    return sorted({k for k in (1, 2, available) if k <= available and batch_size % k == 0})


def check_targets(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    by_k = {row["devices"]: row for row in rows}
    most = max(by_k)
    found = {
        "max_overhead_1_2_devices": max(by_k[k]["overhead"] for k in (1, 2) if k in by_k),
        "min_images_per_s_1_device": by_k[1]["images_per_s"],
        "max_k_vs_1_device": by_k[most]["vs_1_device"],
    }
    met = {
        "max_overhead_1_2_devices": found["max_overhead_1_2_devices"] <= TARGETS["max_overhead_1_2_devices"],
        "min_images_per_s_1_device": found["min_images_per_s_1_device"] >= TARGETS["min_images_per_s_1_device"],
        "max_k_vs_1_device": found["max_k_vs_1_device"] <= TARGETS["max_k_vs_1_device"],
    }
    return {name: {"target": TARGETS[name], "measured": found[name], "met": met[name],
                   **({"devices": most} if name == "max_k_vs_1_device" else {})} for name in TARGETS}


def format_table(record: dict[str, Any], header: str) -> str:
    """The results as a fixed-width text table, the targets below it."""
    columns = (f"{'precision':>9} {'devices':>7} {'epoch s':>8} {'floor s':>8} {'overhead':>8} {'(cpu)':>6} {'img/s':>7} "
               f"{'floor img/s':>11} {'s/epoch':>8} {'GFLOP/s':>8} {'of peak':>7} {'2x lesson':>9} {'vs 1 dev':>8} {'vs base':>7} "
               f"{'vs lesson':>9} formulation")
    lines = [header, columns]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    for r in record["results"]:
        lines.append(
            f"{r['precision']:>9} {r['devices']:>7} {min(r['epoch_s']):>8.2f} {min(r['floor_s']):>8.2f} "
            f"{r['overhead']:>8.3f} {r['overhead_cpu']:>6.3f} "
            f"{r['images_per_s']:>7.0f} {r['floor_images_per_s']:>11.0f} {r['sec_per_epoch']:>8.2f} "
            f"{r['achieved_flops'] / 1e9:>8.1f} {r['fraction_of_peak']:>7.1%} "
            f"{percent(r['twice_lesson_fraction_of_peak']):>9} {r['vs_1_device']:>8.2f} "
            f"{ratio(r['vs_baseline']):>7} {ratio(r['vs_lesson']):>9} {r['formulation']}"
        )
    peaks = ", ".join(f"{name} {flops / 1e9:.1f}" for name, flops in record["matmul_peak_flops"].items())
    lines.append(f"matmul peak (GFLOP/s): {peaks}; model {record['flops_per_image'] / 1e6:.2f} MFLOP/image (fwd+bwd); "
                 "(cpu): the overhead in this process's CPU time, less sensitive to other processes' load; "
                 "2x lesson: the fraction of the peak twice the lesson's PyTorch images/s would need")
    base = record["baseline"]
    if base is None:
        lines.append("vs base / vs lesson: no committed baseline for this machine kind and settings (jdp.bench.baselines)")
    else:
        lesson = base["lesson_images_per_s"]
        lines.append(f"vs base / vs lesson: images/s over the committed float32 baseline of {base['machine']} "
                     f"({base['measured']}) / over the lesson's PyTorch code there "
                     + ("(not measured)" if lesson is None else f"({lesson:.0f} img/s)"))
    for name, t in record["targets"].items():
        lines.append(f"target {name} {t['target']}: measured {t['measured']:.3f} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def run_train_bench(args: argparse.Namespace) -> int:
    for name in ("batch_size", "steps", "rounds", "steps_per_call"):
        check_positive(name, getattr(args, name))
    precisions = [name.strip() for name in args.precision.split(",") if name.strip()]
    if not precisions:
        raise ConfigError(Arg("precision"), " needs at least one of " + ", ".join(precision.PRECISIONS) + ".")
    for name in precisions:
        precision.check(name)
    load_plugins(args.plugin)
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    if args.dataset == "synthetic":
        split = data.synthetic(jax.random.key(0), n_train=args.steps * args.batch_size, n_test=len(devices)).train
    else:
        split = data.load_idx(data.find_data_dir(args.data_dir, download=False)).train
    if args.steps * args.batch_size > len(split.labels):
        raise ConfigError(Arg("steps", args.steps), " × ", Arg("batch_size", args.batch_size), " exceeds the "
                          f"{len(split.labels)} training images; use at most {len(split.labels) // args.batch_size} steps.")
    before = machine()
    kind, cache = this_kind(devices[0].device_kind), read_cache()
    choices = {k: resolve(args.formulation, kind, k, cache) for k in device_counts(len(devices), args.batch_size)}
    baseline = baselines.find(before, devices[0], batch_size=args.batch_size, formulation=args.formulation)
    record = bench_train(devices, split, timing=Timing(args.batch_size, args.steps, args.rounds),
                         formulations={k: c.formulation for k, c in choices.items()},
                         steps_per_call=args.steps_per_call, precisions=precisions, baseline=baseline)
    record["formulations"] = {k: c.to_json() for k, c in choices.items()}
    platform_name = devices[0].platform + (" (simulated)" if devices[0].platform == "cpu" and len(devices) > 1 else "")
    chosen = ", ".join(f"{k}: {c.formulation}" for k, c in choices.items())
    header = (f"jdp bench train: LeNet ({args.formulation}; devices {chosen}), global batch {args.batch_size}, "
              f"{args.dataset}, {args.steps} steps per measurement, fastest of {args.rounds} rounds, {platform_name}, "
              f"load average {' '.join(before['load_average'])}")
    print(format_table(record, header), flush=True)
    if out is not None:
        record = {"benchmark": "train", "machine": before, "load_average_after": machine()["load_average"],
                  "device_kind": devices[0].device_kind, "config": {
                      k: v for k, v in vars(args).items() if k not in ("run", "command", "benchmark")}, **record}
        (out / "bench_train.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out / 'bench_train.json'}")
    return 0
