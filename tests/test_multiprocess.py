"""Multi-process training over jax.distributed on loopback, and the `jdp launch` launcher.

Every run here is small (tiny batches, one epoch of a few steps) and bounded: subprocess timeouts
and the launcher's own `--timeout`, on 127.0.0.1 with ports the OS picks.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import chex
import jax
import numpy as np
import pytest

from jdp import DiLoCo, data
from jdp.errors import ConfigError
from jdp.parallel import layout
from jdp.runtime import distributed, launch
from jdp.training.loop import TrainConfig, train

SYNTHETIC = dict(n_train=96, n_test=40)  # 96 / 16 = 6 steps per epoch
CONFIG = dict(batch_size=16, lr=0.5, epochs=1, allreduce="psum", seed=3)


def run_launch(args, timeout=240):
    return subprocess.run([sys.executable, "-m", "jdp", "launch", *args], capture_output=True, text=True,
                          timeout=timeout)


# --- the launcher, with plain Python children (no JAX: fast) --------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    me = int(sys.argv[sys.argv.index("--process-id") + 1])
    print(f"hello from {me} of", sys.argv[sys.argv.index("--num-processes") + 1], flush=True)
    if me == 1:
        sys.exit(int(sys.argv[1]))
    time.sleep(120)
""")


def test_launcher_prefixes_output_and_fails_fast_naming_the_failed_process():
    start = time.monotonic()
    result = run_launch(["--num-processes", "3", "--", sys.executable, "-c", CHILD, "3"], timeout=60)
    assert time.monotonic() - start < 30  # process 0 and 2 sleep 120 s: they were stopped
    assert result.returncode == 3
    assert "[p1] hello from 1 of 3" in result.stdout
    assert "process 1 (pid" in result.stderr and "failed: exit status 3" in result.stderr
    assert "stopped the other 2 process(es)" in result.stderr


def test_launcher_timeout_stops_everything():
    result = run_launch(["--num-processes", "2", "--timeout", "2", "--", sys.executable, "-c", CHILD, "0"],
                        timeout=60)
    assert result.returncode == 1 and "timed out after 2 s" in result.stderr


def test_launcher_appends_the_job_flags_and_uses_this_interpreter():
    cmd = launch.process_command(["jdp", "train", "--epochs", "1"], 1234, 2, 1, 4)
    assert cmd == [sys.executable, "-m", "jdp", "train", "--epochs", "1", "--coordinator", "127.0.0.1:1234",
                   "--num-processes", "2", "--process-id", "1", "--cpu-devices", "4"]
    with pytest.raises(ConfigError, match="must not set `--process-id`"):
        launch.launch(launch.Job(["jdp", "train", "--process-id", "0"], 2, 2))


# --- flags and the per-process slice of a batch ---------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(coordinator="127.0.0.1:1234"), "missing `num_processes`, `process_id`"),
        (dict(coordinator="localhost", num_processes=2, process_id=0), "must be HOST:PORT"),
        (dict(coordinator="127.0.0.1:1234", num_processes=2, process_id=2), "must be in [0, 2)"),
        (dict(num_processes=1, process_id=1), "`process_id=1` must be 0 with `num_processes=1`"),
    ],
)
def test_bad_job_flags_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        distributed.initialize(**kwargs, environ={})


def test_single_process_without_flags_or_cluster():
    assert distributed.initialize(environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is False
    assert distributed.cluster_detected({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    assert distributed.cluster_detected({"OMPI_COMM_WORLD_SIZE": "2"})


def test_each_process_loads_its_own_rows_of_every_batch(monkeypatch):
    """Two processes' slices tile each batch of the single-process `epoch_batches`: same order,
    no overlap, no row lost (devices are stand-ins: only `process_index` is read)."""
    from jdp.parallel.feeders import epoch_batches

    fake = [type("Device", (), {"process_index": p})() for p in (0, 0, 1, 1)]
    split = data.synthetic(jax.random.key(5), n_train=40, n_test=1).train
    key = jax.random.key(6)
    per_process = []
    for p in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda p=p: p)
        assert layout.process_rows(8, fake) == slice(4 * p, 4 * p + 4)
        per_process.append(list(epoch_batches(split, 8, key, skip=1, rows=layout.process_rows(8, fake))))
    whole = list(epoch_batches(split, 8, key, skip=1))  # skip: a run resumed after batch 1
    assert len(whole) == len(per_process[0]) == len(per_process[1]) == 4
    for (x, y), (x0, y0), (x1, y1) in zip(whole, *per_process):
        np.testing.assert_array_equal(np.concatenate([x0, x1]), x)
        np.testing.assert_array_equal(np.concatenate([y0, y1]), y)


def test_one_process_loads_every_row(devices):
    assert layout.process_rows(16, devices[:4]) == slice(0, 16)
    with pytest.raises(ConfigError, match="divisible by the number of devices"):
        layout.process_rows(10, devices[:4])


# --- real jobs: 2 processes x 2 simulated CPU devices over loopback --------------------------------

# A driver script's start: the flags `jdp launch` appends, the simulated devices, jax.distributed; then `import jax`.
PREAMBLE = textwrap.dedent("""
    import argparse
    import numpy as np
    from jdp import DiLoCo, data
    from jdp.runtime import devices, distributed
    from jdp.training.guards import Guards
    from jdp.training.loop import TrainConfig, train

    parser = argparse.ArgumentParser()
    for flag in ("--coordinator", "--num-processes", "--process-id", "--cpu-devices", "--save"):
        parser.add_argument(flag)
    a = parser.parse_args()
    devices.simulate_cpu_devices(int(a.cpu_devices))
    assert distributed.initialize(a.coordinator, int(a.num_processes), int(a.process_id))
    import jax
""")

DRIVER = PREAMBLE + textwrap.dedent("""
    from jdp.parallel import layout
    dataset = data.synthetic(jax.random.key(0), **{synthetic})
    for backend in layout.BACKENDS:
        params, history = train(TrainConfig(**{config}, backend=backend), dataset, devices.select_devices())
        print(backend, "train loss", history[-1].train_loss, "test acc", history[-1].test_acc, flush=True)
        if jax.process_index() == 0:
            np.savez(a.save + backend + ".npz", *[np.asarray(leaf) for leaf in jax.tree.leaves(params)])
""")


# The lesson's SGD, and AdamW with 2 micro-batches per device and its state sharded over the 4 devices of 2 processes.
# AdamW divides by each gradient's magnitude, so where a gradient is near 0 the order of the cross-process sums shows.
# Measured: on AMD EPYC VMs 9 of 25,000 elements differ by > 1e-6 relative, at most 2e-8; on the Intel Xeon (AMX) VM
# 9 of W1's 180 elements by up to 8.7e-6 after 6 steps: under 1% of one AdamW step (lr 1e-3), hence atol 2e-5. Losing
# a process's gradients moves elements by a sizeable part of lr; a doubled sum, which AdamW cannot see, is the sgd case's.
ZERO = {"optimizer": "adamw", "lr": 1e-3, "accumulate": 2, "shard_optimizer": True}
# DiLoCo across processes: per-device params and momentum between syncs, θ and the outer momentum synced every 3 steps.
DILOCO = {"sync": DiLoCo(every=3), "optimizer": "momentum", "lr": 0.05}  # written into the driver by its repr


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "rtol", "atol"), [({}, 1e-6, 1e-9), (ZERO, 1e-5, 2e-5), (DILOCO, 1e-5, 1e-6)],
                         ids=["sgd", "sharded-adamw-accumulate", "diloco"])
def test_two_processes_end_with_the_params_of_one_process_with_all_devices(extra, rtol, atol, devices, tmp_path):
    """Both backends: 2 processes x 2 devices vs 1 process x 4 devices, the same global batches."""
    config = {**CONFIG, **extra}
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(synthetic=SYNTHETIC, config=config))
    result = run_launch(["--num-processes", "2", "--cpu-devices-per-process", "2", "--timeout", "300", "--",
                         sys.executable, str(script), "--save", str(tmp_path / "params-")], timeout=360)
    assert result.returncode == 0, result.stderr[-3000:]
    dataset = data.synthetic(jax.random.key(0), **SYNTHETIC)
    for backend in layout.BACKENDS:
        expected, history = train(TrainConfig(**config, backend=backend), dataset, devices[:4])
        saved = np.load(tmp_path / f"params-{backend}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        chex.assert_trees_all_close(got, jax.tree.leaves(expected), rtol=rtol, atol=atol)
        for p in ("[p0]", "[p1]"):  # both processes report the global loss and accuracy
            line = f"{p} {backend} train loss {history[-1].train_loss} test acc {history[-1].test_acc}"
            assert line in result.stdout, result.stdout


@pytest.mark.slow
def test_jdp_train_through_the_launcher_writes_from_process_0_only(tmp_path):
    out = tmp_path / "out"
    result = run_launch(["--num-processes", "2", "--cpu-devices-per-process", "2", "--timeout", "200", "--",
                         "jdp", "train", "--dataset", "synthetic", "--epochs", "1", "--batch-size", "256",
                         "--backend", "pmap", "--allreduce", "ring", "--no-progress", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[p0] wrote {out / 'history.json'}" in result.stdout and "[p1] wrote" not in result.stdout
    history = json.loads((out / "history.json").read_text())
    assert len(history["devices"]) == 4 and history["config"]["backend"] == "pmap"
    assert [e["epoch"] for e in history["epochs"]] == [1]


@pytest.mark.slow
def test_a_killed_worker_makes_the_launcher_fail_fast():
    """Killing process 1 once its first collective has connected (gloo logs it) or later
    leaves process 0 waiting inside a collective: the launcher must stop it and exit non-zero
    naming process 1, not hang."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--cpu-devices-per-process", "2",
         "--timeout", "240", "--", "jdp", "train", "--dataset", "synthetic", "--epochs", "100", "--batch-size",
         "128", "--backend", "shard_map", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines, victim = [], None
    with launcher:
        try:
            deadline = time.monotonic() + 200
            for line in launcher.stdout:
                lines.append(line)
                if line.startswith("jdp launch: process 1: pid "):
                    victim = int(line.rsplit(" ", 1)[1])
                if line.startswith(("[p1] [Gloo]", "[p1] epoch   1")):  # in its first collective, or later
                    break
                assert time.monotonic() < deadline, "".join(lines[-20:])
            assert victim is not None, "".join(lines[-20:])
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            code = launcher.wait(timeout=60)
            rest = launcher.stdout.read()
        finally:
            launcher.terminate()  # a no-op once it exited; otherwise it stops its processes and exits
    assert time.monotonic() - killed < 30
    assert code != 0
    assert f"process 1 (pid {victim}) failed: killed by SIGKILL; stopped the other 1 process(es)." in rest


HIERARCHICAL_DRIVER = PREAMBLE + textwrap.dedent("""
    from jdp.parallel import collectives
    mesh = devices.select_devices()
    inner, across = collectives.host_groups(len(mesh))  # one host per process
    print("hosts", [[mesh[d].process_index for d in host] for host in inner], "across", across, flush=True)
    params, history = train(TrainConfig(**{config}), data.synthetic(jax.random.key(0), **{synthetic}), mesh,
                            guards=Guards(check_replicas=1))
    np.savez(a.save + str(jax.process_index()) + ".npz", *[np.asarray(leaf) for leaf in jax.tree.leaves(params)])
""")


@pytest.mark.slow
def test_hierarchical_on_two_processes_of_two_devices_trains_like_psum(devices, tmp_path):
    """2 hosts (processes) × 2 local devices: a ring inside each process, a ring across them; every process
    ends with the same bits (each checks its own replicas every step), within float rounding of psum."""
    config = {**CONFIG, "allreduce": "hierarchical"}
    script = tmp_path / "driver.py"
    script.write_text(HIERARCHICAL_DRIVER.format(synthetic=SYNTHETIC, config=config))
    result = run_launch(["--num-processes", "2", "--cpu-devices-per-process", "2", "--timeout", "200", "--",
                         sys.executable, str(script), "--save", str(tmp_path / "params-")], timeout=260)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[p0] hosts [[0, 0], [1, 1]] across ((0, 2), (1, 3))" in result.stdout, result.stdout
    got = [np.load(tmp_path / f"params-{p}.npz") for p in (0, 1)]
    for name in got[0].files:
        assert got[0][name].tobytes() == got[1][name].tobytes()  # the two processes' replicas: the same bits
    expected, _ = train(TrainConfig(**CONFIG), data.synthetic(jax.random.key(0), **SYNTHETIC), devices[:4])
    for i, want in enumerate(jax.tree.leaves(expected)):
        chex.assert_trees_all_close(got[0][f"arr_{i}"], want, rtol=1e-5, atol=1e-7)
