"""`jdp bench memory`: bytes per device of params, gradients and optimizer state, replicated vs sharded.

For each model, optimizer and device count k, the arrays a train step holds between steps are built
on the devices by what `jdp.train` builds them with (`jdp.training.build.build_run`): the params replicated, the
optimizer state replicated or sharded (`TrainConfig(shard_optimizer=True)`), and the reduced gradients
as the reduction leaves them (`lax.psum` of every leaf, or `psum_scatter` of the flat buffers).
Bytes per device are read off the arrays: the `nbytes` of each addressable shard on that device,
summed; the largest device is reported. Nothing is computed from a formula. Beside them, the
optimizer state of DiLoCo (`--sync diloco`): each device's own inner state, plus the global params θ
and the outer Nesterov momentum, replicated (`TrainConfig(sync="diloco")`, placed as `train` does).

Step time, sharded vs replicated, is measured in the same run for the models of `--time-models`
(interleaved repeats, median), as a ratio: on a shared machine only ratios from one run compare.
"""

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jdp import data, models
from jdp.bench.machine import machine, where
from jdp.errors import Arg, ConfigError, check_positive
from jdp.flags import add_device_flags, check_out_dir, load_plugins, setup_devices
from jdp.parallel.buckets import plan
from jdp.parallel.collectives import psum_scatter
from jdp.parallel.inflight import repeat_step
from jdp.parallel.layout import map_over_devices, replicate, split_batch
from jdp.runtime.devices import AXIS
from jdp.training import optimizers
from jdp.training.build import BuiltRun, build_run
from jdp.training.config import TrainConfig

MODES = ("replicated", "sharded")


class Timing(NamedTuple):
    """How a step is timed, both ways: batches of `batch_size`, the median of `repeats` runs of `steps` steps."""

    batch_size: int = 256
    steps: int = 5
    repeats: int = 3


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `memory` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "memory", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="bytes per device of params, gradients and optimizer state, replicated vs --shard-optimizer",
        description="Build the arrays a train step keeps on the devices (params, reduced gradients, optimizer "
        "state), replicated and sharded (ZeRO), and read bytes per device off their shards; time the step both ways.",
    )
    add_device_flags(p)
    p.add_argument("--models", nargs="+", default=["lenet", "resnet18"], help="registered models")
    p.add_argument("--optimizers", nargs="+", default=list(optimizers.OPTIMIZERS), choices=optimizers.OPTIMIZERS)
    p.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8], help="device counts")
    p.add_argument("--time-models", nargs="*", default=["lenet"], help="models whose step is timed both ways")
    p.add_argument("--batch-size", type=int, default=256, help="global batch of the timed steps")
    p.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per configuration (median reported)")
    p.add_argument("--out", default=None, metavar="DIR", help="write memory.json, memory.md and memory.png here")
    p.set_defaults(run=run_memory_bench)


def bytes_per_device(tree: Any, devices: Sequence[jax.Device]) -> int:
    """The most bytes of `tree`'s arrays that any one of `devices` holds, read off the addressable shards."""
    held = dict.fromkeys(devices, 0)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return max(held.values())


def built(model: models.Model, optimizer_name: str, devices: Sequence[jax.Device], **settings: Any) -> BuiltRun:
    """The run `train` would build for `model` and `optimizer_name` (lr 1e-3) on `devices`, with `settings`
    (`shard_optimizer=True`, `sync="diloco"`, ...)."""
    return build_run(TrainConfig(model=model, optimizer=optimizer_name, lr=1e-3, **settings), devices)


def held_arrays(model: models.Model, variables: Any, optimizer_name: str, devices: Sequence[jax.Device],
                sharded: bool) -> dict:
    """The params, reduced gradients and optimizer state of a step on `devices`, on the devices."""
    run = built(model, optimizer_name, devices, shard_optimizer=sharded)
    params, state = run.placed(*run.initial_state(variables, jax.random.key(0)))
    trainable = models.trainable(model, variables)
    grads = replicate(jax.tree.map(np.zeros_like, trainable), devices)  # each device's local gradient sum
    if sharded:
        flat = plan(trainable, len(devices))
        (reduced,) = map_over_devices(lambda g: ([psum_scatter(b, AXIS) for b in flat.flatten(g)],), devices,
                                      "pmap", ("replicated",), ("per_device",))(grads)
    else:
        (reduced,) = map_over_devices(lambda g: (jax.lax.psum(g, AXIS),), devices, "pmap", ("replicated",),
                                      ("replicated",))(grads)
    return {"params": params, "grads": reduced, "opt_state": state}


def diloco_opt_state(model: models.Model, variables: Any, optimizer_name: str, devices: Sequence[jax.Device]) -> Any:
    """DiLoCo's optimizer state on `devices`: the inner state per device, θ and the outer momentum replicated.
    A model with state besides its params (BatchNorm) has none: `--sync diloco` refuses it."""
    run = built(model, optimizer_name, devices, sync="diloco")
    return run.placed(*run.initial_state(variables, jax.random.key(0)))[1]


def step_seconds(model: models.Model, variables: Any, optimizer_name: str, devices: Sequence[jax.Device],
                 timing: Timing) -> dict[str, list[float]]:
    """Seconds per step of the replicated and the sharded step, their repeats interleaved."""
    split = data.synthetic(jax.random.key(0), n_train=timing.batch_size, n_test=1).train
    x, y = split_batch(split.images, split.labels, devices)
    runs = {}
    for mode in MODES:
        run = built(model, optimizer_name, devices, shard_optimizer=mode == "sharded")
        step = run.step()
        state = run.placed(*run.initial_state(variables, jax.random.key(0)))
        runs[mode] = [step, repeat_step(step, state, x, y, 2), []]  # warm-up: compile
    for _ in range(timing.repeats):
        for run in runs.values():
            start = time.perf_counter()
            run[1] = repeat_step(run[0], run[1], x, y, timing.steps)
            run[2].append((time.perf_counter() - start) / timing.steps)
    return {mode: samples for mode, (_, _, samples) in runs.items()}


def bench_memory(devices: Sequence[jax.Device], model_names: Sequence[str], optimizer_names: Sequence[str],
                 ks: Sequence[int], *, time_models: Sequence[str] = ("lenet",),
                 timing: Timing = Timing()) -> list[dict[str, Any]]:
    """One row per (model, optimizer, k, mode): bytes per device of each part, and ms per step if timed."""
    rows = []
    for model_name in model_names:
        model = models.get(model_name)
        variables = jax.device_get(model.init(jax.random.key(0)))  # once: a ResNet-18 init compiles for minutes
        for optimizer_name in optimizer_names:
            for k in ks:
                timed = (step_seconds(model, variables, optimizer_name, devices[:k], timing)
                         if model_name in time_models else {})
                for mode in MODES:
                    arrays = held_arrays(model, variables, optimizer_name, devices[:k], mode == "sharded")
                    held = {part: bytes_per_device(tree, devices[:k]) for part, tree in arrays.items()}
                    samples = timed.get(mode)
                    diloco = (bytes_per_device(diloco_opt_state(model, variables, optimizer_name, devices[:k]),
                                               devices[:k]) if mode == "replicated" and not model.stateful else None)
                    rows.append({"model": model_name, "optimizer": optimizer_name, "k": k, "mode": mode,
                                 "params_bytes": held["params"], "grads_bytes": held["grads"],
                                 "opt_state_bytes": held["opt_state"], "total_bytes": sum(held.values()),
                                 "diloco_opt_state_bytes": diloco,
                                 "ms_per_step": statistics.median(samples) * 1e3 if samples else None,
                                 "samples_ms": [s * 1e3 for s in samples] if samples else None})
                    del arrays
    return rows


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, optimizer, k): sharded ÷ replicated of the optimizer state, the total and the step time."""
    by = {(r["model"], r["optimizer"], r["k"], r["mode"]): r for r in rows}
    out = []
    for (model, opt, k, mode), rep in by.items():
        if mode != "replicated":
            continue
        sh = by[(model, opt, k, "sharded")]
        out.append({"model": model, "optimizer": opt, "k": k,
                    "opt_state": sh["opt_state_bytes"] / rep["opt_state_bytes"] if rep["opt_state_bytes"] else None,
                    "grads": sh["grads_bytes"] / rep["grads_bytes"], "total": sh["total_bytes"] / rep["total_bytes"],
                    "step_time": sh["ms_per_step"] / rep["ms_per_step"] if rep["ms_per_step"] else None})
    return out


def _mb(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n / 2**20:.3f}" if n < 2**20 else f"{n / 2**20:.1f}"


def format_table(rows: Sequence[dict[str, Any]], header: str) -> str:
    """A Markdown table: one line per (model, optimizer, k), replicated and sharded side by side."""
    lines = [f"{header}", "",
             "| model | optimizer | k | params MiB | grads MiB repl / shard | opt state MiB repl / shard | opt state "
             "shard÷repl | total MiB repl / shard | ms/step repl / shard | time shard÷repl | opt state MiB "
             "`--sync diloco` |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["optimizer"], r["k"], r["mode"]): r for r in rows}
    for ratio in ratios(rows):
        rep, sh = (by[(ratio["model"], ratio["optimizer"], ratio["k"], m)] for m in MODES)
        state = "—" if ratio["opt_state"] is None else f"{ratio['opt_state']:.3f}"
        ms = (f"{rep['ms_per_step']:.1f} / {sh['ms_per_step']:.1f}" if rep["ms_per_step"] else "—")
        time_ratio = f"{ratio['step_time']:.2f}" if ratio["step_time"] else "—"
        lines.append(f"| {ratio['model']} | {ratio['optimizer']} | {ratio['k']} | {_mb(rep['params_bytes'])} | "
                     f"{_mb(rep['grads_bytes'])} / {_mb(sh['grads_bytes'])} | {_mb(rep['opt_state_bytes'])} / "
                     f"{_mb(sh['opt_state_bytes'])} | {state} | {_mb(rep['total_bytes'])} / {_mb(sh['total_bytes'])} | "
                     f"{ms} | {time_ratio} | {_mb(rep['diloco_opt_state_bytes'])} |")
    return "\n".join(lines)


def run_memory_bench(args: argparse.Namespace) -> int:
    from jdp import plot  # matplotlib: only once there is a figure to draw

    for name in ("batch_size", "steps", "repeats"):
        check_positive(name, getattr(args, name))
    for k in args.ks:
        check_positive("ks", k)
    load_plugins(args.plugin)
    for name in (*args.models, *args.time_models):
        models.get(name)  # an unknown model is a one-line error before any work
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    if max(args.ks) > len(devices):
        raise ConfigError(Arg("ks", max(args.ks)), f" exceeds the {len(devices)} devices; pass ",
                          Arg("cpu_devices", max(args.ks)), " (or fewer ", Arg("ks"), ").")
    for k in args.ks:
        if args.batch_size % k:
            raise ConfigError(Arg("batch_size", args.batch_size), " must be divisible by every ", Arg("ks"),
                              f" value, not by {k}.")
    rows = bench_memory(devices, args.models, args.optimizers, sorted(set(args.ks)), time_models=args.time_models,
                        timing=Timing(args.batch_size, args.steps, args.repeats))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    stack = machine(devices)
    header = (f"# jdp bench memory: bytes per device (largest device), replicated vs `--shard-optimizer`, on "
              f"{where(devices)}; step time: LeNet batch {args.batch_size}, median of {args.repeats} × {args.steps} "
              f"steps, interleaved\n\n{date}; {stack['cpu']} ({stack['host_cpus']} cores); Python {stack['python']}, "
              f"JAX {stack['jax_version']}; load average {' '.join(stack['load_average'])}")
    table = format_table(rows, header)
    print(table, flush=True)
    if out is not None:
        record = {"benchmark": "memory", "date": date, **stack, "batch_size": args.batch_size, "steps": args.steps,
                  "repeats": args.repeats, "results": rows, "ratios": ratios(rows)}
        (out / "memory.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "memory.md").write_text(table + "\n")
        plot.save(plot.bytes_per_device(rows, title=f"bytes per device vs k ({where(devices)})"), out / "memory.png")
        print(f"wrote {out / 'memory.json'}, {out / 'memory.md'} and {out / 'memory.png'}")
    return 0
