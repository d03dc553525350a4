"""An emulated cluster on this machine: hosts in network namespaces, joined by a switch, with shaped NICs.

`jdp launch --hosts H --nic RATE` runs one process per emulated host. Each host is a network namespace
with one NIC (`eth0`, a veth) at its own address in 198.18.0.0/24 (RFC 2544's benchmarking range); the
NICs meet in a switch, a bridge in a namespace of its own. A host's NIC is shaped to RATE toward the
switch, and the switch's port to RATE toward the host (Linux's token bucket, `tc qdisc ... tbf`): full
duplex, as a real NIC. Traffic between a host's own devices (the L simulated devices of its process)
stays in its memory; traffic between hosts crosses two shaped links. Gloo advertises the address the
hostname resolves to, so each host gets its own `/etc/netns/NAME/hosts` (bind-mounted over /etc/hosts
by `ip netns exec`); the machine's own interfaces, routes and /etc/hosts are never touched.

Every name carries the launcher's pid (`jdp-PID-h0`, `jdp-PID-sw`), so a later start can tell
the leftovers of a launcher that was killed (its pid gone) from those of one still running.
The plan (`Plan`) is data: the commands that build and remove the cluster, written out before one runs.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from jdp.errors import Arg, ConfigError, DeviceError, Message, check_positive

PREFIX = "jdp-"
NAME = re.compile(r"jdp-(?P<pid>\d+)-(?P<role>sw|h\d+)")  # the namespaces this module creates
SUBNET = "198.18.0"  # /24 of RFC 2544's 198.18.0.0/15: host i is .(i+1)
MAX_HOSTS = 250
NIC = "eth0"  # each host's interface, inside its namespace
BRIDGE = "br0"  # the switch, inside the switch namespace
MANAGER = f"{SUBNET}.254"  # the switch's own address, from which the launcher checks that each host answers
PROBE_S = 1.0  # how long a host may take to answer
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc/*
QUEUE_LATENCY = "100ms"  # tbf's queue: the longest a packet may wait (a NIC's buffer)
BURST_S = 0.001  # tbf's bucket: a millisecond of traffic at RATE (at least BURST_MIN bytes)
BURST_MIN = 32 * 1024
ENV_HOSTS = "JDP_EMULATED_HOSTS"  # what the launched processes learn about the cluster they run on
ENV_NIC_BPS = "JDP_EMULATED_NIC_BPS"
TOOLS = ("ip", "tc", "taskset")
REALTIME = ("chrt", "--rr", "10")  # util-linux's chrt: SCHED_RR at priority 10 (1-99), above every time-shared task
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """`100mbit` → 100_000_000 bits per second (tc's units: bit, kbit, mbit, gbit; any case).

    Raises:
      ConfigError: for anything else, or a rate below 1 kbit/s.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", text.lower())
    if not match:
        raise ConfigError(Arg("nic", text), " is not a rate: write a number and a unit of bits per second, "
                          "kbit, mbit or gbit, e.g. 100mbit or 1gbit.")
    bps = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bps < 1000:
        raise ConfigError(Arg("nic", text), " is below 1kbit: give the NIC a rate of at least 1kbit.")
    return bps


def format_rate(bps: float) -> str:
    """100_000_000 → `100mbit`, 1.5e9 → `1.5gbit`: as tc writes it."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its NIC's address, the switch port it plugs into, its cores."""

    index: int
    namespace: str
    address: str
    port: str
    cores: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The emulated cluster of one launcher: what `up` builds and removes.

    Args:
      launcher_pid: the pid every name carries.
      hosts: the hosts, host 0 runs the coordinator.
      rate_bps: each NIC's rate, each direction.
      hostname: this machine's hostname, mapped in each host's /etc/hosts to the host's own address.
      delay_ms: one-way latency added at each host's NIC (netem), None for none.
      realtime: run each host's process under the real-time round-robin scheduler (`chrt --rr`): its threads
        hand the host's core over without waiting for the time-sharing scheduler's tick, as on a real host
        with cores to spare (time-shared, a message costs milliseconds of that wait; docs/cluster.md).
    """

    launcher_pid: int
    hosts: tuple[Host, ...]
    rate_bps: int
    hostname: str
    delay_ms: float | None = None
    realtime: bool = False

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.launcher_pid}-sw"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(h.namespace for h in self.hosts)]

    @property
    def coordinator_host(self) -> str:
        return self.hosts[0].address

    def setup_commands(self) -> list[list[str]]:
        """The `ip` and `tc` commands that build the cluster, in order; each acts inside one of its namespaces."""
        sw = self.switch
        commands = [["ip", "netns", "add", sw], ["ip", "-n", sw, "link", "set", "lo", "up"],
                    ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"], ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
                    ["ip", "-n", sw, "addr", "add", f"{MANAGER}/24", "dev", BRIDGE]]
        for h in self.hosts:
            ns = h.namespace
            commands += [
                ["ip", "netns", "add", ns],
                ["ip", "-n", ns, "link", "add", NIC, "type", "veth", "peer", "name", h.port, "netns", sw],
                ["ip", "-n", ns, "addr", "add", f"{h.address}/24", "dev", NIC],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                ["ip", "-n", ns, "link", "set", NIC, "up"],
                ["ip", "-n", sw, "link", "set", h.port, "master", BRIDGE],
                ["ip", "-n", sw, "link", "set", h.port, "up"],
                *self.shaping(ns, NIC, self.delay_ms),  # host → switch
                *self.shaping(sw, h.port, None),  # switch → host
            ]
        return commands

    def shaping(self, namespace: str, device: str, delay_ms: float | None) -> list[list[str]]:
        """tbf at the rate on `device`'s egress; with a delay, netem first and tbf as its child."""
        tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst_bytes(self.rate_bps)), "latency", QUEUE_LATENCY]
        tc = ["tc", "-n", namespace, "qdisc", "add", "dev", device]
        if delay_ms is None:
            return [[*tc, "root", *tbf]]
        return [[*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms"], [*tc, "parent", "1:1", *tbf]]

    def port_command(self, index: int, up: bool) -> list[str]:
        """Host `index`'s switch port up or down: down, its packets are dropped as with a pulled cable, while the
        host keeps its own interface and routes (`jdp launch --inject cut:...`)."""
        return ["ip", "-n", self.switch, "link", "set", self.hosts[index].port, "up" if up else "down"]

    def reshape_commands(self, index: int, rate_bps: float) -> list[list[str]]:
        """Host `index`'s NIC shaped to `rate_bps` both ways (`jdp launch --inject slow:...`)."""
        h, rate = self.hosts[index], int(rate_bps)
        tbf = ["tbf", "rate", f"{rate}bit", "burst", str(burst_bytes(rate)), "latency", QUEUE_LATENCY]
        where = ["root"] if self.delay_ms is None else ["parent", "1:1"]  # with netem, tbf is its child
        return [["tc", "-n", h.namespace, "qdisc", "change", "dev", NIC, *where, *tbf],
                ["tc", "-n", self.switch, "qdisc", "change", "dev", h.port, "root", *tbf]]

    def probe_command(self) -> list[str]:
        """A command that prints, as a JSON list, whether each host answers the switch within PROBE_S."""
        return ["ip", "netns", "exec", self.switch, sys.executable, "-c", _PROBE,
                json.dumps([h.address for h in self.hosts]), str(PROBE_S)]

    def keep(self, indices: Sequence[int]) -> "Plan":
        """The plan with only hosts `indices` (in that order): a job started again without lost hosts. It
        runs in the same namespaces; host `indices[0]` runs the coordinator."""
        return replace(self, hosts=tuple(self.hosts[i] for i in indices))

    def named(self, index: int) -> str:
        """`host 1 (198.18.0.2)`: the host of process `index`, by its number in the whole cluster."""
        h = self.hosts[index]
        return f"host {h.index} ({h.address})"

    def hosts_files(self) -> dict[Path, str]:
        """Each host's /etc/hosts: localhost, and this machine's hostname at the host's own address."""
        return {NETNS_ETC / h.namespace / "hosts": f"127.0.0.1 localhost\n{h.address} {self.hostname}\n"
                for h in self.hosts}

    def process_prefix(self, index: int) -> list[str]:
        """What runs host `index`'s process inside its namespace, on its cores (real-time if `realtime`)."""
        h = self.hosts[index]
        scheduler = REALTIME if self.realtime else ()
        return ["ip", "netns", "exec", h.namespace, *scheduler, "taskset", "-c", ",".join(map(str, h.cores))]

    def environment(self) -> dict[str, str]:
        """Variables the launched processes read to know the cluster (`jdp bench allreduce` records them)."""
        return {ENV_HOSTS: str(len(self.hosts)), ENV_NIC_BPS: str(self.rate_bps)}


_PROBE = """
import concurrent.futures, json, socket, sys
def answers(address):
    try:
        socket.create_connection((address, 9), timeout=float(sys.argv[2])).close()
    except ConnectionRefusedError:
        return True  # its kernel refused the port: the host is there
    except OSError:
        return False  # no answer in time, or no route to it
    return True
addresses = json.loads(sys.argv[1])
with concurrent.futures.ThreadPoolExecutor(len(addresses)) as pool:
    print(json.dumps(list(pool.map(answers, addresses))))
"""


def answering(p: Plan) -> list[bool]:
    """Whether each host of `p` answers the switch now (a TCP connection refused or accepted within
    PROBE_S): False for a host whose link is cut or that is gone. All True where the probe cannot run."""
    result = _run(p.probe_command())
    try:
        answers = json.loads(result.stdout)
    except json.JSONDecodeError:
        return [True] * len(p.hosts)
    return [bool(a) for a in answers]


def from_environment(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(hosts, NIC rate in bits/s) of the emulated cluster this process runs on, None outside one."""
    env = os.environ if environ is None else environ
    if ENV_HOSTS not in env or ENV_NIC_BPS not in env:
        return None
    return int(env[ENV_HOSTS]), int(env[ENV_NIC_BPS])


def burst_bytes(rate_bps: int) -> int:
    """tbf's bucket: BURST_S of traffic at the rate, at least BURST_MIN bytes (the timer's granularity)."""
    return max(BURST_MIN, int(rate_bps / 8 * BURST_S))


def plan(hosts: int, rate_bps: int, *, cores_per_host: int | None = None, delay_ms: float | None = None,
         launcher_pid: int | None = None, cores: Sequence[int] | None = None, hostname: str | None = None) -> Plan:
    """The plan of an emulated cluster of `hosts` hosts (time-shared: `dataclasses.replace(p, realtime=True)` for
    real-time ones).

    Args:
      hosts: H, at least 1.
      rate_bps: each NIC's rate in bits per second, each direction.
      cores_per_host: C; None: the cores this process may use, shared out evenly (at least one each).
        Host i gets cores i·C … i·C + C − 1 of them, wrapping around when H·C exceeds them.
      delay_ms: one-way latency at each host's NIC (needs netem), None for none.
      launcher_pid, cores, hostname: this process's, by default.

    Raises:
      ConfigError: for H below 1 or above MAX_HOSTS, C below 1, or a negative delay.
    """
    check_positive("hosts", hosts)
    if hosts > MAX_HOSTS:
        raise ConfigError(Arg("hosts", hosts), f" is more than the {MAX_HOSTS} addresses of the emulated subnet.")
    if delay_ms is not None and not delay_ms >= 0:
        raise ConfigError(Arg("delay", delay_ms), " must be a number of milliseconds >= 0.")
    allowed = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    per_host = max(1, len(allowed) // hosts) if cores_per_host is None else cores_per_host
    check_positive("cores_per_host", per_host)
    pid = os.getpid() if launcher_pid is None else launcher_pid
    members = tuple(
        Host(i, f"{PREFIX}{pid}-h{i}", f"{SUBNET}.{i + 1}", f"p{i}",
             tuple(sorted({allowed[(i * per_host + j) % len(allowed)] for j in range(per_host)})))
        for i in range(hosts))
    return Plan(pid, members, rate_bps, socket.gethostname() if hostname is None else hostname, delay_ms)


CAPABILITIES = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}  # linux/capability.h
CAP_SYS_NICE = 23  # what `realtime` needs besides: a real-time scheduling policy
RT_RUNTIME = Path("/proc/sys/kernel/sched_rt_runtime_us")  # -1: the kernel does not throttle real-time tasks


def effective_capabilities(status: str | None = None) -> int:
    """This process's effective capability mask (`CapEff` of /proc/self/status; 0 where unreadable)."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return 0
    match = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.M)
    return int(match.group(1), 16) if match else 0


def missing_privileges(capabilities: int, which: Callable[[str], str | None], realtime: bool = False,
                       rt_runtime: str = "950000") -> Message | None:
    """What this machine lacks to emulate a cluster, as a sentence; None if nothing.

    Network namespaces, veth pairs and qdiscs need CAP_NET_ADMIN and CAP_SYS_ADMIN (the effective
    `capabilities` mask) in the initial namespaces: root. (Rootless user namespaces could build the
    network, but not give the hosts' processes their own /etc/hosts; jdp does not try.) `realtime` also
    needs CAP_SYS_NICE, `chrt`, and the kernel's throttling of real-time tasks (`rt_runtime`, the value of
    RT_RUNTIME: not -1), which keeps a few percent of each core for everything else.
    """
    tools = [tool for tool in (*TOOLS, *REALTIME[:1] * realtime) if which(tool) is None]
    if any(not capabilities >> bit & 1 for bit in CAPABILITIES.values()):
        lack = f" and {', '.join(f'`{t}`' for t in tools)} (iproute2, util-linux)" if tools else ""
        return Message("an emulated cluster needs root (network namespaces, veth pairs and tc qdiscs need "
                       f"CAP_NET_ADMIN and CAP_SYS_ADMIN){lack}; run `jdp launch --hosts` as root, or drop ",
                       Arg("hosts"))
    if tools:
        return Message(f"an emulated cluster needs {', '.join(f'`{t}`' for t in tools)} on PATH (iproute2 has ip "
                       "and tc, util-linux has taskset and chrt); install them, or drop ", Arg("hosts"))
    if realtime and not capabilities >> CAP_SYS_NICE & 1:
        return Message(Arg("realtime"), " needs CAP_SYS_NICE (root has it) to run the hosts' processes under "
                       "SCHED_RR; run as root, or drop ", Arg("realtime"))
    if realtime and rt_runtime.strip() == "-1":
        return Message(Arg("realtime"), f" needs the kernel to throttle real-time tasks ({RT_RUNTIME} is -1: "
                       "a busy host would hold its cores from everything else); drop ", Arg("realtime"))
    return None


def check_privileges(realtime: bool = False) -> None:
    """Raises DeviceError (one line) unless this process can build an emulated cluster (`realtime`: one whose
    hosts' processes are real-time)."""
    try:
        rt_runtime = RT_RUNTIME.read_text() if realtime else ""
    except OSError:
        rt_runtime = ""  # no such knob: no real-time group scheduling to turn off
    problem = missing_privileges(effective_capabilities(), shutil.which, realtime, rt_runtime)
    if problem is not None:
        raise DeviceError("Cannot emulate a cluster: ", problem, ".")


def _run(command: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True)


def namespaces() -> list[str]:
    """The network namespaces that `ip netns list` names (`NAME (id: N)` lines; first word)."""
    listed = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def leftovers(names: Sequence[str], alive: Callable[[int], bool] = _alive) -> list[str]:
    """The jdp namespaces among `names` whose launcher is dead (killed before it could remove them)."""
    return [n for n in names if (m := NAME.fullmatch(n)) and not alive(int(m["pid"]))]


def remove(names: Sequence[str]) -> list[str]:
    """Ends the processes inside each namespace and deletes it and its /etc/netns folder.

    Deleting a namespace deletes its interfaces: the veth pairs with both ends and the bridge.
    Returns the sentences of what could not be removed (empty if all went).
    """
    problems = []
    for name in names:
        pids = _run(["ip", "netns", "pids", name]).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        result = _run(["ip", "netns", "del", name])
        if result.returncode != 0 and name in namespaces():
            problems.append(f"`ip netns del {name}`: {result.stderr.strip()}")
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    return problems


def remove_leftovers(say: Callable[[str], None]) -> None:
    """Removes the namespaces and /etc/netns folders of dead launchers, saying which."""
    folders = [p.name for p in NETNS_ETC.iterdir()] if NETNS_ETC.is_dir() else []
    stale = sorted(set(leftovers(namespaces())) | set(leftovers(folders)))
    if stale:
        say(f"removing the emulated cluster of a launcher that is gone: {' '.join(stale)}")
        for problem in remove(stale):
            say(f"could not remove {problem}")


def build(p: Plan) -> None:
    """Runs the plan's commands and writes its hosts files; on a failure, removes what was built.

    Raises:
      DeviceError: naming the command that failed and why (e.g. netem missing for a delay).
    """
    try:
        for command in p.setup_commands():
            result = _run(command)
            if result.returncode != 0:
                why = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
                if "netem" in command:
                    raise DeviceError(Arg("delay", f"{p.delay_ms:g}"), " needs the kernel's netem qdisc, which this "
                                      f"machine lacks (`{' '.join(command)}`: {why}); drop ", Arg("delay"), ".")
                raise DeviceError(f"Cannot emulate a cluster: `{' '.join(command)}` failed: {why}.")
        for path, text in p.hosts_files().items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except BaseException:
        teardown(p)
        raise


def run_commands(commands: Sequence[Sequence[str]]) -> list[str]:
    """Runs each command; returns the failures as `command: why` (empty when all succeeded)."""
    failures = []
    for command in commands:
        result = _run(command)
        if result.returncode != 0:
            failures.append(f"{' '.join(command)}: {result.stderr.strip() or f'exit {result.returncode}'}")
    return failures


def teardown(p: Plan) -> list[str]:
    """Removes every namespace and file of the plan; SIGINT and SIGTERM wait until it is done."""
    on_main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    try:
        return remove(p.namespaces)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def up(p: Plan, say: Callable[[str], None]) -> Iterator[Plan]:
    """The cluster of plan `p` while the block runs: built (after removing dead launchers' leftovers),
    then removed however the block ends (normally, an error, SIGINT; SIGTERM if it raises SystemExit)."""
    check_privileges()
    remove_leftovers(say)
    build(p)
    try:
        yield p
    finally:
        for problem in teardown(p):
            say(f"could not remove {problem}")


def traffic(p: Plan) -> list[dict]:
    """Per host: bytes its NIC sent and received, and bytes its NIC's and its switch port's tbf passed."""
    rows = []
    for h in p.hosts:
        link = json.loads(_run(["ip", "-n", h.namespace, "-s", "-j", "link", "show", NIC]).stdout or "[{}]")[0]
        stats = link.get("stats64", link.get("stats", {}))
        rows.append({"host": h.index, "namespace": h.namespace, "address": h.address,
                     "sent_bytes": stats.get("tx", {}).get("bytes", 0), "received_bytes": stats.get("rx", {}).get("bytes", 0),
                     **_shaped(h.namespace, NIC, "out"), **_shaped(p.switch, h.port, "in")})
    return rows


def _shaped(namespace: str, device: str, way: str) -> dict[str, int]:
    """The bytes `device`'s tbf passed, and the packets it dropped (its queue full: the link was the bottleneck)."""
    qdiscs = json.loads(_run(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", device]).stdout or "[]")
    tbf = [q for q in qdiscs if q.get("kind") == "tbf"]
    return {f"shaped_{way}_bytes": sum(q.get("bytes", 0) for q in tbf),
            f"dropped_{way}_packets": sum(q.get("drops", 0) for q in tbf)}


def describe_traffic(rows: Sequence[dict], rate_bps: int) -> list[str]:
    """One line per host: `host 0 (198.18.0.1): sent 8.5 MB, received 8.5 MB through its 100mbit NIC (tbf ...)`,
    with the packets its NIC's queues dropped: in a synchronous job every process waits for the slowest link,
    so the step times are alike everywhere, and a degraded NIC shows as the one whose queue overflowed."""
    lines = []
    for r in rows:
        dropped = r["dropped_out_packets"] + r["dropped_in_packets"]
        lines.append(f"host {r['host']} ({r['address']}): sent {r['sent_bytes'] / 1e6:.2f} MB, received "
                     f"{r['received_bytes'] / 1e6:.2f} MB through its {format_rate(rate_bps)} NIC (shaped: "
                     f"{r['shaped_out_bytes'] / 1e6:.2f} MB out, {r['shaped_in_bytes'] / 1e6:.2f} MB in)"
                     + (f"; its queues dropped {dropped} packets: a bottleneck" if dropped else ""))
    return lines
