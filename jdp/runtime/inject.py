"""Faults on cue (`jdp launch --inject SPEC`): a process killed or stopped, a host's link cut or slowed,
at a training step, so that a test or a user can make the same fault again.

=========================  ==========================================================================
SPEC (repeatable)          the fault
=========================  ==========================================================================
kill:HOST@STEP             process HOST ends itself with SIGKILL once it has run step STEP
stop:HOST@STEP:SECONDS     process HOST stops itself (SIGSTOP); the launcher continues it SECONDS later
cut:HOST@STEP:SECONDS      host HOST's switch port down for SECONDS, then up (an emulated cluster)
cut:HOST@STEP              host HOST's switch port down for the rest of the launch: a host lost for good
slow:HOST@STEP:RATE        host HOST's NIC reshaped to RATE both ways for the rest of the job (an emulated cluster)
=========================  ==========================================================================

HOST is a process index (an emulated host's); STEP counts train steps from 1 over the run, as the
checkpoints do. The launcher hands each process its faults in the environment (`ENV`). A process checks
them each time it reports its progress (`jdp.runtime.faults.JobWatch.beat`, after each compiled call), so
a fault lands at the first call that reaches its step. The process prints `jdp inject: SPEC at step N`
and, for kill and stop, signals itself; the launcher acts on that line for the others. Each fault fires
once per launch: after a restart the job runs without the faults already made.
"""

import json
import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jdp.errors import Arg, ConfigError
from jdp.runtime.cluster import format_rate, parse_rate

ENV = "JDP_INJECT"  # the JSON list of the specs a launched process is to make
MARK = "jdp inject: "  # how a process's line announcing a fault starts
_SPEC = re.compile(r"(kill|stop|cut|slow):(\d+)@(\d+)(?::(.+))?")
_FORMS = "kill:HOST@STEP, stop:HOST@STEP:SECONDS, cut:HOST@STEP[:SECONDS] or slow:HOST@STEP:RATE"
_NO_VALUE, _VALUE_OPTIONAL = {"kill"}, {"cut"}  # kinds whose form has no last part, or may leave it out
_ON_CLUSTER = ("cut", "slow")  # faults of the network: only an emulated cluster has one to break


@dataclass(frozen=True)
class Fault:
    """One fault: what, on which host (process), from which step, and its seconds or rate (bits/s); a cut
    without seconds lasts for the rest of the launch."""

    kind: str
    host: int
    step: int
    value: float | None = None

    @property
    def spec(self) -> str:
        """The fault as `--inject` writes it."""
        if self.value is None:
            tail = ""
        elif self.kind == "slow":
            tail = f":{format_rate(self.value)}"
        else:
            tail = f":{self.value:g}"
        return f"{self.kind}:{self.host}@{self.step}{tail}"


def parse(spec: str) -> Fault:
    """`stop:1@20:5` → Fault("stop", 1, 20, 5.0).

    Raises:
      ConfigError: naming the spec, for anything but the four forms with a step ≥ 1, seconds > 0 or a
        rate in tc's units.
    """
    match = _SPEC.fullmatch(spec.strip())
    if match is None:
        raise ConfigError(Arg("inject", spec), f" is not a fault: use {_FORMS}.")
    kind, host, step, value = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
    if step < 1:
        raise ConfigError(Arg("inject", spec), ": steps count from 1.")
    if kind not in _VALUE_OPTIONAL and (kind in _NO_VALUE) != (value is None):
        raise ConfigError(Arg("inject", spec), f": write it as one of {_FORMS}.")
    if kind == "slow":
        return Fault(kind, host, step, float(parse_rate(value)))
    if value is None:
        return Fault(kind, host, step)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(Arg("inject", spec), f": SECONDS must be a number above 0, got `{value}`.")
    return Fault(kind, host, step, seconds)


def check(faults: Sequence[Fault], num_processes: int, on_cluster: bool) -> None:
    """Raises ConfigError for a fault on a host the job does not have, or of the network without a cluster."""
    for fault in faults:
        if fault.host >= num_processes:
            raise ConfigError(Arg("inject", fault.spec), f" names host {fault.host}, but the job has {num_processes} "
                              f"(0 to {num_processes - 1}).")
        if fault.kind in _ON_CLUSTER and not on_cluster:
            raise ConfigError(Arg("inject", fault.spec), " breaks a link, which only an emulated cluster has: add ",
                              Arg("hosts", "H"), " and ", Arg("nic", "RATE"), ".")


def environment(faults: Sequence[Fault]) -> dict[str, str]:
    """The variable that hands `faults` to the launched processes."""
    return {ENV: json.dumps([f.spec for f in faults])}


def for_process(process_id: int, environ: Mapping[str, str] | None = None) -> list[Fault]:
    """This process's faults from the environment, earliest step first; none outside `jdp launch --inject`."""
    specs = json.loads((os.environ if environ is None else environ).get(ENV, "[]"))
    return sorted((f for f in map(parse, specs) if f.host == process_id), key=lambda f: f.step)


def make_due(faults: list[Fault], step: int) -> None:
    """Makes, in this process, every fault of `faults` whose step is reached (removing it from the list):
    announces it, then kills or stops this process for kill and stop (the launcher does the others)."""
    while faults and faults[0].step <= step:
        fault = faults.pop(0)
        print(f"{MARK}{fault.spec} at step {step}", file=sys.stderr, flush=True)
        if fault.kind in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)


def announced(line: str) -> Fault | None:
    """The fault a process's output line announces, None for any other line."""
    if not line.startswith(MARK):
        return None
    return parse(line[len(MARK):].split(" at step ", 1)[0])
