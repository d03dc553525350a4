"""Compressed allreduce (`--compress`): rounding bounds, PowerSGD's exactness and error feedback,
replicas bit-identical for every wrapper × strategy, and PowerSGD runs that resume bit-identically."""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import small_set

import jdp
from jdp.errors import ConfigError
from jdp.parallel import compress
from jdp.parallel.layout import sharded
from jdp.parallel.opt_state import OptState, ReplicatedOptimizer
from jdp.runtime.devices import AXIS
from jdp.training import checkpoint
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig
from jdp.training.loop import train

K = 4  # devices for these tests: enough for a ring, tree with a fold-free power of two, and a root
STRATEGIES = ["psum", "ring", "tree", "manual", "manual_ring"]
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def run(strategy, tree, devices, state=None):
    """`strategy` on host leaves (k, ...): slice i is device i's; returns (sums, state) or sums."""
    placed = jax.tree.map(lambda x: jax.device_put(x, sharded(devices)), tree)
    args = (placed,) if state is None else (placed, state)
    return (mapped(strategy, tuple(devices)) if strategy.where == "inside" else strategy.fn)(*args)


@functools.lru_cache
def mapped(strategy, devices):
    return jax.pmap(lambda *a: strategy.fn(*a, AXIS), axis_name=AXIS, devices=devices)


def slices(x):
    return [np.asarray(s.data)[0] for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)]


def assert_identical_sums(out, k):
    """Every device holds the same bits; returns device 0's values, leaf by leaf."""
    rows = [slices(x) for x in jax.tree.leaves(out)]
    for leaf in rows:
        assert len(leaf) == k and all(r.tobytes() == leaf[0].tobytes() for r in leaf)
    return [leaf[0] for leaf in rows]


# ---- bf16 / fp16: within the rounding bound of the compressed dtype ---------------------------------

@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-wire", "fp16-wire"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_cast_stays_within_the_rounding_bound_of_its_dtype(name, mode, devices):
    """k inputs rounded to the low dtype (u each) and k−1 additions rounded to it: |error| ≤ (2k−1)·u·Σ|x_i|
    to first order (Higham §4.2); the -wire ring rounds once per hop instead, k times. The test allows 2k·u."""
    if mode.endswith("-wire") and name != "ring":
        with pytest.raises(ConfigError, match=f"`compress={mode}` sends low precision.*use `allreduce=ring, hierarchical`"):
            jdp.get_allreduce(name, compress=mode)
        return
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((K, 37, 5)).astype(np.float32),
            "b": rng.standard_normal((K, 3)).astype(np.float32)}
    strategy = jdp.get_allreduce(name, compress=mode)
    got = assert_identical_sums(run(strategy, tree, devices[:K]), K)
    u = UNIT_ROUNDOFF[mode[:4]]
    for g, x in zip(got, jax.tree.leaves(tree), strict=True):
        assert g.dtype == np.float32
        exact, scale = x.astype(np.float64).sum(0), np.abs(x.astype(np.float64)).sum(0)
        assert (np.abs(g - exact) <= 2 * K * u * scale).all()
        assert np.abs(g - exact).max() > 2.0**-23 * scale.max()  # it did round to the low dtype


def test_the_wire_variant_rounds_less_than_summing_in_bf16(devices):
    """The point of `-wire`: the same bytes on the wire, float32 sums. Over 8 devices its mean error is
    smaller (measured: 0.0072 vs 0.0085 here, 16% less: both round about k partial sums; the cast also
    rounds every input), and it never exceeds the cast's by this seed."""
    rng = np.random.default_rng(1)
    tree = rng.standard_normal((8, 4096)).astype(np.float32)
    exact = tree.astype(np.float64).sum(0)
    error = {mode: np.abs(assert_identical_sums(run(jdp.get_allreduce("ring", compress=mode), tree, devices[:8]), 8)[0]
                          - exact).mean() for mode in ("bf16", "bf16-wire")}
    assert error["bf16-wire"] < 0.9 * error["bf16"], error


# ---- PowerSGD ------------------------------------------------------------------------------------

def powersgd_state(strategy, grads_one, devices):
    state = OptState(ReplicatedOptimizer(optax.identity()), len(devices), strategy)
    return state.optimizer_and_strategy(state.place(state.init(grads_one, jax.random.key(0)), devices, "pmap"))[1]


@pytest.mark.parametrize("name", ["psum", "manual"])
def test_powersgd_with_rank_at_least_the_gradients_rank_is_the_exact_sum(name, devices):
    """Σ_i M_i has rank 2 (every M_i = A·B_i): P̂ spans its columns, so P̂·P̂ᵀ·ΣM_i = ΣM_i."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal((40, 2))
    tree = {"w": np.stack([a @ rng.standard_normal((2, 30)) for _ in range(K)]).astype(np.float32),
            "b": rng.standard_normal((K, 7)).astype(np.float32)}  # a bias: sent as it is
    strategy = jdp.get_allreduce(name, compress="powersgd", rank=2)
    state = powersgd_state(strategy, jax.tree.map(lambda x: x[0], tree), devices[:K])
    out, _ = run(strategy, tree, devices[:K], state)
    for g, x in zip(assert_identical_sums(out, K), jax.tree.leaves(tree), strict=True):
        np.testing.assert_allclose(g, x.astype(np.float64).sum(0), rtol=1e-4, atol=1e-4)


def test_powersgd_with_low_rank_does_not_reproduce_the_sum(devices):
    """The other side of the previous test: rank 1 of a full-rank sum loses most of it in one step."""
    rng = np.random.default_rng(3)
    tree = {"w": rng.standard_normal((K, 12, 10)).astype(np.float32)}
    strategy = jdp.get_allreduce("psum", compress="powersgd", rank=1)
    out, _ = run(strategy, tree, devices[:K], powersgd_state(strategy, {"w": tree["w"][0]}, devices[:K]))
    exact = tree["w"].sum(0)
    assert np.linalg.norm(slices(out["w"])[0] - exact) > 0.3 * np.linalg.norm(exact)


@pytest.mark.parametrize("name", ["ring", pytest.param("manual_ring", marks=pytest.mark.slow)])
def test_error_feedback_makes_the_applied_updates_add_up_to_the_true_gradients(name, devices):
    """Rank 1, the same full-rank gradients every step: each step's sum misses most of ΣG, but what a
    device misses stays in its error and is sent later, so Σ_t (applied sum) − T·ΣG = −Σ_i E_i stays
    bounded and the relative gap shrinks like 1/T. Without error feedback it stays at ~‖ΣG − rank-1 part‖."""
    rng = np.random.default_rng(4)
    grads = {"w": rng.standard_normal((K, 8, 6)).astype(np.float32)}
    strategy = jdp.get_allreduce(name, compress="powersgd", rank=1)
    state = powersgd_state(strategy, {"w": grads["w"][0]}, devices[:K])
    target, applied, gaps = grads["w"].astype(np.float64).sum(0), 0.0, []
    for t in range(1, 101):
        out, state = run(strategy, grads, devices[:K], state)
        applied = applied + slices(out["w"])[0]
        gaps.append(np.linalg.norm(applied - t * target) / np.linalg.norm(t * target))
    assert gaps[0] > 0.3  # one step alone is far off
    assert gaps[-1] < 0.05 and gaps[-1] < gaps[49] < gaps[9], gaps[::10]


# ---- every wrapper × strategy through the training loop: the replica check after every step -------

def tiny_model() -> jdp.Model:
    """A two-layer MLP: two matrices PowerSGD compresses, two biases it sends as they are; compiles fast."""

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": 0.05 * jax.random.normal(k1, (784, 16)), "b1": jnp.zeros(16),
                "w2": 0.05 * jax.random.normal(k2, (16, 10)), "b2": jnp.zeros(10)}

    def apply(params, images):
        h = jax.nn.relu(images.reshape(images.shape[0], -1) @ params["w1"] + params["b1"])
        return h @ params["w2"] + params["b2"]

    return jdp.Model(init, jdp.summed_cross_entropy(apply), apply, name="mlp")


CONFIG = TrainConfig(batch_size=16, lr=0.1, epochs=1, model=tiny_model())
WRAPPERS = [("bf16", None), ("fp16", None), ("powersgd", 2), ("bf16-wire", None)]
FAST = {("psum", "powersgd"), ("manual", "bf16"), ("ring", "bf16-wire")}


def combinations():
    """Every strategy × wrapper, per leaf and fused; the fast tier runs one of each kind, the rest are slow."""
    for name in STRATEGIES:
        for mode, rank in WRAPPERS:
            for fuse in (False, True):
                if mode.endswith("-wire") and name != "ring":
                    continue
                marks = () if (name, mode) in FAST and not fuse else pytest.mark.slow
                yield pytest.param(name, mode, rank, fuse, marks=marks,
                                   id=f"{name}-{mode}{rank or ''}-{'fused' if fuse else 'per-leaf'}")


@pytest.mark.parametrize("name, mode, rank, fuse", list(combinations()))
def test_replicas_stay_bit_identical(name, mode, rank, fuse, devices):
    config = dataclasses.replace(CONFIG, allreduce=jdp.get_allreduce(name, compress=mode, rank=rank, fuse=fuse))
    # raises TrainingError on any difference
    _, history = train(config, small_set(128), devices[:K], guards=jdp.Guards(check_replicas=1))
    assert np.isfinite(history[-1].train_loss)


def test_powersgd_refuses_shard_map_and_ranks_without_it():
    with pytest.raises(ConfigError, match="keeps different state on each device.*Use `backend=pmap`"):
        train(dataclasses.replace(CONFIG, allreduce="psum+powersgd1", backend="shard_map"), small_set(128),
              jax.devices()[:2])
    with pytest.raises(ConfigError, match="`powersgd_rank=2` applies to `compress=powersgd` only"):
        jdp.get_allreduce("psum", compress="bf16", rank=2)
    with pytest.raises(ConfigError, match="`powersgd_rank` must be a positive integer, got 0"):
        jdp.get_allreduce("psum", compress="powersgd", rank=0)


# ---- bytes, and resume ------------------------------------------------------------------------------

def test_payload_bytes_count_what_is_sent():
    grads = {"w": jax.ShapeDtypeStruct((40, 30), jnp.float32), "b": jax.ShapeDtypeStruct((30,), jnp.float32)}
    sent = [compress.payload_bytes(grads, jdp.get_allreduce(name, **settings)) for name, settings in (
        ("psum", {}), ("ring", {"fuse": True}), ("psum", {"compress": "bf16"}), ("ring", {"compress": "bf16-wire"}),
        ("ring", {"compress": "bf16-wire", "fuse": True}), ("psum", {"compress": "powersgd", "rank": 3}),
        ("psum", {"compress": "powersgd", "rank": 3, "fuse": True}))]
    with pytest.raises(TypeError, match=r"is now `payload_bytes\(grads, strategy\)`"):
        compress.payload_bytes(grads, "bf16")
    assert sent == [4 * 1230, 4 * 1230, 2 * 1230, 2 * 1230, 2 * 1230,
                                   4 * (40 * 3 + 30 * 3 + 30), 4 * (40 * 3 + 30 * 3 + 30)]  # P, Q, the bias as it is


def test_a_wrapper_hands_on_the_payload_of_the_strategy_it_wraps():
    """PowerSGD around a bf16 strategy sends P, Q and the bias, each cast: the two payloads composed. A
    strategy prints as its name and place, which spell it (its functions say nothing)."""
    grads = {"w": jax.ShapeDtypeStruct((40, 30), jnp.float32), "b": jax.ShapeDtypeStruct((30,), jnp.float32)}
    stack = compress.powersgd(compress.low_precision(jdp.get_allreduce("ring"), jnp.bfloat16), rank=3)
    assert compress.payload_bytes(grads, stack) == 2 * (40 * 3 + 30 * 3 + 30)
    assert repr(stack) == "Allreduce('ring+bfloat16+powersgd3', where='inside')"
    assert repr(jdp.get_allreduce("manual")) == "Allreduce('manual', where='outside')"


def test_a_strategy_value_carries_its_settings_and_the_old_fields_say_so():
    """A run records the strategy by the name that spells its wrappers; a checkpoint of an older run, with the
    settings apart, reads as the same strategy; the old fields name the value."""
    from jdp.training import resume

    value = dataclasses.replace(CONFIG, allreduce=jdp.get_allreduce("ring", fuse=True, compress="bf16"))
    assert value.to_dict()["allreduce"] == "ring+fused+bfloat16" and "compress" not in value.to_dict()
    older = {**dataclasses.replace(CONFIG, allreduce="ring").to_dict(), "fuse": True, "bucket_mb": None,
             "compress": "bf16", "powersgd_rank": None}
    assert resume.settings(older) == resume.settings(value.to_dict())
    assert resume.settings({**older, "compress": "none"})["allreduce"] == "ring+fused"
    for name in ("fuse", "bucket_mb", "compress", "powersgd_rank"):
        with pytest.raises(TypeError, match=rf"`TrainConfig\({name}=\.\.\.\)` is gone: .*jdp\.get_allreduce"):
            dataclasses.replace(CONFIG, **{name: None})


def test_a_resumed_powersgd_run_is_bit_identical_to_an_uninterrupted_one(tmp_path, devices):
    """The error state is per device and saved whole: resuming mid-epoch continues the same arithmetic."""
    config = dataclasses.replace(CONFIG, allreduce=jdp.get_allreduce("psum", compress="powersgd", rank=1), epochs=2)
    train(config, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "whole", checkpoint_every=3))
    train(dataclasses.replace(config, epochs=1), small_set(128), devices[:2],
          checkpoints=jdp.Checkpoints(tmp_path / "cut", checkpoint_every=3))
    checkpoint.list_checkpoints(tmp_path / "cut")[0].unlink()  # the end of epoch 1 is lost: resume from step 6
    train(config, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "cut", checkpoint_every=3, resume=True))
    target = checkpoint_target(config, device_count=2)
    whole, cut = (checkpoint.restore_latest(tmp_path / d, target) for d in ("whole", "cut"))
    assert whole.step == cut.step == 16
    assert [(r["train_loss"], r["test_acc"]) for r in cut.info["history"]] == [
        (r["train_loss"], r["test_acc"]) for r in whole.info["history"]]
    errors = whole.arrays["opt_state"]["allreduce"]["error"]
    assert not np.array_equal(errors[0][0], errors[0][1])  # per device: the two devices' errors differ
    for a, b in zip(jax.tree.leaves(whole.arrays), jax.tree.leaves(cut.arrays), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_powersgd_checkpoint_is_refused_by_the_setting_that_changed_its_arrays(tmp_path, devices):
    """PowerSGD's error state is saved once per device: another device count or strategy is named as such."""
    config = dataclasses.replace(CONFIG, allreduce=jdp.get_allreduce("psum", compress="powersgd", rank=1))
    train(config, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "powersgd", checkpoint_every=3))
    with pytest.raises(ConfigError, match=r"holds `allreduce=psum\+powersgd1`'s state for each of 2 devices; this run "
                                          r"has 4\. Resume on 2 devices"):
        train(config, small_set(128), devices[:4], checkpoints=jdp.Checkpoints(tmp_path / "powersgd", resume=True))
    plain = dataclasses.replace(config, allreduce="psum")
    with pytest.raises(ConfigError, match=r"This run's allreduce \(`allreduce=psum`\) keeps no state per device, "
                                          r"the checkpoint's \(`allreduce=psum\+powersgd1`\) does:"):
        train(plain, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "powersgd", resume=True))
    train(plain, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "plain", checkpoint_every=3))
    with pytest.raises(ConfigError, match=r"\(`allreduce=psum\+powersgd1`\) keeps state per device, the checkpoint's "
                                          r"\(`allreduce=psum`\) does not:"):
        train(config, small_set(128), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "plain", resume=True))


ROUNDS_UNDER_FLAGS = """
import jdp
jdp.enable_xla_flags()
jdp.simulate_cpu_devices(2)
import jax, numpy as np, optax
from jdp.parallel import compress
from jdp.parallel.layout import replicate, split_batch
from jdp.parallel.step import make_train_step
devices, model, optimizer = jax.devices(), jdp.get_model("lenet"), optax.sgd(0.1)
params = model.init(jax.random.key(0))
step = make_train_step(model.loss, optimizer, jdp.get_allreduce("psum", compress="bf16"), devices)
batch = split_batch(np.zeros((8, 1, 28, 28), np.float32), np.zeros(8, np.int32), devices)
hlo = step.lower(replicate(params, devices), replicate(optimizer.init(params), devices), *batch).compile().as_text()
print(hlo.count("bf16["))
"""


@pytest.mark.slow
def test_bf16_psum_rounds_under_jdps_xla_flags():
    """Regression: with jdp's XLA CPU flags, XLA promoted the bf16 all-reduce to float32 and removed the
    converts around it, so `psum + bf16` compiled to no rounding at all (a 10-epoch run came out
    bit-identical to `none`). The flags are read when JAX starts, hence the fresh process."""
    result = subprocess.run([sys.executable, "-c", ROUNDS_UNDER_FLAGS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) > 0  # bf16 values in the compiled step: the rounding is there


WIRE_UNDER_FLAGS = """
import jdp
jdp.enable_xla_flags()
jdp.simulate_cpu_devices(4)
import jax, numpy as np
from jdp.parallel.layout import map_over_devices, sharded
from jdp.runtime.devices import AXIS
devices = jax.devices()
x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
ring = map_over_devices(lambda row: (jdp.get_allreduce("ring", compress="{mode}").fn(row, AXIS),), devices,
                        "shard_map", ("per_device",), ("per_device",))
(out,) = ring(jax.device_put(x, sharded(devices)))
print(len({{row.tobytes() for row in np.asarray(out)}}))
"""


@pytest.mark.parametrize("mode", ["bf16-wire", "fp16-wire"])
def test_wire_ring_leaves_every_device_the_same_bits_under_jdps_xla_flags(mode):
    """Regression: with jdp's XLA CPU flags, XLA dropped the round trip through the wire dtype of the chunk each
    device keeps (its copies were sent rounded), so the devices disagreed in the last bits: `jdp train` (which
    sets the flags) failed its replica check. Only a process whose backend starts with the flags shows it."""
    result = subprocess.run([sys.executable, "-c", WIRE_UNDER_FLAGS.format(mode=mode)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "1"  # one distinct row: every device holds the same sum
