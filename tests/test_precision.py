"""`--precision bf16`: bfloat16 forward/backward, float32 params, loss, gradients, allreduce and checkpoints."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import small_set

import jdp
from jdp.errors import ConfigError
from jdp.models import get as get_model
from jdp.models import lenet, precision
from jdp.parallel.layout import replicate, split_batch
from jdp.parallel.step import make_train_step
from jdp.training.loop import TrainConfig, train

STRATEGIES = ("psum", "manual", "manual_ring", "ring", "tree")


def batch(n=32, seed=1):
    images = jax.random.uniform(jax.random.key(seed), (n, 1, 28, 28))
    labels = jax.random.randint(jax.random.key(seed + 1), (n,), 0, 10)
    return images, labels


def relative(a, b):
    """‖a − b‖ / ‖b‖ over all leaves of two pytrees."""
    diff = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    norm = sum(float(jnp.sum(y ** 2)) for y in jax.tree.leaves(b))
    return (diff / norm) ** 0.5


@pytest.mark.parametrize("impl", ["fast", pytest.param("reference", marks=pytest.mark.slow)])
def test_bf16_gradients_equal_float32_ones_within_bf16_tolerance(impl):
    model = get_model("lenet", impl=impl)
    low = precision.mixed(model, "bf16")
    params = lenet.init(jax.random.key(0), scale=0.1)
    images, labels = batch()
    want = jax.jit(jax.grad(model.loss))(params, images, labels)  # jitted: op by op takes 10 s more
    got = jax.jit(jax.grad(low.loss))(params, images, labels)
    assert jax.eval_shape(low.loss, params, images, labels).dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    # bfloat16 keeps 8 significant bits (u = 2^-9): a few u per operation, amplified where the
    # bias gradients sum many terms of both signs; a float32 computation would be within ~1e-6.
    assert 1e-3 < relative(got, want) < 0.05, relative(got, want)
    for name in want:
        assert relative(got[name], want[name]) < 0.5, name


def test_float32_precision_is_the_model_itself():
    model = get_model("lenet")
    assert precision.mixed(model, "float32") is model


def test_unknown_precision_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"`precision` must be one of float32, bf16, got `fp8`"):
        TrainConfig(precision="fp8")


def one_step(strategy, devices, name="bf16", backend="pmap"):
    model = precision.mixed(get_model("lenet"), name)
    optimizer = optax.sgd(0.2 / 32)
    params = lenet.init(jax.random.key(0), scale=0.1)
    step = make_train_step(model.loss, optimizer, strategy, devices, backend=backend)
    x, y = split_batch(*batch(), devices, backend)
    state = replicate(params, devices, backend), replicate(optimizer.init(params), devices, backend)
    new_params, _, loss = step(*state, x, y)
    return new_params, loss


@pytest.mark.slow  # fast sibling: test_the_allreduce_receives_float32_gradients
@pytest.mark.parametrize("strategy", ["manual", "manual_ring", "ring", "tree"])
def test_every_strategy_sums_float32_gradients(strategy, devices):
    """A bfloat16 sum of 4 devices' gradients would be off by ~1e-3 relative; float32 sums agree to ~1e-7."""
    devices = devices[:4]
    want, _ = one_step("psum", devices)
    got, loss = one_step(strategy, devices)
    assert loss.dtype == jnp.float32
    for leaf in jax.tree.leaves(got):
        assert leaf.dtype == jnp.float32
        assert all(np.array_equal(np.asarray(leaf[0]), np.asarray(leaf[i])) for i in range(1, 4))  # replicas
    np.testing.assert_allclose(np.asarray(got["W2"][0]), np.asarray(want["W2"][0]), rtol=1e-5, atol=1e-7)
    assert relative(jax.tree.map(lambda a: a[0], got), jax.tree.map(lambda a: a[0], want)) < 1e-6


def test_the_allreduce_receives_float32_gradients(devices):
    seen = []

    def recording(tree, axis_name):
        seen.extend(leaf.dtype for leaf in jax.tree.leaves(tree))
        return jax.lax.psum(tree, axis_name)

    one_step(jdp.Allreduce("recording", recording), devices[:2])
    assert seen and set(seen) == {jnp.dtype(jnp.float32)}


@pytest.mark.slow  # fast siblings: the backends agree in float32 (tests/test_backends.py); bf16 here, with pmap
def test_shard_map_backend_matches_pmap_in_bf16(devices):
    pmapped, _ = one_step("psum", devices[:2])
    mapped, _ = one_step("psum", devices[:2], backend="shard_map")
    np.testing.assert_allclose(np.asarray(jax.tree.map(lambda a: a[0], pmapped)["W1"]),
                               np.asarray(jdp.unreplicate(mapped, "shard_map")["W1"]), rtol=1e-5, atol=1e-7)


def config(**changes):
    return TrainConfig(**{"batch_size": 64, "lr": 0.1, "epochs": 2, "precision": "bf16", **changes})


@pytest.mark.parametrize("model", ["lenet", pytest.param("lenet_flax", marks=pytest.mark.slow)])
def test_trains_with_replicas_bit_identical_and_float32_params(model, devices):
    params, history = train(config(model=model), small_set(256, 64, seed=3), devices[:2], guards=jdp.Guards(check_replicas=1))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert all(np.isfinite(r.train_loss) for r in history)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_every_strategy_and_backend_trains_in_bf16(strategy, backend, devices):
    _, history = train(config(allreduce=strategy, backend=backend), small_set(256, 64, seed=3), devices[:2],
                       guards=jdp.Guards(check_replicas=1))
    assert all(np.isfinite(r.train_loss) for r in history)


@pytest.mark.slow
def test_resnet18_trains_in_bf16_with_float32_batch_statistics(devices):
    variables, history = train(config(model="resnet18", epochs=1), small_set(256, 64, seed=3), devices[:2],
                               guards=jdp.Guards(check_replicas=1))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(variables))
    assert np.isfinite(history[0].train_loss)


@pytest.mark.slow  # fast sibling: test_trains_with_replicas_bit_identical_and_float32_params (what is saved)
def test_resume_is_bit_identical_in_bf16(devices, tmp_path):
    full, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    want, history = train(config(epochs=2), small_set(256, 64, seed=3), devices[:2], checkpoints=jdp.Checkpoints(full, checkpoint_every=3))
    first = sorted(full.glob("checkpoint-*.msgpack"))[0]  # the older of the two kept: step 6 of 8, mid-epoch 2
    assert first.name == "checkpoint-000000006.msgpack", first
    resumed_dir.mkdir()
    shutil.copy2(first, resumed_dir / first.name)
    got, resumed = train(config(epochs=2), small_set(256, 64, seed=3), devices[:2], checkpoints=jdp.Checkpoints(resumed_dir, resume=True))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r.train_loss for r in resumed] == [r.train_loss for r in history]
