import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import sgd

import jdp
from jdp import data
from jdp.cli import main as cli
from jdp.errors import TrainingError
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel import tally
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import replicate, split_batch
from jdp.parallel.step import make_train_step
from jdp.training import checkpoint, guards
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig
from jdp.training.loop import train

LOSSES = np.ones(8, np.float32)


def params_with(name=None, value=None):
    params = lenet.init(jax.random.key(0))
    if name is not None:
        params[name] = params[name].at[0].set(value)
    return params


def tallied(losses, params, devices, step=0):
    """A tally after one call that ran `losses.shape[1:]` steps from `step` and left `params` (replicated), the
    params it was given unknown (a step that donates them): every leaf is checked."""
    leaves = len(jax.tree.leaves(params))
    start = tally.place_tally(tally.start(step, [0.0] * len(devices), leaves), devices, "pmap")
    return tally.read_local(tally.make_fold(devices, "pmap")(start, None, replicate(params, devices),
                                                             jnp.asarray(losses)))


def test_finite_values_pass(devices):
    guards.check_finite(tallied(LOSSES[:2], params_with(), devices[:2]), guards.leaf_names(params_with()), None)


def test_non_finite_loss_names_the_step_and_the_checkpoint(tmp_path, devices):
    found = tallied([1.0, np.nan], params_with(), devices[:2], step=6)
    with pytest.raises(TrainingError, match=r"Stopped at step 7: the loss is not finite .* last good checkpoint .* is "
                                            r".*ckpt.*`resume=True`"):
        guards.check_finite(found, guards.leaf_names(params_with()), last_good=tmp_path / "ckpt")


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_params_name_the_leaf(value, devices):
    params = params_with("W3", value)
    with pytest.raises(TrainingError, match=r"step 2: its update made the parameters \['W3'\] non-finite.*"
                                            r"No checkpoint was saved"):
        guards.check_finite(tallied(LOSSES[:2], params, devices[:2], step=1), guards.leaf_names(params), None)


def test_a_call_of_several_steps_is_named_by_its_range(devices):
    losses = np.ones((2, 4), np.float32)
    losses[1, 2] = np.nan
    with pytest.raises(TrainingError, match=r"Stopped at steps 9–12 \(one compiled call\): the loss is not finite"):
        guards.check_finite(tallied(losses, params_with(), devices[:2], step=8), guards.leaf_names(params_with()), None)


def test_the_tally_keeps_the_first_non_finite_call(devices):
    """Later calls (finite again, or non-finite elsewhere) do not hide where it went wrong first."""
    devices = devices[:2]
    fold, params = tally.make_fold(devices, "pmap"), params_with()
    counted = tally.place_tally(tally.start(0, [0.0, 0.0], len(params)), devices, "pmap")
    for losses, bad_leaf in (([1.0, 1.0], None), ([1.0, 1.0], "b2"), ([np.nan, 1.0], "W3"), ([1.0, 1.0], None)):
        counted = fold(counted, None, replicate(params_with(bad_leaf, np.nan), devices), jnp.asarray(losses))
    host = tally.read_local(counted)
    np.testing.assert_array_equal(host.step, [4, 4])
    np.testing.assert_array_equal(host.bad_from, [2, 2])
    np.testing.assert_allclose(host.loss, [np.nan, 4.0])
    with pytest.raises(TrainingError, match=r"step 2: its update made the parameters \['b2'\] non-finite"):
        guards.check_finite(host, guards.leaf_names(params), None)


def test_a_call_given_its_params_checks_them_only_when_a_loss_is_not_finite(devices):
    """Params an update made non-finite (call 2: steps 3–4) make the next call's loss non-finite; that call
    names call 2 and the leaf. Until then only losses are checked. A loss non-finite by itself names its own call."""
    devices, good, bad = devices[:2], params_with(), params_with("W3", np.nan)
    fold, names = tally.make_fold(devices, "pmap"), guards.leaf_names(good)
    counted = tally.place_tally(tally.start(0, [0.0, 0.0], len(good)), devices, "pmap")
    two_steps = jnp.ones((2, 2))
    for entered, left, losses in ((good, good, two_steps), (good, bad, two_steps)):
        counted = fold(counted, replicate(entered, devices), replicate(left, devices), losses)
    guards.check_finite(tally.read_local(counted), names, None)  # W3 is not looked at yet
    after_bad = fold(counted, replicate(bad, devices), replicate(bad, devices), two_steps.at[0, 1].set(np.nan))
    with pytest.raises(TrainingError, match=r"Stopped at steps 3–4 \(one compiled call\): its update made the "
                                            r"parameters \['W3'\] non-finite"):
        guards.check_finite(tally.read_local(after_bad), names, None)
    own = fold(counted, replicate(good, devices), replicate(bad, devices), two_steps.at[1, 0].set(np.inf))
    with pytest.raises(TrainingError, match=r"Stopped at steps 5–6 \(one compiled call\): the loss is not finite"):
        guards.check_finite(tally.read_local(own), names, None)


def test_a_flush_checks_the_params_themselves(devices):
    """Params that went non-finite without a non-finite loss are caught before a checkpoint or an epoch's end."""
    devices = devices[:2]
    good, bad = replicate(params_with(), devices), replicate(params_with("b2", np.inf), devices)
    fold, watch = tally.make_fold(devices, "pmap"), guards.Watch(params_with())
    counted = tally.place_tally(tally.start(0, [0.0, 0.0], len(good)), devices, "pmap")
    for last, left in ((4, good), (8, good), (12, bad)):
        counted = fold(counted, good, left, jnp.ones((2, 4)))  # finite losses: the tally sees nothing
        watch.after_call(last - 3, last, left, None, counted)
        if last == 8:
            watch.flush(good)
    with pytest.raises(TrainingError, match=r"Stopped at steps 9–12 \(since the parameters were last checked\): its "
                                            r"update made the parameters \['b2'\] non-finite"):
        watch.flush(bad)


def watched(devices, nan_at, steps=40, **options):
    """A Watch over `steps` one-step calls, step `nan_at`'s loss NaN: (the watch, the step it raised at or None)."""
    params = params_with()
    fold, placed = tally.make_fold(devices, "pmap"), replicate(params, devices)
    now = [0.0]
    watch = guards.Watch(params, read=guards.Cadence(**options, clock=lambda: now[0]))
    counted = tally.place_tally(tally.start(0, [0.0, 0.0], len(params)), devices, "pmap")
    for step in range(1, steps + 1):
        now[0] += 0.25 if step <= 20 else 1.0  # 4 steps a second, then one a second
        counted = fold(counted, placed, placed, jnp.asarray([np.nan, 1.0] if step == nan_at else [1.0, 1.0]))
        try:
            watch.after_call(step, step, placed, None, counted)
        except TrainingError as e:
            assert f"Stopped at step {nan_at}:" in str(e)
            return watch, step
    return watch, None


def test_the_watch_reads_a_tally_rarely_lagged_and_always_when_flushed(devices):
    """At most one read per `every_steps` steps and `every_seconds` seconds, of the tally `lag` calls old: reads
    after steps 8 (tally of step 6), 14 (12: 8 steps on, and 1 s after the last read), 20, 26, 32 and 38."""
    options = {"every_steps": 8, "every_seconds": 1.0, "lag": 2}
    watch, raised_at = watched(devices[:2], nan_at=37, **options)
    assert watch.reads == 6 and raised_at is None  # step 37's NaN is in no tally read yet
    with pytest.raises(TrainingError, match="Stopped at step 37"):
        watch.flush()
    assert watch.reads == 7
    assert watched(devices[:2], nan_at=11, **options)[1] == 14  # read at step 14 with step 12's tally
    watch, raised_at = watched(devices[:2], nan_at=99, every_steps=1000, every_seconds=1e9)
    assert watch.reads == 0 and raised_at is None


def test_identical_replicas_pass(devices):
    guards.check_replicas({"params": replicate(params_with(), devices)}, step=5)


def corrupt(array: jax.Array, device_index: int, delta: float | None = None) -> jax.Array:
    """The same global array, except that one device's copy has its first value nudged (by one ulp or `delta`)."""
    shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
    bufs = []
    for i, shard in enumerate(shards):
        data = np.asarray(shard.data).copy()
        if i == device_index:
            flat = data.reshape(-1)
            flat[0] = np.nextafter(flat[0], np.float32(np.inf)) if delta is None else flat[0] + delta
        bufs.append(jax.device_put(data, shard.device))
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, bufs)


@pytest.mark.parametrize("device_index", [3, 0])
def test_one_corrupted_replica_is_named_with_its_leaf(devices, device_index):
    params = replicate(params_with(), devices)
    params["W2"] = corrupt(params["W2"], device_index)
    with pytest.raises(TrainingError, match=rf"by step 9: `\['params'\]\['W2'\]` on CpuDevice\(id={device_index}\) "
                                            r"differs from the copy that 7 of 8 devices hold.*1 of 25000 values"):
        guards.check_replicas({"params": params}, step=9)


# ---- the guards in the training loop --------------------------------------------------------------

def test_absurd_lr_stops_with_the_step_and_the_last_good_checkpoint(tmp_path, capsys):
    args = ["train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "64", "--no-progress",
            "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    assert cli.main([*args, "--lr", "1e30"]) == 2
    err = capsys.readouterr().err.strip()
    match = re.fullmatch(r"jdp: error: Stopped at step (\d+): (.*)\. The last good checkpoint \(all values finite\) "
                         r"is (\S+): lower `--lr` and rerun, or continue from it with `--resume`\.", err)
    assert match, err
    stopped, last_good = int(match.group(1)), checkpoint.load(match.group(3), checkpoint_target(TrainConfig(lr=1e30)))
    assert last_good.step == stopped - 1
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(last_good.arrays))
    assert checkpoint.list_checkpoints(tmp_path)[0] == last_good.path  # nothing non-finite was saved


def broken_allreduce(device_index: int) -> allreduce.Allreduce:
    """The lesson's allreduce with a bug: device `device_index` receives a wrong sum for `b4`."""
    def fn(tree):
        total = allreduce.get("manual").fn(tree)
        return {**total, "b4": corrupt(total["b4"], device_index, delta=1.0)}

    return allreduce.Allreduce("broken", fn, "outside")


def test_check_replicas_stops_a_run_whose_replicas_diverge(devices, monkeypatch):
    monkeypatch.setitem(allreduce._STRATEGIES, "broken", broken_allreduce(5))
    dataset = data.synthetic(jax.random.key(0), n_train=64, n_test=8)
    config = TrainConfig(batch_size=8, lr=0.1, epochs=1, allreduce="broken")
    with pytest.raises(TrainingError, match=r"Replicas diverged by step 3: `\['params'\]\['b4'\]` on CpuDevice\(id=5\) "
                                            r"differs from the copy that 7 of 8 devices hold"):
        train(config, dataset, devices, guards=jdp.Guards(check_replicas=3))
    train(dataclasses.replace(config, allreduce="manual"), dataset, devices, guards=jdp.Guards(check_replicas=1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(allreduce.names()))
def test_two_thousand_steps_on_eight_devices_finish(name, devices):
    """Steps are dispatched asynchronously; unbounded, collectives pile up and freeze XLA's CPU rendezvous
    (JAX <= 0.11 on 2 cores). With the loop's window of in-flight steps, 2,000 steps of every strategy finish.
    A one-leaf linear model keeps each step to its dispatch and its allreduce."""
    def loss(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ params["w"], y).sum()

    optimizer = sgd(0.01)
    params = {"w": jnp.zeros((4, 3))}
    p, s = replicate(params, devices), replicate(optimizer.init(params), devices)
    step = make_train_step(loss, optimizer, allreduce.get(name), devices)
    x, y = split_batch(np.random.default_rng(0).random((8, 4), np.float32), np.arange(8) % 3, devices)
    window = InFlight(limit=2)
    for _ in range(2000):
        p, s, losses = step(p, s, x, y)
        window.push(losses)
    window.drain()
    guards.check_replicas({"params": p, "opt_state": s}, step=2000)
    assert np.isfinite(np.asarray(losses)).all()
