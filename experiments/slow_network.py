"""Which way of communicating trains fastest on a slow network: time to accuracy on an emulated cluster (issue 35).

Every run is one `jdp launch --hosts 2 --nic RATE -- jdp train --backend shard_map` of the lesson's LeNet
(batch 256, 128 per host). A run's accuracies do not depend on the NIC (the same program on the same data,
bit for bit; the script checks it), only its time does. So each row trains once for `--epochs` at the first
rate, which gives its accuracy after each epoch, and for 3 epochs at each other rate and at an unlimited one
(40gbit: the wire is no limit), which give the epoch's time there: epoch 1 (it compiles) and then epoch 2
for every later one (epoch 3 ends with a local mode's final sync). Per row and rate: the training loop's wall
time until the test accuracy first reaches 0.80 and 0.85 (in whole epochs), the accuracy after the last
epoch, the MB each host sent, and the cost model's wall time: the row's time at the unlimited rate plus, per sync, the bytes its strategy sends across
the NICs at RATE (b·β, β from RATE alone as in docs/cluster.md; the messages' α is inside the unlimited run).
Needs root (network namespaces and `tc`); `--quick`: 3 rows, 3 epochs of synthetic data at 100mbit.
"""

import datetime
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.common import machine, markdown_table, parser, write_outputs  # noqa: E402

RATES, UNLIMITED, THRESHOLDS = ("1gbit", "100mbit", "10mbit"), "40gbit", (0.80, 0.85)
STREAMING = ["--sync", "streaming-diloco", "--sync-every", "16", "--fragments", "4", "--sync-delay", "1"]
ROWS = {  # name -> jdp train flags: every-step sums first, then syncs every H steps
    "psum": [], "ring": ["--allreduce", "ring"], "hierarchical": ["--allreduce", "hierarchical"],
    "bf16-wire": ["--allreduce", "ring", "--compress", "bf16-wire"],
    "powersgd-r2": ["--compress", "powersgd", "--powersgd-rank", "2", "--backend", "pmap"],  # per-device state
    "local-sgd-h16": ["--sync", "local-sgd", "--sync-every", "16"],
    "diloco-h16": ["--sync", "diloco", "--sync-every", "16"], "diloco-h64": ["--sync", "diloco", "--sync-every", "64"],
    "streaming-int8": [*STREAMING, "--outer-dtype", "int8"], "streaming-fp8": [*STREAMING, "--outer-dtype", "fp8"],
    "streaming-int8-mixing0": [*STREAMING, "--outer-dtype", "int8", "--mixing", "0"],
}
PPERMUTE_RINGS = ("ring", "hierarchical", "bf16-wire")  # rows whose sum crosses the NICs as a ring of ppermutes
RATE_BPS = {"10mbit": 1e7, "100mbit": 1e8, "1gbit": 1e9}
WIRE_PAYLOAD = 1448 / 1514  # TCP payload per 1514-byte Ethernet frame: the share of what the shaper counts
SHORT_EPOCHS = 3  # epoch 1 compiles; epoch 3 ends with a local mode's final sync (and compiles Streaming DiLoCo's)
QUICK_ROWS, QUICK_DATA = ("psum", "diloco-h16", "streaming-int8"), ["--dataset", "synthetic"]


def launched(name: str, rate: str, data: list[str], runs: Path, reuse: bool) -> dict:
    """The history.json of row `name` at `rate`, run now unless `reuse` finds it."""
    run = runs / f"{name}-{rate}-{data[-1]}epochs"
    if not (reuse and (run / "history.json").exists() and (run / "launch.log").exists()):
        command = [sys.executable, "-m", "jdp", "launch", "--hosts", "2", "--nic", rate, "--timeout", "1800", "--",
                   "jdp", "train", "--backend", "shard_map", "--no-progress", "--out", str(run), *data, *ROWS[name]]
        print("$", " ".join(command[2:]), flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
        run.mkdir(parents=True, exist_ok=True)
        (run / "launch.log").write_text(result.stdout + result.stderr)
        if result.returncode:
            sys.exit(f"slow_network.py: the run failed (exit {result.returncode}); see {run / 'launch.log'}")
    history = json.loads((run / "history.json").read_text())
    sent = re.findall(r"host (\d+) \([^)]*\): sent ([0-9.]+) MB", (run / "launch.log").read_text())
    return {**history, "nic_mb_sent": [float(mb) for _, mb in sent]}  # the launcher's count, per host


def sync_seconds(name: str, bytes_per_sync: int, rate: str) -> float:
    """b·β: seconds one sync's bytes take across a NIC of `rate` (docs/cluster.md's model). On 2 hosts of 1
    device every row's sum sends its whole payload once (a ring: 2(k−1)/k of it; Gloo's psum and gather: all
    of it); a ring of ppermutes between two hosts sends its two directions one after the other."""
    swap = 2.0 if name in PPERMUTE_RINGS else 1.0
    return bytes_per_sync * swap * 8 / (RATE_BPS[rate] * WIRE_PAYLOAD)


def summary(name: str, rate: str, long: dict, short: dict, unlimited: dict) -> dict:
    """Row `name` at `rate`: its accuracies from the long run; its epochs' times from `short` (the long run
    itself at the first rate), epoch 2's for every epoch after the first; the prediction from `unlimited`."""
    epochs, steady = long["epochs"], lambda h: h["epochs"][1]["seconds"]  # noqa: E731
    if short is long:  # measured, every epoch
        wall = [sum(e["seconds"] for e in epochs[: i + 1]) for i in range(len(epochs))]
    else:
        wall = [short["epochs"][0]["seconds"] + i * steady(short) for i in range(len(epochs))]
    # but after its last epoch, where a local mode's final sync (after the run's last step) moves the model
    same = [e["test_acc"] for e in short["epochs"][:-1]] == [e["test_acc"] for e in epochs[: len(short["epochs"]) - 1]]
    free = unlimited["epochs"][0]["seconds"] + (len(epochs) - 1) * steady(unlimited)
    predicted = free + epochs[-1]["syncs"] * sync_seconds(name, long["bytes_per_sync"], rate)
    return {"row": name, "rate": rate, "flags": ROWS[name], "test_acc": [e["test_acc"] for e in epochs],
            "wall_s": wall, "final_test_acc": epochs[-1]["test_acc"], "same_accuracies_at_every_rate": same,
            **{f"seconds_to_{t:.2f}": next((w for w, e in zip(wall, epochs) if e["test_acc"] >= t), None)
               for t in THRESHOLDS},
            "mb_sent_per_host": epochs[-1]["bytes_sent"] / 2**20, "nic_mb_sent": long["nic_mb_sent"],
            "mb_sent": [e["bytes_sent"] / 2**20 for e in epochs],
            "epoch_seconds": [short["epochs"][0]["seconds"], steady(short)], "predicted_wall_s": predicted,
            "measured_wall_s": wall[-1], "prediction_error": predicted / wall[-1] - 1}


def figures(rows: list[dict], rates: tuple[str, ...], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False, sharey=True)
    for ax, rate in zip(axes[0], rates, strict=True):
        for r in (r for r in rows if r["rate"] == rate):
            ax.plot(r["wall_s"], r["test_acc"], marker="o", label=r["row"])
        ax.set(title=f"NIC {rate}", xlabel="training wall time (s)", ylabel="test accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy-vs-time.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in (r for r in rows if r["rate"] == rates[0]):
        ax.plot(r["mb_sent"], r["test_acc"], marker="o", label=r["row"])
    ax.set(xscale="log", xlabel="MB sent per host", ylabel="test accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy-vs-mb.png", dpi=120)


def main() -> None:
    p = parser(__doc__.splitlines()[0], "experiments/results/slow-network")
    p.add_argument("--epochs", type=int, default=12, help="epochs of each row's long run (full mode)")
    p.add_argument("--rates", default=",".join(RATES), help="the NIC rates, comma-separated; the first gets the "
                   "long runs (full mode)")
    p.add_argument("--runs", default="runs/slow-network", help="where each run's history.json goes")
    p.add_argument("--reuse", action="store_true", help="skip the runs whose history.json exists already")
    p.add_argument("--rows", default=None, help="run these rows (comma-separated) first, in this order")
    args = p.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    names, rates = (QUICK_ROWS, ("100mbit",)) if args.quick else (tuple(ROWS), tuple(args.rates.split(",")))
    first = [] if args.rows is None else args.rows.split(",")
    unknown = [name for name in first if name not in ROWS]
    if unknown:
        p.error(f"--rows: no row {', '.join(unknown)}; the rows: {', '.join(ROWS)}")
    names = (*first, *(name for name in names if name not in first))
    data = QUICK_DATA if args.quick else ["--data-dir", args.data_dir]
    epochs = SHORT_EPOCHS if args.quick else args.epochs
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rows = []
    for name in names:
        long = launched(name, rates[0], [*data, "--epochs", str(epochs)], runs, args.reuse)
        short = {rate: launched(name, rate, [*data, "--epochs", str(SHORT_EPOCHS)], runs, args.reuse)
                 for rate in rates[1:]}
        unlimited = launched(name, UNLIMITED, [*data, "--epochs", str(SHORT_EPOCHS)], runs, args.reuse)
        rows += [summary(name, rate, long, short.get(rate, long), unlimited) for rate in rates]
    rows.sort(key=lambda r: (rates.index(r["rate"]), list(ROWS).index(r["row"])))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    seconds = lambda s: "—" if s is None else f"{s:.0f}"  # noqa: E731
    table = markdown_table(
        ["NIC", "row", "s to 0.80", "s to 0.85", "final test acc", "MB sent per host", "through the NIC",
         "wall s", "predicted s", "error"],
        [[r["rate"], r["row"], seconds(r["seconds_to_0.80"]), seconds(r["seconds_to_0.85"]),
          f"{r['final_test_acc']:.4f}", f"{r['mb_sent_per_host']:.1f}",
          " / ".join(f"{mb:.1f}" for mb in r["nic_mb_sent"]), f"{r['measured_wall_s']:.0f}",
          f"{r['predicted_wall_s']:.0f}", f"{r['prediction_error']:+.0%}"] for r in rows])
    import jax

    table += (f"\n2 emulated hosts × 1 device (`jdp launch --hosts 2 --nic RATE`), LeNet, batch 256, "
              f"{'synthetic data (quick mode)' if args.quick else 'Fashion-MNIST'}, {epochs} epochs. "
              f"Measured on {machine()}; JAX {jax.__version__}; {datetime.date.today().isoformat()}; load average "
              f"{' '.join(load_before)} before, {' '.join(load_after)} after. Times are the training loops' (epoch 1's "
              "includes compiling; evaluation is not counted): measured over all epochs at "
              f"{rates[0]}, and from {SHORT_EPOCHS}-epoch runs at the other rates (epoch 2's time for every later epoch; the "
              "accuracies are the same at every rate, checked on the short runs' first epoch: "
              "`same_accuracies_at_every_rate` in the JSON); "
              "MB sent per host: what jdp handed its allreduce; "
              "through the NIC: what the launcher counted leaving each host (Gloo's framing and the evaluations' "
              "own sums included; at the first rate); predicted: the row's time at 40gbit plus each sync's bytes "
              "at RATE.\n")
    record = {"quick": args.quick, "machine": machine(), "jax_version": jax.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "load_average": {"before": load_before, "after": load_after}, "rows": rows}
    write_outputs(out, "slow-network", record, table)
    figures(rows, rates, out)


if __name__ == "__main__":
    main()
