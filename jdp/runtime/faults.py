"""A process of a multi-process job that dies or stalls: every other process ends fast, with one line.

A computation over the devices of several processes is a collective: when one process is gone,
the others either get an error from the transport (gloo: "Connection reset by peer") or wait for
it forever (a stopped process keeps its connections open). Left alone, JAX's coordination service
ends them only after its heartbeat timeout, with a C++ abort (exit status 134).

`JobWatch` turns both cases into one line on stderr and `EXIT_PROCESS_LOST`:

- each process publishes its progress (step, step time, a counter bumped every second) to the
  coordination service's key-value store from a background thread: one small message a second,
  nothing added to the steps themselves;
- a watchdog thread ends the process when no step has finished for the collective timeout;
- whichever way the loss is noticed, the line names the processes whose counter stopped (dead or
  stopped), or those that fell behind, with the step times each reported before.

The heartbeat timeout of `jax.distributed` is set above the collective timeout
(`heartbeat_seconds`), so jdp's line always comes first.
"""

import json
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import jax

from jdp.errors import Arg, Message, ProcessLostError
from jdp.runtime import inject

EXIT_PROCESS_LOST = 75  # sysexits' EX_TEMPFAIL: nothing wrong with the input, a rerun with --resume goes on
STARTUP_S = 300.0  # the limit until the first step finished (compilation; jax.distributed's own start-up limit)
AUTO_FLOOR_S = 60.0  # the automatic collective timeout's least value
AUTO_FACTOR = 20  # ... and its multiple of the slowest interval between finished steps seen so far
AUTO_CAP_S = 600.0  # ... and its greatest value
PUBLISH_S = 1.0  # how often each process publishes its progress
READ_S = 3.0  # how long reading the other processes' progress may take (the coordinator may be stopped)
RECENT = 20  # beats the published step time is averaged over
LEAVE_S = 5.0  # how long process 0, ending, waits for the others to end first (they need its coordinator)
_KEY = "jdp/progress/"
_ENDED = "jdp/ended/"


def collective_limit(timeout: float | None, slowest: float | None) -> float:
    """Seconds without a finished step after which the job is given up.

    Args:
      timeout: `collective_timeout` (seconds), or None for the automatic value.
      slowest: the longest interval between two finished steps seen so far (it includes an
        evaluation and a checkpoint save), or None before the first step finished.

    Returns:
      Before the first step: at least STARTUP_S (the first call compiles). After it: `timeout`,
      or AUTO_FACTOR × `slowest` within [AUTO_FLOOR_S, AUTO_CAP_S]: a healthy job's steps vary by
      far less than 20×, and a stalled one is given up within minutes, before the heartbeat timeout.
    """
    if slowest is None:
        return max(STARTUP_S, timeout or 0.0)
    if timeout is not None:
        return timeout
    return min(AUTO_CAP_S, max(AUTO_FLOOR_S, AUTO_FACTOR * slowest))


def heartbeat_seconds(timeout: float | None) -> int:
    """The `heartbeat_timeout_seconds` for `jax.distributed.initialize`: above every collective limit."""
    return int(max(STARTUP_S, AUTO_CAP_S if timeout is None else timeout)) + 60


def transport_failure(message: str) -> bool:
    """Whether a `JaxRuntimeError`'s text says a peer process went away (rather than, say, an OOM)."""
    signs = ("gloo", "connection reset", "connection refused", "broken pipe", "socket closed", "unavailable",
             "deadline_exceeded", "barrier timed out", "coordination service", "heartbeat", "peer")
    return any(sign in message.lower() for sign in signs)


def lost_processes(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
                   process_count: int) -> tuple[list[int], list[int]]:
    """Which processes stopped and which fell behind, from two readings of the progress board.

    Args:
      before, after: process id -> its published progress (`step`, `alive`), read at least one
        publishing interval apart.
      process_count: the processes in the job.

    Returns:
      (stopped, behind): those whose `alive` counter did not advance or that never published, and
      those still alive whose step is below the highest step of any process.
    """
    stopped = [p for p in range(process_count)
               if p not in after or after[p]["alive"] == before.get(p, {}).get("alive")]
    running = [p for p in range(process_count) if p not in stopped]
    top = max((after[p]["step"] for p in after), default=0)
    return stopped, [p for p in running if after[p]["step"] < top]


def stall_cause(waited: float, timeout: float | None, started: bool, limit: float) -> Message:
    """What the watchdog saw: how long no step finished, and which limit that broke."""
    if not started:
        which = f"the start-up limit of {limit:g} s: the first step compiles"
    elif timeout is not None:
        which = Message(Arg("collective_timeout", f"{timeout:g}"))
    else:
        which = Message(f"the automatic limit of {limit:g} s, see ", Arg("collective_timeout"))
    return Message(f"no step finished for {waited:.0f} s (", which, ")")


def describe_loss(cause: str, lost: tuple[list[int], list[int]], board: dict[int, dict[str, Any]],
                  process_count: int, step: int, checkpoint: str | None, coordinator: str | None = None) -> Message:
    """The one line: which processes on which hosts, what happened, the step, the last checkpoint and how to go on.

    `cause` is e.g. "a collective failed (Connection reset by peer)"; `lost` is `lost_processes`'s
    (stopped, behind); `board` the progress read last, whose `host` names each process's host;
    `coordinator` the coordinator's address, named when it cannot be reached.
    """
    stopped, behind = lost
    if stopped:
        who = f"process{'es' if len(stopped) > 1 else ''} {_listed(stopped, board)} of {process_count} stopped responding"
    elif behind:
        who = f"process{'es' if len(behind) > 1 else ''} {_listed(behind, board)} of {process_count} did not arrive"
    elif not board:
        at = f" at {coordinator}" if coordinator else ""
        who = f"the coordinator, process 0 of {process_count}{at}, cannot be reached"
    else:
        who = f"a process of {process_count} failed"
    times = ", ".join(f"p{p} {board[p]['step_s']:.2g} s" for p in sorted(board) if board[p].get("step_s") is not None)
    where = f"the last complete checkpoint is {checkpoint}" if checkpoint else "no checkpoint was saved"
    return Message(f"{who}: ", cause, f" after step {step}{f' (step times before: {times})' if times else ''}; {where}. "
                   "Rerun the job with ", Arg("resume", True),
                   f" to go on from it; this process ends (exit status {EXIT_PROCESS_LOST}).")


def _listed(ids: list[int], board: dict[int, dict[str, Any]]) -> str:
    """`1 (on box at 198.18.0.2)`: each process, with its host where it published one."""
    return ", ".join(f"{p} (on {board[p]['host']})" if board.get(p, {}).get("host") else str(p) for p in ids)


def host_name() -> str:
    """This process's host as the others know it: `NAME at ADDRESS` (the address its hostname resolves to,
    which is what gloo advertises; an emulated host's own), or NAME where it does not resolve."""
    name = socket.gethostname()
    try:
        return f"{name} at {socket.gethostbyname(name)}"
    except OSError:
        return name


def send_native_logs_to(path: str | os.PathLike) -> None:
    """Sends what C++ code writes to stderr (XLA's and gloo's logs, an abort's stack) to `path`.

    Python's `sys.stderr` keeps writing to the terminal: file descriptor 2 is moved to `path`, and
    `sys.stderr` reopened on a copy of the original descriptor. Call it before JAX starts.
    """
    sys.stderr.flush()
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")


def end_process(line: str | ProcessLostError) -> None:
    """Prints "jdp: error: `line`" (an error: its message) on stderr and ends this process with EXIT_PROCESS_LOST at once.

    `os._exit`: a normal exit would run `jax.distributed.shutdown`, whose barrier waits for the lost
    process until the service aborts.
    """
    sys.stdout.flush()
    print(f"jdp: error: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PROCESS_LOST)


def in_job() -> bool:
    """Whether this process joined a multi-process job."""
    return _client() is not None and jax.process_count() > 1


def _client() -> Any:
    """The coordination service's client of this process (None outside a multi-process job)."""
    from jax._src import distributed  # JAX's one handle on it; multihost_utils reads it the same way

    return distributed.global_state.client


def _coordinator_address() -> str | None:
    """`HOST:PORT` of the job's coordinator (process 0), as this process was given it."""
    from jax._src import distributed

    return distributed.global_state.coordinator_address


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`, or None if it raised or took longer than `seconds` (it may hang on a stopped peer)."""
    result: list[Any] = []

    def run():
        try:
            result.append(fn())
        except Exception:  # the coordinator is gone: reported as "cannot be reached"
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


class JobWatch:
    """Watches a multi-process job for a lost process; every method is a no-op with one process.

    Args:
      timeout: `collective_timeout` in seconds, or None for the automatic limit (`collective_limit`).
      on_loss: called with the `ProcessLostError` (its message is the line, without a "jdp: error: " prefix)
        when the watchdog gives the job up; it must end the process, whose main thread waits inside a collective (default: `end_process`).
    """

    def __init__(self, timeout: float | None = None, on_loss: Callable[[ProcessLostError], None] = end_process) -> None:
        self.timeout, self.on_loss = timeout, on_loss
        self.process_count = jax.process_count()
        self.process_id = jax.process_index()
        self.active = self.process_count > 1 and _client() is not None
        self.step, self.checkpoint = 0, None
        self._last_beat, self._beats, self._slowest = time.monotonic(), 0, None
        self._recent: deque[tuple[float, int]] = deque(maxlen=RECENT)  # (time, step) of the last beats
        self._alive, self._stop = 0, threading.Event()
        self._faults = inject.for_process(self.process_id)  # `jdp launch --inject`'s, for this process
        self.host = host_name() if self.active else ""  # published with the progress, named in a lost line
        if self.active:
            for target in (self._publish, self._watchdog):
                threading.Thread(target=target, daemon=True, name=f"jdp-{target.__name__[1:]}").start()

    def beat(self, step: int) -> None:
        """This process got as far as `step` (a call finished, an epoch ended, a checkpoint was agreed)."""
        now = time.monotonic()
        if self._beats == 0:
            self._slowest = 0.0  # the first call compiled: not counted, but the start-up limit is over
        else:
            self._slowest = max(self._slowest, now - self._last_beat)
            self._recent.append((now, step))
        self.step, self._last_beat, self._beats = step, now, self._beats + 1
        inject.make_due(self._faults, step)

    def step_seconds(self) -> float | None:
        """Seconds per step over the last RECENT beats (evaluation and saves included), None before."""
        (t0, s0), (t1, s1) = (self._recent[0], self._recent[-1]) if self._recent else ((0, 0), (0, 0))
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def limit(self) -> float:
        """The current collective limit in seconds (`collective_limit`)."""
        return collective_limit(self.timeout, self._slowest)

    def all_reached(self, step: int) -> None:
        """Waits until every process reached `step` (a checkpoint counts only then).

        A collective over every device (`sync_global_devices`, which also checks that all name the
        same step): a dead process fails it at once, as any step; a stalled one meets the watchdog.
        """
        if not self.active:
            return
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jdp checkpoint of step {step}")
        self.beat(self.step)

    def lost(self, cause: str) -> ProcessLostError:
        """The error to raise when this process noticed the loss itself (a failed collective)."""
        return ProcessLostError(self._describe(cause))

    def close(self) -> None:
        """Stops publishing and watching (the run is over)."""
        self._stop.set()

    def _describe(self, cause: str) -> Message:
        before = self._board()
        if before is None:  # the coordinator is gone or stopped: nobody can be told apart
            return describe_loss(cause, ([], []), {}, self.process_count, self.step, self.checkpoint,
                                 coordinator=_coordinator_address())
        time.sleep(1.5 * PUBLISH_S)
        after = self._board() or {}
        lost = lost_processes(before, after, self.process_count) if after else ([], [])
        self._leave(lost[0])
        return describe_loss(cause, lost, after, self.process_count, self.step, self.checkpoint)

    def _leave(self, stopped: list[int]) -> None:
        """Says that this process ends. Process 0 first waits (at most LEAVE_S) for every process still
        running to say so: its exit takes the coordination service along, and JAX aborts a process
        that loses it before that process could print its own line."""
        _within(READ_S, lambda: _client().key_value_set(f"{_ENDED}{self.process_id}", "1", allow_overwrite=True))
        waiting, deadline = set(range(1, self.process_count)) - set(stopped), time.monotonic() + LEAVE_S
        while self.process_id == 0 and waiting and time.monotonic() < deadline:
            ended = _within(READ_S, lambda: _client().key_value_dir_get(_ENDED)) or []
            waiting -= {int(key.rsplit("/", 1)[1]) for key, _ in ended}
            time.sleep(0.1)

    def _board(self) -> dict[int, dict[str, Any]] | None:
        """What every process published last (process id -> progress), None if the coordinator did not answer."""
        entries = _within(READ_S, lambda: _client().key_value_dir_get(_KEY))
        return None if entries is None else {int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in entries}

    def _publish(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self._alive += 1
            record = json.dumps({"step": self.step, "alive": self._alive, "step_s": self.step_seconds(),
                                 "host": self.host})
            _within(READ_S, lambda: _client().key_value_set(f"{_KEY}{self.process_id}", record, allow_overwrite=True))

    def _watchdog(self) -> None:
        while not self._stop.wait(0.25):
            waited = time.monotonic() - self._last_beat
            if waited > self.limit():
                self.on_loss(ProcessLostError(self._describe(stall_cause(waited, self.timeout, self._beats > 0,
                                                                        self.limit()))))
                return


def error_gist(error: Exception) -> str:
    """An error's first line without C++ source locations (XLA's errors run to dozens of lines)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"\[[^\]]*\.(cc|h):\d+\] ", "", line)[:200]
