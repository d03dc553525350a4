"""Streaming DiLoCo (`jdp.parallel.streaming`): DiLoCo bit for bit at F = 1, TAU = 0, float32; its schedule;
fragments of 1/F of the model; the quantized wire's round trip and sum; resume mid-interval; bad settings."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import small_set

import jdp
from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.parallel import compress, streaming
from jdp.parallel.layout import map_over_devices
from jdp.runtime.devices import AXIS
from jdp.training import checkpoint
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig, payload_bytes
from jdp.training.loop import train


BASE = TrainConfig(batch_size=32, lr=0.1, epochs=2, seed=0, optimizer="momentum")  # 16 steps


def run(devices, k=4, **settings):
    return train(dataclasses.replace(BASE, **settings), small_set(256), devices[:k], guards=jdp.Guards(check_replicas=1))


def assert_bit_identical(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# ---- exactness: one fragment, no delay, float32 is DiLoCo ---------------------------------------

@pytest.mark.parametrize("settings", [
    (3, {}),  # 16 steps: the last step's sync is off the schedule
    pytest.param((4, {}), marks=pytest.mark.slow),
    pytest.param((4, {"allreduce": "ring"}), marks=pytest.mark.slow),
    pytest.param((3, {"allreduce": "manual"}), marks=pytest.mark.slow),  # outside: copies between calls
    pytest.param((4, {"backend": "shard_map"}), marks=pytest.mark.slow),
], ids=lambda s: "-".join(map(str, (s[0], *s[1].values()))))
def test_one_fragment_without_delay_in_float32_is_diloco_bit_for_bit(settings, devices):
    every, others = settings
    diloco, diloco_history = run(devices, sync=jdp.DiLoCo(every=every), **others)
    stream, history = run(devices, sync=jdp.StreamingDiLoCo(every=every, fragments=1), **others)
    assert_bit_identical(diloco, stream)
    assert [r.train_loss for r in history] == [r.train_loss for r in diloco_history]
    assert [r.syncs for r in history] == [r.syncs for r in diloco_history]


@pytest.mark.parametrize("settings", [{"fragments": 2}, pytest.param({"fragments": 1, "sync_delay": 1},
                                                                    marks=pytest.mark.slow)],
                         ids=["F2", "tau1"])
def test_the_exactness_test_can_fail(settings, devices):
    """Two fragments, or one merged a step late, are other algorithms: far from DiLoCo."""
    diloco, _ = run(devices, epochs=1, sync=jdp.DiLoCo(every=4))
    assert max_difference(diloco, run(devices, epochs=1, sync=jdp.StreamingDiLoCo(every=4, **settings))[0]) > 1e-5


@pytest.mark.parametrize("settings", [
    ({"fragments": 4, "sync_delay": 1, "outer_dtype": "int8"}, {}),
    pytest.param(({"fragments": 4, "sync_delay": 1, "outer_dtype": "int8", "error_feedback": True}, {}),  # per-device
                 marks=pytest.mark.slow),  # state; fast sibling: test_error_feedback_keeps_what_the_wire_lost_and_sends_it_next_time
    pytest.param(({"fragments": 2, "outer_dtype": "fp8"}, {}), marks=pytest.mark.slow),
    pytest.param(({"fragments": 4, "outer_dtype": "bf16"}, {"allreduce": "manual"}), marks=pytest.mark.slow),
    pytest.param(({"fragments": 4, "sync_delay": 3}, {"allreduce": "ring", "backend": "shard_map"}),
                 marks=pytest.mark.slow),
], ids=lambda s: "-".join(str(v) for part in s for v in part.values()))
def test_every_setting_trains_and_ends_with_identical_replicas(settings, devices):
    """`check_replicas=1` compares every device's params (and θ, the outer states) after the final meeting."""
    streaming_settings, others = settings
    sync = jdp.StreamingDiLoCo(every=8, **streaming_settings)
    params, history = run(devices, epochs=1, sync=sync, **others)
    assert history[-1].syncs == 8 // (8 // sync.fragments) - 1 + sync.fragments
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


# ---- the schedule and the fragments -------------------------------------------------------------

def test_fragments_meet_in_turn_and_merge_tau_steps_later():
    sync = jdp.streaming_diloco(every=8, fragments=4, sync_delay=1)
    meetings = {step: sync.meetings(step, 20) for step in range(1, 21)}
    assert {step: m for step, m in meetings.items() if m} == {
        2: (("send", 0),), 3: (("merge", 0),), 4: (("send", 1),), 5: (("merge", 1),), 6: (("send", 2),),
        7: (("merge", 2),), 8: (("send", 3),), 9: (("merge", 3),), 10: (("send", 0),), 11: (("merge", 0),),
        12: (("send", 1),), 13: (("merge", 1),), 14: (("send", 2),), 15: (("merge", 2),), 16: (("send", 3),),
        17: (("merge", 3),), 18: (("send", 0),), 19: (("merge", 0),), 20: ("final",)}
    assert sync.syncs(19, 20) == 9 and sync.syncs(20, 20) == 9 + 4  # step 20: the final meeting, not a send
    late = jdp.streaming_diloco(every=8, fragments=4, sync_delay=2)
    assert late.meetings(4, 20) == (("merge", 0), ("send", 1))  # a merge and a send after one step: merge first
    assert [jdp.streaming_diloco(every=4, fragments=1).meetings(s, 9) for s in range(1, 10)] == \
        [(), (), (), (("send", 0),), (), (), (), (("send", 0),), ("final",)]  # DiLoCo's


def test_a_late_fragment_is_mixed_and_only_it():
    """TAU = 2, α = 0.25: a send updates θ's fragment only (the device keeps its params); the merge TAU
    steps later sets that fragment to α·local + (1 − α)·θ and leaves every other element alone."""
    sync = jdp.streaming_diloco(8, fragments=2, sync_delay=2, mixing=0.25, outer_optimizer="sgd", outer_lr=1.0)
    params = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(6.0, 10.0)}  # 10 elements: 5 per fragment
    state = sync.init(jax.tree.map(jnp.zeros_like, params))  # θ = 0
    change = sync.send(params, state, ("send", 1))  # θ − θ_i over elements 5..9
    assert [np.asarray(x).tolist() for x in change[0]] == [[-5.0], [-6.0, -7.0, -8.0, -9.0]]
    kept, state = sync.receive(change, params, state, ("send", 1))  # outer SGD lr 1 on the mean: θ_p ← θ_i
    assert_bit_identical(kept, params)
    assert np.asarray(state["params"]["b"]).tolist() == [6.0, 7.0, 8.0, 9.0]
    assert not np.asarray(state["params"]["a"]).ravel()[:5].any()
    later = jax.tree.map(lambda x: x + 100.0, params)  # the device trained on for TAU steps
    assert sync.send(later, state, ("merge", 1)) is None
    merged, same = sync.receive(None, later, state, ("merge", 1))
    assert same is state
    expected = np.concatenate([np.arange(5.0) + 100, 0.25 * (np.arange(5.0, 10.0) + 100) + 0.75 * np.arange(5.0, 10.0)])
    assert np.concatenate([np.ravel(merged["a"]), merged["b"]]).tolist() == expected.tolist()


def test_error_feedback_keeps_what_the_wire_lost_and_sends_it_next_time():
    sync = jdp.streaming_diloco(8, fragments=2, outer_dtype="int8", error_feedback=True)
    params = {"w": jax.random.normal(jax.random.key(3), (40,))}
    state = sync.init(jax.tree.map(jnp.zeros_like, params))  # θ = 0, no error yet
    (sent,) = sync.send(params, state, ("send", 0))
    _, state = sync.receive((sent,), params, state, ("send", 0))
    x = -params["w"][:20]  # θ − θ_i over fragment 0
    q, scale = compress.quantize(x, "int8")
    lost = np.asarray(state["error"]["w"])
    assert np.array_equal(lost[:20], np.asarray(x - compress.dequantize(q, scale)))  # kept exactly
    assert 0 < np.max(np.abs(lost[:20])) <= float(scale) / 2 * (1 + 1e-6) and not lost[20:].any()
    (again,) = sync.send(params, state, ("send", 0))  # the next send of fragment 0 carries it
    theta = np.asarray(state["params"]["w"][:20])
    assert np.allclose(np.asarray(again[0]), theta - np.asarray(params["w"][:20]) + lost[:20], atol=1e-6)
    assert sync.state_kind == {"params": "replicated", "optimizer": "replicated", "error": "per_device"}


@pytest.mark.parametrize("sizes, fragments", [([150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10], 4),
                                              ([5], 3), ([1, 1, 1, 1, 1], 5), ([7, 0, 9], 2), ([100], 1)])
def test_fragments_cover_every_element_once_in_equal_parts(sizes, fragments):
    frags = streaming.fragment_slices(sizes, fragments)
    covered = [np.zeros(n, int) for n in sizes]
    for slices in frags:
        for i, start, stop in slices:
            covered[i][start:stop] += 1
    assert all((c == 1).all() for c in covered)
    lengths = [sum(stop - start for _, start, stop in slices) for slices in frags]
    assert len(frags) == fragments and max(lengths) - min(lengths) <= 1


def test_each_sync_sends_one_fragment_the_peak_is_1_over_f_of_dilocos(devices):
    """The LeNet's largest leaf is 78% of it, so fragments are cut across leaves: every send is ≈ 1/4."""
    config = dataclasses.replace(BASE, sync=jdp.StreamingDiLoCo(every=8, fragments=4))
    sync, params = config.build_sync(), config.build_model().init(jax.random.key(0))
    state = sync.init(params)
    whole = sum(np.size(x) for x in jax.tree.leaves(params))
    sent = [sum(np.size(x) for x in jax.tree.leaves(sync.send(params, state, ("send", p)))) for p in range(4)]
    assert max(sent) - min(sent) <= 1 and sum(sent) == whole
    diloco = payload_bytes(dataclasses.replace(BASE, sync="diloco"))
    assert diloco == 4 * whole
    assert payload_bytes(config) == diloco / 4
    for dtype, fraction in (("int8", 1 / 16), ("bf16", 1 / 8)):
        narrow = dataclasses.replace(config, sync=dataclasses.replace(config.sync, outer_dtype=dtype))
        assert payload_bytes(narrow) == pytest.approx(diloco * fraction, abs=1)


# ---- the quantized wire ------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
def test_the_quantizers_round_trip_within_their_bounds(scale):
    x = scale * jax.random.normal(jax.random.key(1), (4096,))
    top = float(jnp.max(jnp.abs(x)))
    for wire, bound in {"float32": 0 * x,
                        "bf16": 2.0 ** -8 * jnp.abs(x),  # half an ulp of 8 significant bits
                        "int8": jnp.full_like(x, top / 127 / 2 * (1 + 1e-6)),  # half a step of the scale
                        # 4 significant bits; below 2^-6 (scaled) the subnormals' fixed step 2^-9
                        "fp8": jnp.maximum(2.0 ** -4 * jnp.abs(x), 2.0 ** -10 * top / 448) * (1 + 1e-6)}.items():
        q, s = compress.quantize(x, wire)
        assert q.dtype == compress.WIRE_DTYPES[wire]
        error = jnp.abs(compress.dequantize(q, s) - x)
        assert bool(jnp.all(error <= bound)), (wire, float(jnp.max(error - bound)))
    for wire in compress.WIRE_DTYPES:  # nothing to scale: zeros, not NaN
        q, s = compress.quantize(jnp.zeros(8), wire)
        assert not bool(jnp.any(compress.dequantize(q, s)))


def test_a_quantizer_that_rounds_too_coarsely_is_caught():
    """The int8 bound is tight: an extra bit lost (a scale twice too large) breaks it."""
    x = jax.random.normal(jax.random.key(1), (4096,))
    q, s = compress.quantize(x, "int8")
    coarse = compress.dequantize(jnp.round(q.astype(jnp.float32) / 2).astype(jnp.int8), 2 * s)
    assert float(jnp.max(jnp.abs(coarse - x))) > float(jnp.max(jnp.abs(x))) / 127 / 2


@pytest.mark.parametrize("wire", ["bf16", "fp8", "int8"])
def test_the_quantized_gather_gives_every_device_the_same_sum(wire, devices):
    k = 4
    rows = jax.random.normal(jax.random.key(2), (k, 3, 50)) * jnp.array([1.0, 10.0, 0.1, 5.0])[:, None, None]
    strategy = compress.quantized(wire)
    summed = map_over_devices(lambda x: (strategy.fn(x, AXIS),), devices[:k], "pmap", ("per_device",),
                              ("per_device",))(jax.device_put(rows))[0]
    out = np.asarray(summed)
    assert all(out[i].tobytes() == out[0].tobytes() for i in range(k))
    per_device_bound = {"bf16": 2.0 ** -8, "fp8": 2.0 ** -4, "int8": 1 / 127 / 2}[wire]
    bound = sum(per_device_bound * float(jnp.max(jnp.abs(r))) for r in rows) + 1e-5
    assert np.max(np.abs(out[0] - np.asarray(rows.sum(0)))) <= bound
    assert strategy.cost.terms(k, [4.0 * 150], None)["intra"].bytes_sent == \
        pytest.approx((k - 1) * 150 * jnp.dtype(compress.WIRE_DTYPES[wire]).itemsize)


# ---- state, resume -------------------------------------------------------------------------------

def test_the_state_holds_theta_and_one_outer_state_per_fragment():
    config = dataclasses.replace(BASE, sync=jdp.StreamingDiLoCo(every=8, fragments=4))
    outer = checkpoint_target(config, device_count=2)["opt_state"]["outer"]
    assert len(outer["optimizer"]) == 4
    trace = sum(np.size(t) for t in jax.tree.leaves(outer["optimizer"]))  # Nesterov's momentum: θ's size
    assert trace == sum(np.size(p) for p in jax.tree.leaves(outer["params"]))


@pytest.mark.slow  # the fast tier resumes DiLoCo mid-interval (tests/test_sync.py), the same machinery
def test_streaming_resumed_mid_interval_ends_bit_identical(tmp_path, devices):
    """Killed after step 6 of H = 8, F = 4, TAU = 1, int8 with error feedback (fragment 2 sent at 6, its merge
    due at 7): resumed, the run ends with the same params and history as an uninterrupted one, bit for bit."""
    config = dataclasses.replace(BASE, epochs=1, sync=jdp.StreamingDiLoCo(every=8, fragments=4, sync_delay=1,
                                                                          outer_dtype="int8", error_feedback=True))
    whole, whole_history = train(dataclasses.replace(config, epochs=2), small_set(256), devices[:4])
    train(config, small_set(256), devices[:4], checkpoints=jdp.Checkpoints(tmp_path, checkpoint_every=3))  # 3, 6, 8
    newest = checkpoint.list_checkpoints(tmp_path)[0]
    assert newest.name == "checkpoint-000000008.msgpack"
    newest.unlink()
    resumed, history = train(dataclasses.replace(config, epochs=2), small_set(256), devices[:4],
                             checkpoints=jdp.Checkpoints(tmp_path, resume=True))
    assert_bit_identical(whole, resumed)
    assert [dataclasses.replace(r, seconds=0, steps_per_call=1) for r in history] == \
        [dataclasses.replace(r, seconds=0, steps_per_call=1) for r in whole_history]


# ---- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync, every, settings, message", [
    ("streaming-diloco", 6, {"fragments": 4}, "`sync_every=6` does not split into `fragments=4`"),
    ("streaming-diloco", None, {"fragments": 0}, "`fragments` must be a positive number, got 0"),
    ("streaming-diloco", None, {"sync_delay": 16}, r"`sync_delay` must be in \[0, `sync_every`=16\), got 16"),
    ("streaming-diloco", None, {"outer_dtype": "fp4"}, "Unknown `outer_dtype=fp4`"),
    ("diloco", None, {"fragments": 2}, "`fragments=2` is a setting of `sync=streaming-diloco`, not of `sync=diloco`"),
    ("streaming-diloco", None, {"outer_lr": -1.0}, "`outer_lr` must be positive"),
    ("streaming-diloco", None, {"error_feedback": True}, "with `outer_dtype=float32` nothing is"),
])
def test_bad_settings_are_refused_by_name(sync, every, settings, message):
    with pytest.raises(ConfigError, match=message):
        jdp.get_sync(sync, every, **settings)


def test_a_strategy_it_cannot_sum_with_is_refused_by_name():
    with pytest.raises(ConfigError, match="keeps per-device state shaped as the whole model"):
        TrainConfig(sync="streaming-diloco", allreduce="psum+powersgd1")


def test_the_mixing_factor_is_checked_when_replaced():
    with pytest.raises(ConfigError, match=r"`mixing` must be in \[0, 1\], got 1.5"):
        dataclasses.replace(jdp.streaming_diloco(), mixing=1.5)
    with pytest.raises(ConfigError, match=r"`mixing` must be in \[0, 1\], got -0.5"):
        jdp.StreamingDiLoCo(mixing=-0.5)


def test_the_cli_names_its_flags(capsys):
    assert cli.main(["train", "--dataset", "synthetic", "--sync", "diloco", "--fragments", "2"]) == 2
    assert "`--fragments 2` is a setting of `--sync streaming-diloco`, not of `--sync diloco`" in \
        capsys.readouterr().err


@pytest.mark.slow  # its fast siblings: the flags' names above, the bytes in test_each_sync_sends_one_fragment...
def test_the_cli_trains_it_and_reports_its_bytes(tmp_path):
    assert cli.main(["train", "--devices", "2", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "128",
                     "--no-progress", "--no-xla-flags", "--sync", "streaming-diloco", "--sync-every", "4",
                     "--fragments", "2", "--sync-delay", "1", "--outer-dtype", "int8", "--out", str(tmp_path)]) == 0
    history = json.loads((tmp_path / "history.json").read_text())
    assert history["config"]["fragments"] == 2 and history["config"]["outer_dtype"] == "int8"
    whole = payload_bytes(TrainConfig(sync="diloco"))
    assert history["bytes_per_sync"] == pytest.approx(whole / 8, abs=1)
