"""Simulate 8 CPU devices before anything starts JAX's backend (tests run without a GPU)."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

N_DEVICES = 8


@pytest.fixture
def devices():
    return jax.devices()[:N_DEVICES]


@pytest.fixture
def key():
    return jax.random.key(0)
