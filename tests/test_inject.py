"""`jdp launch --inject SPEC`: faults made at a training step (docs/faults.md).

Fast: the specs, their refusals, the hand-over to the processes, the launcher's link commands as data.
Slow: a real 2-process job over loopback whose process 1 kills itself at a step and is restarted, and
one whose process 1 stops for 2 s and goes on with nothing restarted.
"""

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import jax
import numpy as np
import pytest

from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.runtime import cluster, inject, launch
from jdp.runtime.faults import EXIT_PROCESS_LOST
from jdp.runtime.inject import Fault
from jdp.training import checkpoint
from jdp.training.build import checkpoint_target
from jdp.training.config import TrainConfig


def test_each_form_parses_and_writes_itself_back():
    for spec, fault in [("kill:1@5", Fault("kill", 1, 5)), ("stop:0@20:2.5", Fault("stop", 0, 20, 2.5)),
                        ("cut:1@3", Fault("cut", 1, 3)),  # no seconds: for good
                        ("cut:1@3:4", Fault("cut", 1, 3, 4.0)), ("slow:2@7:1mbit", Fault("slow", 2, 7, 1e6))]:
        assert inject.parse(spec) == fault and fault.spec == spec


@pytest.mark.parametrize(("spec", "message"), [
    ("kill:1", "`inject=kill:1` is not a fault: use kill:HOST@STEP, stop:HOST@STEP:SECONDS"),
    ("explode:1@3", "`inject=explode:1@3` is not a fault"),
    ("kill:1@0", "`inject=kill:1@0`: steps count from 1."),
    ("stop:1@3", "`inject=stop:1@3`: write it as one of kill:HOST@STEP"),
    ("kill:1@3:2", "`inject=kill:1@3:2`: write it as one of"),
    ("stop:1@3:soon", "`inject=stop:1@3:soon`: SECONDS must be a number above 0, got `soon`."),
    ("cut:1@3:0", "SECONDS must be a number above 0, got `0`."),
    ("slow:1@3:fast", "fast"),
])
def test_a_bad_spec_is_refused_naming_it(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        inject.parse(spec)


def test_a_fault_must_name_a_host_of_the_job_and_a_link_needs_a_cluster():
    with pytest.raises(ConfigError, match=r"`inject=kill:2@5` names host 2, but the job has 2 \(0 to 1\)"):
        inject.check([inject.parse("kill:2@5")], 2, on_cluster=False)
    with pytest.raises(ConfigError, match=r"`inject=cut:1@5:3` breaks a link, which only an emulated cluster has"):
        inject.check([inject.parse("cut:1@5:3")], 2, on_cluster=False)
    inject.check([inject.parse("cut:1@5:3"), inject.parse("kill:0@1")], 2, on_cluster=True)


def test_the_command_line_refuses_a_bad_spec_in_one_line(capsys):
    assert cli.main(["launch", "--num-processes", "2", "--inject", "kill:9@5", "--", "jdp", "train"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "`--inject kill:9@5` names host 9, but the job has 2" in err


def test_each_process_gets_its_own_faults_and_makes_each_once_when_due(capsys):
    env = inject.environment([inject.parse(s) for s in ("cut:1@7:2", "slow:0@3:10mbit", "cut:1@4:1")])
    assert inject.for_process(0, env) == [Fault("slow", 0, 3, 1e7)]
    mine = inject.for_process(1, env)
    assert [f.step for f in mine] == [4, 7]  # earliest first
    inject.make_due(mine, 3)
    assert capsys.readouterr().err == "" and len(mine) == 2
    inject.make_due(mine, 8)  # one call ran past both steps: both are made, in order
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["jdp inject: cut:1@4:1 at step 8", "jdp inject: cut:1@7:2 at step 8"] and mine == []
    assert inject.announced(lines[0]) == Fault("cut", 1, 4, 1.0) and inject.announced("epoch 1") is None
    assert inject.for_process(0, {}) == []


def test_a_cut_downs_the_switch_port_and_a_slow_link_reshapes_both_ends():
    p = cluster.plan(2, 100_000_000, launcher_pid=4242, hostname="box")
    port = p.hosts[1].port
    assert p.port_command(1, up=False) == ["ip", "-n", p.switch, "link", "set", port, "down"]
    assert p.port_command(1, up=True)[-1] == "up"
    host_side, switch_side = p.reshape_commands(1, 1e6)
    assert host_side[:8] == ["tc", "-n", p.hosts[1].namespace, "qdisc", "change", "dev", cluster.NIC, "root"]
    assert switch_side[:8] == ["tc", "-n", p.switch, "qdisc", "change", "dev", port, "root"]
    assert host_side[8:11] == switch_side[8:11] == ["tbf", "rate", "1000000bit"]


TRAIN = ["jdp", "train", "--backend", "shard_map", "--dataset", "synthetic", "--batch-size", "128", "--no-progress",
         "--epochs", "2"]  # 16 steps an epoch


def launched(tmp_path, *flags, where=("--num-processes", "2"), name="ckpt", train=()):
    return subprocess.run(
        [sys.executable, "-m", "jdp", "launch", *where, "--timeout", "600", *flags, "--", *TRAIN, *train,
         "--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", "4"],
        capture_output=True, text=True, timeout=700)


@pytest.mark.slow
def test_a_process_killed_on_cue_is_restarted_once_and_the_job_ends(tmp_path):
    done = launched(tmp_path, "--inject", "kill:1@6", "--max-restarts", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr.count("jdp inject: kill:1@6 at step 6") == 1  # made once: not again after the restart
    assert "process 1 (pid" in done.stderr and "failed: killed by SIGKILL" in done.stderr
    assert "restart 1 of 1" in done.stderr and done.stdout.count("epoch   2") >= 1


@pytest.mark.slow
def test_a_process_stopped_on_cue_for_less_than_the_timeout_goes_on_with_nothing_restarted(tmp_path):
    done = launched(tmp_path, "--inject", "stop:1@6:2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jdp inject: stop:1@6:2 at step 6" in done.stderr
    assert "jdp launch: continued process 1 after 2 s stopped" in done.stderr
    assert "restart" not in done.stderr and "failed" not in done.stderr


missing = cluster.missing_privileges(cluster.effective_capabilities(), shutil.which)


@pytest.mark.slow
@pytest.mark.skipif(missing is not None, reason=f"no emulated cluster here: {missing}")
def test_a_short_cut_of_a_link_heals_and_the_run_ends_bit_identical(tmp_path):
    """Host 1's switch port down for 3 s at step 6, well under the collective timeout: nothing restarts,
    and the final checkpoint equals an uninterrupted run's byte for byte."""
    on_cluster = ("--hosts", "2", "--nic", "1gbit")
    cut = launched(tmp_path, "--inject", "cut:1@6:3", where=on_cluster, name="cut")
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert "jdp inject: cut:1@6:3 at step 6" in cut.stderr and "jdp launch: cut host 1's link" in cut.stderr
    assert "jdp launch: host 1's link back up after 3 s" in cut.stderr and "restart" not in cut.stderr
    whole = launched(tmp_path, where=on_cluster, name="whole")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    target = checkpoint_target(TrainConfig(batch_size=128))
    a, b = (checkpoint.restore_latest(tmp_path / name, target) for name in ("whole", "cut"))
    assert a.step == b.step == 32
    for x, y in zip(jax.tree.leaves(a.arrays), jax.tree.leaves(b.arrays), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_a_restart_leaves_out_the_hosts_that_do_not_answer_down_to_min_hosts(monkeypatch):
    """Host 1 of 3 is silent: the launcher names it as the cause, and a restart goes on with hosts 0 and 2
    (process 1 now runs on host 2); below `min_hosts` it is not restarted."""
    plan = cluster.plan(3, 10**8, launcher_pid=5, cores=[0], hostname="b")
    monkeypatch.setattr(cluster, "answering", lambda p: [h.index != 1 for h in p.hosts])
    job = launch.Job(["jdp", "train"], 3, 1, cluster=plan, min_hosts=2)
    answers = launch._answers(job, EXIT_PROCESS_LOST)
    assert answers == [True, False, True] and launch._answers(replace(job, cluster=None), EXIT_PROCESS_LOST) is None
    assert launch._answers(replace(job, min_hosts=None), 1) is None  # a crash without --min-hosts asks nothing
    assert launch._failed(job, job, [10, 11, 12], 0, EXIT_PROCESS_LOST, answers).startswith(
        "host 1 (198.18.0.2) does not answer (a cut link or a host gone); stopped all 3 processes")
    assert launch._failed(job, job, [10, 11, 12], 2, 1, answers) == "process 2 (pid 12) failed: exit status 1; stopped the other 2 process(es)"
    reduced = replace(job, cluster=plan.keep([0, 2]), num_processes=2)  # a restart already left out host 1
    assert launch._failed(job, reduced, [10, 12], 1, EXIT_PROCESS_LOST, answers).startswith(
        "host 1 (198.18.0.2) does not answer (a cut link or a host gone); stopped all 2 processes")
    again, left_out = launch._restarted(job, job, answers)
    assert again.num_processes == 2 and [h.index for h in again.cluster.hosts] == [0, 2]
    assert again.command[-1] == "--resume" and left_out.startswith(", leaving out host 1 (198.18.0.2) (no answer")
    none, why = launch._restarted(replace(job, min_hosts=3), job, answers)
    assert none is None and why == "host 1 (198.18.0.2) does not answer, and 2 host(s) are fewer than `--min-hosts 3`"
    assert launch._restarted(replace(job, min_hosts=None), job, None)[0].num_processes == 3  # no --min-hosts: every host


@pytest.mark.parametrize(("flags", "message"), [
    (["--num-processes", "2", "--max-restarts", "1", "--min-hosts", "1"], "`--min-hosts` describes an emulated cluster"),
    (["--hosts", "2", "--nic", "1gbit", "--min-hosts", "1"], "`--min-hosts 1` applies when the job restarts"),
    (["--hosts", "2", "--nic", "1gbit", "--max-restarts", "1", "--min-hosts", "3"], "`--min-hosts 3` must be between 1"),
])
def test_min_hosts_needs_a_cluster_restarts_and_a_count_it_has(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(cluster, "check_privileges", lambda realtime=False: None)
    assert cli.main(["launch", *flags, "--", "jdp", "train", "--checkpoint-dir", "c"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(missing is not None, reason=f"no emulated cluster here: {missing}")
def test_a_host_lost_for_good_is_named_and_the_job_goes_on_without_it(tmp_path):
    """Host 1's link cut for good at step 6: both processes end within the collective timeout, each naming
    the host it lost; the restart leaves host 1 out and the job ends on host 0 from the checkpoint of step 4."""
    done = launched(tmp_path, "--inject", "cut:1@6", "--max-restarts", "1", "--min-hosts", "1",
                    where=("--hosts", "2", "--nic", "1gbit"), train=("--collective-timeout", "5"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[p0] jdp: error: process 1 (on " in done.stderr and "at 198.18.0.2) of 2 stopped responding" in done.stderr
    assert "[p1] jdp: error: the coordinator, process 0 of 2 at 198.18.0.1:" in done.stderr
    assert "jdp launch: host 1 (198.18.0.2) does not answer" in done.stderr
    assert ("restart 1 of 1, leaving out host 1 (198.18.0.2) (no answer; 1 of 2 hosts go on, `--min-hosts 1`): "
            "1 process(es) with --resume") in done.stderr
    assert "jdp launch: starting 1 process(es) on host 0 (198.18.0.1)" in done.stderr
    assert "resuming from" in done.stdout + done.stderr and "(step 4," in done.stdout + done.stderr
    target = checkpoint_target(TrainConfig(batch_size=128))
    assert checkpoint.restore_latest(tmp_path / "ckpt", target).step == 32


@pytest.mark.slow
@pytest.mark.skipif(missing is not None, reason=f"no emulated cluster here: {missing}")
def test_a_nic_slowed_100_times_mid_run_shows_in_the_step_times_and_fails_nothing(tmp_path):
    """Host 1's NIC from 100mbit to 1mbit at step 28 of 32, under the default collective timeout: the job ends
    with nothing restarted, history.json's per-process step times show the slower epoch, and the launcher's
    traffic lines name host 1's NIC as the one whose queues overflowed."""
    done = launched(tmp_path, "--inject", "slow:1@28:1mbit", where=("--hosts", "2", "--nic", "100mbit"),
                    train=("--out", str(tmp_path / "out")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "jdp launch: host 1's NIC slowed to 1mbit" in done.stderr
    assert "restart" not in done.stderr and "failed" not in done.stderr and "error" not in done.stderr
    epochs = json.loads((tmp_path / "out" / "history.json").read_text())["epochs"]
    before, after = (e["process_step_s"] for e in epochs)
    assert len(before) == len(after) == 2 and min(after) > 3 * max(before), (before, after)
    dropped = {int(h): int(n) for h, n in re.findall(r"host (\d) \(198[^\n]*; its queues dropped (\d+) packets",
                                                      done.stderr)}
    assert dropped.get(1, 0) > dropped.get(0, 0), done.stderr
