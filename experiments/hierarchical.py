"""Hierarchical allreduce vs flat psum: the same training, max relative difference, replicas identical (issue 24).

Trains the lesson's LeNet with psum and with each hierarchical variant, every replica compared after every
step (`check_replicas=1`), (a) on 8 simulated devices in one process grouped as 2 hosts × 4 and 4 × 2,
(b) on 2 processes × 2 devices (`jdp launch`), one host per process, against psum on 4 devices in one process.
Reports, per run, the largest relative difference of any final parameter from psum's,
max_leaf max|θ − θ_psum| / max|θ_psum|, whether the processes' params are the same bits, and the
first step whose mean loss differs from psum's by more than 1e-5 relative: different summation orders
round differently (~1e-7), which stays so until a near-tie (a max-pool's arg max, a ReLU at 0) flips.
"""

import datetime
import platform
import subprocess
import sys
from pathlib import Path

import common

SIMULATED = ["hierarchical:2x4", "hierarchical:tree:2x4", "hierarchical:psum:2x4", "hierarchical:4x2"]
WIRE = "hierarchical:2x4"  # and with bf16 across hosts: different from psum by design (rounding)
N_TRAIN = 12_800  # 50 steps of 256: enough for rounding differences to grow through the updates


def config(allreduce: str, compress: str = "none"):
    import jdp

    return jdp.TrainConfig(batch_size=256, lr=0.2, epochs=1, allreduce=jdp.get_allreduce(allreduce, compress=compress),
                           seed=0)


def max_relative_difference(got, want) -> float:
    import jax
    import numpy as np

    return max(float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(b).max())
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def first_departure(losses, reference) -> str:
    """The first step (from 1) whose mean loss is off psum's by more than 1e-5 relative, or "none"."""
    off = [i + 1 for i, (a, b) in enumerate(zip(losses, reference, strict=True)) if abs(a - b) > 1e-5 * abs(b)]
    return str(off[0]) if off else "none"


def train_recording(config, dataset, devices, **kwargs):
    """`jdp.train`, and the mean loss of every step."""
    import jdp

    losses = []
    params, _ = jdp.train(config, dataset, devices, **kwargs,
                          hooks=jdp.Hooks(on_steps=lambda first, step_losses: losses.extend(step_losses)))
    return params, [float(x) for x in losses]


def worker(args) -> None:
    """One process of the `jdp launch` job: hierarchical with one host per process; saves its params."""
    import jax
    import numpy as np

    import jdp

    jdp.simulate_cpu_devices(int(args.cpu_devices))
    jax.distributed.initialize(args.coordinator, int(args.num_processes), int(args.process_id))
    dataset = subset(common.load_data(args, 2048, 512))
    params, losses = train_recording(config("hierarchical"), dataset, jdp.select_devices(),
                                     guards=jdp.Guards(check_replicas=1))
    np.savez(Path(args.out) / f"params-p{jax.process_index()}.npz", *[np.asarray(x) for x in jax.tree.leaves(params)],
             losses=np.asarray(losses))


def subset(dataset):
    import jdp

    return jdp.Dataset(jdp.Split(dataset.train.images[:N_TRAIN], dataset.train.labels[:N_TRAIN]), dataset.test)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/hierarchical")
    for flag in ("--coordinator", "--num-processes", "--process-id", "--cpu-devices"):  # set by `jdp launch`
        p.add_argument(flag)
    args = p.parse_args()
    if args.coordinator:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launch = [sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--cpu-devices-per-process", "2",
              "--timeout", "1200", "--", sys.executable, __file__, "--out", str(out), "--data-dir", args.data_dir,
              *(["--quick"] if args.quick else [])]
    subprocess.run(launch, check=True)

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    import jdp

    devices = jax.devices()[:8]
    dataset = subset(common.load_data(args, 2048, 512))
    rows, record = [], {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                        "machine": common.machine(), "jax": jax.__version__, "python": platform.python_version(),
                        "quick": args.quick, "n_train": len(dataset.train.labels), "runs": []}

    def report(where: str, name: str, got, want, identical: str, losses, reference) -> None:
        diff, departs = max_relative_difference(got, want), first_departure(losses, reference)
        rows.append([where, f"`{name}`", f"{diff:.2e}", departs, identical])
        record["runs"].append({"where": where, "allreduce": name, "max_relative_difference": diff,
                               "first_step_loss_departs": departs, "replicas_identical": identical})

    for k, names in ((8, ["ring", *SIMULATED]), (4, ["ring"])):  # the flat ring: another summation order
        want, reference = train_recording(config("psum"), dataset, devices[:k])
        for name in names:
            # raises unless the same
            got, losses = train_recording(config(name), dataset, devices[:k], guards=jdp.Guards(check_replicas=1))
            report(f"{k} simulated devices, 1 process", name, got, want, "yes (every step)", losses, reference)
        for name in (WIRE, "ring") if k == 8 else ():  # bf16 on the wire: the flat ring's difference for scale
            got, losses = train_recording(config(name, "bf16-wire"), dataset, devices[:k],
                                          guards=jdp.Guards(check_replicas=1))
            report(f"{k} simulated devices, 1 process", f"{name} --compress bf16-wire", got, want, "yes (every step)",
                   losses, reference)
    saved = [np.load(out / f"params-p{i}.npz") for i in (0, 1)]
    same = all(saved[0][n].tobytes() == saved[1][n].tobytes() for n in saved[0].files)
    got = [saved[0][f"arr_{i}"] for i in range(len(saved[0].files) - 1)]
    report("2 processes × 2 devices (`jdp launch`)", "hierarchical", got, want,
           f"{'yes' if same else 'NO'} (every step in each process; the 2 processes' params {'the same' if same else 'differ'})",
           list(saved[0]["losses"]), reference)
    for path in out.glob("params-p*.npz"):
        path.unlink()
    table = common.markdown_table(["devices", "allreduce", "max relative difference vs psum",
                                   "first step whose loss departs from psum's (> 1e-5)", "replicas identical"], rows)
    table += (f"\nLeNet, SGD lr 0.2, batch 256, one epoch of {record['n_train']} "
              f"{'synthetic' if args.quick else 'Fashion-MNIST'} images; {record['date']}; {record['machine']}; "
              f"JAX {record['jax']}, Python {record['python']}.\n")
    common.write_outputs(out, "hierarchical", record, table)


if __name__ == "__main__":
    main()
