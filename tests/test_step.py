import chex
import jax
import numpy as np
import pytest
from optax import sgd
from reference import LOSS, assert_replicas_identical, single_device_full_batch

from jdp import data
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel.evaluate import make_evaluator
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import replicate, split_batch, unreplicate
from jdp.parallel.step import make_train_step

STRATEGIES = ["psum", "manual"]


@pytest.fixture(scope="module")
def batches():
    ds = data.synthetic(jax.random.key(1), n_train=256, n_test=100)
    return [(ds.train.images[i:i + 32], ds.train.labels[i:i + 32]) for i in range(0, 128, 32)]


def run_steps(strategy, devices, batches, lr=0.2):
    optimizer = sgd(lr)
    params = lenet.init(jax.random.key(0))
    p, s = replicate(params, devices), replicate(optimizer.init(params), devices)
    step = make_train_step(LOSS, optimizer, allreduce.get(strategy), devices)
    for x, y in batches:
        p, s, _ = step(p, s, *split_batch(x, y, devices))
    return p


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_stay_bit_identical(strategy, devices, batches):
    params = run_steps(strategy, devices, batches)
    assert all(len(leaf.addressable_shards) == 8 for leaf in jax.tree.leaves(params))
    assert_replicas_identical(params)


def test_manual_equals_psum(devices, batches):
    chex.assert_trees_all_close(
        unreplicate(run_steps("manual", devices, batches)),
        unreplicate(run_steps("psum", devices, batches)), rtol=1e-6, atol=1e-9,
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow), 8])
def test_k_devices_equal_one_device_on_the_full_batch(strategy, k, devices, batches):
    got = unreplicate(run_steps(strategy, devices[:k], batches))
    chex.assert_trees_all_close(got, single_device_full_batch(batches), rtol=1e-5, atol=1e-8)


def test_parity_test_catches_a_mean_instead_of_sum(devices, batches):
    """psum of per-device MEANS (the bug in JAX's old spmd example) must fail the parity check."""
    mean_loss = lambda p, x, y: LOSS(p, x, y) / x.shape[0]  # noqa: E731
    optimizer = sgd(0.2)
    params = lenet.init(jax.random.key(0))
    p, s = replicate(params, devices[:4]), replicate(optimizer.init(params), devices[:4])
    step = make_train_step(mean_loss, optimizer, allreduce.get("psum"), devices[:4])
    for x, y in batches:
        p, s, _ = step(p, s, *split_batch(x, y, devices[:4]))
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(unreplicate(p), single_device_full_batch(batches), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, 8])
def test_multi_device_eval_equals_single_device(k, devices):
    ds = data.synthetic(jax.random.key(2), n_train=16, n_test=1001)  # 1001: not a multiple of any batch
    params = lenet.init(jax.random.key(3))
    params = jax.tree.map(lambda w: w * 30, params)  # big weights: predictions vary, accuracy is not trivial
    replicated = replicate(params, devices[:k])
    one = make_evaluator(lenet.apply, devices[:k], batch_size=96, on_all_devices=False)
    everywhere = make_evaluator(lenet.apply, devices[:k], batch_size=96, on_all_devices=True)
    acc_one = one(replicated, ds.test.images, ds.test.labels)
    acc_all = everywhere(replicated, ds.test.images, ds.test.labels)
    logits = lenet.apply(params, ds.test.images)
    expected = float((np.asarray(logits).argmax(-1) == ds.test.labels).mean())
    assert acc_one == acc_all == expected
    assert 0.0 < expected < 1.0


@pytest.mark.slow
def test_thousand_psum_steps_on_eight_devices_do_not_hang(devices):
    """JAX <= 0.11 on 2 cores freezes if psum steps pile up unsynchronised; the window prevents it."""
    ds = data.synthetic(jax.random.key(4), n_train=64, n_test=8)
    optimizer = sgd(0.05)
    params = lenet.init(jax.random.key(0))
    p, s = replicate(params, devices), replicate(optimizer.init(params), devices)
    step = make_train_step(LOSS, optimizer, allreduce.get("psum"), devices)
    x, y = split_batch(ds.train.images[:8], ds.train.labels[:8], devices)
    window = InFlight(limit=2)
    for _ in range(1000):
        p, s, loss = step(p, s, x, y)
        window.push(loss)
    window.drain()
    assert np.isfinite(np.asarray(loss)).all()
    assert_replicas_identical(p)
