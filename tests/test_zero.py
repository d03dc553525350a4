"""Optimizers with state, gradient accumulation and ZeRO-sharded optimizer state: the same math as one
device on the whole batch, replicas bit-identical, the state really split, and planted bugs caught."""

import dataclasses
import json
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import LOSS, assert_replicas_identical, small_set

import jdp
from jdp import data
from jdp.cli.main import main
from jdp.errors import ConfigError
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel.opt_state import OptState, ShardedOptimizer, init_sharded
from jdp.parallel.layout import BACKENDS, replicate, sharded, split_batch, unreplicate
from jdp.parallel.step import accumulate_grads, make_sharded_step, make_train_step
from jdp.runtime.devices import AXIS
from jdp.training import checkpoint, optimizers
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig
from jdp.training.loop import train

BATCH, STEPS, MICRO = 48, 3, 2  # 48 splits into k·2 equal parts for k = 1, 2, 3, 4, 8
LR = {"sgd": 0.2, "momentum": 0.1, "adamw": 1e-3}
# Float tolerance against one device on the whole batch: only the order of the float additions of the
# gradient sums differs (tree of devices / micro-batches vs one sum), as in tests/test_step.py.
RTOL, ATOL = 1e-5, 1e-6


def optimizer(name):
    return optimizers.make(name, LR[name])


@pytest.fixture(scope="module")
def batches():
    ds = data.synthetic(jax.random.key(1), n_train=256, n_test=16)
    return [(ds.train.images[i:i + BATCH], ds.train.labels[i:i + BATCH]) for i in range(0, STEPS * BATCH, BATCH)]


def one_device_full_batch(name, batches):
    """The reference: plain jitted optax on one device over the whole batch, no data parallelism."""
    opt = optimizer(name)
    params = lenet.init(jax.random.key(0))
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.tree.map(lambda g: g / x.shape[0], jax.grad(LOSS)(params, x, y))
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x, y in batches:
        params, state = step(params, state, x, y)
    return params


def initial_state(opt, params, devices, backend, shard):
    if shard:
        return init_sharded(opt, params, devices)
    return replicate(opt.init(params), devices, backend)


def run(name, devices, backend, batches, *, strategy="psum", accumulate=1, shard=False, plant=None):
    """`STEPS` steps from LeNet's seed-0 params; `plant(opt_state)` is applied to the state after step 1."""
    opt = optimizer(name)
    params = lenet.init(jax.random.key(0))
    p, s = replicate(params, devices, backend), initial_state(opt, params, devices, backend, shard)
    step = (make_sharded_step if shard else make_train_step)(LOSS, opt, strategy, devices, backend, accumulate=accumulate)
    for number, (x, y) in enumerate(batches, start=1):
        p, s, losses = step(p, s, *split_batch(x, y, devices, backend))
        assert losses.shape == (len(devices),)
        if plant is not None and number == 1:
            s = plant(s)
    return p, s


def assert_equals_one_device(params, name, backend, batches):
    assert_replicas_identical(params)  # every device's copy, bit for bit
    chex.assert_trees_all_close(unreplicate(params, backend), one_device_full_batch(name, batches),
                                rtol=RTOL, atol=ATOL)


def cases(fast_backend: str) -> list:
    """Every optimizer, backend and device count; the fast tier runs AdamW (the most state) on 3 devices (not a
    power of 2) with `fast_backend` (the sharded step with the other backend: the sibling test's fast case)."""
    fast = ("adamw", fast_backend, 3)
    return [pytest.param(name, backend, k, marks=() if (name, backend, k) == fast else pytest.mark.slow)
            for name in optimizers.OPTIMIZERS for backend in BACKENDS for k in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize(("name", "backend", "k"), cases("shard_map"))
def test_sharded_optimizer_equals_one_device_on_the_full_batch(name, backend, k, devices, batches):
    params, _ = run(name, devices[:k], backend, batches, shard=True)
    assert_equals_one_device(params, name, backend, batches)


@pytest.mark.parametrize(("name", "backend", "k"), cases("pmap"))
def test_accumulation_equals_one_device_on_the_full_batch(name, backend, k, devices, batches):
    params, _ = run(name, devices[:k], backend, batches, accumulate=MICRO)
    assert_equals_one_device(params, name, backend, batches)


@pytest.mark.parametrize("strategy", [pytest.param("ring", marks=pytest.mark.slow),
                                      pytest.param("manual", marks=pytest.mark.slow), "manual_ring"])
def test_every_reduce_scatter_gives_psums_sharded_step(strategy, devices, batches):
    """The ring's halves from ppermute and from device_put, and the star's, step like psum_scatter/all_gather."""
    k = 3 if strategy == "ring" else 4
    params, _ = run("adamw", devices[:k], "pmap", batches, strategy=strategy, shard=True, accumulate=MICRO)
    assert_equals_one_device(params, "adamw", "pmap", batches)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "manual", "manual_ring"])
@pytest.mark.parametrize("k", [2, 8])
def test_every_reduce_scatter_under_shard_map(strategy, k, devices, batches):
    params, _ = run("momentum", devices[:k], "shard_map", batches, strategy=strategy, shard=True)
    assert_equals_one_device(params, "momentum", "shard_map", batches)


@pytest.mark.parametrize(("name", "backend"), [("adamw", "shard_map"), ("momentum", "pmap")])
def test_each_device_holds_one_kth_of_the_optimizer_state(name, backend, devices, batches):
    """Checked on the arrays: every per-element leaf has k shards of c = ⌈N/k⌉ elements, one per device."""
    k = 8
    _, state = run(name, devices[:k], backend, batches[:1], shard=True)
    n = sum(leaf.size for leaf in jax.tree.leaves(lenet.init(jax.random.key(0))))
    replicated = optimizer(name).init(lenet.init(jax.random.key(0)))
    per_device, whole = {d: 0 for d in devices[:k]}, sum(leaf.nbytes for leaf in jax.tree.leaves(replicated))
    for leaf in jax.tree.leaves(state):
        assert {s.device for s in leaf.addressable_shards} == set(devices[:k])
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
            if leaf.ndim == 2:  # a per-element leaf: (k, c)
                assert shard.data.shape == (1, -(-n // k))
    for got in per_device.values():  # 1/k of the replicated state, plus padding and the step count
        assert whole / k <= got <= whole / k + 4 * 2 * k + 16


@pytest.mark.parametrize(("name", "backend"), [("adamw", "pmap"),
                                               pytest.param("adamw", "shard_map", marks=pytest.mark.slow),
                                               pytest.param("momentum", "pmap", marks=pytest.mark.slow)])
def test_a_slice_updated_with_another_slices_state_is_caught(name, backend, devices, batches):
    """The planted bug: after step 1, device i holds slice i+1's optimizer state."""
    k = 3

    def rotate(state):
        return jax.tree.map(lambda x: jax.device_put(jnp.roll(x, 1, axis=0), sharded(devices[:k])), state)

    params, _ = run(name, devices[:k], backend, batches, shard=True, plant=rotate)
    assert_replicas_identical(params)  # the all-gather still hands every device the same (wrong) params
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(unreplicate(params, backend), one_device_full_batch(name, batches),
                                    rtol=RTOL, atol=ATOL)


def test_a_batch_that_does_not_split_into_micro_batches_is_a_config_error(devices, batches):
    x, y = batches[0]
    step = make_train_step(LOSS, optimizer("sgd"), "psum", devices[:4], accumulate=5)
    p, s = replicate(lenet.init(jax.random.key(0)), devices[:4]), replicate(optimizer("sgd").init({}), devices[:4])
    with pytest.raises(ConfigError, match=r"`accumulate=5` cuts each device's 12 rows into 5 equal micro-batches"):
        step(p, s, *split_batch(x, y, devices[:4]))


def test_accumulation_keeps_the_activations_of_one_micro_batch():
    """XLA's own account of the compiled gradient: its temporary buffers shrink with the micro-batch."""
    params = lenet.init(jax.random.key(0))
    x, y = jnp.zeros((512, 1, 28, 28)), jnp.zeros(512, jnp.int32)

    def grads(p, x, y):
        return *jax.value_and_grad(LOSS)(p, x, y), None

    def temp_bytes(n):
        fn = jax.jit(lambda p, x, y: accumulate_grads(grads, p, x, y, n)[:2])
        return fn.lower(params, x, y).compile().memory_analysis().temp_size_in_bytes

    whole, quarter = temp_bytes(1), temp_bytes(4)
    assert quarter < 0.4 * whole, (quarter, whole)


def test_accumulation_threads_the_model_state_through_the_micro_batches():
    """A stateful loss that counts its calls: N micro-batches advance the state N times, in order."""

    def loss(params, state, images, labels):
        return (params["w"] * images.sum()), {"calls": state["calls"] + 1, "last": images[0, 0]}

    def grads(variables, images, labels):
        (value, state), g = jax.value_and_grad(loss, has_aux=True)(variables["params"], variables["state"],
                                                                  images, labels)
        return value, g, state

    variables = {"params": {"w": jnp.float32(2.0)}, "state": {"calls": jnp.int32(0), "last": jnp.float32(0)}}
    images = jnp.arange(8, dtype=jnp.float32).reshape(8, 1)
    total, g, state = accumulate_grads(grads, variables, images, jnp.zeros(8), 4, stateful=True)
    assert float(total) == 2.0 * 28 and float(g["w"]) == 28.0
    assert int(state["calls"]) == 4 and float(state["last"]) == 6.0  # the last micro-batch's first row


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_reduce_scatter_and_all_gather_of_every_strategy(k, devices):
    """Each pair on a buffer of k·c elements: device i gets the sum of slice i, then every slice, in order."""
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((k, 5 * k)) * np.exp2(rng.integers(-6, 7, (k, 5 * k)))).astype(np.float32)
    placed = jax.device_put(x, sharded(devices[:k]))
    want = x.astype(np.float64).sum(0).reshape(k, 5)
    bound = (k - 1) * np.finfo(np.float32).eps * np.abs(x).sum(0).reshape(k, 5) + 1e-30
    for pair in (allreduce.get(name) for name in allreduce.names(halves=True)):
        if pair.where == "inside":
            mapped = jax.pmap(lambda v, f=pair.reduce_scatter: f(v, AXIS), axis_name=AXIS, devices=devices[:k])
            gather = jax.pmap(lambda v, f=pair.all_gather: f(v, AXIS), axis_name=AXIS, devices=devices[:k])
        else:
            mapped, gather = pair.reduce_scatter, pair.all_gather
        mine = mapped(placed)
        rows = sorted(mine.addressable_shards, key=lambda s: s.index[0].start or 0)
        assert [s.device for s in rows] == list(devices[:k]), pair.name  # slice i on device i
        assert np.all(np.abs(np.asarray(mine, np.float64) - want) <= bound), pair.name
        everything = np.asarray(gather(mine))
        np.testing.assert_array_equal(everything, np.broadcast_to(np.asarray(mine).reshape(-1), (k, 5 * k)))


def test_strategies_without_halves_and_bad_optimizer_settings_are_config_errors(devices):
    with pytest.raises(ConfigError, match=r"`allreduce=tree` does not provide; use one of: psum, manual, manual_ring, ring"):
        make_sharded_step(LOSS, optimizer("sgd"), "tree", devices[:2])
    with pytest.raises(ConfigError, match=r"`allreduce=psum\+fused`"):
        make_sharded_step(LOSS, optimizer("sgd"), allreduce.get("psum", fuse=True), devices[:2])
    with pytest.raises(ConfigError, match=r"`momentum` applies to `optimizer=momentum`, not `adamw`"):
        optimizers.make("adamw", 0.1, momentum=0.9)
    with pytest.raises(ConfigError, match=r"Unknown `optimizer=adam`; choose one of: sgd, momentum, adamw"):
        optimizers.make("adam", 0.1)
    with pytest.raises(ConfigError, match=r"`weight_decay` must be >= 0, got -1"):
        optimizers.make("sgd", 0.1, weight_decay=-1)


def test_an_optax_optimizer_of_your_own_trains_as_the_built_in_of_the_same_math(tmp_path, devices):
    """`optimizer=` an optax object: the same run, bit for bit, as the built-in name building that object; the
    run's record names it `own`, and its checkpoint resumes with it (and is refused with a named one)."""
    base = dataclasses.replace(SHARDED, shard_optimizer=False, epochs=1)
    built_in, _ = train(dataclasses.replace(base, optimizer="momentum", momentum=0.8), small_set(128), devices[:2])
    own = dataclasses.replace(base, optimizer=optax.sgd(base.lr, momentum=0.8))
    mine, _ = train(own, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path))
    chex.assert_trees_all_equal(mine, built_in)
    assert own.to_dict()["optimizer"] == "own"
    resumed, _ = train(dataclasses.replace(own, epochs=2), small_set(128), devices[:2],
                       checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert jax.tree.structure(resumed) == jax.tree.structure(mine)
    with pytest.raises(ConfigError, match=r"This run has `optimizer=momentum` but the checkpoint has `optimizer=own`"):
        train(dataclasses.replace(base, optimizer="momentum", epochs=3), small_set(128), devices[:2],
              checkpoints=jdp.Checkpoints(tmp_path, resume=True))


def test_an_optax_optimizer_of_your_own_refuses_the_built_in_settings():
    for setting in ({"momentum": 0.9}, {"weight_decay": 1e-4}, {"warmup_steps": 10}):
        name = next(iter(setting))
        with pytest.raises(ConfigError, match=rf"`{name}=.*` configures a built-in optimizer; your optax optimizer "
                                              rf"brings its own .* Drop `{name}`."):
            TrainConfig(optimizer=optax.sgd(0.1), **setting)
    with pytest.raises(ConfigError, match=r"`optimizer` takes a name \(sgd, momentum, adamw\) or an optax "
                                          r"optimizer \(with `init` and `update`\), got int."):
        TrainConfig(optimizer=3)


def test_host_form_of_the_sharded_state_round_trips_on_any_device_count(devices):
    """gather(shard(state)) is the state, bit for bit, for k = 1..8; the padding holds zeros."""
    opt = optimizer("adamw")
    params = lenet.init(jax.random.key(0))
    host = OptState(ShardedOptimizer(opt, params, 1), 1).init(params, jax.random.key(0))
    host = jax.tree.map(lambda x: np.arange(x.size, dtype=x.dtype).reshape(x.shape) + 1, host)
    for k in range(1, 9):
        state = OptState(ShardedOptimizer(opt, params, k), k)
        back = state.to_host(state.place(host, devices[:k], "pmap"), "pmap")
        for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(back), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ---- checkpoints of a sharded state --------------------------------------------------------------


SHARDED = TrainConfig(batch_size=16, lr=1e-3, epochs=2, optimizer="adamw", shard_optimizer=True)  # 8 steps an epoch


class Killed(Exception):
    pass


def killed_after(calls):
    """A `progress` wrapper that stops the run (like a SIGKILL, but in-process) after `calls` calls of an epoch."""
    seen = {"calls": 0}

    def progress(items, total):
        for item in items:
            seen["calls"] += 1
            if seen["calls"] > calls:
                raise Killed
            yield item

    return progress


def checkpointed(directory):
    return checkpoint.restore_latest(directory, checkpoint_target(SHARDED))


@pytest.mark.slow  # fast siblings: test_host_form_of_the_sharded_state_round_trips_on_any_device_count, and
# test_diloco_resumed_mid_interval_ends_bit_identical (tests/test_sync.py) for resuming mid-run
def test_a_sharded_run_resumed_from_a_mid_run_checkpoint_ends_bit_identical(tmp_path, devices):
    """Stopped at step 11 (mid epoch 2; the newest checkpoint is step 9), resumed: the final params, the
    gathered AdamW state and the history equal an uninterrupted run's, bit for bit."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    train(SHARDED, small_set(128), devices[:4], checkpoints=jdp.Checkpoints(whole, checkpoint_every=3))
    with pytest.raises(Killed):
        train(SHARDED, small_set(128), devices[:4], checkpoints=jdp.Checkpoints(killed, checkpoint_every=3),
              hooks=jdp.Hooks(progress=killed_after(11)))
    assert checkpointed(killed).step == 9 and checkpointed(killed).info["position"]["batches_done"] == 1
    train(SHARDED, small_set(128), devices[:4], checkpoints=jdp.Checkpoints(killed, checkpoint_every=3, resume=True))
    a, b = checkpointed(whole), checkpointed(killed)
    assert a.step == b.step == 16
    for x, y in zip(jax.tree.leaves(a.arrays), jax.tree.leaves(b.arrays), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert [r["train_loss"] for r in a.info["history"]] == [r["train_loss"] for r in b.info["history"]]


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_resharded_on_another_device_count(tmp_path, devices, caplog):
    """The checkpoint holds the state unsliced: 4 devices → 3 re-pads and re-slices it (the same math)."""
    whole, _ = train(SHARDED, small_set(128), devices[:4])
    train(dataclasses.replace(SHARDED, epochs=1), small_set(128), devices[:4], checkpoints=jdp.Checkpoints(tmp_path))
    with caplog.at_level(logging.INFO, logger="jdp"):
        resumed, _ = train(SHARDED, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert "resuming on 2 devices instead of the checkpoint's 4" in caplog.text
    chex.assert_trees_all_close(resumed, whole, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(("change", "message"), [
    ({"optimizer": "momentum", "shard_optimizer": False}, r"This run has `optimizer=momentum` but the checkpoint "
                                                          r"has `optimizer=adamw`"),
    ({"shard_optimizer": False}, r"This run has `shard_optimizer=False` but the checkpoint has `shard_optimizer=True`"),
])
def test_resuming_with_another_kind_of_optimizer_state_is_refused_naming_the_flag(change, message, tmp_path, devices):
    train(dataclasses.replace(SHARDED, epochs=1), small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path))
    with pytest.raises(ConfigError, match=message):
        train(dataclasses.replace(SHARDED, **change), small_set(128), devices[:2],
              checkpoints=jdp.Checkpoints(tmp_path, resume=True))


# ---- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (["--momentum", "0.9"], "`--momentum` applies to `--optimizer momentum`, not `sgd`"),
    (["--accumulate", "0"], "`--accumulate` must be a positive integer, got 0."),
    (["--batch-size", "100", "--accumulate", "3"], "`--batch-size 100` does not split into 2 devices × `--accumulate 3`"),
    (["--shard-optimizer", "--allreduce", "tree"], "which `--allreduce tree` does not provide"),
    (["--shard-optimizer", "--fuse"], "which `--allreduce psum+fused` does not provide"),
])
def test_bad_optimizer_flags_are_one_line_and_exit_2(flags, message, capsys):
    assert main(["train", "--devices", "2", "--dataset", "synthetic", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_bench_memory_reads_bytes_off_the_devices(tmp_path, capsys):
    assert main(["bench", "memory", "--models", "lenet", "--optimizers", "adamw", "--ks", "1", "4",
                 "--time-models", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "memory.json").read_text())
    (ratio,) = [r for r in record["ratios"] if r["k"] == 4]
    assert 0.25 <= ratio["opt_state"] < 0.2501 and 0.25 <= ratio["grads"] < 0.2501  # 1/k, plus ≤ 3 padding elements
    assert (tmp_path / "memory.png").stat().st_size > 0 and "| lenet | adamw | 4 |" in (tmp_path / "memory.md").read_text()
