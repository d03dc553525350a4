"""`jdp bench loop`: what `jdp train`'s loop costs the host, with a model whose step takes well under a millisecond.

On a CPU the lesson's LeNet takes tens of milliseconds a step and hides whatever the host does between
steps; a GPU takes half a millisecond, and there the loop's own work (reading values back, Python per
step) decides the speed. A tiny MLP on a CPU shows the same thing on any machine. Per round:

(a) train: `jdp.train`'s steady-state seconds per step (an epoch's training loop, after the first epoch), with
    its default `steps_per_call="auto"`: steps this short run several to a compiled call from the second epoch;
(b) bare: a bare Python loop over the same compiled train step on one batch already on the devices,
    dispatching without waiting and blocking once at the end: the least a loop can cost;
(c) windowed: (b) with the bounded window of in-flight steps that the loop keeps (`jdp.parallel.inflight`);
(d) runner: the epoch runner that `jdp.train` calls (`jdp.parallel.feeders`), alone, at the steps per call
    `train` chose: the same compiled calls (the batches' rows fetched on the devices, the steps, the tally
    folded), without the guards, the checkpoint keeper or the job watch.

Rounds interleave them, and each keeps its fastest, so load from other processes biases them alike. The
figure of merit is train / bare (target <= 1.3). It splits into runner / bare, what the device does beyond the
step (the fetch and the fold: device time, no host wait), and train / runner, what the loop's host work adds.
"""

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jdp import data
from jdp.bench.machine import machine
from jdp.errors import check_positive
from jdp.flags import add_device_flags, add_steps_per_call_flag, check_out_dir, setup_devices
from jdp.models import Model, summed_cross_entropy
from jdp.parallel import tally
from jdp.parallel.feeders import CallPlan, make_epoch_runner
from jdp.parallel.inflight import repeat_step
from jdp.parallel.layout import split_batch
from jdp.training.build import build_run
from jdp.training.config import TrainConfig
from jdp.training.hooks import EpochRecord, Hooks
from jdp.training.loop import train

TARGET = 1.3  # train / bare, seconds per step


def tiny_mlp(hidden: int = 32) -> Model:
    """784 → hidden → 10, ReLU: a step of a few microseconds of compute per image."""

    def init(key: jax.Array) -> dict[str, jax.Array]:
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (784, hidden)) * 784**-0.5, "b1": jnp.zeros(hidden),
                "w2": jax.random.normal(k2, (hidden, 10)) * hidden**-0.5, "b2": jnp.zeros(10)}

    def apply(params: dict[str, jax.Array], images: jax.Array) -> jax.Array:
        hidden_out = jax.nn.relu(images.reshape(len(images), -1) @ params["w1"] + params["b1"])
        return hidden_out @ params["w2"] + params["b2"]

    return Model(init, summed_cross_entropy(apply), apply, name=f"tiny-mlp-{hidden}")


def bench_loop(devices: Sequence[jax.Device], *, batch_size: int = 32, steps: int = 1000, rounds: int = 3,
               hidden: int = 32, steps_per_call: int | str = "auto") -> dict[str, Any]:
    """Times (a) `jdp.train` per step, (b) a bare loop and (c) a windowed loop, interleaved; returns the record."""
    model = tiny_mlp(hidden)
    dataset = data.synthetic(jax.random.key(0), n_train=steps * batch_size, n_test=len(devices))
    config = TrainConfig(batch_size=batch_size, lr=0.05, epochs=rounds + 1, model=model, steps_per_call=steps_per_call)
    run = build_run(config, devices)  # the components `train` builds, once
    step = run.step()
    params = model.init(jax.random.key(1))
    x, y = split_batch(dataset.train.images[:batch_size], dataset.train.labels[:batch_size], devices)
    state = run.placed(*run.initial_state(params, jax.random.key(2)))
    times: dict[str, list[float]] = {"train_s": [], "bare_s": [], "windowed_s": [], "runner_s": []}
    run_epoch = make_epoch_runner(step, dataset.train, devices, batch_size, "pmap", plan=CallPlan(1, True))

    def bare(state: tuple[Any, Any], count: int) -> tuple[Any, Any]:
        params, opt_state = state
        for _ in range(count):
            params, opt_state, _ = step(params, opt_state, x, y)
        return jax.block_until_ready((params, opt_state))

    def runner(state: tuple[Any, Any], steps_per_call: int = 1) -> tuple[Any, Any]:
        fresh = tally.place_tally(tally.start(0, [0.0] * len(devices), len(jax.tree.leaves(params))), devices, "pmap")
        (*state, _), _ = run_epoch((*state, fresh), jax.random.key(2), lambda calls, total: calls,
                                   steps_per_call=steps_per_call)
        return jax.block_until_ready(tuple(state))

    def timed(name: str, run: Any) -> None:
        nonlocal state
        start = time.perf_counter()
        state = run(state)
        times[name].append((time.perf_counter() - start) / steps)

    state = runner(repeat_step(step, bare(state, 2), x, y, 2))  # compile each

    chosen: list[int] = []  # train's steps per call, each round

    def on_epoch(record: EpochRecord) -> None:  # each epoch after the first is a round
        nonlocal state
        if record.epoch > 1:
            times["train_s"].append(record.seconds / steps)
            if record.steps_per_call not in chosen:
                state = runner(state, record.steps_per_call)  # compile it
            chosen.append(record.steps_per_call)
            timed("bare_s", lambda s: bare(s, steps))
            timed("windowed_s", lambda s: repeat_step(step, s, x, y, steps))
            timed("runner_s", lambda s: runner(s, record.steps_per_call))

    train(config, dataset, devices, hooks=Hooks(on_epoch=on_epoch))
    best = {name: min(values) for name, values in times.items()}
    return {"model": model.name, "batch_size": batch_size, "steps": steps, "devices": len(devices), "rounds": times,
            "train_steps_per_call": chosen,
            "seconds_per_step": best, "train_vs_bare": best["train_s"] / best["bare_s"],
            "train_vs_windowed": best["train_s"] / best["windowed_s"], "runner_vs_bare": best["runner_s"] / best["bare_s"],
            "train_vs_runner": best["train_s"] / best["runner_s"], "target_train_vs_bare": TARGET}


def format_table(records: Sequence[dict[str, Any]], header: str) -> str:
    """One line per device count: microseconds per step of each loop, and the ratios."""
    lines = [header, f"{'devices':>7} {'S':>3} {'train us':>9} {'bare us':>8} {'windowed us':>11} {'runner us':>9} "
                     f"{'train/bare':>10} {'runner/bare':>11} {'train/runner':>12}  target train/bare <= {TARGET}"]
    for r in records:
        us = {name: seconds * 1e6 for name, seconds in r["seconds_per_step"].items()}
        met = "met" if r["train_vs_bare"] <= TARGET else "NOT met"
        per_call = "/".join(str(n) for n in sorted(set(r["train_steps_per_call"])))
        lines.append(f"{r['devices']:>7} {per_call:>3} {us['train_s']:>9.1f} {us['bare_s']:>8.1f} {us['windowed_s']:>11.1f} "
                     f"{us['runner_s']:>9.1f} {r['train_vs_bare']:>9.2f}x {r['runner_vs_bare']:>10.2f}x "
                     f"{r['train_vs_runner']:>11.2f}x  {met}")
    return "\n".join(lines)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `loop` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "loop", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="time jdp train's loop per step against a bare Python loop, with a tiny MLP (host overhead)",
        description="With a model whose step takes well under a millisecond, time jdp train's steady-state "
        "seconds per step against a bare Python loop over the same compiled step, interleaved in one run: "
        "the host's overhead per step, which a GPU exposes and a CPU's slow steps hide.",
    )
    add_device_flags(p)
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split over the devices")
    p.add_argument("--steps", type=int, default=1000, help="steps per epoch and per timed loop")
    p.add_argument("--rounds", type=int, default=3, help="rounds (epochs after the first), fastest kept")
    p.add_argument("--hidden", type=int, default=32, help="the MLP's hidden width")
    add_steps_per_call_flag(p, "jdp train's steps per compiled call: auto (its default) or a number (1: one step "
                               "per call)")
    p.add_argument("--out", default=None, metavar="DIR", help="write bench_loop.json here")
    p.set_defaults(run=run_loop_bench)


def run_loop_bench(args: argparse.Namespace) -> int:
    for name in ("batch_size", "steps", "rounds", "hidden"):
        check_positive(name, getattr(args, name))
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    before = machine()
    counts = sorted({k for k in (1, len(devices)) if args.batch_size % k == 0})
    records = [bench_loop(devices[:k], batch_size=args.batch_size, steps=args.steps, rounds=args.rounds,
                          hidden=args.hidden, steps_per_call=args.steps_per_call) for k in counts]
    header = (f"jdp bench loop: {records[0]['model']}, global batch {args.batch_size}, {args.steps} steps per "
              f"measurement, fastest of {args.rounds} rounds, {devices[0].platform}, "
              f"load average {' '.join(before['load_average'])}")
    print(format_table(records, header), flush=True)
    if out is not None:
        record = {"benchmark": "loop", "machine": before, "load_average_after": machine()["load_average"],
                  "device_kind": devices[0].device_kind, "results": records}
        (out / "bench_loop.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out / 'bench_loop.json'}")
    return 0
