"""Simulate 8 CPU devices before anything starts JAX's backend (tests run without a GPU)."""

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

N_DEVICES = 8


@pytest.fixture(scope="session", autouse=True)
def formulation_pinned(tmp_path_factory):
    """`--formulation auto` (the CLI's default) resolves to `fast` in every test, on every machine kind, in this
    process and in the `jdp` processes tests start: $JDP_CACHE_DIR points at a table that says so for this
    machine, for every device count tests use, and no user's own table is read. Tests of `auto` itself set
    their own table (tests/test_formulation.py)."""
    import os

    from jdp.runtime.machine_kind import this_kind
    from jdp.training import formulation

    folder = tmp_path_factory.mktemp("jdp-cache")
    saved = os.environ.get(formulation.CACHE_ENV)
    os.environ[formulation.CACHE_ENV] = str(folder)
    for k in range(1, N_DEVICES + 1):
        formulation.write_entry(formulation.Entry(this_kind("cpu"), k, "fast", "tests/conftest.py: pinned"))
    yield folder
    if saved is None:
        del os.environ[formulation.CACHE_ENV]
    else:
        os.environ[formulation.CACHE_ENV] = saved


@pytest.fixture
def devices():
    return jax.devices()[:N_DEVICES]


@pytest.fixture
def key():
    return jax.random.key(0)
