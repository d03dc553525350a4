"""The emulated cluster of `jdp launch --hosts H --nic RATE` (jdp.runtime.cluster, docs/cluster.md).

Fast: the plan as data (names, addresses, shaping both ways, cores, the commands that act only
inside the cluster's own namespaces), leftovers, the refusals. Slow (root, `ip` and `tc`; skipped
with the reason elsewhere): the cluster removed after SIGTERM, SIGINT and a killed launcher, and a
2-host `jdp train` at 100mbit and 10mbit whose traffic crosses the shaped NICs.
"""

import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jdp.cli import main as cli
from jdp.errors import ConfigError
from jdp.runtime import cluster, launch

BENCH_NET = ipaddress.ip_network("198.18.0.0/15")


def run_jdp(args, timeout=120, **kwargs):
    return subprocess.run([sys.executable, "-m", "jdp", *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


# --- the plan as data -------------------------------------------------------------------------------


def test_plan_names_addresses_cores_and_hosts_files():
    p = cluster.plan(3, 100_000_000, launcher_pid=4242, cores=[0, 1, 2, 3, 4, 5], hostname="box")
    assert p.switch == "jdp-4242-sw"
    assert [h.namespace for h in p.hosts] == ["jdp-4242-h0", "jdp-4242-h1", "jdp-4242-h2"]
    assert all(cluster.NAME.fullmatch(n) for n in p.namespaces)
    assert [h.address for h in p.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert all(ipaddress.ip_address(h.address) in BENCH_NET for h in p.hosts)
    assert p.coordinator_host == "198.18.0.1"
    assert [h.cores for h in p.hosts] == [(0, 1), (2, 3), (4, 5)]  # each host its own cores
    assert p.hosts_files() == {cluster.NETNS_ETC / f"jdp-4242-h{i}" / "hosts": f"127.0.0.1 localhost\n198.18.0.{i + 1} box\n"
                               for i in range(3)}
    assert p.process_prefix(1) == ["ip", "netns", "exec", "jdp-4242-h1", "taskset", "-c", "2,3"]
    realtime = dataclasses.replace(p, realtime=True)
    assert realtime.process_prefix(1) == ["ip", "netns", "exec", "jdp-4242-h1", "chrt", "--rr", "10", "taskset", "-c",
                                          "2,3"]
    assert realtime.keep([0, 2]).realtime  # a restart without a host keeps the scheduling
    assert p.environment() == {cluster.ENV_HOSTS: "3", cluster.ENV_NIC_BPS: "100000000"}


def test_more_hosts_than_cores_share_them_and_cores_per_host_is_honoured():
    assert [h.cores for h in cluster.plan(4, 10**8, launcher_pid=1, cores=[0, 1], hostname="b").hosts] == [
        (0,), (1,), (0,), (1,)]
    assert [h.cores for h in cluster.plan(2, 10**8, cores_per_host=2, launcher_pid=1, cores=[0, 1, 2], hostname="b").hosts
            ] == [(0, 1), (0, 2)]


def test_every_command_acts_inside_the_clusters_own_namespaces_and_shapes_each_nic_both_ways():
    """The machine's own interfaces and routes are never touched: each `ip`/`tc` names one of the plan's
    namespaces (`ip netns add/del NS`, `ip -n NS`, `tc -n NS`), and a veth's far end goes into the switch."""
    p = cluster.plan(2, 10**9, launcher_pid=77, cores=[0, 1], hostname="b")
    ours = set(p.namespaces)
    for command in p.setup_commands():
        assert command[0] in ("ip", "tc"), command
        if command[1] == "netns":
            assert command[2] == "add" and command[3] in ours
        else:
            assert command[1] == "-n" and command[2] in ours, command
        if "peer" in command:
            assert command[command.index("netns") + 1] == p.switch
    shaped = {(c[2], c[c.index("dev") + 1]) for c in p.setup_commands() if c[0] == "tc"}
    assert shaped == {("jdp-77-h0", "eth0"), ("jdp-77-h1", "eth0"), ("jdp-77-sw", "p0"), ("jdp-77-sw", "p1")}
    for c in p.setup_commands():
        if c[0] == "tc":
            assert c[c.index("rate") + 1] == "1000000000bit" and c[c.index("burst") + 1] == str(125_000)
    addresses = [c[c.index("add") + 1] for c in p.setup_commands() if c[3:5] == ["addr", "add"]]
    assert addresses == ["198.18.0.254/24", "198.18.0.1/24", "198.18.0.2/24"]  # the switch's own, then the hosts'


def test_a_job_started_again_without_a_lost_host_keeps_the_others_numbers_and_the_switch_probes_them():
    p = cluster.plan(3, 10**8, launcher_pid=7, cores=[0, 1], hostname="b")
    kept = p.keep([0, 2])
    assert [h.index for h in kept.hosts] == [0, 2] and kept.switch == p.switch
    assert kept.named(1) == "host 2 (198.18.0.3)" and kept.process_prefix(1)[3] == "jdp-7-h2"
    assert p.keep([1, 2]).coordinator_host == "198.18.0.2"  # the first host kept runs the coordinator
    probe = p.probe_command()
    assert probe[:4] == ["ip", "netns", "exec", p.switch] and json.loads(probe[-2]) == [
        "198.18.0.1", "198.18.0.2", "198.18.0.3"]


def test_a_delay_puts_netem_at_each_hosts_nic_with_tbf_beneath_it():
    p = cluster.plan(2, 10**8, delay_ms=5, launcher_pid=1, cores=[0], hostname="b")
    tc = [c for c in p.setup_commands() if c[0] == "tc"]
    netem = [c for c in tc if "netem" in c]
    assert [c[2] for c in netem] == ["jdp-1-h0", "jdp-1-h1"] and all(c[c.index("delay") + 1] == "5ms" for c in netem)
    assert sum("parent" in c and "tbf" in c for c in tc) == 2 and sum("root" in c and "tbf" in c for c in tc) == 2


def test_rates_parse_as_tc_writes_them():
    assert cluster.parse_rate("100mbit") == 10**8
    assert cluster.parse_rate("1Gbit") == 10**9
    assert cluster.parse_rate("2.5gbit") == 2_500_000_000
    assert cluster.format_rate(10**8) == "100mbit" and cluster.format_rate(1.5e9) == "1.5gbit"
    for bad in ("100", "100mb", "fast", "0mbit"):
        with pytest.raises(ConfigError, match="nic="):
            cluster.parse_rate(bad)


def test_bad_plans_are_refused():
    with pytest.raises(ConfigError, match="`hosts` must be a positive"):
        cluster.plan(0, 10**8)
    with pytest.raises(ConfigError, match="`cores_per_host` must be a positive"):
        cluster.plan(2, 10**8, cores_per_host=0)
    with pytest.raises(ConfigError, match="delay"):
        cluster.plan(2, 10**8, delay_ms=-1)
    with pytest.raises(ConfigError, match="must equal the emulated cluster's `hosts=2`"):
        launch.launch(launch.Job(["jdp", "train"], 3, 1, cluster=cluster.plan(2, 10**8)))


def test_leftovers_are_the_jdp_namespaces_of_dead_launchers_only():
    names = ["jdp-10-sw", "jdp-10-h0", "jdp-11-h0", "jdp-x-h0", "other", "jdp-12-h3"]
    assert cluster.leftovers(names, alive=lambda pid: pid == 11) == ["jdp-10-sw", "jdp-10-h0", "jdp-12-h3"]
    assert cluster.leftovers([f"jdp-{os.getpid()}-h0"]) == []  # this process is alive


ROOT = (1 << 12) | (1 << 21)  # CAP_NET_ADMIN and CAP_SYS_ADMIN


def test_missing_privileges_say_what_is_missing():
    have = {"ip": "/sbin/ip", "tc": "/sbin/tc", "taskset": "/bin/taskset"}
    assert cluster.missing_privileges(ROOT, have.get) is None
    assert "needs root" in cluster.missing_privileges(1 << 12, have.get)  # CAP_NET_ADMIN alone: no namespaces
    no_tc = cluster.missing_privileges(ROOT, {**have, "tc": None}.get)
    assert "`tc`" in no_tc and "`ip`" not in no_tc
    assert "`ip`, `tc`" in cluster.missing_privileges(0, {}.get)
    assert cluster.missing_privileges(ROOT, have.get, realtime=True) == "an emulated cluster needs `chrt` on PATH " \
        "(iproute2 has ip and tc, util-linux has taskset and chrt); install them, or drop `hosts`"
    with_chrt = {**have, "chrt": "/bin/chrt"}.get
    assert cluster.missing_privileges(ROOT | 1 << 23, with_chrt, realtime=True) is None
    assert "`realtime` needs CAP_SYS_NICE" in cluster.missing_privileges(ROOT, with_chrt, realtime=True)
    assert "throttle real-time tasks" in cluster.missing_privileges(ROOT | 1 << 23, with_chrt, True, "-1\n")
    assert cluster.effective_capabilities("Name:\tx\nCapEff:\t000001ffffffffff\n") == 0x1ffffffffff


def test_launch_without_ip_and_tc_refuses_in_one_line(tmp_path):
    """No `ip`/`tc` on PATH: one line naming them, exit status 2, nothing started."""
    result = run_jdp(["launch", "--hosts", "2", "--nic", "100mbit", "--", "jdp", "train"], timeout=60,
                     env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "`ip`" in result.stderr and "`tc`" in result.stderr, result.stderr
    assert "drop `--hosts`" in result.stderr and result.stdout == ""


@pytest.mark.skipif(cluster.effective_capabilities() & ROOT == ROOT and shutil.which("setpriv") is None,
                    reason="privileged and no setpriv to drop the capabilities")
def test_launch_without_root_refuses_in_one_line():
    """Root's capabilities dropped (CAP_NET_ADMIN, CAP_SYS_ADMIN): one line, exit status 2."""
    drop = (["setpriv", "--bounding-set=-net_admin,-sys_admin", "--inh-caps=-net_admin,-sys_admin"]
            if cluster.effective_capabilities() & ROOT == ROOT else [])
    result = subprocess.run([*drop, sys.executable, "-m", "jdp", "launch", "--hosts", "2", "--nic", "100mbit",
                             "--", "jdp", "train"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "needs root" in result.stderr, result.stderr


def test_cluster_flags_need_hosts_and_hosts_needs_a_rate(capsys):
    for args, message in ((["--num-processes", "2", "--nic", "1gbit"], "`--nic` describes an emulated cluster"),
                          (["--num-processes", "2", "--realtime"], "`--realtime` describes an emulated cluster"),
                          (["--hosts", "2"], "`--hosts 2` needs `--nic RATE`"),
                          (["--hosts", "2", "--nic", "fast"], "`--nic fast` is not a rate"),
                          ([], "needs `--num-processes P`")):
        assert cli.main(["launch", *args, "--", "jdp", "train"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_restart_advice_repeats_the_cluster():
    p = cluster.plan(2, 10**8, cores_per_host=1, launcher_pid=1, cores=[0, 1], hostname="b")
    assert launch.cluster_flags(p) == ["--hosts", "2", "--nic", "100mbit", "--cores-per-host", "1"]
    realtime = dataclasses.replace(p, realtime=True)
    assert launch.cluster_flags(realtime)[-1] == "--realtime"


# --- on this machine's kernel (root, ip, tc) --------------------------------------------------------

missing = cluster.missing_privileges(cluster.effective_capabilities(), shutil.which)
needs_netns = pytest.mark.skipif(missing is not None, reason=f"no emulated cluster here: {missing}")

SLEEPER = textwrap.dedent("""
    import socket, sys, time
    print("on", socket.gethostbyname(socket.gethostname()), flush=True)
    time.sleep(120)
""")


def ours(pid):
    return sorted(n for n in cluster.namespaces() if n.startswith(f"jdp-{pid}-"))


def running(pid):
    """Whether process `pid` exists and is not a zombie (an orphan is reaped by whoever is PID 1, if at all)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def start_sleepers(hosts=2):
    # A command run in the background (`cmd &`, as CI jobs may be) starts with SIGINT ignored, and its children
    # too: Python would never raise KeyboardInterrupt in the launcher. A handled signal is reset to its default
    # in a child, an ignored one is not: handle it while the launcher starts.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launcher = subprocess.Popen([sys.executable, "-m", "jdp", "launch", "--hosts", str(hosts), "--nic", "10mbit",
                                     "--", sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    deadline = time.monotonic() + 30
    seen = 0
    while time.monotonic() < deadline and seen < hosts:  # every host's process says its address
        line = launcher.stdout.readline()
        seen += line.startswith("[p") and " on 198.18.0." in line
    assert seen == hosts
    return launcher


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_cluster_is_removed_when_the_launcher_is_stopped(sig):
    launcher = start_sleepers()
    assert ours(launcher.pid) == [f"jdp-{launcher.pid}-h0", f"jdp-{launcher.pid}-h1", f"jdp-{launcher.pid}-sw"]
    assert (cluster.NETNS_ETC / f"jdp-{launcher.pid}-h1" / "hosts").read_text().endswith("198.18.0.2 "
                                                                                         f"{os.uname().nodename}\n")
    launcher.send_signal(sig)
    launcher.communicate(timeout=30)
    assert launcher.returncode != 0
    assert ours(launcher.pid) == []
    assert not any(p.name.startswith(f"jdp-{launcher.pid}-") for p in cluster.NETNS_ETC.glob("*"))


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("realtime", [True, False])
def test_realtime_hosts_run_under_sched_rr_and_others_time_shared(realtime):
    report = "import os; print('round-robin:', os.sched_getscheduler(0) == os.SCHED_RR)"
    result = run_jdp(["launch", "--hosts", "2", "--nic", "1gbit", *["--realtime"] * realtime, "--",
                      sys.executable, "-c", report], timeout=60)
    assert result.returncode == 0, result.stderr
    assert ("real-time (SCHED_RR)" in result.stderr.splitlines()[0]) == realtime, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if "round-robin" in line) == [
        f"[p0] round-robin: {realtime}", f"[p1] round-robin: {realtime}"], result.stdout


@pytest.mark.slow
@needs_netns
def test_a_killed_launchers_cluster_is_removed_at_the_next_start_and_a_live_ones_kept():
    launcher = start_sleepers()
    pids = subprocess.run(["ip", "netns", "pids", f"jdp-{launcher.pid}-h0"], capture_output=True, text=True).stdout.split()
    launcher.kill()
    launcher.communicate(timeout=30)
    assert len(ours(launcher.pid)) == 3 and pids  # SIGKILL: nothing removed, its host's process still runs
    alive = f"jdp-{os.getpid()}-h7"  # as if this test process were a launcher: alive, so kept
    subprocess.run(["ip", "netns", "add", alive], check=True)
    try:
        result = run_jdp(["launch", "--hosts", "1", "--nic", "1gbit", "--", sys.executable, "-c", "pass"])
        assert result.returncode == 0, result.stderr
        assert "removing the emulated cluster of a launcher that is gone" in result.stderr
        assert ours(launcher.pid) == [] and alive in cluster.namespaces()
        assert not any(running(pid) for pid in pids)
    finally:
        subprocess.run(["ip", "netns", "del", alive])


def second_epoch(rate, tmp_path):
    result = run_jdp(["launch", "--hosts", "2", "--nic", rate, "--timeout", "240", "--", "jdp", "train",
                      "--backend", "shard_map", "--dataset", "synthetic", "--epochs", "2", "--batch-size", "256",
                      "--no-progress"], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    seconds = [float(m) for m in re.findall(r"\[p0\] epoch +2 .* ([\d.]+) s$", result.stdout, re.M)]
    traffic = re.findall(r"host (\d) \(198\.18\.0\.\d\): sent ([\d.]+) MB, received ([\d.]+) MB through its "
                         rf"{rate} NIC \(shaped: ([\d.]+) MB out, ([\d.]+) MB in\)", result.stderr)
    launcher = re.search(r"emulated hosts \(jdp-(\d+)-h0", result.stderr).group(1)
    assert ours(launcher) == []
    return seconds[0], [[float(x) for x in row[1:]] for row in traffic]


@pytest.mark.slow
@needs_netns
def test_two_hosts_train_across_the_shaped_nics_and_the_step_time_follows_the_rate(tmp_path):
    """LeNet's 0.25 MB gradient crosses each NIC every step: at 10mbit (1.25 MB/s) each step waits for
    the wire, at 100mbit far less; the bytes are counted on each host's NIC and its switch port's tbf."""
    fast, fast_traffic = second_epoch("100mbit", tmp_path)
    slow, slow_traffic = second_epoch("10mbit", tmp_path)
    for traffic in (fast_traffic, slow_traffic):
        assert len(traffic) == 2
        for sent, received, shaped_out, shaped_in in traffic:  # 2 epochs × 23 steps × 0.25 MB, and Gloo's set-up
            assert sent > 5 and received > 5 and shaped_out >= sent * 0.95 and shaped_in >= received * 0.95
    assert slow > 2 * fast, (slow, fast)  # the wire alone: 0.43 s a step at 10mbit, 0.04 s at 100mbit


# --- the bench and the cost model on the emulated link (fast: rows made up from the model) --------


def test_nic_columns_are_the_bytes_each_nic_must_carry_as_a_fraction_of_its_rate():
    from jdp.bench.allreduce import format_allreduce_table, nic_columns

    two = nic_columns(0.0125, hosts=2, nic_bps=10**8)  # 12.5 MB/s of algbw on 2 hosts: the whole 100mbit
    assert two["nic_busbw_gbps"] == pytest.approx(0.0125) and two["nic_fraction"] == pytest.approx(1.0)
    assert nic_columns(0.0125, hosts=4, nic_bps=10**8)["nic_fraction"] == pytest.approx(1.5)  # 2(H−1)/H
    row = {"algorithm": "psum", "devices": 2, "size_bytes": 4096, "count": 1024, "time_us": 1.0, "algbw_gbps": 0.0112,
           "busbw_gbps": 0.0112, "wrong": 0, **nic_columns(0.0112, 2, 10**8)}
    assert "of NIC" in format_allreduce_table([row], "h") and "89.6%" in format_allreduce_table([row], "h")


def made_up_run(rate, alpha, algorithms=("psum", "ring", "hierarchical"), hosts=2, per_host=1):
    """A run as `jdp bench allreduce` under `jdp launch --hosts` writes it, each time exactly the model's."""
    from jdp.bench import nic_model

    rows = []
    for name in algorithms:
        for size in (4096, 16384, 65536, 2**20, 2**22):
            row = {"algorithm": name, "devices": hosts * per_host, "size_bytes": size, "hosts": hosts, "nic_bps": rate}
            rows.append({**row, "time_us": nic_model.predict_us(row, alpha)})
    return {"benchmark": "allreduce", "nic_bps": rate, "emulated_hosts": hosts, "results": rows}


def test_nic_model_recovers_alpha_and_predicts_the_other_rates_exactly():
    from jdp.bench import nic_model

    record = nic_model.check([made_up_run(10**9, 2e-3), made_up_run(10**8, 2e-3)], alpha_rate=10**9)
    assert set(record["algorithms"]) == {"psum 2x1", "ring 2x1", "hierarchical 2x1"}
    for a in record["algorithms"].values():
        assert a["alpha_s"] == pytest.approx(2e-3) and a["alpha_rows"] == 3 and len(a["held_out"]) == 7
        assert a["worst_relative_error"] < 1e-9


def test_nic_model_prices_a_two_host_ppermute_exchange_as_pieces_both_ways_at_once():
    """4 MiB on 2 hosts × 1 device at 100mbit: Gloo's psum sends N each way at once; the ring's swaps (one per
    half, N/2 each) go in pieces of SWAP_PIECE_BYTES, each a message, the bytes both ways at once: N of wire
    time, 2 · 32 messages. With 3 hosts the ring is full duplex, whole."""
    from jdp.bench import nic_model
    from jdp.parallel.collectives import SWAP_PIECE_BYTES

    n, rate = 2**22, 10**8
    wire = n * nic_model.nic_beta(rate)
    row = {"devices": 2, "size_bytes": n, "hosts": 2, "nic_bps": rate}
    for name in ("psum", "hierarchical:psum", "ring", "hierarchical"):
        assert nic_model.transfer_seconds({**row, "algorithm": name}) == pytest.approx(wire), name
    pieces = n // 2 // SWAP_PIECE_BYTES
    assert nic_model.inter_terms({**row, "algorithm": "ring"}).messages == 2 * pieces
    assert nic_model.inter_terms({**row, "algorithm": "tree"}).messages == 2 * pieces
    assert nic_model.inter_terms({**row, "algorithm": "hierarchical"}).messages == 2 * pieces
    assert nic_model.inter_terms({**row, "algorithm": "psum"}).messages == 2  # Gloo's own: no pieces
    three = {"devices": 3, "size_bytes": n, "hosts": 3, "nic_bps": rate, "algorithm": "ring"}
    assert nic_model.transfer_seconds(three) == pytest.approx(4 / 3 * wire)
    assert nic_model.inter_terms(three).messages == 4
    two_by_two = {"devices": 4, "size_bytes": n, "hosts": 2, "nic_bps": rate}  # both local devices' N/2 chunks cross
    assert nic_model.transfer_seconds({**two_by_two, "algorithm": "hierarchical:psum"}) == pytest.approx(wire)
    assert nic_model.transfer_seconds({**two_by_two, "algorithm": "ring"}) == pytest.approx(1.5 * wire)  # 4 members


def test_nic_model_refuses_runs_off_the_cluster_and_an_unmeasured_alpha_rate():
    from jdp.bench import nic_model

    with pytest.raises(ConfigError, match="jdp launch --hosts"):
        nic_model.check([{"benchmark": "allreduce", "results": []}], 10**8)
    with pytest.raises(ConfigError, match="`alpha_rate=5` matches no run"):
        nic_model.check([made_up_run(10**8, 1e-3)], 5)


def test_bench_allreduce_nic_model_cli(tmp_path):
    import json

    paths = []
    for rate in (10**9, 10**8):
        paths.append(tmp_path / f"{rate}.json")
        paths[-1].write_text(json.dumps(made_up_run(rate, 1e-3)))
    result = run_jdp(["bench", "allreduce", "--fit", *map(str, paths), "--nic-model", "--alpha-rate", "1gbit",
                      "--out", str(tmp_path)], timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^ring 2x1 +1000 +7 +0% / 0% +0% / 0%", result.stdout, re.M), result.stdout
    assert json.loads((tmp_path / "nic_model.json").read_text())["alpha_rate_bps"] == 10**9
    refused = run_jdp(["bench", "allreduce", "--nic-model"], timeout=60)
    assert refused.returncode == 2 and "add `--fit RUN.json ...`" in refused.stderr


@pytest.mark.slow
@needs_netns
def test_bench_allreduce_across_two_hosts_reports_the_nics_share(tmp_path):
    """psum of 1 MiB across 2 hosts at 100mbit: about 87 ms of wire each way; the NIC column says what share
    of 100mbit the allreduce got (≤ 95.6%: TCP's payload per frame), process 0 alone writes."""
    import json

    result = run_jdp(["launch", "--hosts", "2", "--nic", "100mbit", "--timeout", "240", "--", "jdp", "bench",
                      "allreduce", "--backend", "shard_map", "--algorithms", "psum", "ring", "--sizes", "1MiB",
                      "--repeats", "2", "--out", str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "[p1] #" not in result.stdout and "on 2 emulated hosts with 100mbit NICs" in result.stdout
    rows = json.loads((tmp_path / "allreduce.json").read_text())["results"]
    assert {r["algorithm"] for r in rows} == {"psum", "ring"} and all(r["wrong"] == 0 for r in rows)
    for r in rows:
        assert r["hosts"] == 2 and r["nic_bps"] == 10**8 and 0.2 < r["nic_fraction"] < 0.96, r


@pytest.mark.slow
@needs_netns
def test_a_delay_without_netem_is_refused_in_one_line_and_nothing_is_left():
    result = run_jdp(["launch", "--hosts", "2", "--nic", "100mbit", "--delay", "5", "--", sys.executable, "-c", "pass"])
    if result.returncode == 0:
        pytest.skip("this kernel has netem: the delay was emulated, not refused")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "needs the kernel's netem qdisc" in result.stderr and "drop `--delay`" in result.stderr
    launcher = re.search(r"jdp-(\d+)-h0", result.stderr).group(1)
    assert ours(launcher) == [] and not list(cluster.NETNS_ETC.glob(f"jdp-{launcher}-*"))


def test_the_traffic_lines_name_a_nic_whose_queues_dropped_packets():
    row = {"host": 1, "address": "198.18.0.2", "sent_bytes": 2e6, "received_bytes": 3e6, "shaped_out_bytes": 2e6,
           "shaped_in_bytes": 3e6, "dropped_out_packets": 0, "dropped_in_packets": 0}
    quiet, = cluster.describe_traffic([row], 10**8)
    assert quiet == ("host 1 (198.18.0.2): sent 2.00 MB, received 3.00 MB through its 100mbit NIC (shaped: 2.00 MB out, "
                     "3.00 MB in)")
    slow, = cluster.describe_traffic([{**row, "dropped_out_packets": 40, "dropped_in_packets": 2}], 10**8)
    assert slow == quiet + "; its queues dropped 42 packets: a bottleneck"


@pytest.mark.parametrize("ppermutes", [True, False])
def test_nic_model_reads_the_exchange_off_a_strategys_cost_not_its_name(ppermutes, monkeypatch):
    """A user's strategy, named like nothing built in: its cost says whether its messages are ppermutes."""
    from jdp.bench import nic_model
    from jdp.parallel import allreduce, cost

    mine = allreduce.Allreduce("my_exchange", allreduce.get("ring").fn, cost=cost.flat("ring", "my_exchange", ppermutes))
    monkeypatch.setitem(allreduce._STRATEGIES, "my_exchange", mine)
    n, rate = 2**22, 10**8
    row = {"devices": 2, "size_bytes": n, "hosts": 2, "nic_bps": rate}
    for name in ("my_exchange", "my_exchange+fused"):  # a wrapper keeps its strategy's exchange
        expected = (2 if ppermutes else 1) * n * nic_model.nic_beta(rate)  # its swaps whole: one way, then the other
        assert nic_model.transfer_seconds({**row, "algorithm": name}) == pytest.approx(expected)
