"""Every allreduce strategy returns the sum, bit-identical on every device, per leaf and fused."""

import json
import re
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optax import sgd

from jdp import data
from jdp.bench import allreduce as bench_allreduce
from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.models import lenet, summed_cross_entropy
from jdp.parallel import allreduce, buckets
from jdp.parallel.layout import replicate, sharded, split_batch, unreplicate
from jdp.parallel.step import make_train_step
from jdp.runtime.devices import AXIS

ALGORITHMS = list(allreduce.names())
SHAPES = [(), (0,), (1,), (2,), (3,), (7,), (13,), (2, 5), (3, 0, 2)]  # scalars, empty, not divisible by k
DTYPES = [jnp.float32, jnp.bfloat16]
MODES = [(False, None), (True, None), (True, 24 / 2**20)]  # per leaf, one buffer per dtype, 24-byte buckets


def place(tree, devices):
    """Host leaves of shape (k, ...) → global arrays with slice i on device i."""
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharded(devices)), tree)


def run(strategy: allreduce.Allreduce, tree, devices):
    if strategy.where == "inside":
        return jax.pmap(lambda t: strategy.fn(t, AXIS), axis_name=AXIS, devices=devices)(tree)
    return strategy.fn(tree)


def device_slices(leaf: jax.Array) -> list[np.ndarray]:
    """The slices of a (k, ...) array as each device holds them, in device-axis order."""
    shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
    return [np.asarray(s.data)[0] for s in shards]


def assert_allreduced(out, tree, k):
    """Each leaf: same shape/dtype, bit-identical on every device, and the sum within rounding.

    Recursive summation of k terms in a dtype with machine epsilon eps is off from the exact sum by
    at most (k−1)·(eps/2)·Σ|x_i| (Higham, Accuracy and Stability of Numerical Algorithms, §4.2);
    the test allows twice that.
    """
    for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        assert got.shape == x.shape and got.dtype == x.dtype
        slices = device_slices(got)
        assert len(slices) == k
        for other in slices[1:]:
            np.testing.assert_array_equal(other, slices[0])  # bit-identical: replicas cannot drift
        exact = np.asarray(x, np.float64).sum(axis=0)
        bound = (k - 1) * float(jnp.finfo(x.dtype).eps) * np.abs(np.asarray(x, np.float64)).sum(axis=0)
        np.testing.assert_array_less(np.abs(slices[0].astype(np.float64) - exact), bound + 1e-30)


@st.composite
def pytrees(draw):
    """(k, a random nested pytree of host leaves with a leading axis of k)."""
    k = draw(st.integers(1, 8))
    specs = draw(st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)), min_size=1, max_size=4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    leaves = [rng.normal(size=(k, *shape)).astype(dtype) for shape, dtype in specs]
    return k, {"layer": leaves[: len(leaves) // 2], "rest": tuple(leaves[len(leaves) // 2:])}


@pytest.mark.parametrize("name", [  # hierarchical on one process is one host, a ring: tests/test_hierarchical.py groups it
    pytest.param(name, marks=pytest.mark.slow) if name.startswith("hierarchical") else name for name in ALGORITHMS])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=pytrees(), mode=st.sampled_from(MODES))
def test_every_algorithm_returns_the_sum_on_every_device(name, case, mode, devices):
    k, tree = case
    fuse, bucket_mb = mode
    out = run(allreduce.get(name, fuse=fuse, bucket_mb=bucket_mb), place(tree, devices[:k]), devices[:k])
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert_allreduced(out, tree, k)


@pytest.mark.parametrize(("name", "k"), [("tree", 3), ("tree", 5), ("tree", 6), ("tree", 7), ("ring", 7),
                                         ("manual_ring", 7)])
def test_chunked_algorithms_on_awkward_device_counts(name, k, devices):
    """The tree's fold of 1, 2 or 3 devices beyond a power of two; rings of a prime length."""
    rng = np.random.default_rng(k)
    tree = {"w": rng.normal(size=(k, 13)).astype(np.float32), "s": rng.normal(size=(k,)).astype(np.float32)}
    assert_allreduced(run(allreduce.get(name), place(tree, devices[:k]), devices[:k]), tree, k)


def test_fused_buckets_respect_the_cap():
    leaves = [jnp.ones((k,)) for k in (3, 5, 8)] + [jnp.ones((4,), jnp.bfloat16)]
    layout = buckets.layout_of(leaves, lead=0)
    cut = buckets.to_buckets(leaves, layout, 24.0, lead=0)
    assert [b.size for b in cut] == [6, 6, 4, 4]  # 16 float32 in 24-byte buckets; 4 bfloat16 in one
    assert all(b.size * b.dtype.itemsize <= 24 for b in cut)
    restored = buckets.from_buckets(cut, layout, 24.0, lead=0)
    chex.assert_trees_all_equal(restored, leaves)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "star"}, "Unknown allreduce strategy `star`"),
        ({"name": "ring", "bucket_mb": 4.0}, "`bucket_mb=4` only applies to fused buffers; add `fuse=True`"),
        ({"name": "ring", "fuse": True, "bucket_mb": 0.0}, "`bucket_mb` must be positive"),
    ],
)
def test_bad_strategy_options_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError) as info:
        allreduce.get(**kwargs)
    assert message in str(info.value)


def test_strategies_send_no_psum():
    """ring and tree are built from ppermute alone: the point is not to call XLA's all-reduce."""
    for name in ("ring", "tree"):
        text = str(jax.make_jaxpr(partial(allreduce.get(name).fn, axis_name=AXIS), axis_env=[(AXIS, 6)])(jnp.ones(13)))
        assert "ppermute" in text and "psum" not in text


def test_a_swap_in_pieces_moves_the_same_bits_as_one_ppermute(devices):
    """The ring's hop between two processes: a buffer of 3 pieces and a remainder, each piece a ppermute of at
    most SWAP_PIECE_BYTES, arrives whole and unchanged on the other device."""
    from jdp.parallel.collectives import SWAP_PIECE_BYTES, swap_in_pieces
    from jdp.parallel.layout import map_over_devices, place

    n = 3 * SWAP_PIECE_BYTES // 4 + 5  # float32 elements
    rows = np.random.default_rng(0).standard_normal((2, n)).astype(np.float32)
    swap = [(0, 1), (1, 0)]
    jaxpr = str(jax.make_jaxpr(partial(swap_in_pieces, axis_name=AXIS, pairs=swap), axis_env=[(AXIS, 2)])(rows[0]))
    assert jaxpr.count("ppermute") == 4, jaxpr
    (got,) = map_over_devices(lambda row: (swap_in_pieces(row, AXIS, swap),), devices[:2], "pmap",
                              ("per_device",), ("per_device",))(place(rows, "per_device", devices[:2], "pmap"))
    assert np.asarray(got).tobytes() == rows[::-1].tobytes()


def test_swaps_go_in_pieces_only_between_processes(monkeypatch):
    """Devices ordered process by process, 2 per process (as under `jax.process_count() == 2`): a swap inside a
    process stays whole, one between processes goes in pieces; a ring of 4 is no swap. The ring of 2 (one
    device per process) and hierarchical's outer ring cut theirs; hierarchical's inner ring does not."""
    from jdp.parallel import collectives
    from jdp.parallel.collectives import SWAP_PIECE_BYTES, swaps_between_processes

    def traced(fn, k, n):
        return str(jax.make_jaxpr(partial(fn, axis_name=AXIS), axis_env=[(AXIS, k)])(jnp.ones(n)))

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    check = partial(jax.make_jaxpr, axis_env=[(AXIS, 4)])
    for pairs, expected in (([(0, 1), (1, 0), (2, 3), (3, 2)], False), ([(0, 2), (2, 0), (1, 3), (3, 1)], True),
                            ([(0, 1), (1, 2), (2, 3), (3, 0)], False)):
        found = []
        check(lambda x, pairs=pairs: found.append(swaps_between_processes(pairs, AXIS)) or x)(1.0)
        assert found == [expected], pairs
    n = 8 * SWAP_PIECE_BYTES // 4  # float32 elements: chunks of 4 pieces on 2 devices
    assert traced(collectives.ring, 2, n).count("ppermute") == 2 * 4
    assert traced(partial(collectives.hierarchical, shape=(2, 2)), 4, n).count("ppermute") == 2 + 2 * 2
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert traced(collectives.ring, 2, n).count("ppermute") == 2


# --- a few training steps: replicas bit-identical, params equal to psum's ---------------------

K = 3  # not a power of two: the tree folds one device in
LOSS = summed_cross_entropy(lenet.apply)


@pytest.fixture(scope="module")
def batches():
    ds = data.synthetic(jax.random.key(1), n_train=72, n_test=3)
    return [(ds.train.images[i:i + 24], ds.train.labels[i:i + 24]) for i in range(0, 72, 24)]


def train_params(strategy, devices, batches):
    optimizer = sgd(0.2)
    params = lenet.init(jax.random.key(0))
    p, s = replicate(params, devices), replicate(optimizer.init(params), devices)
    step = make_train_step(LOSS, optimizer, strategy, devices)
    for x, y in batches:
        p, s, _ = step(p, s, *split_batch(x, y, devices))
    return p


@pytest.fixture(scope="module")
def psum_params(batches):
    return unreplicate(train_params(allreduce.get("psum"), jax.devices()[:K], batches))


# The fast tier trains each strategy once and each kind of fused path (inside, outside) once.
FAST_TRAINING = {("psum", False), ("psum", True), ("manual", False), ("manual_ring", True), ("ring", False),
                 ("tree", False)}


@pytest.mark.parametrize(("name", "fuse"), [
    (name, fuse) if (name, fuse) in FAST_TRAINING else pytest.param(name, fuse, marks=pytest.mark.slow)
    for name in ALGORITHMS for fuse in (False, True)
], ids=lambda v: {False: "per-leaf", True: "buckets"}.get(v, v) if isinstance(v, bool) else v)
def test_training_keeps_replicas_identical_and_matches_psum(name, fuse, batches, psum_params, devices):
    strategy = allreduce.get(name, fuse=fuse, bucket_mb=0.25 if fuse else None)  # W3 spans two buckets
    params = train_params(strategy, devices[:K], batches)
    for leaf in jax.tree.leaves(params):
        slices = device_slices(leaf)
        for other in slices[1:]:
            np.testing.assert_array_equal(other, slices[0])
    for got, want in zip(jax.tree.leaves(unreplicate(params)), jax.tree.leaves(psum_params), strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


# --- the benchmarks, in quick form --------------------------------------------------------------


def test_parse_sizes():
    assert bench_allreduce.parse_sizes("4KiB..64KiB") == [4096, 16384, 65536]
    assert bench_allreduce.parse_sizes("4KiB..100KiB") == [4096, 16384, 65536]
    assert bench_allreduce.parse_sizes("8,1MiB") == [8, 2**20]
    for bad, message in [("4kb", "not a size"), ("6", "multiple of 4 bytes"), ("1MiB..4KiB", "ends below")]:
        with pytest.raises(ConfigError, match=message):
            bench_allreduce.parse_sizes(bad)


def test_bench_allreduce_quick(tmp_path, capsys):
    code = cli.main(["bench", "allreduce", "--devices", "3", "--sizes", "16,4KiB", "--repeats", "1",
                     "--algorithms", "psum", "manual", "tree", "--out", str(tmp_path)])
    assert code == 0
    table = capsys.readouterr().out
    assert "busbw" in table and "#wrong" in table and "manual" in table
    record = json.loads((tmp_path / "allreduce.json").read_text())
    rows = record["results"]
    assert [(r["size_bytes"], r["algorithm"]) for r in rows] == [
        (s, a) for s in (16, 4096) for a in ("psum", "manual", "tree")]
    for r in rows:
        assert r["wrong"] == 0 and r["devices"] == 3 and r["count"] == r["size_bytes"] // 4
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 4 / 3)
    assert record["platform"] == "cpu" and isinstance(record["jax_version"], str)
    assert record["fit"]["link"] == "shared" and set(record["fit"]["algorithms"]) == {"psum", "manual", "tree"}
    assert all(len(f["residuals"]) == 2 and f["alpha_s"] >= 0 for f in record["fit"]["algorithms"].values())
    assert (tmp_path / "allreduce.png").stat().st_size > 1000


def test_bench_allreduce_counts_a_wrong_sum(devices, monkeypatch):
    broken = allreduce.Allreduce("broken", lambda tree: jax.tree.map(lambda x: x * 2, tree), "outside")
    monkeypatch.setitem(allreduce._STRATEGIES, "broken", broken)
    rows = bench_allreduce.bench_allreduce(devices[:2], [64], ["broken"], repeats=1)
    assert rows[0]["wrong"] == 2 * 16  # every element on both devices


def test_bench_step_quick(tmp_path, capsys):
    code = cli.main(["bench", "step", "--devices", "2", "--batch-size", "8", "--steps", "1", "--repeats", "1",
                     "--algorithms", "psum", "--bucket-mb", "0.5", "--out", str(tmp_path)])
    assert code == 0
    assert "vs psum" in capsys.readouterr().out
    rows = json.loads((tmp_path / "step.json").read_text())["results"]
    assert [r["strategy"] for r in rows] == ["psum", "psum+buckets0.5MB"]
    assert rows[0]["vs_psum"] == 1.0
    assert all(r["ms_per_step"] > 0 and r["images_per_s"] > 0 for r in rows)


def test_bench_step_rejects_an_indivisible_batch(capsys):
    assert cli.main(["bench", "step", "--devices", "3", "--batch-size", "8"]) == 2
    assert "divisible by the number of devices" in capsys.readouterr().err


def test_train_cli_rejects_buckets_without_fuse(capsys):
    assert cli.main(["train", "--dataset", "synthetic", "--allreduce", "ring", "--bucket-mb", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`--bucket-mb 4` only applies to fused buffers; add `--fuse`" in err


@pytest.mark.parametrize("name", ["ring+bfloat16-wire+fused", "tree+buckets25MB", "psum+bfloat16", "ring+powersgd2",
                                  "hierarchical:tree:2x4+fused", "manual_ring+float16", "hierarchical+bfloat16-wire"])
def test_get_reads_back_every_name_the_wrappers_write(name):
    strategy = allreduce.get(name)
    assert strategy.name == name and allreduce.get(strategy) is strategy  # a strategy passes through as itself


def test_get_refuses_a_wrapper_it_does_not_write_and_a_wire_a_strategy_lacks():
    with pytest.raises(ConfigError, match=r"`ring\+zip` has `\+zip`, not a wrapper jdp writes"):
        allreduce.get("ring+zip")
    with pytest.raises(ConfigError, match=r"`compress=bf16-wire` .* use `allreduce=ring, hierarchical`"):
        allreduce.get("tree+bfloat16-wire")
    assert allreduce.names(wire=True) == ("ring", "hierarchical")


def test_every_built_in_has_a_cost_the_wrappers_carry_and_powersgd_drops():
    for name in allreduce.names():
        strategy = allreduce.get(name)
        assert strategy.cost is not None and buckets.fused(strategy).cost is not None, name
        assert allreduce.get(name, compress="bf16").cost is not None, name
        assert allreduce.get(name, compress="powersgd").cost is None, name


@pytest.mark.parametrize("module,name,replacement", [
    ("jdp.parallel.compress", "get", "jdp.get_allreduce"), ("jdp.parallel.cost", "formula", ".cost"),
    ("jdp.parallel.cost", "fit_all", "jdp.bench.fit.fit_all"), ("jdp.runtime.machine_kind", "Kind", "MachineKind"),
    ("jdp.training.formulation", "COMMITTED", "committed()"), ("jdp.bench.baselines", "BASELINES", "committed()"),
    ("jdp.runtime.devices", "mesh", "jdp.parallel.layout.mesh")])
def test_a_removed_name_says_what_replaced_it(module, name, replacement):
    import importlib

    with pytest.raises(AttributeError, match=re.escape(replacement)):
        getattr(importlib.import_module(module), name)


def test_a_renamed_opt_state_method_says_what_replaced_it():
    from jdp.parallel.opt_state import OptState, ReplicatedOptimizer

    with pytest.raises(AttributeError, match="optimizer_and_strategy"):
        OptState(ReplicatedOptimizer(sgd(0.1)), 2).split  # noqa: B018


def test_the_flags_of_the_old_opt_state_say_what_replaced_them():
    """The optimizer state is composed of parts: the old positional form and its flags name the new one."""
    from jdp.parallel.opt_state import OptState, ReplicatedOptimizer

    with pytest.raises(TypeError, match=r"jdp.OptState\(placement, device_count, strategy=, sync=\)"):
        OptState(sgd(0.1), None, 2)
    with pytest.raises(TypeError, match=r"`OptState\(sharded=...\)` is gone: .*`placement`, a `ShardedOptimizer`"):
        OptState(ReplicatedOptimizer(sgd(0.1)), 2, sharded=True)
    with pytest.raises(AttributeError, match="`placement`, a `LocalOptimizer`"):
        OptState(ReplicatedOptimizer(sgd(0.1)), 2).local  # noqa: B018
