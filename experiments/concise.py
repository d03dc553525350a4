"""The lesson's concise run: ResNet-18 (Flax) on 1 device, batch 256, lr 0.1 vs 2 devices, batch 512, lr 0.2.

The lesson trains this on GPUs for 10 epochs on all of Fashion-MNIST. On a 2-core CPU ResNet-18
runs at tens of images per second (each 28×28 image costs ~2.7 GFLOP forward and backward), so the
full mode trains on the first `--train-images` training images for `--epochs` epochs and tests on
the first `--test-images` test images; the numbers show the data-parallel machinery and the two
BatchNorm modes at work, not the accuracy ResNet-18 reaches on the whole set. The 2-device run is
done with synchronised BatchNorm and with per-replica BatchNorm.
"""

import time
from pathlib import Path

import common

FULL = {"train_images": 2048, "test_images": 1000, "epochs": 3, "base_batch": 256}
QUICK = {"train_images": 128, "test_images": 64, "epochs": 1, "base_batch": 16}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/concise")
    p.add_argument("--train-images", type=int, default=None, help=f"training subset (full default {FULL['train_images']})")
    p.add_argument("--test-images", type=int, default=None, help=f"test subset (full default {FULL['test_images']})")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs per run (full default {FULL['epochs']})")
    args = p.parse_args()
    plan = dict(QUICK if args.quick else FULL)
    for name in ("train_images", "test_images", "epochs"):
        plan[name] = getattr(args, name) or plan[name]

    import jdp

    jdp.enable_xla_flags()  # as `jdp train` does: faster kernels, same math (set before JAX starts)
    import jax

    jdp.simulate_cpu_devices(2)
    full = common.load_data(args, n_train=256, n_test=64)
    dataset = jdp.Dataset(
        jdp.Split(full.train.images[:plan["train_images"]], full.train.labels[:plan["train_images"]]),
        jdp.Split(full.test.images[:plan["test_images"]], full.test.labels[:plan["test_images"]]))
    b = plan["base_batch"]
    runs = [(1, b, 0.1, "sync"), (2, 2 * b, 0.2, "sync"), (2, 2 * b, 0.2, "per-replica")]
    results, rows, curves = [], [], {}
    for k, batch_size, lr, batchnorm in runs:
        config = jdp.TrainConfig(model="resnet18", batchnorm=batchnorm, batch_size=batch_size, lr=lr, epochs=plan["epochs"])
        start = time.perf_counter()
        _, history = jdp.train(config, dataset, jdp.select_devices(k))
        label = f"{k} device(s), batch {batch_size}, lr {lr}, BatchNorm {batchnorm}"
        results.append({"devices": k, "batch_size": batch_size, "lr": lr, "batchnorm": batchnorm,
                        "test_acc": history[-1].test_acc, "test_acc_per_epoch": [r.test_acc for r in history],
                        "train_loss_per_epoch": [r.train_loss for r in history],
                        "sec_per_epoch": sum(r.seconds for r in history) / len(history),
                        "seconds_total": time.perf_counter() - start})
        curves[label] = [r.test_acc for r in history]
        losses = " → ".join(f"{r.train_loss:.3f}" for r in history)
        rows.append((k, batch_size, lr, batchnorm, losses, f"{history[-1].test_acc:.4f}",
                     f"{results[-1]['sec_per_epoch']:.1f}"))
        print(f"{label}: test acc {history[-1].test_acc:.4f}", flush=True)
    table = common.markdown_table(
        ["devices", "batch", "lr", "BatchNorm", "train loss per epoch", "test acc", "sec/epoch"], rows)
    table += (f"\nResNet-18 (Flax), {plan['epochs']} epoch(s) on the first {len(dataset.train.labels)} training images, "
              f"tested on the first {len(dataset.test.labels)} test images"
              f"{' (synthetic data)' if args.quick else ''}; the lesson: 10 epochs on all 60,000, on GPUs.\n"
              f"Measured on {common.machine()}; JAX {jax.__version__}.\n")
    out = Path(args.out)
    common.write_outputs(out, "concise", {"quick": args.quick, "machine": common.machine(), "plan": plan,
                                          "jax_version": jax.__version__, "runs": results}, table)
    figure = jdp.plot.curves(curves, xs=list(range(1, plan["epochs"] + 1)), xlabel="epoch", ylabel="test accuracy",
                             title=f"ResNet-18 on {len(dataset.train.labels)} training images")
    jdp.plot.save(figure, out / "concise.png")


if __name__ == "__main__":
    main()
