"""Each network fault on an emulated cluster, made on cue: when it was noticed, when training went on, the steps
lost, and whether the final params equal an uninterrupted run's (docs/faults.md's table).

Every row is one `jdp launch --hosts 2 ... --inject SPEC -- jdp train` (synthetic data, batch 128, 2 epochs of 16
steps, a checkpoint every 4, the fault in epoch 2), its output lines timestamped as they arrive. Times count from
the process's `jdp inject:` line; a fault that heals shows in epoch 2's time beside an uninterrupted run's. Needs root (network namespaces); `--quick` runs the same rows (they are short already).
"""

import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.common import machine, markdown_table, parser, write_outputs  # noqa: E402

TRAIN = ["jdp", "train", "--backend", "shard_map", "--dataset", "synthetic", "--batch-size", "128", "--no-progress",
         "--epochs", "2", "--checkpoint-every", "4"]  # 16 steps an epoch
FAST, SLOW = ("--hosts", "2", "--nic", "1gbit"), ("--hosts", "2", "--nic", "100mbit")
ROWS = [  # (what, launch flags, train flags)
    ("process killed", [*FAST, "--inject", "kill:1@22", "--max-restarts", "1"], []),
    ("process stopped 2 s", [*FAST, "--inject", "stop:1@22:2"], []),
    ("link cut 3 s", [*FAST, "--inject", "cut:1@22:3"], []),
    ("link cut for good (host lost)", [*FAST, "--inject", "cut:1@22", "--max-restarts", "1", "--min-hosts", "1"],
     ["--collective-timeout", "5"]),
    ("NIC 100mbit -> 1mbit", [*SLOW, "--inject", "slow:1@28:1mbit"], []),
]
NOTICED = ("jdp: error:", "does not answer", "failed:")  # a process's or the launcher's line about the fault


def timed_run(flags: list[str], train: list[str], directory: Path) -> tuple[int, float, list[tuple[float, str]]]:
    """Runs one launch; returns its exit status, its seconds, and every output line with its seconds since the start."""
    command = [sys.executable, "-m", "jdp", "launch", *flags, "--timeout", "600", "--", *TRAIN, *train,
               "--checkpoint-dir", str(directory)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start, lines, lock = time.monotonic(), [], threading.Lock()

    def read(pipe):
        for line in pipe:
            with lock:
                lines.append((time.monotonic() - start, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(pipe,)) for pipe in (proc.stdout, proc.stderr)]
    for reader in readers:
        reader.start()
    code = proc.wait()
    seconds = time.monotonic() - start
    for reader in readers:
        reader.join()
    return code, seconds, sorted(lines)


def epoch_seconds(lines: list[tuple[float, str]], epoch: int) -> float | None:
    """Process 0's last reported seconds of `epoch` (its training loop only; after a restart, the part run then)."""
    found = [line for _, line in lines if line.startswith(f"[p0] epoch {epoch:3d} ")]
    return float(found[-1].rsplit(" ", 2)[-2]) if found else None


def first(lines: list[tuple[float, str]], after: float, *signs: str) -> tuple[float, str] | None:
    return next(((t, line) for t, line in lines if t >= after and any(s in line for s in signs)), None)


def newest_arrays(directory: Path) -> tuple[int, list]:
    """(step, array leaves) of the newest checkpoint in `directory`, read as docs/checkpoints.md describes the
    file: a magic line, the payload's sha256 (32 bytes), then a Flax msgpack payload {"info", "arrays"}."""
    import jax
    from flax import serialization

    path = max(directory.glob("checkpoint-*.msgpack"))
    payload = path.read_bytes().split(b"\n", 1)[1][32:]
    return int(path.stem.split("-")[1]), jax.tree.leaves(serialization.msgpack_restore(payload)["arrays"])


def final_difference(a: Path, b: Path) -> tuple[bool, float]:
    """(bit-identical, largest |difference|) of the params and optimizer state of the two runs' newest checkpoints."""
    import numpy as np

    (step_a, xs), (step_b, ys) = newest_arrays(a), newest_arrays(b)
    pairs = list(zip(xs, ys, strict=True))
    same = step_a == step_b and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in pairs)
    return same, max(float(np.max(np.abs(np.asarray(x, float) - np.asarray(y, float)))) for x, y in pairs)


def measure(what: str, flags: list[str], train: list[str], work: Path, baselines: dict) -> dict:
    rate = flags[flags.index("--nic") + 1]
    if rate not in baselines:
        code, seconds, whole_lines = timed_run(list(flags[:4]), [], work / f"whole-{rate}")
        assert code == 0, f"the uninterrupted run at {rate} failed"
        baselines[rate] = work / f"whole-{rate}", seconds, epoch_seconds(whole_lines, 2)
    whole, whole_seconds, whole_epoch = baselines[rate]
    directory = work / what.split()[0] / flags[flags.index("--inject") + 1].replace(":", "_")
    code, seconds, lines = timed_run(flags, train, directory)
    made = first(lines, 0, "jdp inject:")
    t0 = made[0] if made else float("nan")
    noticed = first(lines, t0, *NOTICED)
    resumed = first(lines, t0, "resuming from")
    healed = first(lines, t0, "continued process", "link back up")
    step = int(made[1].rsplit("at step ", 1)[1]) if made else None
    from_step = int(resumed[1].split("(step ", 1)[1].split(",")[0]) if resumed else None
    same, largest = final_difference(whole, directory)
    return {"fault": what, "command": " ".join(["jdp launch", *flags, "-- jdp train ...", *train]),
            "exit_status": code, "noticed_s": None if noticed is None else round(noticed[0] - t0, 1),
            "going_on_s": round((resumed or healed)[0] - t0, 1) if (resumed or healed) else None,
            "restarted": resumed is not None, "steps_lost": None if from_step is None else step - from_step,
            "seconds": round(seconds, 1), "uninterrupted_seconds": round(whole_seconds, 1),
            "epoch_2_seconds": epoch_seconds(lines, 2), "uninterrupted_epoch_2_seconds": whole_epoch,
            "final_bit_identical": same, "final_max_difference": largest,
            "lines": [line for _, line in lines if "jdp launch:" in line or "jdp: error" in line or "inject" in line]}


def row(r: dict) -> list[object]:
    going_on = "-" if r["going_on_s"] is None else \
        f"{r['going_on_s']:g} s ({'resumed after a restart' if r['restarted'] else 'continued or link back up'})"
    final = "bit-identical" if r["final_bit_identical"] else f"differs by up to {r['final_max_difference']:.1e}"
    return [r["fault"], f"`{r['command'].split('--inject ')[1].split()[0]}`", r["exit_status"],
            "-" if r["noticed_s"] is None else f"{r['noticed_s']:g} s", going_on,
            0 if r["steps_lost"] is None else r["steps_lost"],
            f"{r['seconds']:g} s ({r['seconds'] - r['uninterrupted_seconds']:+.1f} s)",
            "-" if r["restarted"] else f"{r['epoch_2_seconds']:g} s ({r['uninterrupted_epoch_2_seconds']:g} s)", final]


def main() -> int:
    args = parser(__doc__.splitlines()[0], "experiments/results/network-faults").parse_args()
    out = Path(args.out)
    work = out / "runs"
    results, baselines = [], {}
    for what, flags, train in ROWS:
        results.append(measure(what, flags, train, work, baselines))
        print(f"{what}: {results[-1]['exit_status']}", flush=True)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    table = markdown_table(["fault", "--inject", "exit", "noticed after", "training went on after", "steps lost",
                            "job (vs uninterrupted)", "epoch 2 (uninterrupted)", "final params vs uninterrupted"],
                           [row(r) for r in results])
    record = {"quick": args.quick, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "results": results}
    write_outputs(out, "network_faults", record, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
