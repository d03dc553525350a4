"""The lesson's table: 1 vs 2 devices, batch 256, lr 0.2, 10 epochs, with `psum` and `manual`.

Each run is the real `jdp train` command (one process each, 2 simulated CPU devices), so the
numbers are exactly what a user gets. The lesson reported test accuracy ≈ 0.84 for both device
counts, and on GPUs 2 devices were no faster than 1 because its loop was dominated by Python.
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import common

LESSON = "lesson (d2l, GPUs): test acc ≈ 0.84 on 1 and on 2 devices, ~2.7–3.0 s/epoch; 2 GPUs no faster than 1"


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/reproduce")
    p.add_argument("--epochs", type=int, default=10)
    args = p.parse_args()
    data = ["--dataset", "synthetic", "--batch-size", "64", "--lr", "0.5"] if args.quick else ["--data-dir", args.data_dir]
    epochs = 1 if args.quick else args.epochs
    out = Path(args.out)
    rows, runs = [], []
    for devices in (1, 2):
        for strategy in ("psum", "manual"):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = ["jdp", "train", "--cpu-devices", "2", "--devices", str(devices), "--allreduce", strategy,
                       "--epochs", str(epochs), "--out", tmp, "--no-progress", *data]
                print("$", shlex.join(cmd), flush=True)
                result = subprocess.run([sys.executable, "-m", "jdp", *cmd[1:]], capture_output=True, text=True)
                if result.returncode:
                    sys.exit(f"run failed:\n{result.stderr}")
                print(result.stdout.strip().splitlines()[-2], flush=True)
                history = json.loads((Path(tmp) / "history.json").read_text())
            sec = sum(e["seconds"] for e in history["epochs"]) / len(history["epochs"])
            acc = history["epochs"][-1]["test_acc"]
            runs.append({"command": recorded(cmd, tmp), "devices": history["devices"], "allreduce": strategy,
                         "test_acc": acc, "sec_per_epoch": sec, "epochs": history["epochs"],
                         "jax_version": history["jax_version"]})
            rows.append((devices, strategy, f"{acc:.4f}", f"{sec:.1f}", ", ".join(history["devices"])))
    table = common.markdown_table(["devices", "allreduce", "test acc", "sec/epoch", "device list"], rows)
    table += f"\n{LESSON}.\nMeasured here: {common.machine()}; JAX {runs[0]['jax_version']}; {epochs} epochs, batch 256, lr 0.2.\n"
    common.write_outputs(out, "reproduce", {"quick": args.quick, "machine": common.machine(), "lesson": LESSON,
                                            "runs": runs}, table)
    plot(runs, out / "reproduce.png")


def recorded(cmd: list[str], tmp: str) -> str:
    """`cmd` as the JSON records it, with no absolute path of this machine: the temporary `--out` as
    `<tmp>`, any other absolute path relative to the working directory (the checkout, when run as documented)."""
    return " ".join("<tmp>" if a == tmp else shlex.quote(os.path.relpath(a) if os.path.isabs(a) else a) for a in cmd)


def plot(runs: list[dict], path: Path) -> None:
    import jdp

    figure = jdp.plot.curves({f"{len(r['devices'])} dev, {r['allreduce']}": [e["test_acc"] for e in r["epochs"]]
                              for r in runs}, xlabel="epoch", ylabel="test accuracy")
    jdp.plot.save(figure, path)


if __name__ == "__main__":
    main()
