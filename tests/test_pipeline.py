"""Resident and host data paths train on exactly the batches of the lesson's host loop."""

import jax
import numpy as np
import pytest
from optax import sgd

from jdp import data
from jdp.bench.loop import tiny_mlp
from jdp.errors import ConfigError
from jdp.parallel import allreduce
from jdp.parallel.layout import replicate, split_batch, unreplicate
from jdp.parallel.step import make_train_step
from jdp.training import feeders as pipeline
from jdp.training import tally

BATCH = 32
OPTIMIZER = sgd(0.2)
MODEL = tiny_mlp()  # what is checked does not depend on the model: a small one compiles fast


@pytest.fixture(scope="module")
def split():
    return data.synthetic(jax.random.key(1), n_train=168, n_test=8).train  # 5 full batches, 8 images left over


def fresh_state(devices):
    params = MODEL.init(jax.random.key(0))
    return replicate(params, devices), replicate(OPTIMIZER.init(params), devices)


def fresh_carry(devices):
    leaves = len(jax.tree.leaves(MODEL.init(jax.random.key(0))))
    return *fresh_state(devices), tally.place_tally(tally.start(0, [0.0] * len(devices), leaves), devices, "pmap")


def host_loop(step, split, devices, key):
    """The lesson's loop: copy each batch of `epoch_batches` from the host, one step per call."""
    params, opt_state = fresh_state(devices)
    total = 0.0
    for x, y in pipeline.epoch_batches(split, BATCH, key):
        params, opt_state, loss = step(params, opt_state, *split_batch(x, y, devices))
        total += float(np.asarray(loss).sum())
    return unreplicate(params), total


@pytest.mark.parametrize(
    ("resident", "strategy", "steps_per_call"),
    [pytest.param(True, "psum", 1, marks=pytest.mark.slow), (True, "psum", 2), (True, "manual", 1), (False, "psum", 2),
     pytest.param(False, "manual", 1, marks=pytest.mark.slow)],
)
def test_runner_equals_the_host_loop(split, devices, resident, strategy, steps_per_call):
    devices = devices[:2]
    strategy = allreduce.get(strategy)
    step = make_train_step(MODEL.loss, OPTIMIZER, strategy, devices)
    key = jax.random.key(5)
    want_params, want_loss = host_loop(step, split, devices, key)
    plan = pipeline.CallPlan(steps_per_call, traceable=strategy.where == "inside", resident=resident)
    run = pipeline.make_epoch_runner(step, split, devices, BATCH, plan=plan)
    calls = []
    (params, _, counted), losses = run(fresh_carry(devices), key, lambda it, total: calls.append(total) or it)
    assert calls == [-(-5 // steps_per_call)]  # 2 steps per call: calls of 2, 2 and 1
    assert sum(np.asarray(l).size for l in losses) == 5 * 2  # one loss per step and device
    assert all(np.asarray(loss).shape[0] == 2 for loss in losses)  # device axis first
    np.testing.assert_allclose(sum(float(np.asarray(l).sum()) for l in losses), want_loss, rtol=1e-6)
    counted = tally.read_local(counted)
    np.testing.assert_array_equal(counted.step, [5, 5])
    np.testing.assert_allclose(counted.loss.sum(), want_loss, rtol=1e-6)
    np.testing.assert_array_equal(counted.bad_to, [0, 0])
    for name, want in want_params.items():
        np.testing.assert_allclose(params[name][0], want, rtol=1e-6, atol=1e-8, err_msg=name)


def test_several_steps_per_call_need_a_collective_strategy(split, devices):
    step = make_train_step(MODEL.loss, OPTIMIZER, allreduce.get("manual"), devices[:2])
    with pytest.raises(ConfigError, match="`steps_per_call=2`"):
        pipeline.make_epoch_runner(step, split, devices[:2], BATCH, plan=pipeline.CallPlan(2, traceable=False))


def test_fashion_mnist_fits_on_eight_cpu_devices(devices):
    fashion = data.Split(np.zeros((60000, 1, 28, 28), np.float32), np.zeros(60000, np.int32))
    assert pipeline.fits_on_devices(fashion, devices[:1])
    assert not pipeline.fits_on_devices(fashion, devices[:1], fraction=1e-6)


def test_scanned_steps_equal_unrolled_steps(split, devices):
    """The `lax.scan` a GPU runs S steps with computes what the CPU's unrolled steps compute."""
    devices = devices[:2]
    step = make_train_step(MODEL.loss, OPTIMIZER, allreduce.get("psum"), devices)
    fold = tally.make_fold(devices, "pmap")
    x = split.images[:3 * BATCH].reshape(3, 2, BATCH // 2, *split.images.shape[1:])
    y = split.labels[:3 * BATCH].reshape(3, 2, BATCH // 2)
    xs, ys = replicate(x, devices)[0], replicate(y, devices)[0]  # any placement: both paths take the same
    results = {}
    for unrolled in (True, False):
        parts = pipeline.Parts(step, fold, unrolled=unrolled)
        run = jax.jit(lambda carry, xs, ys, parts=parts: parts.steps(carry, (xs, ys), 3))
        (params, _, counted, _), losses = run(fresh_carry(devices), xs, ys)
        results[unrolled] = unreplicate(params), np.asarray(losses), tally.read_local(counted)
    (want, want_losses, want_tally), (got, got_losses, got_tally) = results[True], results[False]
    assert got_losses.shape == want_losses.shape == (2, 3)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    np.testing.assert_array_equal(got_tally.step, [3, 3])
    np.testing.assert_allclose(got_tally.loss, want_tally.loss, rtol=1e-6)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-8, err_msg=name)
