"""Local SGD and DiLoCo against every-step sync on real data: accuracy, bytes sent, wall time (issue 25).

Trains the lesson's LeNet on 4 simulated devices, once with the gradients allreduced every step and
once more with momentum 0.9 (`--optimizer momentum`: DiLoCo's outer optimizer is Nesterov momentum),
and once per local mode (`--sync local-sgd`, `--sync diloco`) and H in {4, 16, 64}, each run a separate
`jdp train` process, one after the other; then `jdp compare` draws test accuracy per epoch and
against the bytes each device sent. Then it times `jdp launch` jobs of two processes (two devices
each), every-step vs local SGD, without and with process 1 sleeping before each of its steps
(`--simulate-straggler`): where does process 0 wait for it?
"""

import datetime
import json
import subprocess
import sys
from pathlib import Path

import common

DEVICES = 4
# run name -> jdp train flags; every-step with momentum: the baseline for DiLoCo's outer Nesterov momentum
MODES = {"every-step": [], "every-step-momentum": ["--optimizer", "momentum"]} | {
    f"{mode}-h{h}": ["--sync", mode, "--sync-every", str(h)] for mode in ("local-sgd", "diloco") for h in (4, 16, 64)}
QUICK = ["--dataset", "synthetic", "--epochs", "1", "--batch-size", "64"]
STRAGGLER_RUNS = {"every-step": [], "local-sgd-h4": MODES["local-sgd-h4"], "local-sgd-h16": MODES["local-sgd-h16"]}
DELAY_S = 0.05  # process 1's sleep before each step: about one step's compute here


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/local-sgd")
    p.add_argument("--epochs", type=int, default=10, help="epochs per run (full mode)")
    p.add_argument("--runs", default="runs/local-sgd", help="where each run's history.json goes")
    p.add_argument("--reuse", action="store_true", help="skip the runs whose history.json exists already")
    p.add_argument("--straggler-epochs", type=int, default=1, help="epochs per straggler job (full mode)")
    args = p.parse_args()
    runs, out = Path(args.runs), Path(args.out)
    data = QUICK if args.quick else ["--epochs", str(args.epochs), "--data-dir", args.data_dir]
    histories = common.train_and_compare(MODES, runs, out, ["--cpu-devices", str(DEVICES), *data],
                                         reuse=args.reuse)
    import jax

    base = histories["every-step"]["epochs"][-1]["bytes_sent"]
    rows = [[name, f"{h['epochs'][-1]['test_acc']:.4f}", f"{max(e['test_acc'] for e in h['epochs']):.4f}",
             f"{h['epochs'][-1]['bytes_sent'] / 2**20:.1f}", f"{base / h['epochs'][-1]['bytes_sent']:.1f}x",
             f"{sum(e['seconds'] for e in h['epochs']):.0f}"] for name, h in histories.items()]
    table = common.markdown_table(["sync", "final test acc", "best test acc", "MB sent per device",
                                   "fewer bytes", "train wall s"], rows)
    epochs = len(histories["every-step"]["epochs"])
    table += (f"\nLeNet, {DEVICES} simulated CPU devices, batch 256 (64 per device), (inner) SGD lr 0.2 "
              "(every-step-momentum: with momentum 0.9), "
              f"{epochs} epoch(s), allreduce psum; DiLoCo's outer optimizer Nesterov, lr 0.7, momentum 0.9. "
              f"{'Synthetic data (quick mode)' if args.quick else 'Fashion-MNIST'}. Measured on {common.machine()}; "
              f"JAX {jax.__version__}; {datetime.date.today().isoformat()}. Curves: compare.png (`jdp compare`); "
              "train wall s: the epochs' training loops, runs one after the other on a machine shared with "
              "other jobs.\n")
    record = {"quick": args.quick, "machine": common.machine(), "jax_version": jax.__version__,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "runs": {name: {"flags": MODES[name], "test_acc": [e["test_acc"] for e in h["epochs"]],
                              "train_loss": [e["train_loss"] for e in h["epochs"]],
                              "bytes_sent": [e["bytes_sent"] for e in h["epochs"]],
                              "bytes_per_step": h["bytes_per_step"], "seconds": [e["seconds"] for e in h["epochs"]]}
                       for name, h in histories.items()}}
    stragglers, straggler_table = straggler_jobs(args, runs)
    record["stragglers"] = stragglers
    common.write_outputs(out, "local-sgd", record, table + "\n" + straggler_table)


def straggler_jobs(args, runs: Path) -> tuple[dict, str]:
    """Each of STRAGGLER_RUNS as a `jdp launch` job of 2 processes × 2 devices, without and with a delay."""
    data = QUICK if args.quick else ["--epochs", str(args.straggler_epochs), "--data-dir", args.data_dir]
    results, rows = {}, []
    for name, flags in STRAGGLER_RUNS.items():
        for delay in (0.0, DELAY_S):
            run = runs / "stragglers" / f"{name}-delay{delay}"
            if not (args.reuse and (run / "history.json").exists()):
                command = [sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--cpu-devices-per-process",
                           "2", "--", "jdp", "train", "--backend", "shard_map", "--no-progress", "--out", str(run),
                           "--simulate-straggler", f"1:{delay}", *data, *flags]
                print("$", " ".join(command[1:]), flush=True)
                subprocess.run(command, check=True)
            history = json.loads((run / "history.json").read_text())
            p0, p1 = history["stragglers"]
            results[f"{name}-delay{delay}"] = history["stragglers"]
            ms = lambda r, what: f"{1e3 * r[what + '_s']:.0f}" if r[what + "s"] else "-"  # noqa: E731
            rows.append([name, f"{delay:.2f}", ms(p0, "step"), ms(p0, "sync"), ms(p1, "step"), ms(p1, "sync"),
                         f"{sum(e['seconds'] for e in history['epochs']):.1f}"])
    table = common.markdown_table(["sync", "process 1 sleeps s/step", "p0 ms/step", "p0 ms/sync", "p1 ms/step",
                                   "p1 ms/sync", "train wall s"], rows)
    table += ("\n`jdp launch --num-processes 2 --cpu-devices-per-process 2`, `--backend shard_map`, "
              f"{'synthetic data, batch 64' if args.quick else 'Fashion-MNIST, batch 256'} (a quarter per device); "
              "`--simulate-straggler 1:DELAY`: process 1 sleeps DELAY s before each step. Each step and sync is "
              "timed to completion on its process (the first of each compiles and is not timed); a process waiting "
              "for the other inside a collective shows in its step time (every-step) or its sync time (local SGD).\n")
    return results, table


if __name__ == "__main__":
    main()
