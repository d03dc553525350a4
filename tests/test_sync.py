"""Local SGD and DiLoCo (`jdp.parallel.sync`): exactness against every-step training, bit-identical replicas
after every sync with every strategy, the state they add (checkpoints, resume), bytes, and bad settings."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from reference import small_set

import jdp
from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.parallel import layout
from jdp.parallel.layout import fetch
from jdp.parallel.step import make_local_step
from jdp.parallel.sync import DiLoCo, Sync
from jdp.parallel.sync import get as get_sync
from jdp.training import checkpoint, resume
from jdp.training.build import checkpoint_target, opt_state_of
from jdp.training.config import TrainConfig
from jdp.training.loop import train


BASE = TrainConfig(batch_size=32, lr=0.1, epochs=1, seed=0)  # 8 steps


def run(devices, k=4, **settings):
    return train(dataclasses.replace(BASE, **settings), small_set(256), devices[:k], guards=jdp.Guards(check_replicas=1))


def max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def assert_bit_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@pytest.fixture(scope="module")
def every_step():
    """8 steps of the lesson's training on 4 devices: what every exactness test compares with."""
    return train(BASE, small_set(256), jax.devices()[:4])


# ---- exactness: the local modes reduce to every-step training ------------------------------------

@pytest.mark.parametrize("settings", [
    {"sync": get_sync("local-sgd", 1)},
    pytest.param({"sync": get_sync("local-sgd", 1), "backend": "shard_map"}, marks=pytest.mark.slow),
    # an outside strategy: copies between calls
    pytest.param({"sync": get_sync("local-sgd", 1), "allreduce": "manual"}, marks=pytest.mark.slow),
    {"sync": DiLoCo(every=1, outer_optimizer="sgd", outer_lr=1.0)},
    pytest.param({"sync": DiLoCo(every=1, outer_optimizer="sgd", outer_lr=1.0), "allreduce": "ring"},
                 marks=pytest.mark.slow),
], ids=lambda s: "-".join(str(getattr(v, "name", v)) for v in s.values()))
def test_h1_equals_every_step_training_up_to_rounding(settings, every_step, devices):
    """H = 1 with plain SGD: the mean of k updates on B/k rows each is the update on the full batch
    (local SGD); with an outer SGD at lr 1 and no momentum, θ − mean(θ − θᵢ) is that mean (DiLoCo)."""
    params, history = run(devices, **settings)
    assert max_difference(params, every_step[0]) < 1e-6  # rounding only: a real difference is ~1e-2 here
    assert history[0].train_loss == pytest.approx(every_step[1][0].train_loss, rel=1e-6)
    assert history[0].syncs == 8


def test_a_wrong_average_is_caught(every_step, devices):
    """The exactness test can fail: H = 2 is a different algorithm, far from every-step training."""
    params, _ = run(devices, sync=get_sync("local-sgd", 2))
    assert max_difference(params, every_step[0]) > 1e-4


@pytest.mark.parametrize("settings", [
    {"sync": get_sync("local-sgd", 4)},
    pytest.param({"sync": get_sync("local-sgd", 3), "backend": "shard_map"}, marks=pytest.mark.slow),
], ids=["pmap", "shard_map"])
def test_h_above_1_on_one_device_is_plain_training_bit_for_bit(settings, devices):
    plain, _ = run(devices, k=1)
    local, _ = run(devices, k=1, **settings)
    assert_bit_identical(plain, local)


@pytest.mark.slow
def test_diloco_on_one_device_with_outer_sgd_lr_1_is_plain_training(devices):
    plain, _ = run(devices, k=1)
    diloco, _ = run(devices, k=1, sync=DiLoCo(every=4, outer_optimizer="sgd", outer_lr=1.0))
    assert max_difference(plain, diloco) < 1e-6  # θ − (θ − θ₁) rounds


# ---- replicas: different between syncs, identical after each ------------------------------------

@pytest.mark.parametrize("settings", [
    {"sync": "diloco"},
    *(pytest.param(s, marks=pytest.mark.slow) for s in (
        {"sync": "diloco", "allreduce": "ring+bfloat16-wire"},  # rounds on the wire, on its owner
        {"sync": "local-sgd"}, {"sync": "local-sgd", "allreduce": "tree"},
        {"sync": "diloco", "allreduce": "manual_ring"}, {"sync": "diloco", "allreduce": "psum+bfloat16"},
        {"sync": "diloco", "allreduce": "psum+powersgd1"}, {"sync": "local-sgd", "allreduce": "ring+fused"},
        {"sync": "diloco", "backend": "shard_map"})),
], ids=lambda s: "-".join(str(v) for v in s.values()))
def test_every_strategy_leaves_the_replicas_bit_identical_at_each_sync(settings, devices):
    """`check_replicas=1` compares every device's params (and DiLoCo's outer state) at each sync: H = 3 on 8
    steps syncs after steps 3, 6 and 8 (the run's last step always syncs)."""
    params, history = run(devices, **{**settings, "sync": get_sync(settings["sync"], 3)})
    assert history[0].syncs == 3
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_replicas_differ_between_syncs(devices):
    """Each device steps on its own shard: after step 2 of H = 4 the params differ from device to device."""
    k, config = 4, dataclasses.replace(BASE, sync=get_sync("local-sgd", 4))
    model = config.build_model()
    params = model.init(jax.random.key(0))
    opt = opt_state_of(config, params, k)
    own_step = make_local_step(model, opt, devices[:k])
    state = (layout.place(jax.tree.map(lambda x: np.broadcast_to(x, (k, *x.shape)), params), "per_device",
                          devices[:k]), opt.place(opt.init(params, jax.random.key(0)), devices[:k], "pmap"))
    x, y = layout.split_batch(small_set(256).train.images[:32], small_set(256).train.labels[:32], devices[:k])
    for _ in range(2):
        state = own_step(*state, x, y)[:2]
    rows = fetch(state[0], "per_device")["W1"]
    assert len({rows[i].tobytes() for i in range(k)}) == k


# ---- state: DiLoCo's outer part, checkpoints and resume ------------------------------------------

def test_diloco_keeps_theta_and_the_outer_momentum_in_the_optimizer_state():
    config = dataclasses.replace(BASE, sync=DiLoCo(every=4))
    target = checkpoint_target(config, device_count=3)
    assert set(target["opt_state"]) == {"optimizer", "outer"}
    theta, rows = target["opt_state"]["outer"]["params"], target["params"]
    assert jax.tree.map(np.shape, theta) == jax.tree.map(lambda x: np.shape(x)[1:], rows)  # θ: one copy
    assert all(np.shape(x)[0] == 3 for x in jax.tree.leaves(rows))  # the devices' params: one row each
    trace = jax.tree.leaves(target["opt_state"]["outer"]["optimizer"])  # Nesterov's momentum: θ's size
    assert sum(np.size(t) for t in trace) == sum(np.size(p) for p in jax.tree.leaves(theta))


def test_diloco_resumed_mid_interval_ends_bit_identical(tmp_path, devices):
    """A checkpoint at step 6 of H = 4 (mid-interval: devices hold different params and momentum) resumes
    to the same final params and history as an uninterrupted run, bit for bit."""
    config = dataclasses.replace(BASE, sync=DiLoCo(every=4), optimizer="momentum", lr=0.05)
    whole, whole_history = train(dataclasses.replace(config, epochs=2), small_set(256), devices[:4])
    train(config, small_set(256), devices[:4], checkpoints=jdp.Checkpoints(tmp_path, checkpoint_every=3))  # saves at 3, 6, 8
    newest = checkpoint.list_checkpoints(tmp_path)[0]
    assert newest.name == "checkpoint-000000008.msgpack"
    newest.unlink()  # as if killed after step 6's save
    resumed, history = train(dataclasses.replace(config, epochs=2), small_set(256), devices[:4],
                             checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert_bit_identical(whole, resumed)
    assert [dataclasses.replace(r, seconds=0) for r in history] == \
        [dataclasses.replace(r, seconds=0) for r in whole_history]
    saved = checkpoint.restore_latest(tmp_path, checkpoint_target(dataclasses.replace(config, epochs=2), 4))
    assert saved.step == 16 and saved.arrays["params"]["W1"].shape[0] == 4


def test_a_local_mode_resumes_only_on_the_same_device_count(tmp_path, devices):
    config = dataclasses.replace(BASE, sync=get_sync("local-sgd", 4))
    train(config, small_set(256), devices[:4], checkpoints=jdp.Checkpoints(tmp_path))
    with pytest.raises(ConfigError, match="for each of 4 devices; this run has 2. Resume on 4 devices"):
        train(dataclasses.replace(config, epochs=2), small_set(256), devices[:2],
              checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    with pytest.raises(ConfigError, match="This run has `sync=every-step` but the checkpoint has `sync=local-sgd`"):
        train(dataclasses.replace(BASE, epochs=2), small_set(256), devices[:4],
              checkpoints=jdp.Checkpoints(tmp_path, resume=True))


# ---- bytes in history.json ----------------------------------------------------------------------

@pytest.mark.slow  # two CLI runs; fast siblings: test_sync_settings_default_and_check, test_tensorboard_counts_bytes_per_sync
def test_history_records_bytes_per_step_per_sync_and_sent(tmp_path):
    flags = ["train", "--devices", "4", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128",
             "--no-progress", "--no-xla-flags"]  # 16 steps
    assert cli.main([*flags, "--out", str(tmp_path / "every")]) == 0
    assert cli.main([*flags, "--sync", "local-sgd", "--sync-every", "5", "--out", str(tmp_path / "local")]) == 0
    every, local = (json.loads((tmp_path / name / "history.json").read_text()) for name in ("every", "local"))
    payload = every["bytes_per_sync"]
    assert payload == local["bytes_per_sync"] == every["allreduce_payload_bytes"]  # the params: the gradients' size
    assert every["bytes_per_step"] == payload and every["epochs"][0]["bytes_sent"] == 16 * payload
    assert local["epochs"][0]["syncs"] == 4  # after steps 5, 10, 15 and the last, 16
    assert local["epochs"][0]["bytes_sent"] == 4 * payload and local["bytes_per_step"] == 4 * payload / 16
    assert cli.main(["compare", str(tmp_path / "every"), str(tmp_path / "local"), "--out", str(tmp_path)]) == 0
    table = (tmp_path / "compare.md").read_text()
    assert f"| {payload * 4 / 16:.0f} | {4 * payload / 2**20:.1f} |" in table


# ---- settings ------------------------------------------------------------------------------------

def test_sync_settings_default_and_check():
    assert get_sync("every-step", None) == Sync("every-step", 1)
    assert get_sync("local-sgd", None).every == 16
    diloco = get_sync("diloco", 8)
    assert diloco.every == 8 and diloco.init is not None  # θ and the outer momentum
    every_8 = get_sync("local-sgd", 8)
    assert every_8.due(8, 100) and not every_8.due(9, 100) and every_8.due(100, 100)  # and the run's last step
    assert every_8.syncs(100, 100) == 13 and get_sync("every-step", None).syncs(7, 10) == 7


@pytest.mark.parametrize("settings, message", [
    ({"sync": "sometimes"}, "Unknown `sync=sometimes`; choose one of: every-step, local-sgd, diloco"),
    ({"sync": "local-sgd", "shard_optimizer": True}, "`shard_optimizer=True` keeps one slice"),
    ({"sync": "diloco", "steps_per_call": 4}, "`steps_per_call=4` runs several steps in one call"),
    ({"sync": "local-sgd", "model": "resnet18"}, "`model=resnet18` carries state besides them"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**settings)


@pytest.mark.parametrize("sync, every, settings, message", [
    ("every-step", 4, {}, "`sync_every=4` needs a local mode"),
    ("local-sgd", 0, {}, "`sync_every` must be a positive number of steps, got 0"),
    ("local-sgd", None, {"outer_lr": 0.5},
     r"`outer_lr=0.5` is a setting of `sync=diloco` or `sync=streaming-diloco`, not of `sync=local-sgd`"),
    ("diloco", None, {"outer_optimizer": "adam"}, "Unknown `outer_optimizer=adam`"),
    ("diloco", None, {"outer_momentum": 0.0}, "`outer_optimizer=nesterov` needs a momentum in"),
    ("diloco", None, {"outer_momentum": 1.0}, r"`outer_momentum` must be in \[0, 1\), got 1.0"),
])
def test_bad_sync_settings_are_refused_by_name(sync, every, settings, message):
    with pytest.raises(ConfigError, match=message):
        get_sync(sync, every, **settings)


def test_a_sync_value_carries_its_settings_and_the_old_fields_say_so():
    """`jdp.DiLoCo(...)` is checked when made; a run records its settings as `TrainConfig` once held them (a
    checkpoint of an older run, with None for the sync's own, compares equal); the old fields name the value."""
    with pytest.raises(ConfigError, match="Unknown `outer_optimizer=adam`"):
        DiLoCo(outer_optimizer="adam")
    assert get_sync("diloco", 8, outer_lr=1.0) == dataclasses.replace(get_sync("diloco"), every=8, outer_lr=1.0)
    recorded = dataclasses.replace(BASE, sync=DiLoCo(every=8, outer_lr=1.0)).to_dict()
    assert {k: recorded[k] for k in ("sync", "sync_every", "outer_lr", "outer_optimizer", "fragments")} == \
        {"sync": "diloco", "sync_every": 8, "outer_lr": 1.0, "outer_optimizer": None, "fragments": None}
    older = {**dataclasses.replace(BASE, sync="local-sgd").to_dict(), "sync_every": None, "fragments": None}
    assert resume.settings(older) == resume.settings(dataclasses.replace(BASE, sync="local-sgd").to_dict())
    assert resume.settings(older)["sync_every"] == 16
    for name in ("sync_every", "outer_lr", "fragments"):
        with pytest.raises(TypeError, match=rf"`TrainConfig\({name}=\.\.\.\)` is gone: the sync value carries it"):
            dataclasses.replace(BASE, **{name: 1})
    from jdp.parallel import sync

    for name, replacement in (("diloco", "jdp.DiLoCo"), ("from_settings", "jdp.get_sync"),
                              ("make_consensus", "make_sync")):
        with pytest.raises(AttributeError, match=rf"`jdp\.parallel\.sync\.{name}` is now .*`{replacement}"):
            getattr(sync, name)
    with pytest.raises(TypeError, match=r"`Sync\(configure=\.\.\.\)` is gone"):
        Sync("mine", configure=lambda every: None)


def test_the_cli_names_the_flags(capsys):
    assert cli.main(["train", "--sync-every", "4", "--dataset", "synthetic"]) == 2
    assert "`--sync-every 4` needs a local mode: `--sync local-sgd` or `--sync diloco`" in capsys.readouterr().err
    assert cli.main(["train", "--sync", "sometimes", "--dataset", "synthetic"]) == 2  # the registry's names
    assert "Unknown `--sync sometimes`; choose one of: every-step, local-sgd, diloco" in capsys.readouterr().err


def test_the_cli_has_a_flag_for_every_built_in_sync_setting():
    """`jdp train` passes `SYNC_SETTINGS` to `get_sync`: a built-in sync's new setting needs its flag there."""
    from jdp.parallel.streaming import StreamingDiLoCo
    from jdp.parallel.sync import settings_of

    assert set(cli.SYNC_SETTINGS) == set(settings_of(StreamingDiLoCo())) >= set(settings_of(DiLoCo()))
    args = cli.build_parser().parse_args(["train"])
    assert all(hasattr(args, name) and getattr(args, name) is None for name in cli.SYNC_SETTINGS)


def test_registering_a_sync_checks_it():
    from jdp.parallel.sync import register

    with pytest.raises(ConfigError, match="named `local-sgd` is registered already; pass `replace=True`"):
        register(Sync("local-sgd", 4, lambda mean, state: (mean, state)))
    with pytest.raises(ConfigError, match="The sync `mine` has no `received`"):
        register(Sync("mine"))
    with pytest.raises(ConfigError, match="`sync_every` must be a positive number of steps, got 0"):
        TrainConfig(sync=Sync("mine", 0, lambda mean, state: (mean, state)))


def test_the_memory_bench_shows_dilocos_outer_state(devices):
    """Per device: the inner state (none for SGD) plus θ and the outer momentum, each the params' size."""
    from jdp.bench.memory import bytes_per_device, diloco_opt_state

    model = BASE.build_model()
    variables = model.init(jax.random.key(0))
    params_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(variables))
    for optimizer, inner in (("sgd", 0), ("adamw", 2)):  # AdamW: two moments per param (and a step count)
        held = bytes_per_device(diloco_opt_state(model, variables, optimizer, devices[:4]), devices[:4])
        assert (2 + inner) * params_bytes <= held <= (2 + inner) * params_bytes + 64


# ---- stragglers ----------------------------------------------------------------------------------

def test_a_simulated_straggler_sleeps_and_every_step_and_sync_is_timed(tmp_path, capsys):
    """One process (this one) sleeps 0.01 s before every 4th of 16 steps; steps and syncs are timed but the
    first of each (it compiles), and the times land in history.json."""
    assert cli.main(["train", "--devices", "4", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128",
                     "--no-progress", "--no-xla-flags", "--sync", "local-sgd", "--sync-every", "8",
                     "--simulate-straggler", "0:0.01:4", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "history.json").read_text())["stragglers"]
    assert row["process"] == 0 and row["steps"] == 15 and row["syncs"] == 1  # syncs after steps 8 and 16
    assert row["delayed_s"] == pytest.approx(0.04) and row["step_s"] > 0 and row["sync_s"] > 0
    assert "process 0: 15 steps timed" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("1", "is not PROCESS:SECONDS"), ("a:1", "is not PROCESS:SECONDS"), ("1:0.5:0", "EVERY at least 1"),
    ("2:0.5", "delays process 2, but the job has 1 process"),
])
def test_bad_straggler_specs_are_refused(text, message):
    from jdp.training.stragglers import Straggler

    with pytest.raises(ConfigError, match=message):
        Straggler.parse(text).check(1)


@pytest.mark.slow
def test_the_experiment_quick_mode_writes_its_tables(tmp_path):
    """experiments/local_sgd.py --quick: 8 short runs, `jdp compare`, 6 two-process straggler jobs."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "experiments" / "local_sgd.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path / "out"), "--runs",
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "local-sgd.json").read_text())
    assert record["quick"] is True and len(record["runs"]) == 8 and len(record["stragglers"]) == 6
    delayed = record["stragglers"]["every-step-delay0.05"]
    assert delayed[1]["delayed_s"] > 0 and delayed[0]["delayed_s"] == 0  # process 1 slept, process 0 did not
    table = (tmp_path / "out" / "local-sgd.md").read_text()
    assert "| diloco-h64 |" in table and "| local-sgd-h16 | 0.05 |" in table
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000


def test_tensorboard_counts_bytes_per_sync(tmp_path):
    """A local mode's bytes in TensorBoard: one payload per sync, averaged over the steps."""
    pytest.importorskip("tensorboard")
    from jdp.training.loop import EpochRecord
    from jdp.training.tensorboard import TensorBoardWriter, read_scalars

    board = TensorBoardWriter(tmp_path, {"sync": "local-sgd"}, 0.1, payload_bytes=100)
    board.steps(1, [1.0] * 8)
    board.epoch(EpochRecord(epoch=1, train_loss=1.0, test_acc=0.5, seconds=1.0, syncs=2))  # H = 4
    board.close()
    scalars = read_scalars(tmp_path)
    assert scalars["comm/allreduce_bytes_total"] == [(8, 200.0)]
    assert scalars["comm/allreduce_bytes_per_step"] == [(8, 25.0)]
