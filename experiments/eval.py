"""Exercise 4: test accuracy computed across all devices vs on device 0 — same result, and the time of each.

A LeNet is trained briefly, then the test set is evaluated by every device count k in both modes:
`all` splits each batch over the k devices and sums the correct counts with `lax.psum` (the last
partial batch padded and masked); `device0` evaluates everything on the first device, as the lesson does.
"""

import statistics
import time
from pathlib import Path

import common


def main() -> None:
    p = common.parser(__doc__.splitlines()[0], "experiments/results/eval")
    p.add_argument("--repeats", type=int, default=5, help="timed evaluations per setting (median reported)")
    args = p.parse_args()
    ks = (1, 2) if args.quick else (1, 2, 4, 8)

    import jax

    import jdp

    jdp.simulate_cpu_devices(max(ks))
    dataset = common.load_data(args, n_train=512, n_test=333)
    lenet = jdp.get_model("lenet", impl="reference")  # the lesson's formulation, evaluated as the lesson does
    config = jdp.TrainConfig(batch_size=64 if args.quick else 256, epochs=1 if args.quick else 2, lr=0.5 if args.quick else 0.2)
    params, _ = jdp.train(config, dataset, jdp.select_devices(1))
    rows, results = [], []
    for k in ks:
        devices = jdp.select_devices(k)
        replicated = jdp.replicate(params, devices)
        for mode in ("all", "device0"):
            evaluate = jdp.make_evaluator(lenet.apply, devices, batch_size=1000, on_all_devices=mode == "all")
            acc = evaluate(replicated, dataset.test.images, dataset.test.labels)  # also compiles
            times = []
            for _ in range(1 if args.quick else args.repeats):
                start = time.perf_counter()
                again = evaluate(replicated, dataset.test.images, dataset.test.labels)
                times.append(time.perf_counter() - start)
                assert again == acc, "evaluation is not deterministic"
            results.append({"k": k, "mode": mode, "test_acc": acc, "seconds_median": statistics.median(times)})
            rows.append((k, mode, f"{acc:.4f}", f"{1000 * statistics.median(times):.1f}"))
    accs = {r["test_acc"] for r in results}
    verdict = ("identical test accuracy in every setting" if len(accs) == 1
               else f"MISMATCH: accuracies {sorted(accs)}")
    table = common.markdown_table(["devices", "evaluated on", "test acc", "ms per pass (median)"], rows)
    table += (f"\n{verdict}; {len(dataset.test.labels)} test images, batches of 1000 split over the devices.\n"
              f"Measured on {common.machine()}; JAX {jax.__version__}.\n")
    out = Path(args.out)
    common.write_outputs(out, "eval", {"quick": args.quick, "machine": common.machine(), "identical": len(accs) == 1,
                                       "results": results}, table)
    figure = jdp.plot.curves(
        {mode: [1000 * r["seconds_median"] for r in results if r["mode"] == mode] for mode in ("all", "device0")},
        xs=list(ks), xlabel="devices", ylabel="ms per test-set pass", logx=True)
    jdp.plot.save(figure, out / "eval.png")
    if len(accs) != 1:
        raise SystemExit(verdict)


if __name__ == "__main__":
    main()
