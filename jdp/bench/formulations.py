"""`jdp bench formulations`: ways to write the lesson's LeNet step, timed side by side.

Every formulation takes the lesson's params and NCHW images and computes the same logits (up to
rounding; the table prints each one's largest gradient difference from the reference). Each runs
as jdp's data-parallel SGD step on the devices asked for (one by default) and is timed in
alternating rounds, fastest round kept, so the ratios of one run compare. `reference`, `fast`,
`split-2`, `split-4` and the three `phase-matmul` ones are the formulations jdp trains
(`--formulation`); `--write-table` records the fastest of them for this machine kind in
`--formulation auto`'s table. The others are
alternatives kept here so their cost can be re-measured on new hardware or a new XLA:

* conv1 as XLA's convolution (weight gradient as an im2col matmul) followed by separate bias,
  ReLU and pooling ops, instead of the fused one-channel layer; pooling as reshape + mean;
* conv1's fused output left to XLA's fusion instead of stored behind an optimisation barrier;
* conv2's gradients as im2col matmuls (weight gradient, input gradient through col2im, or both),
  and the whole conv2 as an im2col matmul: the input gradient as a convolution pads dy by 4
  pixels, so more than half of its multiply-adds are with zeros;
* the bias gradients as matmuls with a ones vector instead of XLA's reductions;
* conv2 in NCHW/OIHW (the lesson's layout) inside the fast formulation;
* the batch split into independent chunks inside one step (`split-2`, `split-4`: independent work for
  XLA's CPU thread pool, without devices);
* conv2 with XLA's own gradients instead of `fast`'s custom one (the same program in float32; in
  bfloat16 XLA's CPU compiler runs its input gradient in float32), and with both gradients as
  bfloat16 forward convolutions;
* bfloat16: the whole model cast (`--precision bf16`: conv1's fused layer in float32, conv2's input
  gradient in bfloat16), that with conv1's layer in bfloat16 too, with XLA's conv2 input gradient, or
  both (jdp's bf16 before 2026-12-07), or only the conv and matmul operands with float32 accumulation
  and float32 elementwise work.
"""

import argparse
import datetime
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jdp.bench.machine import machine
from jdp.errors import Arg, ConfigError, check_positive
from jdp.flags import add_device_flags, check_out_dir, setup_devices
from jdp.models import get as get_model
from jdp.models import Model, lenet, lenet_fast, precision, summed_cross_entropy
from jdp.models.lenet import Params
from jdp.models.lenet_fast import (
    conv_low_precision_forward_gradients,
    conv_relu_pool,
    conv_with_matmul_gradients,
    make_apply,
    one_channel_conv_relu_pool,
    patches,
    valid_conv,
)
from jdp.parallel.inflight import repeat_step
from jdp.parallel.layout import split_batch
from jdp.runtime.machine_kind import this_kind
from jdp.training import formulation as auto_table
from jdp.training.build import build_run
from jdp.training.config import TrainConfig

# `--write-table` adopts a formulation over `fast` only if its median speed-up is at least this
MARGIN = 0.05

Apply = Callable[[Params, jax.Array], jax.Array]

# conv1's fused layer computing in its inputs' dtype (bfloat16 under bf16), as jdp's bf16 did before 2026-12-07
_layer1_in_input_dtype = functools.partial(one_channel_conv_relu_pool, compute_dtype=None)


def _conv_im2col(x: jax.Array, w: jax.Array) -> jax.Array:
    kh, kw, c, o = w.shape
    return jnp.einsum("nhwk,ko->nhwo", patches(x, kh, kw), w.reshape(kh * kw * c, o))


@jax.custom_vjp
def _add_bias_by_matmul(y: jax.Array, b: jax.Array) -> jax.Array:
    return y + b


_add_bias_by_matmul.defvjp(lambda y, b: (y + b, None),
                           lambda _, dy: (dy, jnp.ones(dy.size // dy.shape[-1], dy.dtype) @ dy.reshape(-1, dy.shape[-1])))


def _reshape_mean_pool(x: jax.Array) -> jax.Array:
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


_conv_matmul_dw = conv_with_matmul_gradients(weight=True, inputs=False)


def _conv_nchw(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    """conv2 in the lesson's NCHW/OIHW layout, between NHWC activations."""
    y = jax.lax.conv_general_dilated(x.transpose(0, 3, 1, 2), w_hwio.transpose(3, 2, 0, 1), (1, 1), "VALID",
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y.transpose(0, 2, 3, 1)


def _conv_bf16_operands(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x.astype(jnp.bfloat16), w_hwio.astype(jnp.bfloat16), (1, 1), "VALID",
                                        dimension_numbers=lenet_fast.DIMS, preferred_element_type=jnp.float32)


def _matmul_bf16_operands(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _bf16(apply: Apply) -> Apply:
    return precision.mixed(get_model("lenet")._replace(apply=apply), "bf16").apply


# name -> (what it is, logits function)
FORMULATIONS: dict[str, tuple[str, Apply]] = {
    "reference": ("the lesson's NCHW formulation (`--formulation reference`)", lenet.apply),
    "fast": ("jdp's default (`--formulation fast`): cropped, NHWC, conv1+bias+ReLU+pool fused, strided-sum pooling",
             lenet_fast.apply),
    "conv1-xla": ("fast, conv1 as XLA's convolution (weight gradient as a matmul), then bias, ReLU, pool",
                  make_apply(layer1=conv_relu_pool(_conv_matmul_dw))),
    "pool-reshape-mean": ("fast, conv2's pooling as reshape + mean", make_apply(pool=_reshape_mean_pool)),
    "conv1-xla+pool-reshape-mean": ("both of the above, no barrier: jdp's earlier fast formulation",
                                    make_apply(layer1=conv_relu_pool(_conv_matmul_dw, pool=_reshape_mean_pool),
                                               pool=_reshape_mean_pool, barrier=False)),
    "no-barrier": ("fast, conv1's output not stored: XLA fuses its loop into conv2's weight-gradient transpose too",
                   make_apply(barrier=False)),
    "conv2-dw-matmul": ("fast, conv2's weight gradient as an im2col matmul",
                        make_apply(conv2=_conv_matmul_dw)),
    "conv2-dx-matmul": ("fast, conv2's input gradient as a matmul + col2im",
                        make_apply(conv2=conv_with_matmul_gradients(weight=False, inputs=True))),
    "conv2-grads-matmul": ("fast, both conv2 gradients as matmuls",
                           make_apply(conv2=conv_with_matmul_gradients(weight=True, inputs=True))),
    "conv2-im2col": ("fast, conv2 forward and backward as im2col matmuls", make_apply(conv2=_conv_im2col)),
    "bias-grads-matmul": ("fast, bias gradients as ones-vector matmuls", make_apply(bias=_add_bias_by_matmul)),
    "conv2-nchw": ("fast, conv2 in the lesson's NCHW/OIHW layout", make_apply(conv2=_conv_nchw)),
    "split-2": ("fast, the batch as 2 independent chunks in one step", lenet_fast.FORMULATIONS["split-2"]),
    "split-4": ("fast, the batch as 4 independent chunks in one step", lenet_fast.FORMULATIONS["split-4"]),
    "phase-matmul": ("fast, conv1's layer as one matmul of the pixel phases by the kernel placed per pooling phase",
                     lenet_fast.FORMULATIONS["phase-matmul"]),
    "phase-matmul-split-2": ("phase-matmul, the batch as 2 independent chunks in one step",
                             lenet_fast.FORMULATIONS["phase-matmul-split-2"]),
    "phase-matmul-split-4": ("phase-matmul, the batch as 4 independent chunks in one step",
                             lenet_fast.FORMULATIONS["phase-matmul-split-4"]),
    "bf16": ("fast under `--precision bf16`: bfloat16, conv1's fused layer in float32", _bf16(lenet_fast.apply)),
    "bf16-conv1-bf16": ("bf16, conv1's fused layer in bfloat16 too",
                        _bf16(make_apply(layer1=_layer1_in_input_dtype))),
    "conv2-xla-grads": ("fast, conv2 without its custom gradient (XLA's own transposes; float32 runs the same)",
                        make_apply(conv2=valid_conv)),
    "bf16-conv2-xla-dx": ("bf16, conv2's input gradient XLA's own, which XLA runs in float32",
                          _bf16(make_apply(conv2=valid_conv))),
    "bf16-conv1-bf16+conv2-xla-dx": ("both of the above: `--precision bf16` before 2026-12-07",
                                     _bf16(make_apply(layer1=_layer1_in_input_dtype, conv2=valid_conv))),
    "bf16-conv2-forward-grads": ("bf16, conv2's gradients as forward convolutions, all in bfloat16 (not XLA's)",
                                 _bf16(make_apply(conv2=conv_low_precision_forward_gradients))),
    "bf16-operands": ("fast, bfloat16 conv/matmul operands only, float32 accumulation and elementwise",
                      make_apply(layer1=conv_relu_pool(_conv_bf16_operands), conv2=_conv_bf16_operands,
                                 matmul=_matmul_bf16_operands)),
}


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    """Adds `formulations` to the `jdp bench` subcommands."""
    p = benchmarks.add_parser(
        "formulations", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="time ways to write the LeNet step (conv2 gradients, bias, layout, chunks, bf16) side by side",
        description="Time the lesson's LeNet SGD step written in several ways, as jdp's data-parallel step on the "
        "devices (one unless --cpu-devices/--devices say more), in alternating rounds, and print ms/step, images/s, the ratio to the reference and to jdp's fast formulation, "
        "and each one's largest gradient difference from the reference.",
    )
    add_device_flags(p)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (fastest kept)")
    p.add_argument("--only", default=None, metavar="A,B", help=f"formulations to time (default: all: {', '.join(FORMULATIONS)})")
    p.add_argument("--out", default=None, metavar="DIR", help="write formulations.json and formulations.md here")
    p.add_argument("--write-table", action="store_true",
                   help="time the formulations jdp trains (unless --only) and record the fastest for this machine kind "
                   "and device count in the table `--formulation auto` reads ($JDP_CACHE_DIR or ~/.cache/jdp/"
                   f"{auto_table.CACHE_FILE}); adopted over fast only at a median speed-up of {1 + MARGIN:.2f}x or more")
    p.set_defaults(run=run_formulations_bench)


def _gradient(apply: Apply, batch: int) -> Params:
    params = lenet.init(jax.random.key(0), scale=0.1)
    images = jax.random.uniform(jax.random.key(1), (batch, 1, 28, 28))
    labels = jax.random.randint(jax.random.key(2), (batch,), 0, 10)
    return jax.jit(jax.grad(summed_cross_entropy(apply)))(params, images, labels)  # op by op is seconds slower


_reference_gradient = functools.cache(lambda batch: _gradient(lenet.apply, batch))


def gradient_error(apply: Apply, batch: int = 32) -> float:
    """Largest |gradient − reference gradient| / max |reference gradient| over the params' leaves."""
    want, got = _reference_gradient(batch), _gradient(apply, batch)
    return max(float(jnp.max(jnp.abs(got[k] - want[k])) / jnp.max(jnp.abs(want[k]))) for k in want)


def time_formulations(names: list[str], devices: Sequence[jax.Device], *, batch_size: int, steps: int,
                      rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each formulation's data-parallel SGD step on `devices` (jdp's train step, psum,
    at most 2 steps in flight, as `jdp train` runs it), one list entry per round."""
    params = lenet.init(jax.random.key(0))
    images = jax.random.uniform(jax.random.key(1), (batch_size, 1, 28, 28))
    labels = jax.random.randint(jax.random.key(2), (batch_size,), 0, 10)
    x, y = split_batch(images, labels, devices)
    candidates = {name: Model(lenet.init, summed_cross_entropy(FORMULATIONS[name][1]), FORMULATIONS[name][1],
                              name=f"lenet-{name}") for name in names}
    runs = {name: build_run(TrainConfig(batch_size=batch_size, lr=0.2 / batch_size, model=model), devices)
            for name, model in candidates.items()}  # the components `train` builds, once per formulation
    state = {name: run.placed(*run.initial_state(params, jax.random.key(3))) for name, run in runs.items()}
    stepped = {name: run.step() for name, run in runs.items()}
    for name, step in stepped.items():
        state[name] = jax.block_until_ready(repeat_step(step, state[name], x, y, 1))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, step in stepped.items():
            start = time.perf_counter()
            state[name] = jax.block_until_ready(repeat_step(step, state[name], x, y, steps))
            seconds[name].append((time.perf_counter() - start) / steps)
    return seconds


def pick(seconds: dict[str, list[float]], margin: float = MARGIN) -> tuple[str, float]:
    """The trainable formulation to use, and its median per-round speed-up over `fast`.

    Among the timed formulations jdp trains, the one with the highest median of the per-round ratios
    fast / it (each round times all of them in turn, so a ratio compares like with like); adopted
    only if that median is at least 1 + `margin`, else `fast`: noise must not make `auto` slower
    than the default it replaces.
    """
    ratios = {name: statistics.median(f / s for f, s in zip(seconds["fast"], times))
              for name, times in seconds.items() if name in lenet_fast.FORMULATIONS}
    best = max(ratios, key=ratios.get)
    return (best, ratios[best]) if ratios[best] >= 1 + margin else ("fast", 1.0)


def format_table(rows: list[dict]) -> str:
    """A markdown table, one row per formulation."""
    lines = ["| formulation | ms/step | images/s | × reference | × fast | median × fast | max grad diff | what |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ms_per_step']:.1f} | {r['images_per_s']:.0f} | {r['vs_reference']:.2f} | "
                     f"{r['vs_fast']:.2f} | {r['median_vs_fast']:.2f} | {r['gradient_error']:.1e} | {r['what']} |")
    return "\n".join(lines)


def run_formulations_bench(args: argparse.Namespace) -> int:
    for name in ("batch_size", "steps", "rounds"):
        check_positive(name, getattr(args, name))
    default = list(lenet_fast.FORMULATIONS) if args.write_table else list(FORMULATIONS)
    names = default if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in FORMULATIONS]
    if unknown:
        raise ConfigError(Arg("only"), f": no formulation `{unknown[0]}`; choose from {', '.join(FORMULATIONS)}.")
    names = list(dict.fromkeys(["reference", "fast", *names]))  # the two ratios need both
    out = check_out_dir(args.out)
    devices = setup_devices(args)
    before = machine(devices)
    seconds = time_formulations(names, devices, batch_size=args.batch_size, steps=args.steps, rounds=args.rounds)
    best = {name: min(s) for name, s in seconds.items()}
    rows = [{"name": name, "what": FORMULATIONS[name][0], "seconds": seconds[name], "ms_per_step": 1e3 * best[name],
             "images_per_s": args.batch_size / best[name], "vs_reference": best["reference"] / best[name],
             "vs_fast": best["fast"] / best[name],
             "median_vs_fast": statistics.median(f / s for f, s in zip(seconds["fast"], seconds[name])),
             "gradient_error": gradient_error(FORMULATIONS[name][1])}
            for name in names]
    header = (f"jdp bench formulations: LeNet SGD step, batch {args.batch_size}, {len(devices)} {before['platform']} "
              f"device(s), fastest of {args.rounds} rounds of {args.steps} steps; JAX {before['jax_version']}, "
              f"{before['cpu']} ({before['vector_isa']}, {before['host_cpus']} CPUs), load average "
              f"{' '.join(before['load_average'])}, XLA flags: {before['xla_flags'] or 'none'}")
    table = format_table(rows)
    print(header, table, sep="\n", flush=True)
    entry = None
    if args.write_table:
        chosen, speedup = pick(seconds)
        entry = auto_table.Entry(this_kind(devices[0].device_kind), len(devices), chosen,
                            f"jdp bench formulations --write-table, {datetime.date.today()}, JAX {before['jax_version']}: "
                            f"{chosen} {speedup:.2f}x fast (median of {args.rounds} rounds of {args.steps} steps)")
        print(f"wrote {auto_table.write_entry(entry)}: {len(devices)} device(s) of this machine kind -> {chosen} "
              f"({speedup:.2f}x fast, median of the rounds; adopted from {1 + MARGIN:.2f}x)", flush=True)
    if out is not None:
        (out / "formulations.md").write_text(header + "\n\n" + table + "\n")
        record = {"benchmark": "formulations", "machine": before, "load_average_after": machine()["load_average"],
                  "config": {k: v for k, v in vars(args).items() if k not in ("run", "command", "benchmark")},
                  "results": rows, "table_entry": None if entry is None else entry.to_json()}
        (out / "formulations.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out / 'formulations.md'} and formulations.json")
    return 0
