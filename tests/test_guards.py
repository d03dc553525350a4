import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import sgd

from jdp import data
from jdp.cli import main as cli
from jdp.errors import TrainingError
from jdp.models import lenet
from jdp.parallel import allreduce
from jdp.parallel.inflight import InFlight
from jdp.parallel.layout import replicate, split_batch
from jdp.parallel.step import make_train_step
from jdp.training import checkpoint, guards
from jdp.training.config import TrainConfig, checkpoint_target
from jdp.training.loop import train

LOSSES = np.ones(8, np.float32)


def params_with(name=None, value=None):
    params = lenet.init(jax.random.key(0))
    if name is not None:
        params[name] = params[name].at[0].set(value)
    return params


def test_finite_flags_pass_finite_values():
    flags = guards.finite_flags(jnp.asarray(LOSSES), params_with())
    guards.check_finite(flags, guards.leaf_names(params_with()), step=3, last_good=None)


def test_non_finite_loss_names_the_step_and_the_checkpoint(tmp_path):
    flags = guards.finite_flags(jnp.asarray([1.0, np.nan]), params_with())
    with pytest.raises(TrainingError, match=r"Stopped at step 7: the loss is not finite .* last good checkpoint .* is "
                                            r".*ckpt.*`resume=True`"):
        guards.check_finite(flags, guards.leaf_names(params_with()), step=7, last_good=tmp_path / "ckpt")


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_params_name_the_leaf(value):
    params = params_with("W3", value)
    flags = guards.finite_flags(jnp.asarray(LOSSES), params)
    with pytest.raises(TrainingError, match=r"step 2: its update made the parameters \['W3'\] non-finite.*"
                                            r"No checkpoint was saved"):
        guards.check_finite(flags, guards.leaf_names(params), step=2, last_good=None)


def test_finite_flags_read_replicated_arrays(devices):
    """The flags are computed where the (k, ...) replicas live, whatever their sharding."""
    params = replicate(params_with("b2", np.nan), devices)
    flags = guards.finite_flags(replicate(np.float32(1.0), devices), params)
    assert [bool(np.asarray(f).all()) for f in flags] == [True] + [name != "b2" for name in sorted(lenet.SHAPES)]


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
        train(config, dataset, devices, check_replicas=3)
    train(dataclasses.replace(config, allreduce="manual"), dataset, devices, check_replicas=1)


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
