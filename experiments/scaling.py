"""Exercises 1–2: scale the batch with the device count and sweep the learning rate.

For k devices the global batch is 256·k. For each k and each lr the run's final test accuracy is
recorded; then the linear scaling rule (lr ∝ batch, Goyal et al. 2017: lr = 0.2·k) is tried with
and without a linear warmup. The conclusion printed is computed from the numbers, not assumed.
"""

import time
from pathlib import Path

import common

QUICK = {"ks": (1, 2), "lrs": (0.2, 0.8), "epochs": 1}
FULL = {"ks": (1, 2, 4, 8), "lrs": (0.1, 0.2, 0.4, 0.8, 1.6), "epochs": 3}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/scaling")
    p.add_argument("--epochs", type=int, default=None, help=f"epochs per run (full mode default {FULL['epochs']})")
    args = p.parse_args()
    plan = QUICK if args.quick else FULL
    epochs = args.epochs or plan["epochs"]

    import jdp

    jdp.enable_xla_flags()  # as `jdp train` does: faster kernels, same math (set before JAX starts)
    import jax

    jdp.simulate_cpu_devices(max(plan["ks"]))
    dataset = common.load_data(args, n_train=1024, n_test=256)
    base = 64 if args.quick else 256
    runs = []

    def run(k: int, lr: float, warmup_steps: int) -> float:
        config = jdp.TrainConfig(batch_size=base * k, lr=lr, epochs=epochs, warmup_steps=warmup_steps)
        start = time.perf_counter()
        _, history = jdp.train(config, dataset, jdp.select_devices(k))
        acc = history[-1].test_acc
        runs.append({"k": k, "batch_size": base * k, "lr": lr, "warmup_steps": warmup_steps, "test_acc": acc,
                     "test_acc_per_epoch": [r.test_acc for r in history], "seconds": time.perf_counter() - start})
        print(f"k={k} batch={base * k} lr={lr} warmup={warmup_steps}: test acc {acc:.4f}", flush=True)
        return acc

    sweep = {k: {lr: run(k, lr, 0) for lr in plan["lrs"]} for k in plan["ks"]}
    base_lr = 0.2
    lsr = {}
    for k in plan["ks"]:
        steps_per_epoch = len(dataset.train.labels) // (base * k)
        lr = base_lr * k
        without = sweep[k][lr] if lr in sweep[k] else run(k, lr, 0)
        lsr[k] = {"lr": lr, "no_warmup": without, "warmup": run(k, lr, steps_per_epoch // 2)}

    rows = [[k, base * k] + [f"{sweep[k][lr]:.3f}" for lr in plan["lrs"]] + [max(sweep[k], key=sweep[k].get)]
            for k in plan["ks"]]
    table = common.markdown_table(["k", "batch"] + [f"lr {lr}" for lr in plan["lrs"]] + ["best lr"], rows)
    table += "\nLinear scaling rule (lr = 0.2·k), warmup = linear from 0 over half an epoch:\n\n"
    table += common.markdown_table(
        ["k", "batch", "lr", "no warmup", "warmup"],
        [[k, base * k, v["lr"], f"{v['no_warmup']:.3f}", f"{v['warmup']:.3f}"] for k, v in lsr.items()],
    )
    table += "\n" + conclusion(sweep, lsr, plan["ks"]) + "\n"
    table += f"\nMeasured on {common.machine()}; JAX {jax.__version__}; {epochs} epoch(s) per run"
    table += " (synthetic data, quick mode).\n" if args.quick else " on Fashion-MNIST.\n"
    out = Path(args.out)
    common.write_outputs(out, "scaling", {"quick": args.quick, "epochs": epochs, "machine": common.machine(),
                                          "jax_version": jax.__version__, "runs": runs,
                                          "linear_scaling": {str(k): v for k, v in lsr.items()}}, table)
    figure = jdp.plot.curves({f"k={k} (batch {base * k})": [sweep[k][lr] for lr in plan["lrs"]] for k in plan["ks"]},
                             xs=plan["lrs"], xlabel="learning rate", ylabel="final test accuracy", logx=True,
                             title=f"{epochs} epoch(s) per run")
    jdp.plot.save(figure, out / "scaling.png")


def conclusion(sweep: dict, lsr: dict, ks) -> str:
    """Sentences stating what the numbers show: where the best lr moves, and whether warmup helped."""
    best = {k: max(sweep[k], key=sweep[k].get) for k in ks}
    grows = all(best[a] <= best[b] for a, b in zip(ks, ks[1:]))
    lines = [f"Best lr per k: {', '.join(f'k={k}: {best[k]}' for k in ks)} — the best lr "
             + ("does not decrease as the batch grows" if grows else "does not grow monotonically with the batch") + "."]
    helped = [k for k in ks if lsr[k]["warmup"] > lsr[k]["no_warmup"] + 0.005]
    hurt = [k for k in ks if lsr[k]["warmup"] < lsr[k]["no_warmup"] - 0.005]
    lines.append(f"Warmup at lr = 0.2·k helped (> +0.005) for k in {helped or 'none'}, hurt for k in {hurt or 'none'}.")
    gap = {k: max(sweep[k].values()) - lsr[k]["no_warmup"] for k in ks}
    lines.append("Accuracy lost by using the linear-scaling lr instead of the best swept lr: "
                 + ", ".join(f"k={k}: {g:.3f}" for k, g in gap.items()) + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
