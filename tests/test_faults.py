"""A process of a multi-process job that dies or stalls, and `jdp launch --max-restarts` (docs/faults.md).

The fast tests check each piece in this process: the limits, the classification of what the
others published, the line, the checkpoint rule, the launcher's restarts with plain Python
children. The slow ones start real 2-process jobs over loopback, kill or stop one process, and
time the others.
"""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jdp.cli import main as cli
from jdp.errors import ConfigError, ProcessLostError
from jdp.parallel import tally
from jdp.runtime import faults, launch
from jdp.training import checkpoint
from jdp.training.checkpoint import Checkpoints
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig
from jdp.training.keeper import Keeper
from jdp.training.resume import check_resumable, check_same_state

LOST = faults.EXIT_PROCESS_LOST


# --- the limits ------------------------------------------------------------------------------------

def test_collective_limit_waits_out_compilation_then_follows_the_slowest_step():
    assert faults.collective_limit(None, None) == faults.STARTUP_S  # nothing finished yet: compiling
    assert faults.collective_limit(10, None) == faults.STARTUP_S
    assert faults.collective_limit(900, None) == 900
    assert faults.collective_limit(10, 50.0) == 10  # given: used as is once a step finished
    assert faults.collective_limit(None, 0.05) == faults.AUTO_FLOOR_S
    assert faults.collective_limit(None, 5.0) == 5.0 * faults.AUTO_FACTOR
    assert faults.collective_limit(None, 1e4) == faults.AUTO_CAP_S


def test_heartbeat_timeout_is_above_every_collective_limit():
    for timeout in (None, 1, 10, 300, 5000):
        for slowest in (None, 0.01, 3.0, 1e4):
            assert faults.heartbeat_seconds(timeout) > faults.collective_limit(timeout, slowest)


# --- which process, and the line --------------------------------------------------------------------

GLOO_RESET = ("UNKNOWN: Gloo all-reduce failed: [external/xla++third_party_ext+gloo/gloo/transport/tcp/pair.cc:538] "
              "Read error [127.0.0.1]:64142: Connection reset by peer")


def test_transport_failures_are_told_from_other_runtime_errors():
    assert faults.transport_failure(GLOO_RESET)
    assert faults.transport_failure("INTERNAL: Error dispatching computation: Gloo AllGather failed: Broken pipe")
    assert not faults.transport_failure("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
    assert faults.error_gist(RuntimeError(GLOO_RESET + "\n=== Source Location Trace ===")) == \
        "UNKNOWN: Gloo all-reduce failed: Read error [127.0.0.1]:64142: Connection reset by peer"


def progress(step, alive, step_s=0.05):
    return {"step": step, "alive": alive, "step_s": step_s}


def test_a_process_whose_counter_stopped_is_named_stopped():
    before = {0: progress(74, 10), 1: progress(74, 9), 2: progress(74, 10)}
    after = {0: progress(74, 12), 1: progress(74, 9), 2: progress(74, 12)}
    assert faults.lost_processes(before, after, 3) == ([1], [])


def test_a_process_that_never_published_is_stopped_and_a_late_one_is_behind():
    before = {0: progress(80, 10), 1: progress(75, 10)}
    after = {0: progress(80, 11), 1: progress(75, 11)}
    assert faults.lost_processes(before, after, 3) == ([2], [1])


def test_the_line_names_the_process_the_step_the_checkpoint_and_how_to_go_on():
    board = {0: progress(74, 12, 0.05), 1: progress(74, 9, 0.31)}
    line = faults.describe_loss("a collective failed (Connection reset by peer)", ([1], []), board, 2, 74,
                                "runs/ckpt/checkpoint-000000070.msgpack")
    assert line == ("process 1 of 2 stopped responding: a collective failed (Connection reset by peer) after step 74 "
                    "(step times before: p0 0.05 s, p1 0.31 s); the last complete checkpoint is "
                    "runs/ckpt/checkpoint-000000070.msgpack. Rerun the job with `resume=True` to go on from it; "
                    f"this process ends (exit status {LOST}).")
    assert "\n" not in line
    assert faults.describe_loss("x", ([], [2, 3]), board, 4, 9, None).startswith("processes 2, 3 of 4 did not arrive: x")
    assert "the coordinator, process 0 of 2, cannot be reached" in faults.describe_loss("x", ([], []), {}, 2, 9, None)
    assert "no checkpoint was saved" in faults.describe_loss("x", ([1], []), {}, 2, 9, None)


def test_the_line_names_the_host_of_each_lost_process_and_the_coordinators_address():
    board = {0: {**progress(74, 12), "host": "box at 198.18.0.1"}, 1: {**progress(74, 9), "host": "box at 198.18.0.2"}}
    assert faults.describe_loss("x", ([1], []), board, 2, 74, None).startswith(
        "process 1 (on box at 198.18.0.2) of 2 stopped responding: x after step 74")
    assert faults.describe_loss("x", ([], []), {}, 2, 9, None, coordinator="198.18.0.1:4242").startswith(
        "the coordinator, process 0 of 2 at 198.18.0.1:4242, cannot be reached: x")
    name = faults.host_name()
    assert name.startswith(socket.gethostname())


def test_the_stall_names_the_limit_it_broke():
    assert faults.stall_cause(10.4, 10, True, 10) == "no step finished for 10 s (`collective_timeout=10`)"
    assert faults.stall_cause(61, None, True, 60) == \
        "no step finished for 61 s (the automatic limit of 60 s, see `collective_timeout`)"
    assert faults.stall_cause(301, 10, False, 300) == \
        "no step finished for 301 s (the start-up limit of 300 s: the first step compiles)"


def test_with_one_process_the_watch_does_nothing():
    job = faults.JobWatch(timeout=0.01, on_loss=lambda line: pytest.fail(line))
    assert not job.active
    job.beat(5)
    job.all_reached(5)
    time.sleep(0.1)  # no watchdog thread that could call on_loss


def test_the_published_step_time_is_the_mean_over_recent_steps(monkeypatch):
    clock = iter([0.0, 10.0, 10.5, 11.0, 11.5])  # construction, the first call (compiling), then 0.5 s per step
    monkeypatch.setattr(faults.time, "monotonic", lambda: next(clock))
    job = faults.JobWatch()
    for step in (1, 2, 3, 4):
        job.beat(step)
    assert job.step_seconds() == pytest.approx(0.5)
    assert job.limit() == faults.AUTO_FLOOR_S  # the compiling call does not count as a slow step


class Store:
    """The coordination service's key-value store, in memory."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(key, value) for key, value in self.kv.items() if key.startswith(prefix)]


def test_process_0_ends_only_after_the_processes_still_running(monkeypatch):
    """Its exit takes the coordination service along, and JAX aborts a process that loses it."""
    store = Store()
    monkeypatch.setattr(faults, "_client", lambda: store)
    job = faults.JobWatch()
    job.process_id, job.process_count = 0, 3
    threading.Timer(0.5, store.key_value_set, ("jdp/ended/1", "1")).start()
    start = time.monotonic()
    job._leave(stopped=[2])  # process 2 is gone: only process 1 is waited for
    assert 0.5 <= time.monotonic() - start < faults.LEAVE_S
    assert store.kv["jdp/ended/0"] == "1"
    job.process_id = 1
    start = time.monotonic()
    job._leave(stopped=[2])  # any other process says so and goes
    assert time.monotonic() - start < 0.5 and store.kv["jdp/ended/1"] == "1"


# --- checkpoints: written only once every process reached them --------------------------------------

class Unreached:
    """A job in which another process never reaches the checkpoint."""

    active, step, checkpoint = True, 0, None

    def beat(self, step):
        self.step = step

    def all_reached(self, step):
        raise ProcessLostError(f"process 1 did not reach step {step}")


class Unwatched:
    def after_call(self, *args):
        pass

    def flush(self, params=None):
        pass


def keeper(directory, job):
    return Keeper(Checkpoints(directory, 2), described={"config": {}}, steps_per_epoch=8, watch=Unwatched(),
                  host_copy=lambda params, opt_state: (np.asarray(params), np.asarray(opt_state)),
                  data_key=np.zeros(2, np.uint32), job=job)


def test_a_checkpoint_that_not_every_process_reached_is_not_written(tmp_path):
    carry = (np.ones(3, np.float32), np.zeros(3, np.float32), tally.start(2, [0.5], leaves=1))
    unreached = keeper(tmp_path / "ckpt", Unreached())
    unreached.start_epoch(device_count=1, leaves=1)
    with pytest.raises(ProcessLostError, match="did not reach step 2"):
        unreached.after_call(2, carry)
    assert checkpoint.list_checkpoints(tmp_path / "ckpt") == []
    reached = Unreached()
    reached.all_reached = lambda step: None
    saver = keeper(tmp_path / "ckpt", reached)
    saver.start_epoch(device_count=1, leaves=1)
    saver.after_call(2, carry)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "ckpt")] == ["checkpoint-000000002.msgpack"]
    assert reached.checkpoint == str(checkpoint.path_for(tmp_path / "ckpt", 2)) and reached.step == 2


# --- resuming on another number of processes --------------------------------------------------------

RUN = {"config": {"batch_size": 64, "seed": 0, "compress": "none", "allreduce": "psum"}, "devices": 2,
       "dataset": {"train": 2048, "test": 512, "sha256": "ab"}, "per_device_state": False}


def test_another_process_count_resumes_with_a_note_unless_state_is_kept_per_device():
    notes = check_resumable({**RUN, "processes": 2}, {**RUN, "processes": 1})
    assert notes == ["resuming in 1 process(es) instead of the checkpoint's 2: the same sums, exchanged between "
                     "processes instead of within one (their float additions may be grouped otherwise)"]
    assert check_resumable(RUN, {**RUN, "processes": 1}) == []  # checkpoints from before the field: 1 process
    powersgd = {**RUN, "config": {**RUN["config"], "compress": "powersgd"}, "per_device_state": True}
    check_same_state({**powersgd, "processes": 2}, {**powersgd, "processes": 1})  # the same 2 devices' state
    with pytest.raises(ConfigError, match="state for each of 2 devices; this run has 4. Resume on 2 devices"):
        check_same_state({**powersgd, "processes": 2}, {**powersgd, "devices": 4, "processes": 1})


# --- C++ logs to a file, Python's stderr on the terminal ---------------------------------------------

def test_native_logs_go_to_the_file_and_python_stderr_stays(tmp_path):
    script = textwrap.dedent(f"""
        import ctypes, sys
        from jdp.runtime import faults
        faults.send_native_logs_to({str(tmp_path / "native.log")!r})
        ctypes.CDLL(None).write(2, b"C++ says\\n", 9)
        print("jdp says", file=sys.stderr)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "jdp says\n"
    assert (tmp_path / "native.log").read_text() == "C++ says\n"


# --- the launcher's restarts, with plain Python children (no JAX: fast) ------------------------------

FLAKY = textwrap.dedent("""
    import sys
    from pathlib import Path
    me = int(sys.argv[sys.argv.index("--process-id") + 1])
    runs = Path(sys.argv[1]) / f"runs-{me}"
    runs.write_text((runs.read_text() if runs.exists() else "") + " ".join(sys.argv[2:]) + "\\n")
    if me == 1 and runs.read_text().count("\\n") <= int(sys.argv[2]):
        sys.exit(int(sys.argv[3]))
""")


def launch_flaky(tmp_path, failures, status, max_restarts):
    command = [sys.executable, "-c", FLAKY, str(tmp_path), str(failures), str(status), "--checkpoint-dir", "d"]
    return subprocess.run([sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--max-restarts",
                           str(max_restarts), "--", *command], capture_output=True, text=True, timeout=120)


def test_launcher_restarts_every_process_with_resume_up_to_max_restarts(tmp_path):
    result = launch_flaky(tmp_path, failures=2, status=LOST, max_restarts=2)
    assert result.returncode == 0, result.stderr
    runs = (tmp_path / "runs-1").read_text().splitlines()  # (process 0 may be stopped before it wrote its line)
    assert len(runs) == 3 and "--resume" not in runs[0] and all(r.count("--resume") == 1 for r in runs[1:])
    assert result.stderr.count("jdp launch: process 0: pid") == result.stderr.count("jdp launch: process 1: pid") == 3
    for n in (1, 2):
        assert f"failed: exit status {LOST}; stopped the other 1 process(es); restart {n} of 2: all 2 processes " \
               "with --resume, from the newest complete checkpoint." in result.stderr
    assert result.stderr.count("restart ") == 2


def test_launcher_gives_up_after_max_restarts_and_never_restarts_exit_status_2(tmp_path):
    result = launch_flaky(tmp_path, failures=5, status=LOST, max_restarts=1)
    assert result.returncode == LOST and result.stderr.count("restart ") == 1
    assert f"failed: exit status {LOST}; stopped the other 1 process(es); go on from the" in result.stderr
    (tmp_path / "runs-1").unlink()
    result = launch_flaky(tmp_path, failures=5, status=2, max_restarts=3)
    assert result.returncode == 2 and "restart " not in result.stderr


def test_launcher_restarts_need_a_checkpoint_dir_and_names_the_cause_not_the_witness():
    with pytest.raises(ConfigError, match="needs `--checkpoint-dir DIR`"):
        launch.launch(launch.Job(["jdp", "train"], 2, 1), max_restarts=1)
    assert launch.with_resume(["jdp", "train", "--resume"]) == ["jdp", "train", "--resume"]

    class Exited:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    # process 0 exited because it lost process 2, killed by SIGKILL: process 2 is the one named
    assert launch._watch([Exited(LOST), Exited(0), Exited(-9)], None) == (2, -9)


def test_launcher_names_a_stopped_process_and_says_how_to_go_on(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not launch._is_stopped(sleeper.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        witness = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({LOST})"])
        witness.wait()
        assert launch._watch([witness, sleeper], None) == (1, -signal.SIGSTOP)
    finally:
        sleeper.kill()
        sleeper.wait()
    result = launch_flaky(tmp_path, failures=1, status=LOST, max_restarts=0)
    assert result.returncode == LOST
    assert result.stderr.rstrip().endswith(
        f"failed: exit status {LOST}; stopped the other 1 process(es); go on from the newest checkpoint in d with "
        f"`jdp launch --num-processes 2 --cpu-devices-per-process 1 -- {sys.executable} -c '{FLAKY}' {tmp_path} 1 {LOST} "
        "--checkpoint-dir d --resume`.")


# --- real 2-process jobs (slow) ----------------------------------------------------------------------

TRAIN = ["--backend", "shard_map", "--dataset", "synthetic", "--batch-size", "64", "--no-progress"]


def start_job(tmp_path, extra, epochs=50):
    """Two `jdp train` processes started directly (as srun or mpirun start them), 1 device each."""
    port = random.randint(20000, 40000)
    procs = []
    for i in (0, 1):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jdp", "train", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--cpu-devices", "1", *TRAIN, "--epochs", str(epochs),
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10", "--out", str(tmp_path / "out"),
             *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def wait_for_epoch(procs, epoch, timeout=300):
    """Reads process 0's stdout until `epoch` ended (both processes are then training)."""
    deadline = time.monotonic() + timeout
    for line in procs[0].stdout:
        if line.startswith(f"epoch {epoch:3d}"):
            return
        assert time.monotonic() < deadline
    pytest.fail(f"process 0 ended early: {procs[0].stderr.read()}")


def end(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_the_other_process_ends_fast_with_one_line_naming_the_lost_one(signum, tmp_path, capsys):
    """kill -9 (or SIGSTOP) of process 1 of a directly started job: process 0 exits with status 75
    and one line naming process 1, its step and checkpoint; within 15 s of a death, within the
    collective timeout (10 s) and the time to read the others' progress after a stall. The job's
    checkpoint then resumes in one process on 4 devices."""
    procs = start_job(tmp_path, ["--collective-timeout", "10"])
    try:
        wait_for_epoch(procs, 2)
        os.kill(procs[1].pid, signum)
        stopped = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        end(procs)
    assert procs[0].returncode == LOST, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # no traceback, no C++ log
    assert re.match(r"jdp: error: process 1 \(on .+ at [\d.]+\) of 2 stopped responding: ", lines[0]), lines[0]
    assert f"the last complete checkpoint is {tmp_path / 'ckpt'}/checkpoint-" in lines[0]
    assert "Rerun the job with `--resume` to go on from it" in lines[0]
    if signum == signal.SIGKILL:
        assert took < 15 and "a collective failed" in lines[0]
    else:
        assert 10 < took < 10 + 15 and "no step finished for 1" in lines[0] and "`--collective-timeout 10`" in lines[0]
    saved = checkpoint.restore_latest(tmp_path / "ckpt", checkpoint_target(TrainConfig(batch_size=64)))
    epoch = saved.info["position"]["epoch"]  # the epoch it is in: finished below
    assert saved.info["run"]["processes"] == 2 and epoch >= 2
    capsys.readouterr()
    assert cli.main(["train", *TRAIN, "--devices", "4", "--epochs", str(epoch), "--checkpoint-dir",
                     str(tmp_path / "ckpt"), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "resuming in 1 process(es) instead of the checkpoint's 2" in err
    assert "resuming on 4 devices instead of the checkpoint's 2" in err and f"epoch {epoch:3d}" in out


def launch_job(tmp_path, name, extra=()):
    return subprocess.Popen(
        [sys.executable, "-m", "jdp", "launch", "--num-processes", "2", "--cpu-devices-per-process", "1",
         "--timeout", "900", *extra, "--", "jdp", "train", *TRAIN, "--epochs", "3", "--checkpoint-dir",
         str(tmp_path / name), "--checkpoint-every", "5",
         "--simulate-straggler", "1:0.01"],  # steps of 10 ms at least: the killer cannot miss its window
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_job_killed_twice_mid_epoch_comes_back_and_ends_bit_identical(tmp_path):
    """`jdp launch --max-restarts 2`; process 1 is killed in epoch 1 and again, after the restart, in
    epoch 2: the job ends with the final checkpoint of an uninterrupted job, bit for bit."""
    killed = launch_job(tmp_path, "killed", ["--max-restarts", "2"])
    lines, kills = [], []

    def killer():  # SIGKILL process 1 once the newest checkpoint is past `at` (mid-epoch: 32 steps per epoch)
        for at in (15, 45):
            while True:
                pid = next((int(line.rsplit(" ", 1)[1]) for line in reversed(lines)
                            if line.startswith("jdp launch: process 1: pid ")), None)
                newest = checkpoint.list_checkpoints(tmp_path / "killed")
                if pid is not None and pid not in kills and newest and int(newest[0].name[11:20]) >= at:
                    os.kill(pid, signal.SIGKILL)
                    kills.append(pid)
                    break
                if killed.poll() is not None:
                    return
                time.sleep(0.02)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with killed:
        lines.extend(killed.stdout)
        killed.wait(timeout=60)
    whole = launch_job(tmp_path, "whole")
    out, _ = whole.communicate(timeout=900)
    assert whole.returncode == 0, out[-3000:]
    output = "".join(lines)
    assert killed.returncode == 0, output[-3000:]
    assert len(kills) == 2 and output.count("killed by SIGKILL") == 2
    assert "restart 1 of 2: all 2 processes with --resume" in output and "restart 2 of 2" in output
    assert output.count("[p0] resuming from ") == 2
    config = TrainConfig(batch_size=64)
    a = checkpoint.restore_latest(tmp_path / "whole", checkpoint_target(config))
    b = checkpoint.restore_latest(tmp_path / "killed", checkpoint_target(config))
    assert a.step == b.step == 96
    for x, y in zip(jax.tree.leaves(a.arrays), jax.tree.leaves(b.arrays), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    timing = ("seconds", "process_step_s", "steps_per_call")  # measured: each run its own
    strip = lambda history: [{k: v for k, v in r.items() if k not in timing} for r in history]  # noqa: E731
    assert strip(a.info["history"]) == strip(b.info["history"])
    assert not any(Path(tmp_path / "killed").glob(".tmp-*"))
