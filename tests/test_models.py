"""Flax models on the data-parallel machinery: the Flax LeNet equals the from-scratch one, and
BatchNorm synchronised over k devices equals one device on the full batch, while per-replica
BatchNorm does not (and the tests show exactly what it computes instead)."""

import contextlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax import sgd
from reference import LOSS, assert_replicas_identical, single_device_full_batch

import jdp
from jdp import data, models
from jdp.errors import ConfigError
from jdp.models import flax as flax_models
from jdp.models import lenet
from jdp.parallel import allreduce, layout
from jdp.parallel.step import make_train_step
from jdp.runtime.devices import AXIS
from jdp.training.loop import TrainConfig, train

BATCH = 24  # divisible by 1, 2, 3, 4, 8


@pytest.fixture(scope="module")
def batches():
    ds = data.synthetic(jax.random.key(1), n_train=256, n_test=16)
    return [(ds.train.images[i:i + BATCH], ds.train.labels[i:i + BATCH]) for i in range(0, 2 * BATCH, BATCH)]


class TinyBN(nn.Module):
    """A conv → BatchNorm → ReLU → pool → dense net: BatchNorm's data-parallel behaviour at a
    fraction of ResNet-18's compile time (ResNet-18 itself is tested once per mode below)."""

    batchnorm_axis: str | None = None

    @nn.compact
    def __call__(self, images, train=False):
        x = nn.Conv(6, (3, 3))(images.reshape(-1, 28, 28, 1))
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.batchnorm_axis)(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def make_model(name: str, sync: bool) -> models.Model:
    axis = AXIS if sync else None
    if name == "resnet18":
        return models.get("resnet18", batchnorm="sync" if sync else "per-replica")
    return models.batchnorm_model(TinyBN(batchnorm_axis=axis))


def run_steps(model, strategy, backend, devices, batches, lr=0.1, variables=None, dtype=np.float32):
    optimizer = sgd(lr)
    variables = model.init(jax.random.key(0)) if variables is None else variables
    variables = jax.tree.map(lambda a: np.asarray(a, dtype), variables)
    batches = [(np.asarray(x, dtype), y) for x, y in batches]
    v = layout.replicate(variables, devices, backend)
    s = layout.replicate(optimizer.init(models.trainable(model, variables)), devices, backend)
    step = make_train_step(model, optimizer, allreduce.get(strategy), devices, backend=backend)
    losses = []
    for x, y in batches:
        v, s, loss = step(v, s, *layout.split_batch(x, y, devices, backend))
        losses.append(np.asarray(loss).sum())
    return v, np.array(losses)


def first_copy(tree, backend):
    return layout.unreplicate(tree, backend)


def device_copy(tree, i):
    """Device i's copy of a pmap-layout tree (leading device axis)."""
    return jax.tree.map(lambda a: np.asarray(a)[i], tree)


@pytest.mark.slow
def test_flax_lenet_equals_the_from_scratch_one_given_the_same_params(batches):
    params = lenet.init(jax.random.key(0))
    params = jax.tree.map(lambda w: w * 30, params)  # big weights: logits far from zero
    variables = flax_models.lenet_variables(params)
    model = models.get("lenet_flax")
    x, y = batches[0]
    chex.assert_trees_all_close(model.apply(variables, x), lenet.apply(params, x), rtol=1e-5, atol=1e-5)
    grads = jax.grad(model.loss)(variables, x, y)
    expected = flax_models.lenet_variables(jax.grad(LOSS)(params, x, y))
    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-7)
    # and its init has the from-scratch shapes, in Flax's layouts
    chex.assert_trees_all_equal_shapes(model.init(jax.random.key(0)), variables)


def test_flax_lenet_data_parallel_equals_one_device_from_scratch(devices, batches):
    """Any Flax model goes through replicate/split/allreduce unchanged: k=4 == 1 device, full batch."""
    variables = flax_models.lenet_variables(lenet.init(jax.random.key(0)))
    got, _ = run_steps(models.get("lenet_flax"), "ring", "pmap", devices[:4], batches, lr=0.2, variables=variables)
    assert_replicas_identical(got)
    expected = flax_models.lenet_variables(single_device_full_batch(batches, lr=0.2))
    chex.assert_trees_all_close(first_copy(got, "pmap"), expected, rtol=1e-5, atol=1e-8)


def precision(name):
    """ResNet-18 is compared in float64: in float32 its gradients at this init (BatchNorm on a few
    images, 17 layers deep) differ by up to ~2e-2 relative between two summation orders of the SAME
    math (1 vs 4 devices), while in float64 they agree to ~1e-12. The small net is compared in float32."""
    return (jax.enable_x64(True), np.float64) if name == "resnet18" else (contextlib.nullcontext(), np.float32)


def small(batches):
    """One batch of 8 (2 images per device on 4): ResNet-18 in float64 on a CPU is slow."""
    return [(batches[0][0][:8], batches[0][1][:8])]


SYNC_CASES = [
    pytest.param("resnet18", "psum", "pmap", 4, marks=pytest.mark.slow),  # float64 ResNet-18: minutes on 2 cores
    ("tiny", "manual", "pmap", 4),
    pytest.param("tiny", "tree", "shard_map", 3, marks=pytest.mark.slow),
    pytest.param("tiny", "manual_ring", "shard_map", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,strategy,backend,k", SYNC_CASES)
def test_sync_batchnorm_on_k_devices_equals_one_device_on_the_full_batch(name, strategy, backend, k, devices, batches):
    model = make_model(name, sync=True)
    x64, dtype = precision(name)
    batches = small(batches) if name == "resnet18" else batches
    with x64:
        got, got_loss = run_steps(model, strategy, backend, devices[:k], batches, dtype=dtype)
        want, want_loss = run_steps(model, "psum", "pmap", devices[:1], batches, dtype=dtype)
    assert_replicas_identical(got)  # params AND running statistics: the same on every device
    got, want = first_copy(got, backend), first_copy(want, "pmap")
    chex.assert_trees_all_close(got["params"], want["params"], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got["state"], want["state"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in ("resnet18", "tiny")])
def test_per_replica_batchnorm_normalises_each_shard_on_its_own(name, devices, batches):
    """Per-replica BN on k devices is NOT the full-batch result: device i's statistics are those of
    one device stepping on shard i alone, and the update is the allreduced sum of the shards'
    gradients, each computed with its own shard's normalisation. Params stay identical."""
    k, lr = 4, 0.1
    model = make_model(name, sync=False)
    batch = small(batches) if name == "resnet18" else batches[:1]
    x64, dtype = precision(name)
    with x64:
        _check_per_replica(model, name, k, lr, batch, devices, dtype)


def _check_per_replica(model, name, k, lr, batch, devices, dtype):
    got, _ = run_steps(model, "psum", "pmap", devices[:k], batch, lr=lr, dtype=dtype)
    assert_replicas_identical(got["params"])

    # what it computes: per shard, the 1-device statistics; together, the mean of the shard gradients
    x, y = np.asarray(batch[0][0], dtype), batch[0][1]
    init = jax.tree.map(lambda a: np.asarray(a, dtype), model.init(jax.random.key(0)))
    shard = len(x) // k
    grads_sum = None
    for i in range(k):
        xi, yi = x[i * shard:(i + 1) * shard], y[i * shard:(i + 1) * shard]
        g, state_i = jax.grad(model.loss, has_aux=True)(init["params"], init["state"], xi, yi)
        chex.assert_trees_all_close(device_copy(got["state"], i), state_i, rtol=1e-5, atol=1e-6)
        grads_sum = g if grads_sum is None else jax.tree.map(jnp.add, grads_sum, g)
    expected = jax.tree.map(lambda p, g: p - lr * g / len(x), init["params"], grads_sum)
    chex.assert_trees_all_close(first_copy(got["params"], "pmap"), expected, rtol=1e-5, atol=1e-7)

    # and that differs from synchronised BN (= one device on the full batch) by far more than rounding
    sync, _ = run_steps(make_model(name, sync=True), "psum", "pmap", devices[:1], batch, lr=lr, dtype=dtype)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(first_copy(got, "pmap")["state"], first_copy(sync, "pmap")["state"],
                                    rtol=1e-3, atol=1e-5)
    with pytest.raises(AssertionError):  # the devices' running statistics differ from each other
        chex.assert_trees_all_close(device_copy(got["state"], 0), device_copy(got["state"], 1), rtol=1e-3, atol=1e-5)


def test_average_state_leaves_one_set_of_statistics_and_the_params_as_they_were(devices):
    k = 4
    got, _ = run_steps(make_model("tiny", sync=False), "psum", "pmap", devices[:k], _batches())
    averaged = jax.pmap(models.average_state, axis_name=AXIS, devices=devices[:k])(got)
    assert_replicas_identical(averaged)
    mean = jax.tree.map(lambda a: np.asarray(a).mean(axis=0), got["state"])
    chex.assert_trees_all_close(device_copy(averaged["state"], 2), mean, rtol=1e-6, atol=1e-8)
    chex.assert_trees_all_equal(averaged["params"], got["params"])


def _batches():
    ds = data.synthetic(jax.random.key(1), n_train=64, n_test=8)
    return [(ds.train.images[:8], ds.train.labels[:8])]


@pytest.mark.slow
def test_per_replica_training_passes_the_replica_check(devices):
    """`train` with per-replica BN: the replica check compares params and optimizer state (the
    statistics are meant to differ mid-epoch; comparing them too would stop this run at step 1)."""
    ds = data.synthetic(jax.random.key(3), n_train=64, n_test=24)
    config = TrainConfig(model="resnet18", batchnorm="per-replica", batch_size=16, lr=0.1, epochs=1)
    variables, history = train(config, ds, devices[:2], guards=jdp.Guards(check_replicas=1))
    assert len(history) == 1 and 0.0 <= history[0].test_acc <= 1.0
    assert set(variables) == {"params", "state"}
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(variables))


@pytest.mark.parametrize("kwargs,message", [
    ({"model": "lenet", "batchnorm": "sync"}, "`batchnorm` applies to models with BatchNorm .*, not `model=lenet`"),
    ({"model": "resnet18", "batchnorm": "per-replica", "backend": "shard_map"}, "`backend=pmap`"),
    ({"model": "resnet50"}, "`model` must be one of"),
])
def test_bad_model_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)
