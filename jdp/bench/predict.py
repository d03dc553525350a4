"""`jdp predict`: a data-parallel step's time and scaling efficiency on a cluster jdp never ran on.

The step is the model's compute (per image × images per device) plus one allreduce of its float32
gradient, priced by the strategy's own cost (`Allreduce.cost`, the α–β–γ model of
`jdp.parallel.cost`), so a strategy a `--plugin` registers is priced too; not overlapped with the compute (an upper
bound: DDP-style overlap hides part of it). Weak scaling: each device keeps its batch, so the
efficiency at k devices is compute / step.

The network is either a `jdp bench allreduce --fit` (measured here, one link) or a named cluster:
nodes of G devices, an intra-node link and inter-node NICs. A flat algorithm spanning nodes runs
at the pace of its slowest link, the NIC: the ring through one device of a node at a time, the
tree's long-distance steps with all G devices of a node sharing its NICs; `hierarchical` sends only
N/G-byte chunks across nodes, all G devices at once. Link presets, from their specifications:

===========  ==========================  =======================================================
link         bandwidth per direction     source
===========  ==========================  =======================================================
nvlink4      450 GB/s                    NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both ways)
pcie4-x16    31.5 GB/s                   PCI-SIG PCIe 4.0: 16 GT/s × 16 lanes, 128b/130b
ib-ndr       50 GB/s                     NVIDIA ConnectX-7 / Quantum-2: NDR 400 Gb/s per port
100gbe       12.5 GB/s                   IEEE 802.3 100 Gb/s Ethernet
10gbe        1.25 GB/s                   IEEE 802.3 10 Gb/s Ethernet
===========  ==========================  =======================================================

α per message is NCCL's own latency model (src/graph/tuning.cc, `hwLat`, ring, Simple protocol):
3.4 µs over NVLink, 5.7 µs over PCIe, 9.6 µs over the network. NCCL uses one network figure for
InfiniBand and sockets; TCP over Ethernet is slower than that, so the Ethernet α is optimistic.
"""

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp

from jdp.bench.fit import levels_of
from jdp.errors import Arg, ConfigError, check_positive
from jdp.flags import add_plugin_flag, check_out_dir, load_plugins
from jdp.parallel import allreduce, cost
from jdp.parallel.buckets import fused
from jdp.parallel.strategy import Allreduce

LINKS = {  # α (s per message), β (s per byte: 1 / bandwidth per direction)
    "nvlink4": cost.Link(3.4e-6, 1 / 450e9, "NVLink 4 (H100 SXM)"),
    "pcie4-x16": cost.Link(5.7e-6, 1 / 31.5e9, "PCIe 4.0 x16"),
    "ib-ndr": cost.Link(9.6e-6, 1 / 50e9, "InfiniBand NDR 400 Gb/s"),
    "100gbe": cost.Link(9.6e-6, 1 / 12.5e9, "100 Gb Ethernet"),
    "10gbe": cost.Link(9.6e-6, 1 / 1.25e9, "10 Gb Ethernet"),
}


@dataclass(frozen=True)
class Cluster:
    """Nodes of `per_node` devices: an intra-node link, and `nics` inter-node NICs per node."""

    per_node: int
    intra: cost.Link
    inter: cost.Link
    nics: int
    title: str


CLUSTERS = {
    "nvlink4-ib-ndr": Cluster(8, LINKS["nvlink4"], LINKS["ib-ndr"], 8,
                              "8×H100 SXM per node on NVLink 4, one InfiniBand NDR NIC per GPU (DGX H100)"),
    "pcie4-100gbe": Cluster(8, LINKS["pcie4-x16"], LINKS["100gbe"], 1,
                            "8 GPUs per node on PCIe 4.0 x16, one 100 GbE NIC per node"),
    "pcie4-10gbe": Cluster(8, LINKS["pcie4-x16"], LINKS["10gbe"], 1,
                           "8 GPUs per node on PCIe 4.0 x16, one 10 GbE NIC per node"),
}
DEFAULT_COUNTS = "8,16,32,64,128,256,512,1024"


def default_strategies() -> list[Allreduce]:
    """Every registered strategy that has a cost, fused (stateless ones), and each that has a
    low-precision wire sending bfloat16, fused: the registry's, a `--plugin`'s included."""
    priced = [s for s in map(allreduce.get, allreduce.names()) if s.cost is not None]
    whole = [s if s.stateful else fused(s) for s in priced]
    return whole + [fused(s.wire(jnp.bfloat16)) for s in priced if s.wire is not None and not s.stateful]


def allreduce_seconds(strategy: str | Allreduce, k: int, leaf_bytes: Sequence[float], network: "Cluster | dict"
                      ) -> float | None:
    """One allreduce of the gradient (float32 leaves of `leaf_bytes`) on k devices by the strategy's own
    cost; None if it has none, or none for k devices on this network.

    `network` is a `Cluster` (nodes of `per_node` devices), or a `--fit` record (every level on the
    link fitted for the first of the strategy's `cost.fits` that the record holds; a strategy that
    needs a grouping of its devices gets √k nodes, or the nearest split).
    """
    priced = allreduce.get(strategy).cost
    if priced is None:
        return None
    if isinstance(network, Cluster):
        levels = priced.terms(k, leaf_bytes, network.per_node)
        inter = cost.Link(network.inter.alpha, network.inter.beta, network.inter.name, ports=network.nics)
        return None if levels is None else cost.seconds(levels, network.intra, inter)
    model = next((network["algorithms"][name] for name in priced.fits if name in network["algorithms"]), None)
    levels = levels_of(priced, k, leaf_bytes, _hosts_for_fit(k))
    if model is None or levels is None:
        return None
    link = cost.Link(model["alpha_s"], model["beta_s_per_byte"], shared=model.get("shared", False))
    return cost.seconds(levels, link, link, model["gamma_s_per_byte"])


def _hosts_for_fit(k: int) -> int:
    """Measured networks have no nodes: a strategy that needs them is priced on √k hosts of √k (or the nearest split)."""
    return max(d for d in range(1, math.isqrt(k) + 1) if k % d == 0)


def predict(leaf_bytes: Sequence[float], compute_s: float, counts: Sequence[int],
            strategies: Sequence[str | Allreduce], network: "Cluster | dict") -> list[dict]:
    """One row per device count: compute, each strategy's step time and efficiency, the best strategy."""
    rows = []
    for k in counts:
        steps = {}
        for strategy in map(allreduce.get, strategies):
            t = allreduce_seconds(strategy, k, leaf_bytes, network)
            if t is not None:
                steps[strategy.name] = {"allreduce_ms": t * 1e3, "step_ms": (compute_s + t) * 1e3,
                               "efficiency": compute_s / (compute_s + t)}
        best = min(steps, key=lambda n: steps[n]["step_ms"]) if steps else None
        rows.append({"devices": k, "compute_ms": compute_s * 1e3, "strategies": steps, "best": best})
    return rows


def gradient_leaf_bytes(model_name: str) -> list[int]:
    """Bytes of each float32 gradient leaf of a registered model (shapes only: nothing is computed)."""
    import jax
    import numpy as np

    from jdp import models

    model = models.get(model_name)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    params = models.trainable(model, variables)
    return [math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params)]


def format_table(rows: Sequence[dict], strategies: Sequence[str], header: str) -> str:
    """Step time (ms) and efficiency per strategy and device count; `*` marks the best."""
    shown = [s for s in strategies if any(s in r["strategies"] for r in rows)]
    widths = [max(13, len(s)) for s in shown]
    lines = [f"# {header}", f"{'devices':>7} {'compute':>7}  " + "  ".join(f"{s:>{w}}" for s, w in zip(shown, widths))]
    for r in rows:
        cells = []
        for s, w in zip(shown, widths):
            p = r["strategies"].get(s)
            cell = "-" if p is None else f"{p['step_ms']:.2f} {p['efficiency']:4.0%}{'*' if s == r['best'] else ' '}"
            cells.append(f"{cell:>{w}}")
        lines.append(f"{r['devices']:>7} {r['compute_ms']:>7.2f}  " + "  ".join(cells))
    lines.append("step ms and scaling efficiency (compute / step) per strategy; * the fastest at that count")
    return "\n".join(lines)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `predict` to the `jdp` subcommands."""
    p = commands.add_parser(
        "predict", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="predict step time and scaling efficiency on a cluster (α–β model: measured fit or link presets)",
        description="Step = compute per image × batch per device + one allreduce of the model's float32 gradient "
        "(not overlapped), priced by jdp's α–β–γ cost model on a measured network (`jdp bench allreduce --fit ... "
        "--out DIR` wrote DIR/fit.json) or a cluster preset. Prints a table and writes predict.json and "
        "predict.png to --out. Presets: " + "; ".join(f"{n}: {c.title}" for n, c in CLUSTERS.items()) + ".",
    )
    p.add_argument("--model", default="lenet", help="a registered model whose gradient is allreduced (lenet, resnet18)")
    p.add_argument("--grad-bytes", type=float, default=None, metavar="BYTES",
                   help="instead of --model: the gradient's bytes, one buffer")
    p.add_argument("--compute-ms-per-image", type=float, default=None, metavar="MS",
                   help="forward+backward time per image on one device")
    p.add_argument("--train-json", default=None, metavar="PATH",
                   help="instead of --compute-ms-per-image: the bench_train.json of `jdp bench train --out` (1 / its float32 "
                   "1-device images per second)")
    p.add_argument("--batch-per-device", type=int, default=32, help="images per device per step")
    p.add_argument("--network", default="nvlink4-ib-ndr", help=f"a preset ({', '.join(CLUSTERS)}) or a fit.json")
    p.add_argument("--devices", default=DEFAULT_COUNTS, help="device counts, comma-separated")
    p.add_argument("--strategies", nargs="+", default=None, metavar="NAME",
                   help="strategy names as jdp writes them: a registered one (jdp.allreduce_names(), a --plugin's "
                   "included) or hierarchical[:tree][:HxL], then wrappers (+fused, +buckets25MB, +bfloat16-wire, "
                   "+bfloat16); default: every registered strategy with a cost, fused, and those with a "
                   "low-precision wire sending bfloat16, fused")
    add_plugin_flag(p)
    p.add_argument("--out", default=None, metavar="DIR", help="write predict.json and predict.png here")
    p.set_defaults(run=run_predict)


def load_network(spec: str) -> "Cluster | dict":
    """A preset's Cluster, or the record of a `jdp bench allreduce --fit` fit.json."""
    if spec in CLUSTERS:
        return CLUSTERS[spec]
    try:
        record = json.loads(Path(spec).read_text())
    except (OSError, ValueError):
        raise ConfigError(Arg("network", spec), f" is neither a preset ({', '.join(CLUSTERS)}) nor a readable fit.json."
                          ) from None
    if not isinstance(record, dict) or "algorithms" not in record:
        raise ConfigError(Arg("network", spec), " is not a fit.json (written by `jdp bench allreduce --fit --out`).")
    return record


def compute_seconds_per_image(args: argparse.Namespace) -> float:
    """--compute-ms-per-image, or the 1-device rate of a `jdp bench train` record."""
    if (args.compute_ms_per_image is None) == (args.train_json is None):
        raise ConfigError("Give exactly one of ", Arg("compute_ms_per_image"), " and ", Arg("train_json"), ".")
    if args.compute_ms_per_image is not None:
        _check_above_zero("compute_ms_per_image", args.compute_ms_per_image)
        return args.compute_ms_per_image * 1e-3
    try:
        record = json.loads(Path(args.train_json).read_text())
        one = next(r for r in record["results"] if r.get("devices") == 1 and r.get("precision") == "float32")
        return 1 / one["images_per_s"]
    except (OSError, ValueError, KeyError, StopIteration, TypeError, ZeroDivisionError):
        raise ConfigError(Arg("train_json", args.train_json), " has no float32 1-device result with images_per_s "
                          "(write one with `jdp bench train --out DIR`).") from None


def _check_above_zero(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(Arg(name), f" must be a positive number, got {value}.")


def run_predict(args: argparse.Namespace) -> int:
    from jdp import plot

    network = load_network(args.network)
    check_positive("batch_per_device", args.batch_per_device)
    try:
        counts = [int(c) for c in args.devices.split(",")]
    except ValueError:
        raise ConfigError(Arg("devices", args.devices), ": write device counts separated by commas, e.g. 8,64,1024."
                          ) from None
    for k in counts:
        check_positive("devices", k)
    load_plugins(args.plugin)
    strategies = default_strategies() if args.strategies is None else [allreduce.get(s) for s in args.strategies]
    for strategy in strategies:
        if strategy.cost is None:
            print(f"predict: skipping `{strategy.name}`: it has no cost (`jdp.Allreduce.cost`)")
    out = check_out_dir(args.out)
    compute = compute_seconds_per_image(args) * args.batch_per_device
    if args.grad_bytes is not None:
        _check_above_zero("grad_bytes", args.grad_bytes)
        leaves, what = [args.grad_bytes], f"{args.grad_bytes / 1e6:.2f} MB gradient"
    else:
        leaves = gradient_leaf_bytes(args.model)
        what = f"{args.model}: {sum(leaves) / 1e6:.2f} MB gradient in {len(leaves)} leaves"
    where = network.title if isinstance(network, Cluster) else f"measured fit ({args.network})"
    header = (f"jdp predict: {what}, compute {compute * 1e3:.2f} ms/step ({args.batch_per_device} images per "
              f"device), {where}")
    rows = predict(leaves, compute, counts, strategies, network)
    print(format_table(rows, [s.name for s in strategies], header), flush=True)
    if out is not None:
        record = {"command": "predict", "model": None if args.grad_bytes else args.model,
                  "gradient_bytes": sum(leaves), "leaves": len(leaves), "compute_ms": compute * 1e3,
                  "batch_per_device": args.batch_per_device, "network": args.network, "network_title": where,
                  "rows": rows}
        (out / "predict.json").write_text(json.dumps(record, indent=2) + "\n")
        plot.save(plot.predicted_scaling(rows, title=header.removeprefix("jdp predict: ")), out / "predict.png")
        print(f"wrote {out / 'predict.json'} and {out / 'predict.png'}")
    return 0
