"""The public API (`jdp.__all__`) as a user meets it: their own model and allreduce through
`jdp.train`, its checkpoints and guards; the README's Python quickstart; `jdp train --plugin`.

Everything here goes through `import jdp` and the names in `jdp.__all__` only.
"""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from doc_code import api_problems
from jax import lax

import jdp

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

LESSON_NAMES = {
    "replicate", "unreplicate", "split_batch", "make_train_step", "make_evaluator", "Allreduce",
    "register_allreduce", "Model", "register_model", "TrainConfig", "train", "load_dataset",
    "simulate_cpu_devices", "JdpError", "ConfigError", "DataError", "DeviceError", "TrainingError",
    "__version__",
}
ERRORS = ("JdpError", "ConfigError", "DataError", "DeviceError", "TrainingError")

BATCH = 128
N_TRAIN = 4 * BATCH  # 4 steps per epoch
N_TEST = 128


# ---------------------------------------------------------------------------------------------
# A user's own models, as plain functions over pytrees.


def mlp_init(key):
    k1, k2 = jax.random.split(key)
    return {
        "hidden": {"w": 0.05 * jax.random.normal(k1, (784, 16)), "b": jnp.zeros(16)},
        "out": {"w": 0.05 * jax.random.normal(k2, (16, 10)), "b": jnp.zeros(10)},
    }


def mlp_logits(params, x):
    h = jax.nn.relu(x @ params["hidden"]["w"] + params["hidden"]["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def mlp_apply(params, images):
    return mlp_logits(params, images.reshape(len(images), -1))


MLP = jdp.Model(mlp_init, jdp.summed_cross_entropy(mlp_apply), mlp_apply, name="mlp")


# Stateful, carried like BatchNorm's statistics: a running mean of the inputs (synchronised over the
# devices with `lax.pmean`, so every replica holds the same state) that centres the inputs, and a
# step counter; the loss returns the new state, gradients never touch it.
MOMENTUM = 0.9


def centred_init(key):
    return {"params": mlp_init(key), "state": {"mean": jnp.zeros(784), "count": jnp.zeros((), jnp.int32)}}


def centred_loss(params, state, images, labels):
    x = images.reshape(len(images), -1)
    mean = MOMENTUM * state["mean"] + (1 - MOMENTUM) * lax.pmean(x.mean(0), jdp.AXIS)
    logits = mlp_logits(params, x - mean)
    loss = jnp.sum(jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(logits, labels[:, None], 1)[:, 0])
    return loss, {"mean": mean, "count": state["count"] + 1}


def centred_apply(variables, images):
    return mlp_logits(variables["params"], images.reshape(len(images), -1) - variables["state"]["mean"])


CENTRED = jdp.Model(centred_init, centred_loss, centred_apply, stateful=True, name="centred_mlp")


# ---------------------------------------------------------------------------------------------
# Helpers.


@pytest.fixture(scope="module")
def data():
    """A small slice of the synthetic data set: 4 steps of 128 per epoch, one 128-image test batch."""
    full = jdp.load_dataset("synthetic")
    return jdp.Dataset(
        jdp.Split(full.train.images[:N_TRAIN], full.train.labels[:N_TRAIN]),
        jdp.Split(full.test.images[:N_TEST], full.test.labels[:N_TEST]),
    )


def config(model, **changes):
    return jdp.TrainConfig(**{"model": model, "batch_size": BATCH, "lr": 0.1, "epochs": 2, **changes})


def assert_trees_bit_identical(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(g, w, err_msg=f"leaf {jax.tree_util.keystr(path)}", strict=True)


def numbers(history):
    """What a resumed run must reproduce exactly (`seconds` is wall time)."""
    return [(r.epoch, r.train_loss, r.test_acc) for r in history]


def checkpoint_steps(directory):
    names = sorted(p.name for p in Path(directory).iterdir())
    steps = []
    for name in names:
        match = re.fullmatch(r"checkpoint-(\d{9})\.msgpack", name)
        assert match, f"unexpected file {name} in the checkpoint directory {directory}"
        steps.append(int(match.group(1)))
    return steps


# ---------------------------------------------------------------------------------------------
# a. The public names.


def test_all_lists_exactly_existing_public_names():
    missing = [name for name in jdp.__all__ if not hasattr(jdp, name)]
    assert not missing, f"jdp.__all__ lists names that `jdp` does not define: {missing}"
    assert len(set(jdp.__all__)) == len(jdp.__all__), "jdp.__all__ lists a name twice"
    assert LESSON_NAMES <= set(jdp.__all__), f"missing from jdp.__all__: {sorted(LESSON_NAMES - set(jdp.__all__))}"
    cli = [name for name in jdp.__all__ if name in ("main", "cli") or "cli" in name.lower()]
    assert not cli, f"the CLI is not part of the Python API, but jdp.__all__ lists {cli}"
    for name in ERRORS:
        assert issubclass(getattr(jdp, name), jdp.JdpError), name
    assert jdp.__version__ == importlib.metadata.version("jdp")


def test_api_doc_mentions_every_public_name():
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"`jdp\.(\w+)", text)) - {"__all__"}  # the list itself is not a public name
    assert not set(jdp.__all__) - documented, (
        f"docs/api.md does not document {sorted(set(jdp.__all__) - documented)}")
    assert not documented - set(jdp.__all__), (
        f"docs/api.md documents names that are not in jdp.__all__: {sorted(documented - set(jdp.__all__))}")


# ---------------------------------------------------------------------------------------------
# b. Your own model through the loop, checkpoints, resume and guards.


@pytest.fixture(scope="module")
def mlp_run(data, tmp_path_factory):
    """The uninterrupted run of the MLP: 2 epochs of 4 steps, psum, a checkpoint every 3 steps."""
    directory = tmp_path_factory.mktemp("mlp-full")
    params, history = jdp.train(config(MLP), data, jax.devices()[:2],
                                checkpoints=jdp.Checkpoints(directory, checkpoint_every=3),
                                guards=jdp.Guards(check_replicas=1))
    return params, history, directory


@pytest.mark.parametrize("moved, replacement", [
    ({"stateful": True}, "pass the `jdp.Model` itself"),
    ({"shard_optimizer": True}, "`jdp.make_sharded_step`"),
    ({"sync": None}, "`jdp.make_local_step(loss, opt, devices)`, `opt` a local `jdp.OptState`"),
])
def test_a_moved_step_argument_names_its_replacement(devices, moved, replacement):
    with pytest.raises(TypeError, match=rf"`make_train_step\({next(iter(moved))}=...\)` is gone: {re.escape(replacement)}"):
        jdp.make_train_step(MLP.loss, jdp.make_optimizer("sgd", 0.1), "psum", devices[:2], **moved)


@pytest.mark.parametrize("moved, group", [
    ("checkpoint_dir", "checkpoints=jdp.Checkpoints"), ("resume", "checkpoints=jdp.Checkpoints"),
    ("on_epoch", "hooks=jdp.Hooks"), ("check_replicas", "guards=jdp.Guards"), ("on_lost", "guards=jdp.Guards")])
def test_a_moved_train_argument_names_its_group(data, devices, moved, group):
    with pytest.raises(TypeError, match=rf"`train\({moved}=...\)` is gone: `{re.escape(group)}\({moved}=...\)`"):
        jdp.train(config(MLP), data, devices[:2], **{moved: None})


def test_the_groups_of_train_arguments_check_their_values(tmp_path):
    with pytest.raises(jdp.ConfigError, match=r"`checkpoint_every` must be a positive number of steps, got 0"):
        jdp.Checkpoints(tmp_path, checkpoint_every=0)
    with pytest.raises(jdp.ConfigError, match=r"`check_replicas` must be a positive number of steps, got 0"):
        jdp.Guards(check_replicas=0)
    with pytest.raises(jdp.ConfigError, match=r"`collective_timeout` must be a positive number of seconds, got -1"):
        jdp.Guards(collective_timeout=-1)


def test_own_model_resumes_mid_run_bit_identically(data, devices, mlp_run, tmp_path):
    want, history, full_dir = mlp_run
    steps_per_epoch, total = N_TRAIN // BATCH, 2 * N_TRAIN // BATCH
    steps = checkpoint_steps(full_dir)
    assert steps[-1] == total and len(steps) >= 2, steps
    mid = steps[0]  # the older checkpoint kept: the "interrupted" run got this far
    assert 0 < mid < total and mid % steps_per_epoch, f"checkpoint at step {mid} is not mid-epoch ({steps})"
    name = f"checkpoint-{mid:09d}.msgpack"
    shutil.copy2(full_dir / name, tmp_path / name)

    epochs_run = []
    got, resumed_history = jdp.train(config(MLP), data, devices[:2],
                                     checkpoints=jdp.Checkpoints(tmp_path, checkpoint_every=3, resume=True),
                                     hooks=jdp.Hooks(on_epoch=lambda r: epochs_run.append(r.epoch)),
                                     guards=jdp.Guards(check_replicas=1))

    resumed_epoch = mid // steps_per_epoch + 1
    assert epochs_run == list(range(resumed_epoch, 3)), epochs_run
    # epochs finished before the checkpoint come from it, wall time included: proof it was resumed
    assert resumed_history[:resumed_epoch - 1] == history[:resumed_epoch - 1]
    assert numbers(resumed_history) == numbers(history)
    assert_trees_bit_identical(got, want)
    assert checkpoint_steps(tmp_path)[-1] == total


def test_guards_stop_own_model_on_nan_loss(data, devices):
    def poisoned(key):
        params = mlp_init(key)
        return {**params, "out": {**params["out"], "b": params["out"]["b"].at[3].set(jnp.nan)}}

    with pytest.raises(jdp.TrainingError, match=r"step 1: the loss is not finite"):
        jdp.train(config(MLP._replace(init=poisoned), epochs=1), data, devices[:2],
                  guards=jdp.Guards(check_replicas=1))


def test_replica_check_catches_own_allreduce_that_diverges(data, devices):
    def uneven(tree, axis_name):  # a sum that leaves a slightly different value on each device
        return jax.tree.map(lambda g: lax.psum(g, axis_name) + 1e-3 * lax.axis_index(axis_name), tree)

    cfg = config(MLP, epochs=1, allreduce=jdp.Allreduce("uneven", uneven))
    with pytest.raises(jdp.TrainingError, match=r"Replicas diverged by step 1"):
        jdp.train(cfg, data, devices[:2], guards=jdp.Guards(check_replicas=1))


# ---------------------------------------------------------------------------------------------
# c. A stateful model: state carried through the step, checked across replicas, checkpointed.


def test_stateful_own_model_trains_and_resumes_bit_identically(data, devices, tmp_path):
    devices = devices[:2]
    steps_per_epoch, total = N_TRAIN // BATCH, 2 * N_TRAIN // BATCH
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"

    # checkpoints at the end of each epoch (no checkpoint_every)
    want, history = jdp.train(config(CENTRED), data, devices, checkpoints=jdp.Checkpoints(full_dir),
                              guards=jdp.Guards(check_replicas=1))
    assert set(want) == {"params", "state"}
    assert int(want["state"]["count"]) == total, "the loss's new state was not carried from step to step"
    assert float(jnp.abs(want["state"]["mean"]).max()) > 0.01
    assert checkpoint_steps(full_dir) == [steps_per_epoch, total]

    # interrupted after epoch 1: continue from its end-of-epoch checkpoint
    resumed_dir.mkdir()
    name = f"checkpoint-{steps_per_epoch:09d}.msgpack"
    shutil.copy2(full_dir / name, resumed_dir / name)
    epochs_run = []
    got, resumed_history = jdp.train(config(CENTRED), data, devices,
                                     checkpoints=jdp.Checkpoints(resumed_dir, resume=True),
                                     hooks=jdp.Hooks(on_epoch=lambda r: epochs_run.append(r.epoch)),
                                     guards=jdp.Guards(check_replicas=1))

    assert epochs_run == [2]
    assert resumed_history[0] == history[0]
    assert numbers(resumed_history) == numbers(history)
    assert_trees_bit_identical(got, want)


# ---------------------------------------------------------------------------------------------
# d. Your own Allreduce object, not registered, passed straight to TrainConfig.


def test_own_allreduce_object_trains_like_psum(data, devices, mlp_run):
    traced = []

    def gather_sum(tree, axis_name):
        traced.append(axis_name)
        return jax.tree.map(lambda g: lax.all_gather(g, axis_name).sum(0), tree)

    mine = jdp.Allreduce("gather_sum_unregistered", gather_sum)
    assert mine.name not in jdp.allreduce_names()
    want, want_history, _ = mlp_run  # the same config with "psum"
    got, got_history = jdp.train(config(MLP, allreduce=mine), data, devices[:2])

    assert traced == [jdp.AXIS], "the strategy passed in was not the one the step used"
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert [r.epoch for r in got_history] == [1, 2]
    for g, w in zip(got_history, want_history):
        assert g.train_loss == pytest.approx(w.train_loss, rel=1e-5)


# ---------------------------------------------------------------------------------------------
# e. The README's Python quickstart, as a user copies it.


def readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Python quickstart\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no `## Python quickstart` section"
    block = re.search(r"^```python\n(.*?)^```", section.group(1), re.S | re.M)
    assert block, "the `## Python quickstart` section of README.md has no ```python block"
    return block.group(1)


def test_readme_python_quickstart_names_only_what_jdp_has():
    assert api_problems(readme_quickstart()) == []


@pytest.mark.slow  # a fresh process that checks a strategy and trains twice; the test above is its fast sibling
def test_readme_python_quickstart_runs(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(readme_quickstart())
    result = subprocess.run([sys.executable, "-W", "error", str(script)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["psum", "gather_sum"], result.stdout
    for line in lines:
        accuracies = ast.literal_eval(line.split(" ", 1)[1])
        assert len(accuracies) == 2 and all(0.0 <= a <= 1.0 for a in accuracies), line


# ---------------------------------------------------------------------------------------------
# f. `jdp train --plugin`: a user's module registers a strategy and a model for the CLI.


def run_jdp(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "jdp", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # a jdp process; fast siblings: `jdp predict --plugin` loads a plugin (tests/test_architecture.py),
# `jdp train --model FILE:FACTORY` trains a model from a user's file in this process (tests/test_adapters.py)
def test_plugin_registers_allreduce_and_model_for_jdp_train(tmp_path):
    result = run_jdp("train", "--plugin", "plugin_example", "--allreduce", "example_gather_sum",
                     "--model", "example_softmax", "--dataset", "synthetic", "--epochs", "1",
                     "--no-progress", "--cpu-devices", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"^epoch +1  train loss \d+\.\d{4}  test acc \d\.\d{4}  ", result.stdout, re.M), result.stdout
    assert re.search(r"^test acc: \d\.\d\d, .* on \[CpuDevice\(id=0\), CpuDevice\(id=1\)\]$",
                     result.stdout, re.M), result.stdout


def test_plugin_that_cannot_be_imported_is_one_line_exit_2(tmp_path):
    result = run_jdp("train", "--plugin", "no_such_module", "--dataset", "synthetic", "--epochs", "1",
                     "--no-progress", "--cpu-devices", "2", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("jdp: error: ") and "no_such_module" in result.stderr, result.stderr
    assert result.stdout == ""
