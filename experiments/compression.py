"""Compressed allreduce on real data: final test accuracy vs bytes sent per step (issue 16).

Trains the lesson's LeNet on 2 devices once per compression mode (none, bf16, PowerSGD rank 1, 2
and 4), each run a separate `jdp train` process, one after the other, then puts them side by side
with `jdp compare`. Bytes per step are those each device hands to the allreduce, traced from the
arrays the compression wrapper actually sends (`jdp.parallel.compress.payload_bytes`, recorded by
`jdp train` in history.json).
"""

import datetime
from pathlib import Path

import common

MODES = {  # run name -> jdp train flags
    "none": [],
    "bf16": ["--compress", "bf16"],
    "powersgd-r1": ["--compress", "powersgd", "--powersgd-rank", "1"],
    "powersgd-r2": ["--compress", "powersgd", "--powersgd-rank", "2"],
    "powersgd-r4": ["--compress", "powersgd", "--powersgd-rank", "4"],
}
QUICK = ["--dataset", "synthetic", "--epochs", "1", "--batch-size", "64"]


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/compression")
    p.add_argument("--epochs", type=int, default=10, help="epochs per run (full mode)")
    p.add_argument("--runs", default="runs/compression", help="where each run's history.json goes")
    p.add_argument("--reuse", action="store_true", help="skip the runs whose history.json exists already")
    args = p.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    data = QUICK if args.quick else ["--epochs", str(args.epochs), "--data-dir", args.data_dir]
    histories = common.train_and_compare(MODES, runs, out, ["--cpu-devices", "2", *data], reuse=args.reuse)
    import jax

    rows = [[name, f"{h['epochs'][-1]['test_acc']:.4f}", f"{plateau(h):.4f}", h["allreduce_payload_bytes"],
             f"{histories['none']['allreduce_payload_bytes'] / h['allreduce_payload_bytes']:.1f}x",
             f"{sum(e['seconds'] for e in h['epochs']) / len(h['epochs']):.1f}"] for name, h in histories.items()]
    table = common.markdown_table(["compress", "final test acc", "mean test acc, last 3 epochs",
                                   "bytes sent per step per device", "smaller by", "s/epoch"], rows)
    epochs = len(histories["none"]["epochs"])
    table += (f"\nLeNet, 2 simulated CPU devices, batch 256, lr 0.2, {epochs} epoch(s), allreduce psum; "
              f"{'synthetic data (quick mode)' if args.quick else 'Fashion-MNIST'}. Measured on {common.machine()}; "
              f"JAX {jax.__version__}; {datetime.date.today().isoformat()}. Curves and per-epoch table: "
              "compare.png, compare.md (`jdp compare`). Test accuracy swings by ~0.02-0.03 from epoch to epoch "
              "at lr 0.2, so the mean over the last 3 epochs compares better than the last one; s/epoch is "
              "from a machine shared with other jobs while the runs went one after the other.\n")
    record = {"quick": args.quick, "machine": common.machine(), "jax_version": jax.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "runs": {name: {"flags": MODES[name], "test_acc": [e["test_acc"] for e in h["epochs"]],
                              "train_loss": [e["train_loss"] for e in h["epochs"]],
                              "allreduce_payload_bytes": h["allreduce_payload_bytes"]}
                       for name, h in histories.items()}}
    common.write_outputs(out, "compression", record, table)


def plateau(history: dict) -> float:
    """Mean test accuracy of the last 3 epochs (of fewer if the run is shorter)."""
    accs = [e["test_acc"] for e in history["epochs"][-3:]]
    return sum(accs) / len(accs)


if __name__ == "__main__":
    main()
