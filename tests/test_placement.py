import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.errors import ConfigError
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel.layout import replicate, split_batch, unreplicate
from jdp.runtime.devices import AXIS


def test_replicate_puts_one_full_copy_on_each_device(devices, key):
    params = lenet.init(key)
    replicated = replicate(params, devices[:4])
    for name, leaf in replicated.items():
        assert leaf.shape == (4, *params[name].shape)
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start)
        assert [s.device for s in shards] == devices[:4]
        for shard in shards:
            np.testing.assert_array_equal(np.asarray(shard.data[0]), np.asarray(params[name]))


def test_unreplicate_returns_first_copy_without_gathering(devices, key):
    params = lenet.init(key)
    back = unreplicate(replicate(params, devices[:3]))
    for name, leaf in back.items():
        assert leaf.shape == params[name].shape
        assert leaf.devices() == {devices[0]}
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(params[name]))


def test_split_batch_lesson_demo(devices):
    """The lesson: arange(20).reshape(4, 5) over 2 devices -> rows 0-1 and rows 2-3."""
    x = np.arange(20).reshape(4, 5)
    xs, ys = split_batch(x, np.arange(4), devices[:2])
    assert xs.shape == (2, 2, 5)
    shards = sorted(xs.addressable_shards, key=lambda s: s.index[0].start)
    assert shards[0].device == devices[0] and shards[1].device == devices[1]
    np.testing.assert_array_equal(np.asarray(shards[0].data[0]), x[0:2])
    np.testing.assert_array_equal(np.asarray(shards[1].data[0]), x[2:4])
    np.testing.assert_array_equal(np.asarray(ys), [[0, 1], [2, 3]])


def test_split_batch_rejects_indivisible_batch(devices):
    with pytest.raises(ConfigError, match="divisible by the number of devices"):
        split_batch(np.zeros((10, 3)), np.zeros(10), devices[:4])


def test_split_batch_rejects_length_mismatch(devices):
    with pytest.raises(ConfigError, match="differ in length"):
        split_batch(np.zeros((8, 3)), np.zeros(6), devices[:2])


@pytest.mark.parametrize("name", ["psum", "manual"])
def test_allreduce_lesson_demo(devices, name):
    """[[1, 1]] on device 0 and [[2, 2]] on device 1 -> [[3, 3]] on both."""
    x = split_batch(np.array([[1.0, 1.0], [2.0, 2.0]]), np.zeros(2), devices[:2])[0]  # (2, 1, 2)
    strategy = allreduce.get(name)
    if strategy.where == "inside":
        out = jax.pmap(lambda v: strategy.fn(v, AXIS), axis_name=AXIS, devices=devices[:2])(x)
    else:
        out = strategy.fn(x)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data[0]), [[3.0, 3.0]])
    assert {s.device for s in out.addressable_shards} == set(devices[:2])


def test_unknown_strategy_is_a_clear_error():
    with pytest.raises(ConfigError, match="Unknown allreduce strategy `ringg`"):
        allreduce.get("ringg")


def test_lenet_shapes_and_init(key):
    params = lenet.init(key)
    assert {k: v.shape for k, v in params.items()} == lenet.SHAPES
    assert float(jnp.std(params["W3"])) == pytest.approx(0.01, rel=0.05)
    assert all(float(jnp.abs(params[b]).max()) == 0.0 for b in ("b1", "b2", "b3", "b4"))
    assert lenet.apply(params, jnp.zeros((3, 1, 28, 28))).shape == (3, 10)
