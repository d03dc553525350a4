"""Simulate 8 CPU devices before anything starts JAX's backend (tests run without a GPU), and share one
XLA compilation cache between the tests of a run."""

import gc
import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

N_DEVICES = 8
SHARED_CACHE_ENV = "JDP_TESTS_COMPILATION_CACHE"  # how the pytest-xdist workers learn the run's cache folder


def pytest_configure(config):
    """Many tests compile the same step for the same shapes; a compilation cache, fresh for each run and shared by
    its pytest-xdist workers, compiles each once. The `jdp` processes tests start keep JAX's default (no cache):
    JAX 0.12 warns on stderr when it cannot serialize a multi-process CPU executable, and tests read those streams.
    A run that sets $JAX_COMPILATION_CACHE_DIR itself (empty: no cache) keeps its own choice."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    folder = os.environ.get(SHARED_CACHE_ENV)
    if folder is None:  # the first process of the run: the workers it starts inherit the variable
        folder = config.jdp_compilation_cache = tempfile.mkdtemp(prefix="jdp-tests-xla-cache-")
        os.environ[SHARED_CACHE_ENV] = folder
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # LeNet's steps compile in well under 1 s


def pytest_unconfigure(config):
    if hasattr(config, "jdp_compilation_cache"):
        shutil.rmtree(config.jdp_compilation_cache, ignore_errors=True)
        del os.environ[SHARED_CACHE_ENV]


@pytest.fixture(scope="session", autouse=True)
def formulation_pinned(tmp_path_factory):
    """`--formulation auto` (the CLI's default) resolves to `fast` in every test, on every machine kind, in this
    process and in the `jdp` processes tests start: $JDP_CACHE_DIR points at a table that says so for this
    machine, for every device count tests use, and no user's own table is read. Tests of `auto` itself set
    their own table (tests/test_formulation.py)."""
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


@pytest.fixture(scope="module", autouse=True)
def compiled_code_freed():
    """Frees each module's compiled executables when it ends. XLA:CPU maps every executable's code into
    memory; one process running the whole tier kept tens of thousands of maps until Linux's limit
    (vm.max_map_count, 65530) made LLVM fail to allocate ("Cannot allocate memory") and the process
    crash. The compilation cache on disk keeps recompiling cheap."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def devices():
    return jax.devices()[:N_DEVICES]


@pytest.fixture
def key():
    return jax.random.key(0)
