"""Flax NNX, Flax Linen and Equinox models through jdp (`jdp.from_nnx`, `from_linen`, `from_equinox`):
trained data-parallel with psum and with ring + a sharded optimizer they agree and keep identical
replicas; sync BatchNorm equals one device on the full batch; the dropout key differs per device and
step yet is reproducible and resumes bit-identically; `--model module:factory` loads them from a file."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from adapter_models import LinenMLP, NnxCNN, equinox_mlp, make_equinox_mlp, make_linen_mlp, make_nnx_cnn
from flax import nnx
from reference import small_set

import jdp
from jdp import models
from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.runtime.devices import AXIS
from jdp.training import checkpoint
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig

MODELS = Path(__file__).with_name("adapter_models.py")


RUNS = {"psum": {"allreduce": "psum"}, "ring+sharded": {"allreduce": "ring", "shard_optimizer": True}}


def adapted(library: str, **options) -> jdp.Model:
    if library == "equinox":
        pytest.importorskip("equinox")
    return {"nnx": make_nnx_cnn, "linen": make_linen_mlp, "equinox": make_equinox_mlp}[library](**options)


def config(model, **options) -> TrainConfig:
    return TrainConfig(model=model, **{"epochs": 2, "batch_size": 32, "lr": 0.1, **options})


def max_relative_difference(a, b) -> float:
    a, b = jax.device_get((a, b))
    """The largest |a − b| of any leaf, relative to the largest |b| (a conv bias before BatchNorm has a
    gradient of 0 in exact arithmetic: relative to itself, its rounding would be all there is)."""
    pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    return max(float(np.max(np.abs(x - y))) for x, y in pairs) / max(float(np.max(np.abs(y))) for _, y in pairs)


@pytest.fixture(scope="module")
def runs():
    """(library, run) -> (params, history) of 2 epochs on 2 devices, replicas checked after every step."""
    cache = {}

    def run(library, name):
        if (library, name) not in cache:
            cache[library, name] = jdp.train(config(adapted(library), **RUNS[name]), small_set(128, 64), jax.devices()[:2],
                                             guards=jdp.Guards(check_replicas=1))
        return cache[library, name]

    return run


@pytest.mark.parametrize("library", ["linen", "equinox"])
def test_adapted_model_trains_with_identical_replicas(library, runs):
    params, history = runs(library, "psum")
    assert history[-1].train_loss < history[0].train_loss and history[-1].test_acc > 0.3
    assert set(params) == {"params", "state"} and params["state"]["rng"].dtype == np.uint32


@pytest.mark.slow  # fast sibling: test_adapted_model_trains_with_identical_replicas (each library, psum)
@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_adapted_model_trains_alike_with_psum_and_ring_with_a_sharded_optimizer(library, runs):
    (psum, psum_history), (ring, ring_history) = runs(library, "psum"), runs(library, "ring+sharded")
    assert [r.epoch for r in psum_history] == [1, 2]
    assert psum_history[-1].train_loss < psum_history[0].train_loss and psum_history[-1].test_acc > 0.3  # it learns
    assert set(psum) == {"params", "state"} and psum["state"]["rng"].dtype == np.uint32
    assert max_relative_difference(ring, psum) < 1e-4
    assert [r.test_acc for r in ring_history] == pytest.approx([r.test_acc for r in psum_history], abs=1 / 64)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"allreduce": "manual"}, {"allreduce": "manual_ring"},
                                     {"allreduce": "tree", "backend": "shard_map"},
                                     {"allreduce": "ring", "backend": "shard_map", "shard_optimizer": True},
                                     {"allreduce": "psum", "steps_per_call": 2}],
                         ids=lambda options: "-".join(str(v) for v in options.values()))
def test_adapted_nnx_model_trains_alike_with_every_strategy_and_backend(options, runs):
    """Outside strategies (copies between mapped calls), shard_map's layout and chunked calls carry the state too."""
    want, _ = runs("nnx", "psum")
    got, _ = jdp.train(config(make_nnx_cnn(), **options), small_set(128, 64), jax.devices()[:2],
                       guards=jdp.Guards(check_replicas=1))
    assert max_relative_difference(got, want) < 1e-4


def test_per_replica_batchnorm_keeps_each_devices_statistics_and_trains_with_replicated_params(devices):
    per_replica, sync = make_nnx_cnn(batchnorm="per-replica"), make_nnx_cnn()
    assert per_replica.per_replica_state and not sync.per_replica_state
    variables = jdp.replicate(sync.init(jax.random.key(0)), devices[:2])
    x, y = small_set(128, 64).train.images[:16].reshape(2, 8, 1, 28, 28), small_set(128, 64).train.labels[:16].reshape(2, 8)
    new = {name: jax.pmap(model.loss, axis_name=AXIS, devices=devices[:2])(variables["params"], variables["state"],
                                                                           x, y)[1]["model"]
           for name, model in [("per-replica", per_replica), ("sync", sync)]}
    spread = lambda state: max(float(np.abs(a[0] - a[1]).max()) for a in jax.tree.leaves(state))  # noqa: E731
    assert spread(new["sync"]) == 0 and spread(new["per-replica"]) > 1e-4  # momentum 0.9: 10% of a step
    # params and key stay replicated
    jdp.train(config(per_replica, epochs=1), small_set(128, 64), devices[:2], guards=jdp.Guards(check_replicas=1))


def test_sync_batchnorm_on_two_devices_equals_one_device_on_the_full_batch():
    """With dropout off, the adapted NNX net's step on 2 devices (psum) equals 1 device's on the whole batch."""
    model = jdp.from_nnx(lambda rngs: NnxCNN(rngs, dropout=0.0))
    variables = model.init(jax.random.key(0))
    images, labels = small_set(128, 64).train.images[:16], small_set(128, 64).train.labels[:16]

    def grads(devices, x, y):
        step = jax.pmap(jax.grad(model.loss, has_aux=True), axis_name=AXIS, devices=devices)
        k = len(devices)
        both = jdp.replicate(variables, devices)
        g, state = step(both["params"], both["state"], x.reshape(k, -1, *x.shape[1:]), y.reshape(k, -1))
        return jax.tree.map(lambda a: a.sum(0), g), jdp.unreplicate(state)["model"]

    one, one_state = grads(jax.devices()[:1], images, labels)
    two, two_state = grads(jax.devices()[:2], images, labels)
    assert max_relative_difference(two, one) < 1e-4
    assert max_relative_difference(two_state, one_state) < 1e-5


@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_dropout_key_differs_per_device_and_step_and_is_reproducible(library):
    """The same images on 2 devices, the same state: each device drops other units; the next step others again."""
    model = adapted(library)
    variables = model.init(jax.random.key(0))
    devices = jax.devices()[:2]
    losses = jax.pmap(model.loss, axis_name=AXIS, devices=devices)
    x = np.broadcast_to(small_set(128, 64).train.images[:8], (2, 8, 1, 28, 28))
    y = np.broadcast_to(small_set(128, 64).train.labels[:8], (2, 8))
    both = jdp.replicate(variables, devices)
    first, state = losses(both["params"], both["state"], x, y)
    again, _ = losses(both["params"], both["state"], x, y)
    second, _ = losses(both["params"], state, x, y)
    assert first[0] != first[1], "both devices drew the same dropout masks"
    np.testing.assert_array_equal(first, again)  # reproducible from the state
    assert not np.any(np.asarray(second) == np.asarray(first)), "the key did not advance with the step"
    assert np.array_equal(*np.asarray(state["rng"]))  # the carried key is the same on every device
    logits = jax.jit(model.apply)(variables, small_set(128, 64).test.images[:8])
    np.testing.assert_array_equal(logits, jax.jit(model.apply)(variables, small_set(128, 64).test.images[:8]))  # no dropout


def test_resumed_mid_epoch_equals_uninterrupted_bit_for_bit(tmp_path, devices):
    """NNX with BatchNorm and dropout: a run stopped at step 6 of 8 and resumed ends with the same bits."""
    cfg = config(make_nnx_cnn())
    whole, _ = jdp.train(cfg, small_set(128, 64), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "whole", checkpoint_every=3))
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for later in checkpoint.list_checkpoints(tmp_path / "resumed")[:-1]:  # keep step 6's checkpoint only
        later.unlink()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "resumed")] == ["checkpoint-000000006.msgpack"]
    resumed, _ = jdp.train(cfg, small_set(128, 64), devices[:2], checkpoints=jdp.Checkpoints(tmp_path / "resumed", resume=True))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_nnx_variables_outside_the_trainable_filter_are_carried_unchanged(devices):
    """Fine-tuning the output layer only: the conv's params ride in the state, untouched by the update."""
    model = jdp.from_nnx(lambda rngs: NnxCNN(rngs), trainable=nnx.All(nnx.Param, nnx.PathContains("out")))
    init = model.init(jax.random.key(0))
    assert set(init["params"]) == {"out"} and {"conv", "bn"} <= set(init["state"]["model"])
    optimizer = optax.sgd(0.1)
    step = jdp.make_train_step(model, optimizer, "psum", devices[:2])
    variables = jdp.replicate(init, devices[:2])
    opt_state = jdp.replicate(optimizer.init(init["params"]), devices[:2])
    variables, _, _ = step(variables, opt_state, *jdp.split_batch(small_set(128, 64).train.images[:16], small_set(128, 64).train.labels[:16],
                                                                   devices[:2]))
    got = jdp.unreplicate(variables)
    np.testing.assert_array_equal(got["state"]["model"]["conv"]["kernel"], init["state"]["model"]["conv"]["kernel"])
    assert not np.array_equal(got["params"]["out"]["kernel"], init["params"]["out"]["kernel"])
    assert not np.array_equal(got["state"]["model"]["bn"]["mean"], init["state"]["model"]["bn"]["mean"])


def test_loss_given_by_the_user_replaces_the_default():
    calls = []

    def hinge(logits, labels):
        calls.append(logits.shape)
        return jnp.maximum(0, 1 - logits[jnp.arange(len(labels)), labels]).sum()

    model = jdp.from_linen(LinenMLP(dropout=0.0), loss=hinge)
    variables = model.init(jax.random.key(0))
    loss = jax.pmap(model.loss, axis_name=AXIS, devices=jax.devices()[:1])
    both = jdp.replicate(variables, jax.devices()[:1])
    value, _ = loss(both["params"], both["state"], small_set(128, 64).train.images[None, :4], small_set(128, 64).train.labels[None, :4])
    logits = model.apply(variables, small_set(128, 64).train.images[:4])  # BatchNorm in inference mode differs from training
    assert calls == [(4, 10)] and float(value[0]) != pytest.approx(float(models.adapters.summed_softmax_cross_entropy(
        logits, small_set(128, 64).train.labels[:4])))


def test_integer_state_passes_through_the_per_replica_average(devices):
    state = {"params": jnp.zeros((2, 3)), "state": {"mean": jnp.array([[1.0], [3.0]]),
                                                    "rng": jnp.full((2, 2), 2**31 + 5, jnp.uint32)}}
    got = jax.pmap(models.average_state, axis_name=AXIS, devices=devices[:2])(state)
    np.testing.assert_array_equal(got["state"]["mean"], [[2.0], [2.0]])
    np.testing.assert_array_equal(got["state"]["rng"], state["state"]["rng"])  # a psum would overflow


def test_bad_models_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"`make` of `from_nnx` must be a function .* got `NnxCNN`"):
        jdp.from_nnx(NnxCNN(nnx.Rngs(0)))
    with pytest.raises(ConfigError, match=r"`batchnorm` must be one of sync, per-replica, got `global`"):
        jdp.from_nnx(lambda rngs: NnxCNN(rngs), batchnorm="global")
    with pytest.raises(ConfigError, match=r"`module` of `from_linen` must be a `flax.linen.Module`"):
        jdp.from_linen(lambda x: x)

    import flax.linen as nn

    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.BatchNorm(use_running_average=not train, axis_name=AXIS)(x.reshape(len(x), -1))
            return nn.Dense(10)(nn.BatchNorm(use_running_average=not train)(x))

    with pytest.raises(ConfigError, match=r"BatchNorms of `Mixed` normalise over axes \['None', 'data'\]"):
        jdp.from_linen(Mixed())


def test_equinox_batchnorm_is_refused():
    eqx = pytest.importorskip("equinox")
    with pytest.raises(ConfigError, match=r"holds Equinox state .* use `from_nnx` or `from_linen`"):
        jdp.from_equinox(lambda key: eqx.nn.BatchNorm(8, axis_name="batch", mode="batch"))
    with pytest.raises(ConfigError, match=r"`make` of `from_equinox` must be a function"):
        jdp.from_equinox(equinox_mlp(jax.random.key(0)))


# ---- `jdp train --model module:factory` ----------------------------------------------------------

def test_model_from_a_file_trains_from_the_command_line(capsys, tmp_path):
    assert cli.main(["train", "--devices", "2", "--model", f"{MODELS}:make_nnx_cnn", "--batchnorm", "per-replica",
                     "--dataset", "synthetic", "--epochs", "1", "--batch-size", "256", "--check-replicas", "2",
                     "--no-progress", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "epoch   1" in out and "test acc" in out
    assert models.get(f"{MODELS}:make_nnx_cnn", batchnorm="per-replica").per_replica_state


@pytest.mark.parametrize("spec,message", [
    ("no_such_module_here:make", r"`--model no_such_module_here:make`: `no_such_module_here` cannot be imported "
                                 r"\(No module named 'no_such_module_here'\)"),
    ("{dir}/missing.py:make", r"there is no file `.*missing.py`"),
    ("{models}:make_cnn", r"adapter_models.py` has no function `make_cnn`; it defines .*make_nnx_cnn"),
    ("{models}:not_a_model", r"`not_a_model\(\)` returned a `NnxCNN`, not a `jdp.Model`; wrap the network with "
                             r"`jdp.from_nnx`"),
])
def test_model_factory_errors_name_the_problem(spec, message, capsys, tmp_path):
    spec = spec.format(dir=tmp_path, models=MODELS)
    assert cli.main(["train", "--devices", "2", "--model", spec, "--dataset", "synthetic", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jdp: error: ") and len(err.strip().splitlines()) == 1
    assert __import__("re").search(message, err), err


def test_batchnorm_reaches_only_a_factory_that_takes_it(capsys):
    assert cli.main(["train", "--devices", "2", "--model", f"{MODELS}:make_linen_mlp", "--batchnorm", "sync",
                     "--dataset", "synthetic"]) == 2
    assert "`make_linen_mlp` has no parameter batchnorm to receive `--batchnorm sync`; add one or drop " \
           "`--batchnorm`." in capsys.readouterr().err


# ---- kill and resume, a real process ------------------------------------------------------------

FLAGS = ["--dataset", "synthetic", "--epochs", "2", "--batch-size", "64", "--lr", "0.1", "--no-progress",
         "--checkpoint-every", "3", "--no-xla-flags", "--model", f"{MODELS}:make_nnx_cnn",
         "--allreduce", "ring", "--shard-optimizer", "--optimizer", "momentum"]  # 32 steps per epoch


@pytest.mark.slow
def test_killed_and_resumed_nnx_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, capsys):
    """SIGKILL `jdp train --model adapter_models.py:make_nnx_cnn` (BatchNorm, dropout) mid-epoch 2 and
    `--resume` it: params, BatchNorm statistics, dropout key and sharded momentum end bit-identical."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    target = checkpoint_target(TrainConfig(model=f"{MODELS}:make_nnx_cnn", lr=0.1, optimizer="momentum",
                                           allreduce="ring", shard_optimizer=True))
    proc = subprocess.Popen([sys.executable, "-m", "jdp", "train", "--cpu-devices", "8", "--devices", "2", *FLAGS,
                             "--checkpoint-dir", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    deadline = time.monotonic() + 600
    while not any(int(p.name[11:20]) >= 36 for p in killed.glob("checkpoint-*.msgpack")):  # in epoch 2
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    interrupted = checkpoint.restore_latest(killed, target)
    assert 36 <= interrupted.step < 64

    assert cli.main(["train", "--devices", "2", *FLAGS, "--checkpoint-dir", str(killed), "--resume"]) == 0
    assert f"resuming from {interrupted.path}" in capsys.readouterr().err
    assert cli.main(["train", "--devices", "2", *FLAGS, "--checkpoint-dir", str(whole)]) == 0
    a, b = checkpoint.restore_latest(whole, target), checkpoint.restore_latest(killed, target)
    assert a.step == b.step == 64
    for x, y in zip(jax.tree.leaves(a.arrays), jax.tree.leaves(b.arrays), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
