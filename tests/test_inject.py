"""`jdp launch --inject SPEC`: faults made at a training step (docs/faults.md).

Fast: the specs, their refusals, the hand-over to the processes, the launcher's link commands as data.
Slow: a real 2-process job over loopback whose process 1 kills itself at a step and is restarted, and
one whose process 1 stops for 2 s and goes on with nothing restarted.
"""

import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.runtime import cluster, inject
from jdp.runtime.inject import Fault
from jdp.training import checkpoint
from jdp.training.config import TrainConfig, checkpoint_target


def test_each_form_parses_and_writes_itself_back():
    for spec, fault in [("kill:1@5", Fault("kill", 1, 5)), ("stop:0@20:2.5", Fault("stop", 0, 20, 2.5)),
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


def launched(tmp_path, *flags, where=("--num-processes", "2"), name="ckpt"):
    return subprocess.run(
        [sys.executable, "-m", "jdp", "launch", *where, "--timeout", "600", *flags, "--", *TRAIN,
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
