"""`jdp bench allreduce`: every allreduce strategy on one buffer per device, side by side in one run.

`bench allreduce` follows nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): a buffer of
S bytes on each of k devices summed in t seconds (median over repeats, after a warm-up) has
algbw = S / t and busbw = algbw · 2(k−1)/k. busbw is what each link of a bandwidth-optimal ring
carries, so it can be compared across device counts and with the hardware's link bandwidth.
Each buffer holds small integers, so every order of summation gives the exact sum: `#wrong`
counts the elements, on every device, that differ from it (it must be 0).

Under `jdp launch --hosts H --nic RATE` (an emulated cluster, docs/cluster.md) each row also has the
NIC's bus bandwidth, algbw · 2(H−1)/H: the bytes each host's NIC must carry at least, per direction,
for an allreduce over H hosts (any algorithm), per second; and that as a fraction of RATE.

Each run also fits the α–β–γ model of every algorithm to its times (`jdp.bench.fit`).
One process has one device count, so `--fit RUN.json ...` fits saved runs of several counts
together, and `--hold-out K` leaves count K out of the fit and reports how well it is predicted.
"""

import argparse
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from jdp.bench import fit
from jdp.bench.machine import machine, where
from jdp.errors import Arg, ConfigError, check_positive
from jdp.flags import add_device_flags, add_job_flags, check_out_dir, load_plugins, setup_devices
from jdp.parallel import allreduce
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import BACKENDS, map_over_devices, sharded
from jdp.runtime import cluster
from jdp.runtime.devices import AXIS

DEFAULT_SIZES = "4KiB..64MiB"
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_ITEMSIZE = 4  # the buffers are float32, as the gradients
LINK_MODES = ("auto", "per-device", "shared")


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `allreduce` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "allreduce", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="time each allreduce algorithm over buffer sizes (nccl-tests' algbw and busbw)",
        description="Time each allreduce algorithm on one float32 buffer per device, for each size: median "
        "over repeats after a warm-up, algbw = S/t, busbw = algbw·2(k−1)/k, #wrong = elements not equal "
        "to the exact sum on some device.",
    )
    add_device_flags(p)
    add_job_flags(p)
    add_algorithms_flag(p)
    p.add_argument("--backend", default="pmap", choices=list(BACKENDS),
                   help="map the inside algorithms with jax.pmap or jax.jit(jax.shard_map)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help="bytes per device: LO..HI (each ×4 the last) or a comma list; units B, KiB, MiB, GiB")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per algorithm and size (median reported)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write allreduce.json and allreduce.png here (with --fit: fit.json and fit.png)")
    fitting = p.add_argument_group("fitting saved runs (docs/allreduce.md#the-cost-model)")
    fitting.add_argument("--fit", nargs="+", default=None, metavar="RUN_JSON",
                         help="measure nothing: fit α, β, γ per algorithm to these allreduce.json files together "
                         "(e.g. runs with --cpu-devices 2, 4, 6 and 8)")
    fitting.add_argument("--hold-out", type=int, default=None, metavar="K",
                         help="with --fit: fit without the runs on K devices, then predict them and report the "
                         "median and worst relative error")
    fitting.add_argument("--link", default="auto", choices=LINK_MODES,
                         help="bytes in the β term: per-device (the busiest device's, as on real links), shared (all "
                         "devices', as simulated CPU devices share one memory), or auto: shared for CPU runs")
    fitting.add_argument("--nic-model", action="store_true",
                         help="with --fit of runs on an emulated cluster (`jdp launch --hosts`): fit nothing, predict "
                         "every row from the NIC rate (β) and an α measured from the small rows at --alpha-rate, and "
                         "report the held-out errors (docs/cluster.md)")
    fitting.add_argument("--alpha-rate", default=None, metavar="RATE",
                         help="with --nic-model: the rate whose small buffers measure α (default: the highest)")
    p.set_defaults(run=run_allreduce_bench)


def add_algorithms_flag(parser: argparse.ArgumentParser) -> None:
    """`--algorithms NAME...`: registered strategies (checked once `--plugin`s are loaded)."""
    names = list(allreduce.names())
    parser.add_argument("--algorithms", nargs="+", default=names, metavar="NAME",
                        help=f"any of: {' '.join(names)}, or strategies a --plugin registered")


def check_algorithms(names: Sequence[str]) -> None:
    """Raises ConfigError naming the first unknown strategy."""
    for name in names:
        allreduce.get(name)


# --- parsing -----------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """`4KiB` → 4096 bytes; a whole number of float32 elements.

    Raises:
      ConfigError: for an unknown unit, or a size that is not a positive multiple of 4 bytes.
    """
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text)
    if not match:
        raise ConfigError(
            Arg("sizes"), f" has `{text}`, not a size: write a number with a unit B, KiB, MiB or GiB, e.g. 4KiB."
        )
    size = int(match.group(1)) * _UNITS[match.group(2) or ""]
    if size < _ITEMSIZE or size % _ITEMSIZE:
        raise ConfigError(Arg("sizes"), f" has `{text}`: a buffer must be a positive multiple of 4 bytes (float32).")
    return size


def parse_sizes(text: str) -> list[int]:
    """`LO..HI` → LO, 4·LO, 16·LO, … up to HI (nccl-tests' -b/-e/-f with f = 4); or `A,B,C`.

    Raises:
      ConfigError: for a malformed size or a range whose end is below its start.
    """
    if ".." in text:
        low, high = (parse_size(part) for part in text.split("..", 1))
        if high < low:
            raise ConfigError(Arg("sizes", text), ": the range ends below where it starts; write LO..HI.")
        sizes = [low]
        while sizes[-1] * 4 <= high:
            sizes.append(sizes[-1] * 4)
        return sizes
    return [parse_size(part) for part in text.split(",")]


# --- bench allreduce ---------------------------------------------------------------------------


def bench_allreduce(
    devices: Sequence[jax.Device],
    sizes: Sequence[int],
    algorithms: Sequence[str],
    *,
    repeats: int = 5,
    min_seconds: float = 0.02,
    backend: str = "pmap",
    nic: tuple[int, int] | None = None,
) -> list[dict]:
    """Times each algorithm on one float32 buffer per device, for each size.

    For every size, each algorithm is first run once to compile and check (#wrong), then timed
    once to choose how many back-to-back calls make a sample of at least `min_seconds`; the timed
    samples then alternate between algorithms, so a slow phase of a shared machine hits them all.

    Args:
      devices: the k devices the buffers live on.
      sizes: bytes per device.
      algorithms: registered strategy names (`jdp.allreduce_names()`), per leaf (one buffer: fusing changes nothing).
      repeats: timed samples per algorithm and size; the median is reported.
      min_seconds: the least duration of one sample.
      backend: how the inside algorithms are mapped: "pmap" or "shard_map".
      nic: (hosts H, NIC rate in bits/s) of the emulated cluster the devices are on, or None.

    Returns:
      One row per (size, algorithm): algorithm, devices, size_bytes, count, dtype, time_us,
      algbw_gbps, busbw_gbps (GB = 1e9 bytes), wrong, iters, samples_us (every repeat, for the spread);
      with `nic`, also hosts, nic_bps, nic_busbw_gbps and nic_fraction (of the rate).
    """
    k = len(devices)
    sharding = sharded(devices)
    runners = {name: _runner(allreduce.get(name), devices, backend) for name in algorithms}
    rows = []
    for size in sizes:
        count = size // _ITEMSIZE
        x = jax.jit(_ramp, static_argnums=(0, 1), out_shardings=sharding)(k, count)
        wrong, iters = {}, {}
        for name, run in runners.items():
            wrong[name] = int(_count_wrong(run(x)))  # warm-up: compiles, and checks the sum
            once = _seconds_per_call(run, x, 1)
            iters[name] = _agreed(max(1, min(1000, math.ceil(min_seconds / max(once, 1e-9)))))
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
                **({} if nic is None else nic_columns(algbw, *nic)),
            })
        del x
    return rows


def nic_columns(algbw_gbps: float, hosts: int, nic_bps: int) -> dict:
    """hosts, nic_bps, nic_busbw_gbps = algbw · 2(H−1)/H and nic_fraction = that / the NIC's bytes per second."""
    busbw = algbw_gbps * 2 * (hosts - 1) / hosts
    return {"hosts": hosts, "nic_bps": nic_bps, "nic_busbw_gbps": busbw, "nic_fraction": busbw * 1e9 / (nic_bps / 8)}


def _agreed(iters: int) -> int:
    """Process 0's count in every process of a job (each must dispatch the same calls); `iters` alone."""
    if jax.process_count() == 1:
        return iters
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(jnp.int32(iters)))


def _runner(strategy: allreduce.Allreduce, devices: Sequence[jax.Device],
            backend: str = "pmap") -> Callable[[jax.Array], jax.Array]:
    """x (k, n) sharded over `devices` → its allreduce, however the strategy runs."""
    if not strategy.inside:
        return strategy.fn
    mapped = map_over_devices(lambda row: (strategy.fn(row, AXIS),), devices, backend, ("per_device",), ("per_device",))
    return lambda x: mapped(x)[0]


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
    """Mean wall time of `iters` back-to-back calls, at most two in flight (see jdp.parallel.inflight)."""
    window = InFlight(limit=2)
    start = time.perf_counter()
    for _ in range(iters):
        window.push(run(x))
    window.drain()
    return (time.perf_counter() - start) / iters


def format_allreduce_table(rows: Sequence[dict], header: str) -> str:
    """nccl-tests' columns, one row per (size, algorithm), a blank line between sizes."""
    w = max([12, *(len(r["algorithm"]) for r in rows)])  # `hierarchical:tree:2x4+bfloat16-wire` is long
    nic = bool(rows) and "nic_fraction" in rows[0]
    lines = [
        f"# {header}",
        (f"#{'size':>11} {'count':>10}  {'type':<6} {'algorithm':<{w}} "
         f"{'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}" + (f" {'NIC busbw':>9} {'of NIC':>6}" if nic else "")),
        f"#{'(B)':>11} {'(elements)':>10}  {'':<6} {'':<{w}} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}"
        + (f" {'':>7} {'(GB/s)':>9}" if nic else ""),
    ]
    previous = None
    for r in rows:
        if previous is not None and r["size_bytes"] != previous:
            lines.append("")
        previous = r["size_bytes"]
        lines.append(f" {r['size_bytes']:>11} {r['count']:>10}  {'float':<6} {r['algorithm']:<{w}} "
                     f"{r['time_us']:>10.1f} {r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} {r['wrong']:>7}"
                     + (f" {r['nic_busbw_gbps']:>9.4f} {r['nic_fraction']:>6.1%}" if nic else ""))
    return "\n".join(lines)


def format_fit_table(record: dict) -> str:
    """α (µs), β (as GB/s), γ and the fit's median residual per algorithm; then the held-out errors."""
    header = (f"{'algorithm':<22} {'alpha (us)':>10} {'1/beta (GB/s)':>13} {'gamma (s/B)':>11} "
              f"{'fit median |err|':>16} {'rows':>4}")
    lines = [header]
    for name, f in record["algorithms"].items():
        bandwidth = f"{1e-9 / f['beta_s_per_byte']:.3f}" if f["beta_s_per_byte"] > 0 else "inf"
        gamma = f"{f['gamma_s_per_byte']:.3g}" if f["gamma_fitted"] else "in beta"
        median = statistics.median(abs(r["relative_error"]) for r in f["residuals"])
        lines.append(f"{name:<22} {f['alpha_s'] * 1e6:>10.2f} {bandwidth:>13} {gamma:>11} {median:>16.1%} "
                     f"{f['rows']:>4}")
    held = record["held_out"]
    if held:
        lines.append(f"held out: {held['devices']} devices, fitted on {held['fitted_on']}; relative error of the "
                     "predicted time")
        for name, h in held["per_algorithm"].items():
            lines.append(f"  {name:<20} median {h['median_relative_error']:6.1%}  worst {h['worst_relative_error']:6.1%}")
        lines.append(f"  {'all':<20} median {held['median_relative_error']:6.1%}  "
                     f"worst {held['worst_relative_error']:6.1%}")
    return "\n".join(lines)


def load_runs(paths: Sequence[str]) -> list[dict]:
    """The `allreduce.json` records at `paths`.

    Raises:
      ConfigError: if one is missing or not a `jdp bench allreduce` record.
    """
    runs = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(Arg("fit"), f" has `{path}`, which cannot be read as JSON: {e}.") from None
        if not isinstance(record, dict) or record.get("benchmark") != "allreduce":
            raise ConfigError(Arg("fit"), f" has `{path}`, not written by `jdp bench allreduce --out`.")
        runs.append(record)
    return runs


def run_fit(args: argparse.Namespace) -> int:
    """`--fit`: one fit over saved runs, optionally holding out one device count."""
    from jdp import plot

    out = check_out_dir(args.out)
    load_plugins(args.plugin)  # rows of a plugin's strategy are priced by its cost
    runs = load_runs(args.fit)
    if args.nic_model:
        return run_nic_model(args, runs, out)
    rows = [r for run in runs for r in run["results"]]
    counts = sorted({r["devices"] for r in rows})
    if args.hold_out is not None and (args.hold_out not in counts or len(counts) < 2):
        raise ConfigError(Arg("hold_out", args.hold_out), f" must be one of the runs' device counts {counts}, "
                          "with at least one other count to fit on.")
    shared = args.link == "shared" or (args.link == "auto" and all(run.get("platform") == "cpu" for run in runs))
    record = fit.fit_all(rows, held_out=args.hold_out, shared=shared)
    print(f"# jdp bench allreduce --fit: t = m·alpha + b·beta + r·gamma per algorithm, over {len(runs)} run(s) on "
          f"{counts} devices, b = bytes {'all devices send (one shared host)' if shared else 'the busiest device sends'}",
          flush=True)
    print(format_fit_table(record), flush=True)
    if out is not None:
        fields = ("cpu", "vector_isa", "host_cpus", "python", "jax_version", "xla_flags", "backend", "repeats")
        full = {"benchmark": "allreduce-fit", "runs": list(args.fit), "devices": counts,
                **{key: runs[0].get(key) for key in fields},
                "load_average_per_run": [run.get("load_average") for run in runs], **record}
        (out / "fit.json").write_text(json.dumps(full, indent=2) + "\n")
        held = f", x: {args.hold_out} devices held out" if args.hold_out is not None else ""
        title = f"α–β fit on {counts} devices{held}"
        plot.save(plot.fitted_vs_measured(full, title=title), out / "fit.png")
        print(f"wrote {out / 'fit.json'} and {out / 'fit.png'}")
    return 0


def run_nic_model(args: argparse.Namespace, runs: list[dict], out: Path | None) -> int:
    """`--fit ... --nic-model`: the held-out check of a network described by its NIC rate (jdp.bench.nic_model)."""
    from jdp.bench import nic_model

    rates = sorted({run.get("nic_bps", 0) for run in runs})
    alpha_rate = rates[-1] if args.alpha_rate is None else cluster.parse_rate(args.alpha_rate)
    record = nic_model.check(runs, alpha_rate)
    print(f"# jdp bench allreduce --nic-model: t = m·alpha + b·8/(RATE·{nic_model.WIRE_PAYLOAD:.4f}), alpha from the "
          f"buffers <= {nic_model.ALPHA_MAX_BYTES // 1024} KiB at {cluster.format_rate(alpha_rate)}, every other row "
          f"held out; {len(runs)} run(s) at {', '.join(cluster.format_rate(r) for r in rates)}", flush=True)
    print(nic_model.format_check(record), flush=True)
    if out is not None:
        full = {"benchmark": "allreduce-nic-model", "runs": list(args.fit), **record}
        (out / "nic_model.json").write_text(json.dumps(full, indent=2) + "\n")
        print(f"wrote {out / 'nic_model.json'}")
    return 0


def run_allreduce_bench(args: argparse.Namespace) -> int:
    from jdp import plot

    if args.fit is not None:
        return run_fit(args)
    if args.hold_out is not None or args.link != "auto" or args.nic_model or args.alpha_rate is not None:
        raise ConfigError(Arg("hold_out"), ", ", Arg("link"), ", ", Arg("nic_model"), " and ", Arg("alpha_rate"),
                          " apply to fits of saved runs; add ", Arg("fit", "RUN.json ..."), ".")
    sizes = parse_sizes(args.sizes)
    check_positive("repeats", args.repeats)
    load_plugins(args.plugin)
    check_algorithms(args.algorithms)
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    nic = cluster.from_environment()  # set by `jdp launch --hosts H --nic RATE`
    rows = bench_allreduce(devices, sizes, args.algorithms, repeats=args.repeats, backend=args.backend, nic=nic)
    if jax.process_index() != 0:  # every process timed the same calls; process 0 reports
        return 0
    realtime = os.sched_getscheduler(0) == os.SCHED_RR  # `jdp launch --hosts ... --realtime`
    on = "" if nic is None else (f" on {nic[0]} emulated{' real-time' * realtime} hosts with "
                                 f"{cluster.format_rate(nic[1])} NICs")
    header = (f"jdp bench allreduce: {where(devices)}{on}, float32 sum, "
              f"median of {args.repeats} repeats after a warm-up")
    print(format_allreduce_table(rows, header), flush=True)
    if out is not None:
        shared = devices[0].platform == "cpu" and nic is None  # a cluster's hosts have links of their own
        record = {"benchmark": "allreduce", **machine(devices), "cpu_devices_simulated": args.cpu_devices,
                  "backend": args.backend, "repeats": args.repeats, "processes": jax.process_count(),
                  **({} if nic is None else {"emulated_hosts": nic[0], "nic_bps": nic[1], "realtime_hosts": realtime}),
                  "results": rows,
                  "fit": fit.fit_all(rows, shared=shared, say=lambda line: print(line, flush=True))}
        (out / "allreduce.json").write_text(json.dumps(record, indent=2) + "\n")
        title = f"allreduce on {len(devices)} {devices[0].platform} devices, float32, median of {args.repeats}"
        plot.save(plot.busbw_vs_size(rows, title=title), out / "allreduce.png")
        print(f"wrote {out / 'allreduce.json'} and {out / 'allreduce.png'}")
    return 0
