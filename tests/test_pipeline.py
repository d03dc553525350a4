"""Resident and host data paths train on exactly the batches of the lesson's host loop."""

import jax
import numpy as np
import pytest
from optax import sgd

from jdp import data
from jdp.bench.loop import tiny_mlp
from jdp.errors import ConfigError
from jdp.parallel import allreduce
from jdp.parallel import feeders as pipeline
from jdp.parallel import tally
from jdp.parallel.layout import replicate, split_batch, unreplicate
from jdp.parallel.step import make_train_step
from jdp.training import loop
from jdp.training.config import TrainConfig

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


@pytest.mark.parametrize(("step_seconds", "steps"), [(70e-6, 16), (0.5e-3, 8), (1e-3, 4), (2e-3, 2), (3e-3, 1), (30e-3, 1), (float("inf"), 1)])
def test_auto_steps_per_call_makes_a_call_of_about_4_ms(step_seconds, steps):
    assert pipeline.auto_steps_per_call(step_seconds) == steps


def test_auto_steps_per_call_stays_within_a_bound():  # a checkpoint every 5 steps: at most 4 per call
    assert pipeline.auto_steps_per_call(1e-6, most=5) == 4 and pipeline.auto_steps_per_call(1e-6, most=1) == 1


def test_the_steady_step_time_skips_the_compiling_calls_and_needs_enough_of_them():
    paced = [(0.0, 1), (5.0, 1)] + [(5.0 + 0.002 * i, 2) for i in range(1, 9)]  # two slow first calls, then 2 ms
    assert pipeline.steady_step_seconds(paced) == pytest.approx(0.001)
    assert pipeline.steady_step_seconds(paced[:9]) == float("inf")  # 7 timed calls: too few


@pytest.mark.parametrize(("strategy", "chosen"), [("psum", 4), ("manual", 1)])
def test_auto_steps_per_call_groups_later_epochs_and_changes_no_result(devices, monkeypatch, strategy, chosen):
    """Epoch 1 runs a step per call; from epoch 2, the chooser's count where the step allows it (a collective
    strategy; `manual` copies between calls, so it stays 1). Grouped or not, the params are bit-identical."""
    monkeypatch.setattr(loop, "auto_steps_per_call", lambda seconds, most: min(4, most))  # the measured time varies; the wiring not
    dataset = data.synthetic(jax.random.key(1), n_train=640, n_test=8)
    runs = {}
    for steps_per_call in ("auto", 1):
        config = TrainConfig(batch_size=32, lr=0.05, epochs=3, model=MODEL, allreduce=strategy,
                             steps_per_call=steps_per_call)
        params, history = loop.train(config, dataset, devices[:2])
        runs[steps_per_call] = params, [record.steps_per_call for record in history]
    assert runs["auto"][1] == [1, chosen, chosen] and runs[1][1] == [1, 1, 1]
    for a, b in zip(jax.tree.leaves(runs["auto"][0]), jax.tree.leaves(runs[1][0]), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("value", ["fast", 0, 2.5])
def test_steps_per_call_is_a_positive_integer_or_auto(value):
    with pytest.raises(ConfigError, match="`steps_per_call`"):
        TrainConfig(steps_per_call=value)
