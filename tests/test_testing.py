"""`jdp.testing.check_allreduce`: passes every built-in strategy, catches planted bugs by name."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jdp.errors import ConfigError
from jdp.parallel import allreduce, collectives
from jdp.parallel.buckets import fused
from jdp.parallel.strategy import Allreduce
from jdp.testing import check_allreduce

FAST_COUNTS = (1, 3, 8)  # one device, an odd count (the tree folds one device in), all of them
BUILT_IN = ("psum", "manual", "manual_ring", "ring", "tree")


@pytest.fixture
def registry():
    """The strategy registry, restored after the test whatever it registered."""
    saved = dict(allreduce._STRATEGIES)
    yield allreduce
    allreduce._STRATEGIES.clear()
    allreduce._STRATEGIES.update(saved)


def test_the_built_ins_are_what_is_registered():
    assert allreduce.names()[: len(BUILT_IN)] == BUILT_IN  # so the parametrizations below cover every one


# --- every built-in strategy passes -------------------------------------------------------------

STRATEGIES = {
    **{name: lambda name=name: allreduce.get(name) for name in BUILT_IN},
    "psum+fused": lambda: fused(allreduce.get("psum")),
    "manual_ring+buckets": lambda: fused(allreduce.get("manual_ring"), bucket_mb=0.25),  # LeNet's W3 spans two
}


# The fast tier checks an inside, an outside and a bucketed strategy here; every built-in's sums are also checked
# fast by tests/test_allreduce.py, and each strategy passes the full check in the slow tier below.
FAST_CHECKS = ("psum", "manual", "manual_ring+buckets")


@pytest.mark.parametrize("name", [
    name if name in FAST_CHECKS else pytest.param(name, marks=pytest.mark.slow) for name in STRATEGIES])
def test_built_in_strategies_pass(name):
    """The sums on one, three and eight devices (no training: a LeNet step compiles for seconds)."""
    check_allreduce(STRATEGIES[name](), FAST_COUNTS, sgd_steps=0)


@pytest.mark.parametrize("name", [pytest.param("psum", marks=pytest.mark.slow), "manual"])  # the reference, an "outside" step
def test_built_in_strategies_train_like_psum(name):
    check_allreduce(STRATEGIES[name](), (8,), sgd_steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_built_in_strategies_pass_in_full(name):
    """Every device count 1..8, and three LeNet steps on eight devices: the defaults."""
    check_allreduce(STRATEGIES[name]())


# --- a strategy of one's own: check, register, look up -----------------------------------------


def gather_then_sum(tree, axis_name):
    """Every device gathers every device's buffer and adds them up in device order."""
    return jax.tree.map(lambda x: lax.all_gather(x, axis_name).sum(axis=0), tree)


def test_a_user_strategy_passes_and_registers(registry):
    strategy = Allreduce("gather_sum", gather_then_sum)
    check_allreduce(strategy, FAST_COUNTS, sgd_steps=0)
    assert registry.register(strategy) is strategy
    assert registry.get("gather_sum") is strategy
    assert "gather_sum" in registry.names("inside") and "gather_sum" not in registry.names("outside")
    with pytest.raises(ConfigError, match="named `gather_sum` is registered already"):
        registry.register(Allreduce("gather_sum", collectives.psum))
    assert registry.get("gather_sum") is strategy


def test_the_registry_fixture_restored_the_registry():
    assert "gather_sum" not in allreduce.names()  # runs after the test above


# --- a strategy with its own halves: checked, and trained with the optimizer sharded ------------


def gather_then_keep_mine(flat, axis_name):
    """Reduce-scatter: every device sums every device's buffer and keeps its own slice."""
    c = flat.size // lax.axis_size(axis_name)
    return lax.dynamic_slice_in_dim(lax.all_gather(flat, axis_name).sum(axis=0), lax.axis_index(axis_name) * c, c)


def gather_slices(mine, axis_name):
    """All-gather: every device's slice, in device order."""
    return lax.all_gather(mine, axis_name, tiled=True)


def gather_slices_backwards(mine, axis_name):
    """A planted bug: the slices in reverse device order."""
    return jnp.flip(lax.all_gather(mine, axis_name), axis=0).reshape(-1)


def gather_then_keep_the_mean(flat, axis_name):
    """A planted bug: device i's slice of the mean, not the sum."""
    return gather_then_keep_mine(flat, axis_name) / lax.axis_size(axis_name)


HALVED = Allreduce("gather_sum_halves", gather_then_sum, reduce_scatter=gather_then_keep_mine,
                   all_gather=gather_slices)
PLUGIN = f"""
import jdp
from {__name__} import HALVED
jdp.register_allreduce(HALVED)
"""


def test_a_user_strategy_with_halves_passes():
    check_allreduce(HALVED, (1, 2, 3), sgd_steps=2)  # the sums, the halves, SGD replicated and sharded


@pytest.mark.slow  # two runs from the CLI; the test above checks the same strategy's halves and sharded SGD
def test_a_user_strategy_with_halves_trains_with_the_optimizer_sharded(registry, tmp_path, monkeypatch, capsys):
    from jdp.cli.main import main

    (tmp_path / "halves_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "64", "--no-progress",
            "--cpu-devices", "8", "--devices", "2", "--optimizer", "adamw", "--lr", "0.01", "--shard-optimizer",
            "--check-replicas", "8"]
    assert main([*args, "--plugin", "halves_plugin", "--allreduce", "gather_sum_halves"]) == 0
    mine = capsys.readouterr().out
    assert main([*args, "--allreduce", "psum"]) == 0
    reference = capsys.readouterr().out
    loss = lambda out: float(re.search(r"train loss (\S+)", out).group(1))  # noqa: E731
    assert loss(mine) == pytest.approx(loss(reference), rel=1e-4), (mine, reference)


@pytest.mark.parametrize("halves,message", [
    ((gather_then_keep_mine, gather_slices_backwards), "`all_gather` does not return every device's slice in device "
                                                       "order"),
    ((gather_then_keep_the_mean, gather_slices), "`reduce_scatter`'s slice 0 on device 0: device 0's result is not "
                                                 "the sum over the devices.*looks like the mean"),
])
def test_planted_bugs_in_the_halves_are_caught(halves, message):
    strategy = Allreduce("planted", gather_then_sum, reduce_scatter=halves[0], all_gather=halves[1])
    with pytest.raises(AssertionError, match=message):
        check_allreduce(strategy, (1, 2), sgd_steps=0)


def test_a_strategy_with_one_half_is_refused():
    with pytest.raises(ConfigError, match="has one half only"):
        check_allreduce(Allreduce("half", gather_then_sum, reduce_scatter=gather_then_keep_mine), (1,), sgd_steps=0)


# --- planted bugs: each is caught, and the message names the case and the problem ----------------


def _inside(name, per_leaf):
    return Allreduce(name, lambda tree, axis: jax.tree.map(lambda x: per_leaf(x, axis), tree))


def drop_last(x, axis):
    """psum, but the last device's contribution is zeroed."""
    last = lax.axis_index(axis) == lax.axis_size(axis) - 1
    return lax.psum(jnp.where(last, jnp.zeros_like(x), x), axis)


def perturb_device_1(x, axis):
    """psum, then device 1 nudges its copy by a relative 2^-20 (float32 notices, bfloat16 does not)."""
    total = lax.psum(x, axis)
    return jnp.where(lax.axis_index(axis) == 1, total * (1 + 2**-20), total)


def sum_in_float32(x, axis):
    """Upcasts to float32 for the sum and forgets to cast back."""
    return lax.psum(x.astype(jnp.float32), axis)


def sum_in_bfloat16(x, axis):
    """Sums in bfloat16 to halve the traffic: float32 leaves lose 16 bits."""
    return lax.psum(x.astype(jnp.bfloat16), axis).astype(x.dtype)


def chunk_without_padding(x, axis):
    """Cuts the buffer into k chunks without padding: breaks on sizes k does not divide."""
    k = lax.axis_size(axis)
    return lax.psum(x.reshape(k, -1), axis).reshape(x.shape)


def mean_of_large_leaves(x, axis):
    """Right on small leaves, the mean on large ones: only a training step notices."""
    return lax.pmean(x, axis) if x.size > 1000 else lax.psum(x, axis)


def _shards(x):
    return sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)


def _copies(x, value_for_device):
    """A (k, ...) array with slice i = value_for_device(i, shards) placed on device i."""
    shards = _shards(x)
    pieces = [jax.device_put(value_for_device(i, shards), s.device) for i, s in enumerate(shards)]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, pieces)


def star_without_last(tree):
    """The star allreduce that forgets the last device's shard."""

    def leaf(x):
        shards = _shards(x)
        total = jnp.zeros_like(shards[0].data)
        for shard in shards[:-1]:
            total = total + jax.device_put(shard.data, shards[0].device)
        return _copies(x, lambda i, _: total)

    return jax.tree.map(leaf, tree)


def each_device_sums_in_its_own_order(tree):
    """Every device adds all shards itself, starting from its own: the same sum, rounded differently."""

    def leaf(x):
        def own_order(i, shards):
            k = len(shards)
            total = jax.device_put(shards[i].data, shards[i].device)
            for j in range(1, k):
                total = total + jax.device_put(shards[(i + j) % k].data, shards[i].device)
            return total

        return _copies(x, own_order)

    return jax.tree.map(leaf, tree)


def all_on_device_0(tree):
    """Returns the input moved to device 0: right on one device, wrongly placed on more."""
    return jax.tree.map(lambda x: jax.device_put(x, _shards(x)[0].device), tree)


F32_FIRST = r"float32 leaf \['edge'\]\[0\] shape \(1,\)"  # the first leaf of the random tree

PLANTED = [
    pytest.param(
        _inside("drop_last", drop_last),
        rf"`drop_last` on 1 device, {F32_FIRST}: device 0's result is not the sum over the devices: .*"
        r"it looks like the sum without device 0's contribution",
        id="inside-dropped-shard",
    ),
    pytest.param(
        Allreduce("star_without_last", star_without_last, "outside"),
        r"`star_without_last` on 1 device, .*not the sum over the devices: .*without device 0's contribution",
        id="outside-dropped-shard",
    ),
    pytest.param(
        _inside("pmean", lambda x, axis: lax.pmean(x, axis)),
        rf"`pmean` on 3 devices, {F32_FIRST}: .*not the sum.*it looks like the mean over the devices, not the sum",
        id="mean-not-sum",
    ),
    pytest.param(
        _inside("nudge", perturb_device_1),
        r"`nudge` on 3 devices, float32 leaf .*: device 1 holds a value that differs from device 0 \(first at index",
        id="one-device-differs",
    ),
    pytest.param(
        Allreduce("own_order", each_device_sums_in_its_own_order, "outside"),
        r"`own_order` on 3 devices, float32 leaf .*: device [12] holds a value that differs from device 0",
        id="devices-round-differently",
    ),
    pytest.param(
        _inside("f32", sum_in_float32),
        r"`f32` on 1 device, bfloat16 leaf \['edge'\]\[2\] shape \(3, 0\): returned float32 of shape \(3, 0\)"
        r".*must preserve shapes and dtypes",
        id="bfloat16-upcast",
    ),
    pytest.param(
        _inside("bf16", sum_in_bfloat16),
        rf"`bf16` on 1 device, {F32_FIRST}: device 0's result is not the sum over the devices: at index \(0,\)",
        id="float32-rounded-to-bfloat16",
    ),
    pytest.param(
        _inside("chunks", chunk_without_padding),
        rf"`chunks` on 3 devices, {F32_FIRST}: raised TypeError: .*reshape",
        id="indivisible-size-raises",
    ),
    pytest.param(
        Allreduce("on_device_0", all_on_device_0, "outside"),
        r"`on_device_0` on 3 devices, .*: device 1 \(.*\) does not hold slice 1 of the result",
        id="outside-misplaced",
    ),
]


@pytest.mark.parametrize(("strategy", "message"), PLANTED)
def test_planted_bugs_are_caught_by_name(strategy, message):
    with pytest.raises(AssertionError, match=message):
        check_allreduce(strategy, FAST_COUNTS)


def test_a_bug_only_training_shows_is_caught():
    strategy = _inside("large_mean", mean_of_large_leaves)  # every leaf of the random tree is small; W2 is not
    check_allreduce(strategy, FAST_COUNTS, sgd_steps=0)
    with pytest.raises(AssertionError, match=r"`large_mean` on 8 devices, SGD on LeNet \(batch 32\), after step 1: "
                                             r"param \['W2'\] differs from psum's"):
        check_allreduce(strategy, (8,), sgd_steps=2)


# --- the argument ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "kwargs", "error", "message"),
    [
        ("psum", {}, TypeError, r"takes a `jdp.Allreduce`, got str \(look one up with `jdp.get_allreduce"),
        (("psum", collectives.psum, "inside"), {}, TypeError, "takes a `jdp.Allreduce`, got tuple"),
        (Allreduce("x", None), {}, TypeError, "`x` has a `fn` that is not callable"),
        (Allreduce("x", collectives.psum, "sideways"), {}, ConfigError, "`x` has `where='sideways'`"),
        (Allreduce("x", collectives.psum), {"device_counts": (0, 2)}, ConfigError, "between 1 and the 8 devices"),
        (Allreduce("x", collectives.psum), {"device_counts": (9,)}, ConfigError, "between 1 and the 8 devices"),
        (Allreduce("x", collectives.psum), {"device_counts": ()}, ConfigError, "between 1 and the 8 devices"),
        (Allreduce("x", collectives.psum), {"sgd_steps": -1}, ConfigError, "`sgd_steps` must be a non-negative"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(strategy, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_allreduce(strategy, **kwargs)
