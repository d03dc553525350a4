"""The shard_map backend beside pmap: same math, its own layout, gradients summed exactly once."""

import chex
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from optax import sgd
from reference import LOSS, assert_replicas_identical, single_device_full_batch

from jdp import data
from jdp.errors import ConfigError
from jdp.models import lenet
from jdp.parallel import allreduce, layout
from jdp.parallel.evaluate import make_evaluator
from jdp.parallel.step import make_train_step
from jdp.runtime.devices import AXIS

INSIDE = list(allreduce.names("inside"))
OUTSIDE = list(allreduce.names("outside"))
BATCH = 24  # divisible by every device count tested


@pytest.fixture(scope="module")
def batches():
    ds = data.synthetic(jax.random.key(1), n_train=256, n_test=16)
    return [(ds.train.images[i:i + BATCH], ds.train.labels[i:i + BATCH]) for i in range(0, 2 * BATCH, BATCH)]


def run_steps(strategy, backend, devices, batches, lr=0.2):
    optimizer = sgd(lr)
    params = lenet.init(jax.random.key(0))
    p = layout.replicate(params, devices, backend)
    s = layout.replicate(optimizer.init(params), devices, backend)
    step = make_train_step(LOSS, optimizer, allreduce.get(strategy), devices, backend=backend)
    for x, y in batches:
        p, s, losses = step(p, s, *layout.split_batch(x, y, devices, backend))
        assert losses.shape == (len(devices),)
    return p


# 3: not a power of 2. The fast tier keeps psum and manual under shard_map (under pmap: tests/test_step.py);
# every strategy's sum is checked on 1-8 devices by tests/test_testing.py.
FAST = {("psum", "pmap", 3), ("psum", "shard_map", 3), ("manual", "shard_map", 3)}
CASES = [(s, b, k) for s in INSIDE for b in layout.BACKENDS for k in (3, 8)]
CASES += [(s, "shard_map", 3) for s in OUTSIDE]
CASES = [case if case in FAST else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]


@pytest.mark.parametrize(("strategy", "backend", "k"), CASES)
def test_every_strategy_under_both_backends_equals_one_device(strategy, backend, k, devices, batches):
    params = run_steps(strategy, backend, devices[:k], batches)
    assert_replicas_identical(params)
    chex.assert_trees_all_close(
        layout.unreplicate(params, backend), single_device_full_batch(batches), rtol=1e-5, atol=1e-8
    )


def test_shard_map_layout_is_replicated_params_and_sharded_batch(devices, batches):
    x, y = layout.split_batch(*batches[0], devices[:4], "shard_map")
    assert x.shape == batches[0][0].shape and x.sharding.spec == P(AXIS)
    assert [s.data.shape[0] for s in x.addressable_shards] == [BATCH // 4] * 4
    params = run_steps("psum", "shard_map", devices[:4], batches[:1])
    for leaf, ref in zip(jax.tree.leaves(params), jax.tree.leaves(lenet.init(jax.random.key(0)))):
        assert leaf.shape == ref.shape and leaf.sharding.spec == P()
        assert len(leaf.addressable_shards) == 4


def one_sgd_step_delta(step_builder, devices, x, y):
    """params before minus after one SGD step with lr 1: the gradient the step applied."""
    optimizer = sgd(1.0)
    params = lenet.init(jax.random.key(0))
    p = layout.replicate(params, devices, "shard_map")
    s = layout.replicate(optimizer.init(params), devices, "shard_map")
    p, _, _ = step_builder(optimizer)(p, s, *layout.split_batch(x, y, devices, "shard_map"))
    return jax.tree.map(lambda a, b: a - np.asarray(b), params, layout.unreplicate(p, "shard_map"))


def test_shard_map_sums_gradients_exactly_once(devices, batches):
    """The step applies the full-batch mean gradient; with replicated params and `check_vma=True`,
    autodiff's implicit psum plus an explicit psum would apply k times it. The second half shows
    that this test tells the two apart."""
    x, y = batches[0]
    mean_grad = jax.tree.map(lambda g: g / len(x), jax.grad(LOSS)(lenet.init(jax.random.key(0)), x, y))
    k, ds = 4, devices[:4]
    ours = one_sgd_step_delta(
        lambda opt: make_train_step(LOSS, opt, allreduce.get("psum"), ds, backend="shard_map"), ds, x, y
    )
    chex.assert_trees_all_close(ours, mean_grad, rtol=1e-4, atol=1e-7)

    def summed_twice(optimizer):
        def local(params, opt_state, images, labels):
            grads = jax.grad(LOSS)(params, images, labels)  # check_vma=True: already psummed by autodiff
            grads = jax.tree.map(lambda g: jax.lax.psum(g, AXIS) / (len(images) * k), grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return jax.tree.map(lambda a, u: a + u, params, updates), opt_state, jax.numpy.zeros(1)

        return jax.jit(jax.shard_map(local, mesh=layout.mesh(ds), in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                     out_specs=(P(), P(), P(AXIS)), check_vma=True))

    doubled = one_sgd_step_delta(summed_twice, ds, x, y)
    chex.assert_trees_all_close(doubled, jax.tree.map(lambda g: k * g, mean_grad), rtol=1e-4, atol=1e-7)
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(doubled, mean_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("on_all_devices", [True, False])
def test_shard_map_eval_equals_single_device(on_all_devices, devices):
    ds = data.synthetic(jax.random.key(2), n_train=16, n_test=301)  # 301: pads the last batch
    params = jax.tree.map(lambda w: w * 30, lenet.init(jax.random.key(3)))
    evaluate = make_evaluator(lenet.apply, devices[:3], batch_size=96, on_all_devices=on_all_devices,
                              backend="shard_map")
    acc = evaluate(layout.replicate(params, devices[:3], "shard_map"), ds.test.images, ds.test.labels)
    expected = float((np.asarray(lenet.apply(params, ds.test.images)).argmax(-1) == ds.test.labels).mean())
    assert acc == expected and 0.0 < expected < 1.0


def test_unknown_backend_is_a_config_error(devices):
    with pytest.raises(ConfigError, match="Unknown `backend=vmap`"):
        make_train_step(LOSS, sgd(0.1), allreduce.get("psum"), devices[:2], backend="vmap")


def test_outside_strategies_are_refused_across_processes(devices):
    """`jax.device_put` reaches only this process's devices: a mesh with another process's device
    (here a stand-in: only its `process_index` is read) must be refused, naming the fix."""
    elsewhere = type("RemoteDevice", (), {"process_index": jax.process_index() + 1})()
    for name in OUTSIDE:
        with pytest.raises(ConfigError, match=f"`allreduce={name}` copies buffers .* Use a collective strategy"):
            make_train_step(LOSS, sgd(0.1), allreduce.get(name), [devices[0], elsewhere], backend="shard_map")
    make_train_step(LOSS, sgd(0.1), allreduce.get(INSIDE[0]), devices[:2], backend="shard_map")  # no error
