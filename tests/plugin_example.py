"""A `--plugin` module as a user would write one (used by tests/test_api.py through `jdp train`).

Importing it registers an allreduce strategy and a model; it starts nothing (no arrays are made
at import time), so `jdp train` can import it before it simulates the CPU devices.
"""

import jax
import jax.numpy as jnp
from jax import lax

import jdp

ALLREDUCE = "example_gather_sum"
MODEL = "example_softmax"


def gather_sum(tree, axis_name):
    """Every device gathers every device's copy and adds them in device order."""
    return jax.tree.map(lambda g: lax.all_gather(g, axis_name).sum(0), tree)


def init(key):
    return {"w": 0.01 * jax.random.normal(key, (784, 10)), "b": jnp.zeros(10)}


def apply(params, images):
    return images.reshape(len(images), -1) @ params["w"] + params["b"]


def build(**options):
    """`jdp train` passes `impl=` and `batchnorm=`; this model has neither, so it refuses a BatchNorm choice."""
    if options.get("batchnorm") is not None:
        raise jdp.ConfigError(jdp.Arg("batchnorm"), " does not apply to ", jdp.Arg("model", MODEL), ".")
    return jdp.Model(init, jdp.summed_cross_entropy(apply), apply, name=MODEL)


jdp.register_allreduce(jdp.Allreduce(ALLREDUCE, gather_sum))
jdp.register_model(MODEL, build)
