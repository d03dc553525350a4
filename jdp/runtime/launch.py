"""`jdp launch`: a multi-process job on this machine, over loopback, for trials without a cluster.

It starts P copies of a command, each told its place in the job by appended flags
(`--coordinator 127.0.0.1:PORT --num-processes P --process-id I --cpu-devices N`), forwards their
output line by line with a `[pI]` prefix, and watches them. Once one process fails, the others
would wait for it inside a collective, so they are stopped and the launcher exits non-zero
naming the failed process. Interrupting the launcher (Ctrl-C, SIGTERM) stops them as well.

With `max_restarts` (`--max-restarts N`, as torchrun's elastic agent), a failed job is started
again, all P processes with `--resume` appended, from the newest complete checkpoint in the
command's `--checkpoint-dir`, up to N times. Not after exit status 2: jdp's errors that a rerun
repeats (bad input, non-finite values). On a real cluster, the cluster's own launcher (`srun`,
`mpirun`) plays this part; see the README, "Beyond one process", and docs/faults.md.

With a `cluster` plan (`--hosts H --nic RATE`), the P = H processes run on an emulated cluster
instead of loopback: process I inside host I's network namespace, pinned to its cores, the
coordinator at host 0's address; the cluster is built before the first start, kept over restarts,
and removed however the launcher ends (see `jdp.runtime.cluster`, docs/cluster.md). When every
process only saw another's loss, the launcher names the hosts that do not answer the switch; with
`min_hosts` (`--min-hosts M`) a restart leaves them out, down to M hosts (docs/faults.md).
"""

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from jdp.errors import Arg, ConfigError, check_positive
from jdp.runtime import cluster as emulated
from jdp.runtime import inject
from jdp.runtime.faults import EXIT_PROCESS_LOST

HOST = "127.0.0.1"
JOB_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--cpu-devices")
STOP_GRACE_S = 5.0  # how long a stopped process may take to exit on SIGTERM before SIGKILL
RESTART_WAIT_S = 1.0  # pause between stopping a failed job and starting it again
NOT_RESTARTED = 2  # jdp's exit status for errors a rerun repeats (bad input, non-finite values)


def free_port(host: str = HOST) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_command(command: Sequence[str], port: int, num_processes: int, process_id: int,
                    cpu_devices: int, host: str = HOST) -> list[str]:
    """The command line of process `process_id`; a leading `jdp` runs with this interpreter."""
    head = [sys.executable, "-m", "jdp"] if command[0] == "jdp" else list(command[:1])
    return [*head, *command[1:], "--coordinator", f"{host}:{port}", "--num-processes", str(num_processes),
            "--process-id", str(process_id), "--cpu-devices", str(cpu_devices)]


@dataclass(frozen=True)
class Job:
    """What `launch` runs: P processes of one command, and where (loopback or an emulated cluster).

    Attributes:
      command: the program and its arguments, e.g. ["jdp", "train", "--backend", "shard_map"].
      num_processes: P, the number of processes.
      cpu_devices_per_process: CPU devices each process simulates (`--cpu-devices`).
      cluster: the emulated cluster to run on (`jdp.runtime.cluster.plan`), one process per host;
        None: every process on 127.0.0.1.
      faults: faults to make at given steps (`jdp.runtime.inject`), each once per launch.
      min_hosts: on a cluster, restart without the hosts that do not answer, down to this many (None: restart
        on every host).
    """

    command: Sequence[str]
    num_processes: int
    cpu_devices_per_process: int
    cluster: emulated.Plan | None = None
    faults: tuple[inject.Fault, ...] = ()
    min_hosts: int | None = None


@dataclass(frozen=True)
class _Output:
    """Where the launcher and its processes write; the lock keeps their lines whole when threads interleave."""

    stdout: TextIO
    stderr: TextIO
    lock: threading.Lock

    def say(self, message: str) -> None:
        """The launcher's own line, on stderr."""
        with self.lock:
            print(f"jdp launch: {message}", file=self.stderr, flush=True)


def launch(
    job: Job,
    *,
    timeout: float | None = None,
    max_restarts: int = 0,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs `job.command` as processes 0..P−1 of one job on 127.0.0.1 (or an emulated cluster) and waits for all.

    Args:
      job: the command, P, the CPU devices of each process, and the emulated cluster if any.
      timeout: seconds after which every process still running is stopped (None: no limit); the
        limit covers all restarts.
      max_restarts: how many times a failed job is started again with `--resume` (not after exit
        status 2); the command must then have `--checkpoint-dir`.
      stdout, stderr: where the prefixed output goes (default: sys.stdout, sys.stderr).

    Returns:
      0 if every process exited 0; otherwise the failed process's exit status (1 if it was killed
      by a signal or the job timed out), after stopping all the others.

    Raises:
      ConfigError: for an empty command, P or N below 1, a command that sets the job flags itself,
        restarts of a command without `--checkpoint-dir`, P unlike the cluster's host count, or
        `min_hosts` without a cluster and restarts, or outside 1..H.
      DeviceError: if the cluster cannot be built (no root, no `ip`/`tc`, no netem for a delay).
    """
    command, num_processes, cluster = job.command, job.num_processes, job.cluster
    if not command:
        raise ConfigError('`command` is empty: pass the program and its arguments, e.g. ["jdp", "train"].')
    check_positive("num_processes", num_processes)
    check_positive("cpu_devices_per_process", job.cpu_devices_per_process)
    if max_restarts < 0:
        raise ConfigError(Arg("max_restarts"), f" must be >= 0, got {max_restarts}.")
    clash = [flag for flag in JOB_FLAGS if _has(command, flag)]
    if clash:
        raise ConfigError(f"The launched command must not set {', '.join(f'`{f}`' for f in clash)}: "
                          "`jdp launch` appends them for each process. Remove them.")
    if max_restarts and not _has(command, "--checkpoint-dir"):
        raise ConfigError(Arg("max_restarts", max_restarts), " restarts the job from its newest checkpoint: the "
                          "command needs `--checkpoint-dir DIR` (and `--checkpoint-every STEPS` to lose no more than "
                          "that).")
    inject.check(job.faults, num_processes, cluster is not None)
    _check_min_hosts(job.min_hosts, cluster, max_restarts)
    if cluster is not None and len(cluster.hosts) != num_processes:
        raise ConfigError(Arg("num_processes", num_processes), " must equal the emulated cluster's ",
                          Arg("hosts", len(cluster.hosts)), ": one process per host.")
    output = _Output(stdout or sys.stdout, stderr or sys.stderr, threading.Lock())
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:  # SIGTERM to the launcher stops the job (and removes the cluster): `finally` blocks run
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if cluster is None:
            return _launch(job, timeout, max_restarts, output)
        with emulated.up(cluster, output.say):
            output.say(f"{num_processes} emulated hosts ({' '.join(h.namespace for h in cluster.hosts)}), NICs at "
                       f"{emulated.format_rate(cluster.rate_bps)} each way, cores "
                       f"{' | '.join(','.join(map(str, h.cores)) for h in cluster.hosts)}"
                       f"{', real-time (SCHED_RR)' * cluster.realtime}")
            try:
                return _launch(job, timeout, max_restarts, output)
            finally:
                for line in emulated.describe_traffic(emulated.traffic(cluster), cluster.rate_bps):
                    output.say(line)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _launch(job: Job, timeout: float | None, max_restarts: int, output: _Output) -> int:
    """`launch`'s loop of starts and restarts; returns its exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt, made, run = 0, set(), job  # made: the specs of the faults already made (each once per launch)
    while True:
        run = replace(run, faults=tuple(f for f in job.faults if f.spec not in made and f.host < run.num_processes))
        if run.cluster is not None:
            output.say(f"starting {run.num_processes} process(es) on {_hosts(run.cluster, range(run.num_processes))}")
        pids, failure = _run_job(run, deadline, output, made)
        if failure is None:
            return 0
        index, code = failure
        if index is None:
            output.say(f"the job timed out after {timeout:g} s; stopped all {run.num_processes} processes.")
            return 1
        answers = _answers(job, code)
        failed = _failed(job, run, pids, index, code, answers)
        if attempt == max_restarts or code == NOT_RESTARTED:
            output.say(f"{failed}{_how_to_go_on(run)}.")
            return code if code > 0 else 1
        attempt += 1
        run, left_out = _restarted(job, run, answers)
        if run is None:
            output.say(f"{failed}; not restarted: {left_out}.")
            return code if code > 0 else 1
        which = f"{run.num_processes} process(es)" if left_out else f"all {run.num_processes} processes"
        output.say(f"{failed}; restart {attempt} of {max_restarts}{left_out}: {which} with --resume, from the newest "
                   "complete checkpoint.")
        time.sleep(RESTART_WAIT_S)


def _answers(job: Job, code: int) -> list[bool] | None:
    """Which hosts of the whole cluster answer the switch, asked once after a failure; None when nothing asks
    (no cluster, or neither a lost process to explain nor `--min-hosts` to choose hosts by)."""
    if job.cluster is None or (code != EXIT_PROCESS_LOST and job.min_hosts is None):
        return None
    return emulated.answering(job.cluster)


def _failed(job: Job, run: Job, pids: Sequence[int], index: int, code: int, answers: list[bool] | None) -> str:
    """What failed (process `index` of `pids`, with exit `code`), and that the others were stopped. When every
    process only saw the loss of another (`EXIT_PROCESS_LOST`) on an emulated cluster, the hosts that do not
    answer the switch (`answers`, of the whole cluster) are the cause."""
    silent = [i for i, ok in enumerate(answers or []) if not ok]
    if job.cluster is not None and code == EXIT_PROCESS_LOST and silent:
        return f"{_silent(job.cluster, silent)} (a cut link or a host gone); stopped all {run.num_processes} processes"
    return f"process {index} (pid {pids[index]}) failed: {_describe(code)}; " \
           f"stopped the other {run.num_processes - 1} process(es)"


def _restarted(job: Job, run: Job, answers: list[bool] | None) -> tuple[Job | None, str]:
    """The job to start again, with `--resume`, and which hosts it leaves out (", leaving out ...", or "").
    With `min_hosts`, on the hosts of the whole cluster that answer the switch now (`answers`: a host back up
    rejoins); (None, why) when fewer than `min_hosts` do."""
    again = replace(run, command=with_resume(job.command))
    if job.cluster is None or job.min_hosts is None or answers is None:
        return again, ""
    kept, silent = [i for i, ok in enumerate(answers) if ok], [i for i, ok in enumerate(answers) if not ok]
    if len(kept) < job.min_hosts:
        return None, (f"{_silent(job.cluster, silent)}, and {len(kept)} host(s) are fewer than "
                      f"`--min-hosts {job.min_hosts}`")
    left_out = (f", leaving out {_hosts(job.cluster, silent)} (no answer; {len(kept)} of {len(answers)} hosts go on, "
                f"`--min-hosts {job.min_hosts}`)") if silent else ""
    return replace(again, cluster=job.cluster.keep(kept), num_processes=len(kept)), left_out


def _silent(cluster: emulated.Plan, indices: Sequence[int]) -> str:
    """`host 1 (198.18.0.2) does not answer`, or `... do not answer` for several."""
    return f"{_hosts(cluster, indices)} {'does' if len(indices) == 1 else 'do'} not answer"


def _hosts(cluster: emulated.Plan, indices) -> str:
    """`host 0 (198.18.0.1), host 2 (198.18.0.3)`: hosts of `cluster` by position."""
    return ", ".join(cluster.named(i) for i in indices)


def _check_min_hosts(min_hosts: int | None, cluster: emulated.Plan | None, max_restarts: int) -> None:
    """Raises ConfigError unless `min_hosts` is None, or a count of the cluster's hosts with restarts to use it."""
    if min_hosts is None:
        return
    if cluster is None:
        raise ConfigError(Arg("min_hosts", min_hosts), " leaves out hosts of an emulated cluster: add ",
                          Arg("hosts", "H"), ".")
    if not 1 <= min_hosts <= len(cluster.hosts):
        raise ConfigError(Arg("min_hosts", min_hosts), f" must be between 1 and the cluster's {len(cluster.hosts)} "
                          "hosts.")
    if max_restarts == 0:
        raise ConfigError(Arg("min_hosts", min_hosts), " applies when the job restarts: add ",
                          Arg("max_restarts", "N"), ".")


def _how_to_go_on(job: Job) -> str:
    """"; go on from the newest checkpoint in DIR with `jdp launch ... --resume`", for a command that saves them."""
    directory = _value(job.command, "--checkpoint-dir")
    if directory is None:
        return ""
    where = ["--num-processes", str(job.num_processes)] if job.cluster is None else cluster_flags(job.cluster)
    again = ["jdp", "launch", *where, "--cpu-devices-per-process", str(job.cpu_devices_per_process), "--",
             *with_resume(job.command)]
    return f"; go on from the newest checkpoint in {directory} with `{shlex.join(again)}`"


def cluster_flags(cluster: emulated.Plan) -> list[str]:
    """The `jdp launch` flags that make the same emulated cluster again."""
    delay = [] if cluster.delay_ms is None else ["--delay", f"{cluster.delay_ms:g}"]
    return ["--hosts", str(len(cluster.hosts)), "--nic", emulated.format_rate(cluster.rate_bps),
            "--cores-per-host", str(len(cluster.hosts[0].cores)), *delay, *["--realtime"] * cluster.realtime]


def with_resume(command: Sequence[str]) -> list[str]:
    """`command` with `--resume` appended, unless it has it already."""
    return list(command) if _has(command, "--resume") else [*command, "--resume"]


def _value(command: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in `command` (`--flag VALUE` or `--flag=VALUE`), None if not there."""
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
    return None


def _has(command: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in command)


def _run_job(job: Job, deadline: float | None, output: _Output,
             made: set[str]) -> tuple[list[int], tuple[int | None, int] | None]:
    """Starts the P processes, waits as `_watch`, stops them all; returns their pids and `_watch`'s result.
    The faults the processes announce are made (`_make`) and added to `made`."""
    cluster = job.cluster
    port = free_port()  # on loopback; in a fresh namespace of the cluster every port is free
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           **({} if cluster is None else cluster.environment()), **inject.environment(job.faults)}
    host = HOST if cluster is None else cluster.coordinator_host
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    try:
        for i in range(job.num_processes):
            cmd = process_command(job.command, port, job.num_processes, i, job.cpu_devices_per_process, host)
            if cluster is not None:
                cmd = [*cluster.process_prefix(i), *cmd]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env, start_new_session=True)
            procs.append(proc)
            output.say(f"process {i}: pid {proc.pid}")
            def on_line(line: str, proc: subprocess.Popen = proc) -> None:
                fault = inject.announced(line)
                if fault is not None:
                    made.add(fault.spec)
                    _make(fault, proc, cluster, output)

            for pipe, target, seen in ((proc.stdout, output.stdout, None), (proc.stderr, output.stderr, on_line)):
                readers.append(threading.Thread(target=_forward, args=(pipe, f"[p{i}] ", target, output.lock, seen),
                                                daemon=True))
                readers[-1].start()
        failure = _watch(procs, deadline)
    finally:
        _stop(procs)
        for reader in readers:
            reader.join(timeout=STOP_GRACE_S)
    return [proc.pid for proc in procs], failure


def _watch(procs: Sequence[subprocess.Popen], deadline: float | None) -> tuple[int | None, int] | None:
    """Waits until all exit 0 (→ None), one fails (→ (index, status)) or time runs out (→ (None, 1)).

    Of several failed at once, the first not to exit with `EXIT_PROCESS_LOST` is named: the others
    only noticed its loss. If only such witnesses exited, a process stopped by a signal (SIGSTOP) is
    named, as (index, −SIGSTOP).
    """
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(index, code) for index, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            cause = min(failed, key=lambda failure: failure[1] == EXIT_PROCESS_LOST)
            if cause[1] == EXIT_PROCESS_LOST:
                stopped = [i for i, proc in enumerate(procs) if codes[i] is None and _is_stopped(proc.pid)]
                return (stopped[0], -signal.SIGSTOP) if stopped else cause
            return cause
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            return None, 1
        time.sleep(0.05)


def _is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped by a signal (Linux's /proc; False where it cannot be told)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every process still running, SIGKILL to those still there after STOP_GRACE_S."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _forward(pipe: TextIO, prefix: str, target: TextIO, lock: threading.Lock, seen=None) -> None:
    for line in pipe:
        with lock:
            target.write(prefix + line)
            target.flush()
        if seen is not None:
            seen(line)
    pipe.close()


def _make(fault: inject.Fault, proc: subprocess.Popen, cluster: emulated.Plan | None, output: _Output) -> None:
    """The launcher's part of a fault a process announced: continue a stopped process, cut or slow a link
    (the process killed or stopped itself)."""
    if fault.kind == "stop":
        _later(fault.value, lambda: proc.send_signal(signal.SIGCONT) if proc.poll() is None else None,
               output, f"continued process {fault.host} after {fault.value:g} s stopped")
    elif fault.kind == "cut":
        lasting = "" if fault.value is not None else " for the rest of the launch"
        _on_link(cluster, [cluster.port_command(fault.host, up=False)], output, f"cut host {fault.host}'s link{lasting}")
        if fault.value is not None:
            _later(fault.value, lambda: _on_link(cluster, [cluster.port_command(fault.host, up=True)], output,
                                                 f"host {fault.host}'s link back up after {fault.value:g} s"), output)
    elif fault.kind == "slow":
        _on_link(cluster, cluster.reshape_commands(fault.host, fault.value), output,
                 f"host {fault.host}'s NIC slowed to {emulated.format_rate(fault.value)}")


def _later(seconds: float, action, output: _Output, said: str | None = None) -> None:
    def run():
        action()
        if said is not None:
            output.say(said)

    timer = threading.Timer(seconds, run)
    timer.daemon = True
    timer.start()


def _on_link(cluster: emulated.Plan, commands: list[list[str]], output: _Output, said: str) -> None:
    failures = emulated.run_commands(commands)
    output.say(said if not failures else f"could not change a link ({'; '.join(failures)})")


def _describe(code: int) -> str:
    if code == -signal.SIGSTOP:
        return "stopped by SIGSTOP, not responding"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
