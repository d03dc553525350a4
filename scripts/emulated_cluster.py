"""`jdp predict` against LeNet's training step measured on an emulated cluster (issue 34, docs/cluster.md).

Runs as root. For each NIC rate and strategy: `jdp launch --hosts 2 --nic RATE -- jdp train` on the
synthetic set (batch 256: 128 per host, 8 steps an epoch), step time = the median of epochs 2.. / 8.
The prediction is `jdp.bench.predict`'s step (compute + one allreduce of LeNet's gradient, leaf by leaf as
each strategy's cost prices it, not overlapped) on 2 hosts of one device joined by NICs described by the
rate (β, `jdp.bench.nic_model`) and each algorithm's α from `--nic-model-json` (`jdp bench allreduce
--fit ... --nic-model --out DIR`). Compute per image is measured here too: one process, one device, on one
core, batch 128 (what each host computes per step).

A second prediction takes as "compute" the step measured on the same cluster with NICs of 40gbit (where
the wire is not the limit: it holds the 2-process step's own costs, α included), and adds only the
bytes' time at RATE, b·β (α = 0: already inside).

`--realtime`: the hosts' processes under the real-time round-robin scheduler (`jdp launch --realtime`), and
the compute measured so too.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path


RATES = ("100mbit", "1gbit")
UNLIMITED = "40gbit"  # the wire is no limit: LeNet's 0.5 MB gradient crosses in 0.1 ms
STRATEGIES = ("psum", "ring", "hierarchical", "hierarchical:psum")
EPOCHS = 4
TRAIN_IMAGES = 2048  # the synthetic set's training split
BATCH = 256
RESULTS = "experiments/results/emulated-cluster"


def epoch_seconds(history: Path) -> list[float]:
    return [e["seconds"] for e in json.loads(history.read_text())["epochs"]]


def run(command: list[str], log: Path) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        sys.exit(f"emulated_cluster.py: `{' '.join(command)}` failed (exit {result.returncode}); see {log}")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help=f"where the results go (default: {RESULTS}/MODE/train, MODE realtime or time-shared)")
    p.add_argument("--nic-model-json", help="α per algorithm: the nic_model.json of `jdp bench allreduce --fit ... "
                   f"--nic-model --out` (default: {RESULTS}/MODE/nic_model.json)")
    p.add_argument("--realtime", action="store_true", help="real-time hosts (`jdp launch --realtime`)")
    args = p.parse_args()
    mode = Path(RESULTS) / ("realtime" if args.realtime else "time-shared")
    out = Path(args.out or mode / "train")
    nic_model_json = Path(args.nic_model_json or mode / "nic_model.json")
    out.mkdir(parents=True, exist_ok=True)
    jdp = [sys.executable, "-m", "jdp"]
    train = ["train", "--dataset", "synthetic", "--epochs", str(EPOCHS), "--no-progress", "--formulation", "fast"]

    from jdp.runtime import cluster

    one = out / "compute"
    realtime = ["--realtime"] * args.realtime
    run([*cluster.REALTIME * args.realtime, "taskset", "-c", "0", *jdp, *train, "--cpu-devices", "1",
         "--batch-size", str(BATCH // 2), "--out", str(one)],
        out / "compute.log")
    compute_s_per_image = statistics.median(epoch_seconds(one / "history.json")[1:]) / TRAIN_IMAGES

    from jdp.bench import nic_model, predict
    from jdp.parallel import cost

    alphas = {a["algorithm"]: a["alpha_s"] for a in json.loads(nic_model_json.read_text())["algorithms"].values()
              if (a["hosts"], a["per_host"]) == (2, 1)}
    leaves = predict.gradient_leaf_bytes("lenet")
    def step_on_cluster(strategy: str, rate: str) -> float:
        folder = out / f"{strategy.replace(':', '-')}-{rate}"
        run([*jdp, "launch", "--hosts", "2", "--nic", rate, *realtime, "--timeout", "600", "--", "jdp", *train,
             "--backend", "shard_map", "--batch-size", str(BATCH), "--allreduce", strategy, "--out", str(folder)],
            out / f"{folder.name}.log")
        return statistics.median(epoch_seconds(folder / "history.json")[1:]) / (TRAIN_IMAGES // BATCH)

    def predicted_step(strategy: str, rate: str, compute_s: float, alpha: float) -> dict:
        bps = cluster.parse_rate(rate)
        one_byte = {"algorithm": strategy, "devices": 2, "hosts": 2, "size_bytes": 1, "nic_bps": bps}
        swap = nic_model.inter_terms(one_byte).bytes_sent  # 2 for whole swaps between two hosts, else 1 (jdp's
        # ring and hierarchical send theirs in pieces: the pieces' extra messages, LeNet's 1-4, are not priced here)
        network = predict.Cluster(1, cost.Link(0.0, 0.0, "memory"),  # a device per host: every sum crosses the NIC
                                  cost.Link(alpha, nic_model.nic_beta(bps) * swap, "nic"), 1, f"2 hosts, {rate}")
        return predict.predict(leaves, compute_s, [2], [strategy], network)[0]["strategies"][strategy]

    rows = []
    for strategy in STRATEGIES:
        unlimited = step_on_cluster(strategy, UNLIMITED)
        for rate in RATES:
            measured = step_on_cluster(strategy, rate)
            alone = predicted_step(strategy, rate, compute_s_per_image * (BATCH // 2), alphas[strategy])
            on_cluster = predicted_step(strategy, rate, unlimited, 0.0)
            rows.append({"rate": rate, "strategy": strategy, "measured_step_ms": measured * 1e3,
                         "predicted_step_ms": alone["step_ms"], "allreduce_ms": alone["allreduce_ms"],
                         "relative_error": alone["step_ms"] / 1e3 / measured - 1,
                         "unlimited_step_ms": unlimited * 1e3, "predicted_from_unlimited_ms": on_cluster["step_ms"],
                         "relative_error_from_unlimited": on_cluster["step_ms"] / 1e3 / measured - 1})
            r = rows[-1]
            print(f"{rate:>8} {strategy:<18} measured {measured * 1e3:6.1f} ms; predicted {r['predicted_step_ms']:6.1f} ms "
                  f"({r['relative_error']:+.0%}), from the {UNLIMITED} step {r['predicted_from_unlimited_ms']:6.1f} ms "
                  f"({r['relative_error_from_unlimited']:+.0%})", flush=True)
    from jdp.bench.machine import machine

    kind = machine()
    record = {"experiment": "emulated-cluster-train", "machine": f"{kind['cpu']} ({kind['vector_isa']}), "
              f"{kind['host_cpus']} cores, JAX {kind['jax_version']}, Python {kind['python']}",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "compute_ms_per_image": compute_s_per_image * 1e3, "gradient_bytes": sum(leaves), "leaves": len(leaves),
              "batch": BATCH, "hosts": 2, "epochs": EPOCHS, "unlimited_rate": UNLIMITED,
              "realtime_hosts": args.realtime, "rows": rows}
    (out / "train.json").write_text(json.dumps(record, indent=2) + "\n")
    table = markdown_table(
        ["NIC", "strategy", "measured step (ms)", "predicted (ms)", "of which allreduce (ms)", "error",
         f"step at {UNLIMITED} (ms)", "predicted from it (ms)", "error"],
        [[r["rate"], r["strategy"], f"{r['measured_step_ms']:.1f}", f"{r['predicted_step_ms']:.1f}",
          f"{r['allreduce_ms']:.1f}", f"{r['relative_error']:+.0%}", f"{r['unlimited_step_ms']:.1f}",
          f"{r['predicted_from_unlimited_ms']:.1f}", f"{r['relative_error_from_unlimited']:+.0%}"] for r in rows])
    load = Path("/proc/loadavg").read_text().split()[0]
    (out / "train.md").write_text(f"{record['machine']}; {record['date']}; load average (1 min) at the end {load}; "
                                  f"compute {record['compute_ms_per_image']:.3f} ms per image\n\n{table}\n")
    print(f"wrote {out / 'train.json'} and {out / 'train.md'}")


if __name__ == "__main__":
    main()
