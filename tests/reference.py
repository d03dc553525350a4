"""What the parity tests compare against: plain one-device SGD, and bit-identity of replicas; the small
synthetic sets of short runs."""

import functools

import jax
import numpy as np

from jdp import data
from jdp.models import lenet, summed_cross_entropy

LOSS = summed_cross_entropy(lenet.apply)


def single_device_full_batch(batches, lr=0.2):
    """The reference: plain jitted SGD on one device over the whole batch, no data parallelism."""
    params = lenet.init(jax.random.key(0))

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(LOSS)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g / x.shape[0], params, grads)

    for x, y in batches:
        params = step(params, x, y)
    return params


def assert_replicas_identical(tree):
    """Every device's copy of every leaf is bit-identical, not merely close."""
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for other in shards[1:]:
            np.testing.assert_array_equal(other, shards[0])


@functools.cache
def small_set(n_train: int, n_test: int = 32, seed: int = 0) -> data.Dataset:
    """A synthetic set for short runs, made on first use (at import, every pytest-xdist worker would compile its
    random draws while collecting) and shared by a process's tests."""
    return data.synthetic(jax.random.key(seed), n_train=n_train, n_test=n_test)
