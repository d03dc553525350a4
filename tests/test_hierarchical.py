"""The hierarchical allreduce: within each host, across hosts, within again; exact groupings, clear refusals."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.errors import ConfigError
from jdp.parallel import allreduce, collectives
from jdp.parallel.layout import sharded
from jdp.parallel.step import check_strategy
from jdp.runtime.devices import AXIS
from jdp.testing import check_allreduce
from jdp.training.config import TrainConfig

VARIANTS = ["hierarchical:2x4", "hierarchical:tree:2x4", "hierarchical:psum:2x4", "hierarchical:4x2"]


@pytest.mark.parametrize("name", [  # 2x4's sums are also the first check of the training test below
    pytest.param(name, marks=pytest.mark.slow) if name == "hierarchical:2x4" else name for name in VARIANTS])
def test_each_variant_passes_check_allreduce_on_eight_devices(name):
    """Sums within rounding, bit-identical on every device (check_allreduce's first check)."""
    check_allreduce(allreduce.get(name), (8,), sgd_steps=0)


def test_one_host_per_process_by_default_and_the_degenerate_groupings():
    check_allreduce(allreduce.get("hierarchical"), (3,), sgd_steps=0)  # one process: one host of k devices
    check_allreduce(allreduce.get("hierarchical:tree:3x1"), (3,), sgd_steps=0)  # one device per host: all outer
    assert collectives.host_groups(3) == (((0, 1, 2),), ((0,), (1,), (2,)))


def _ppermutes(jaxpr) -> list[tuple[str, tuple]]:
    """(dtype, perm) of every ppermute in a jaxpr, loop bodies included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found.append((eqn.invars[0].aval.dtype.name, eqn.params["perm"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if hasattr(sub, "jaxpr"):
                    found += _ppermutes(sub.jaxpr)
    return found


def test_traffic_stays_in_its_groups_and_only_the_cross_host_traffic_is_compressed():
    """2 hosts × 4: float32 hops only inside a host, bfloat16 hops only between the same local index."""
    strategy = allreduce.get("hierarchical:2x4", compress="bf16-wire")
    jaxpr = jax.make_jaxpr(partial(strategy.fn, axis_name=AXIS), axis_env=[(AXIS, 8)])(jnp.ones(13))
    hops = _ppermutes(jaxpr.jaxpr)
    inside = [perm for dtype, perm in hops if dtype == "float32"]
    across = [perm for dtype, perm in hops if dtype == "bfloat16"]
    assert inside and across and len(inside) + len(across) == len(hops)
    assert all(a // 4 == b // 4 for perm in inside for a, b in perm)
    assert all(a % 4 == b % 4 and a // 4 != b // 4 for perm in across for a, b in perm)
    assert "psum" not in str(jaxpr)


def test_the_wire_variant_is_bit_identical_and_within_the_bfloat16_bound(devices):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 37)).astype(np.float32)  # 37: not divisible by 4 local devices
    strategy = allreduce.get("hierarchical:2x4", compress="bf16-wire")
    out = jax.pmap(lambda t: strategy.fn(t, AXIS), axis_name=AXIS, devices=devices[:8])(
        jax.device_put(x, sharded(devices[:8])))
    rows = [np.asarray(s.data)[0] for s in sorted(out.addressable_shards, key=lambda s: s.index[0].start)]
    assert all(r.tobytes() == rows[0].tobytes() for r in rows)
    exact, scale = x.astype(np.float64).sum(0), np.abs(x.astype(np.float64)).sum(0)
    error = np.abs(rows[0] - exact)
    assert np.all(error <= 2 * 8 * 2.0**-8 * scale)  # a few bfloat16 roundings of partial sums
    assert error.max() > 1e-6 * scale.max()  # it did round: the hops across hosts were bfloat16


@pytest.mark.parametrize(("name", "k", "message"), [
    ("hierarchical:2x3", 8, ("2 hosts × 3 local devices needs 6 devices, but the step runs on 8; give a grouping "
                             "HxL with H·L = 8, e.g. `allreduce=hierarchical:2x4`")),
    ("hierarchical:tree:4x2", 6, "needs 8 devices, but the step runs on 6"),
])
def test_a_grouping_that_is_not_the_device_count_is_refused(name, k, message, devices):
    with pytest.raises(AssertionError, match="raised ConfigError") as info:
        check_allreduce(allreduce.get(name), (k,), sgd_steps=0)
    assert message in str(info.value)


@pytest.mark.parametrize(("name", "message"), [
    ("hierarchical:0x8", "`hosts` must be a positive integer, got 0"),
    ("hierarchical:star", "Unknown allreduce strategy `hierarchical:star`"),
    ("hierarchical:2x4x1", "hierarchical[:ring|tree|psum][:HxL]"),
])
def test_bad_names_are_config_errors(name, message):
    with pytest.raises(ConfigError) as info:
        allreduce.get(name)
    assert message in str(info.value)


def test_a_host_must_not_span_two_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # 8 devices of 2 processes: 0..3 and 4..7
    assert collectives.host_groups(8) == (((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7)))
    assert collectives.host_groups(8, (4, 2))[0] == ((0, 1), (2, 3), (4, 5), (6, 7))  # two hosts per process: fine
    with pytest.raises(ConfigError, match="puts one host's devices in two of the 2 processes"):
        collectives.host_groups(8, (1, 8))


def test_names_round_trip_and_the_wire_goes_with_the_outer_ring():
    for name in ["hierarchical", "hierarchical:tree", "hierarchical:psum:2x4", "hierarchical:4x2"]:
        assert allreduce.get(name).name == name
    assert allreduce.get("hierarchical:ring:2x4").name == "hierarchical:2x4"
    assert allreduce.get("hierarchical:2x4", compress="bf16-wire").name == "hierarchical:2x4+bfloat16-wire"
    with pytest.raises(ConfigError, match="use `allreduce=ring, hierarchical`"):
        allreduce.get("hierarchical:tree:2x4", compress="bf16-wire")


def test_shard_optimizer_takes_the_ring_across_hosts_and_refuses_the_others():
    assert allreduce.get("hierarchical:2x4").has_halves  # check_allreduce checked them above
    for name in ("hierarchical:tree:2x4", "hierarchical:psum:2x4"):
        with pytest.raises(ConfigError, match=f"`allreduce={name}` does not provide; use one of: psum, .*hierarchical"):
            check_strategy(allreduce.get(name), "pmap", shard_optimizer=True)


@pytest.mark.slow  # fast sibling: test_each_variant_passes_check_allreduce_on_eight_devices[hierarchical:4x2]
def test_training_on_two_hosts_of_four_matches_psum_with_replicas_identical():
    """Two LeNet SGD steps: after each, every replica bit-identical and the params psum's (rtol 1e-5).
    (The optimizer sharded: the slow test below; `jdp launch` on 2 processes: tests/test_multiprocess.py.)"""
    assert TrainConfig(allreduce="hierarchical:2x4").strategy().name == "hierarchical:2x4"
    replicated_only = allreduce.get("hierarchical:2x4")._replace(reduce_scatter=None, all_gather=None)
    check_allreduce(replicated_only, (8,), sgd_steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hierarchical:2x4", "hierarchical:4x2"])
def test_training_with_the_optimizer_sharded_matches_psum(name):
    check_allreduce(allreduce.get(name), (8,), sgd_steps=2)  # replicated, then reduce-scatter / all-gather
