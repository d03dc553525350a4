"""Why jdp's ring on two hosts gets half the NIC: a swap of ppermutes against a one-way send and Gloo's psum.

Run under `jdp launch --hosts 2 --nic RATE -- python scripts/exchange_probe.py BYTES` (as root; the
launcher appends the job flags). Each process holds BYTES of float32; printed by process 0, the mean of 5
calls after a warm-up: a one-way `ppermute` (host 0 → host 1), a swap (both ways in one `ppermute`) and
`psum`, the swap as an `all_to_all` and as an `all_gather` (Gloo's own collectives), then a swap that starts
right after a small psum (both processes enter it together) and the swap cut into 4, 16 and 64 `ppermute`s. On a full-duplex link a swap takes as long as a one-way send; measured, a large
one takes twice as long, and pieces small enough for the rate (64 KiB at 100mbit) bring it back to one.
"""

import argparse
import sys
import time


PIECES = (4, 16, 64)  # a swap cut into this many `ppermute`s, one after the other


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bytes", type=int)
    for flag in ("--coordinator", "--num-processes", "--process-id", "--cpu-devices"):
        p.add_argument(flag)
    args = p.parse_args()
    from jdp.flags import setup_devices

    devices = setup_devices(argparse.Namespace(cpu_devices=int(args.cpu_devices), devices=None, no_xla_flags=False,
                                               coordinator=args.coordinator, num_processes=int(args.num_processes),
                                               process_id=int(args.process_id)))
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jdp.parallel.layout import map_over_devices, sharded
    from jdp.runtime.devices import AXIS

    k = len(devices)
    x = jax.jit(lambda: jnp.ones((k, args.bytes // 4)), out_shardings=sharded(devices))()
    def synced(row):  # both processes leave a small psum together, then start the swap
        row, token = lax.optimization_barrier((row, jnp.zeros((1,), row.dtype)))
        row, _ = lax.optimization_barrier((row, lax.psum(token, AXIS)))
        return row

    exchanges = {"one way": lambda row: (lax.ppermute(row, AXIS, [(0, 1)]),),
                 "swap": lambda row: (lax.ppermute(row, AXIS, [(0, 1), (1, 0)]),),
                 "psum": lambda row: (lax.psum(row, AXIS),),
                 "swap as all_to_all": lambda row: (lax.dynamic_slice_in_dim(
                     lax.all_to_all(jnp.concatenate([row, row]), AXIS, 0, 0, tiled=True), 1 - lax.axis_index(AXIS), 1),),
                 "swap as all_gather": lambda row: (lax.dynamic_slice_in_dim(
                     lax.all_gather(row, AXIS, tiled=True), 1 - lax.axis_index(AXIS), 1),),
                 "swap after a psum": lambda row: (lax.ppermute(synced(row), AXIS, [(0, 1), (1, 0)]),),
                 **{f"swap as {n} pieces": lambda row, n=n: (jnp.concatenate(
                     [lax.ppermute(q, AXIS, [(0, 1), (1, 0)]) for q in jnp.split(row, n)]),) for n in PIECES}}
    for name, exchange in exchanges.items():
        run = map_over_devices(exchange, devices, "shard_map", ("per_device",), ("per_device",))
        jax.block_until_ready(run(x))
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(run(x))
        if jax.process_index() == 0:
            print(f"{name}: {args.bytes / 1e6:.1f} MB per device, {(time.perf_counter() - start) / 5 * 1e3:.1f} ms",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
