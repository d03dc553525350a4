"""`jdp` on the command line: argparse in, calls into the library, one-line errors out (exit 2)."""

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from jdp.errors import ConfigError, JdpError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jdp", description="Data-parallel training of the lesson's LeNet in functional JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train LeNet data-parallel and report test accuracy per epoch",
        description="Train the lesson's LeNet data-parallel: replicate params, split each batch over "
        "the devices, allreduce gradients, SGD with the full batch size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_device_flags(train)
    train.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    train.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (on the full-batch mean gradient)")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--allreduce", default="psum", help="gradient allreduce strategy: psum or manual")
    train.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "tfds", "synthetic"])
    train.add_argument("--data-dir", default=None,
                       help="folder with the four IDX files (default: $JDP_DATA_DIR, ../shared/data/fashion-mnist, "
                       "~/.cache/jdp/fashion-mnist, else download); for --dataset tfds, the tfds data_dir")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-on", default="all", choices=["all", "device0"],
                       help="evaluate split over all devices (psum of counts) or on the first device only")
    train.add_argument("--out", default=None, help="write history.json and accuracy.png here")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.set_defaults(run=run_train)
    return parser


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=None, help="number of devices to use (default: all)")
    parser.add_argument("--cpu-devices", type=int, default=None,
                        help="simulate N CPU devices (set before JAX starts); for machines without accelerators")


def setup_devices(args: argparse.Namespace):
    """Simulates CPU devices if asked, then selects the devices (this is where JAX starts)."""
    from jdp import devices

    if args.cpu_devices is not None:
        devices.simulate_cpu_devices(args.cpu_devices)
    return devices.select_devices(args.devices)


def _check_out_dir(out: str | None) -> Path | None:
    if out is None:
        return None
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"`--out {out}` cannot be created: {e.strerror}.") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"`--out {out}` is not writable.")
    return path


def run_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from jdp import data, plot
    from jdp.devices import describe
    from jdp.train import TrainConfig, train

    config = TrainConfig(batch_size=args.batch_size, lr=args.lr, epochs=args.epochs,
                         allreduce=args.allreduce, seed=args.seed, eval_on=args.eval_on)
    config.validate()
    out = _check_out_dir(args.out)
    devices = setup_devices(args)
    dataset = data.load(args.dataset, args.data_dir, seed=args.seed)

    def progress(batches, total):
        return tqdm(batches, total=total, unit="step", leave=False, disable=args.no_progress, file=sys.stderr)

    def on_epoch(record):
        print(f"epoch {record.epoch:3d}  train loss {record.train_loss:.4f}  "
              f"test acc {record.test_acc:.4f}  {record.seconds:.1f} s", flush=True)

    import jax

    _, history = train(config, dataset, devices, on_epoch=on_epoch, progress=progress)
    test_acc = [r.test_acc for r in history]
    sec_per_epoch = sum(r.seconds for r in history) / len(history)
    print(f"test acc: {test_acc[-1]:.2f}, {sec_per_epoch:.1f} sec/epoch on [{', '.join(describe(devices))}]")
    if out is not None:
        record = {
            "config": {k: v for k, v in vars(args).items() if k not in ("run", "command")},
            "devices": describe(devices),
            "jax_version": jax.__version__,
            "epochs": [dataclasses.asdict(r) for r in history],
        }
        (out / "history.json").write_text(json.dumps(record, indent=2) + "\n")
        plot.accuracy_per_epoch(test_acc, out / "accuracy.png",
                                title=f"{args.allreduce}, {len(devices)} device(s), batch {args.batch_size}, lr {args.lr}")
        print(f"wrote {out / 'history.json'} and {out / 'accuracy.png'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except JdpError as e:
        print(f"jdp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
