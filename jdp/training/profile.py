"""Where a step's time goes: a `jax.profiler` trace of chosen steps, and a per-step breakdown.

`jdp train --profile DIR --profile-steps A:B` traces steps A..B (counted from 1 over the run) into
DIR, in the format TensorBoard's profiler reads (`DIR/plugins/profile/<run>/*.xplane.pb`) and as a
Perfetto trace (`perfetto_trace.json.gz` beside it; open it at https://ui.perfetto.dev). The run
waits for the devices before A and after B, so the window holds those steps and nothing else.

The breakdown splits the window's wall time per step into three parts:

* compute: the device ops that are not collectives, per device (summed over the devices' ops, / k);
* communication: the collectives (all-reduce, collective-permute, all-gather, ...), per device,
  including the time a device waits in them for the others;
* host: the rest of the wall time, when a device runs no op: Python, dispatch, feeding batches.

An "inside" strategy runs within one compiled program, so the ops come from the trace. An
"outside" one moves buffers from the host between programs, which no device op records; there the
step's three calls are timed as segments instead (gradients and update: compute; the allreduce:
communication), each waited for, and marked in the trace as `jdp:compute` / `jdp:communication`.
"""

import gzip
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax

from jdp.errors import Arg, ConfigError
from jdp.parallel.strategy import Allreduce
from jdp.types import PyTree

# A collective's instruction is named by its HLO opcode (all-reduce.3) or, in current JAX, by the
# primitive that made it (psum.7, ppermute.2).
COLLECTIVE = re.compile(r"^(all[-_]reduce|all[-_]gather|reduce[-_]scatter|collective[-_]permute|all[-_]to[-_]all"
                        r"|collective[-_]broadcast|send|recv|psum|pmean|pmax|pmin|ppermute|psum_scatter|pbroadcast)"
                        r"([.-]|$)")
# An HLO instruction's name: fusion.3, all-reduce, ynn_fusion.9, and the oneDNN calls jdp's XLA flags turn
# convolutions and matmuls into on CPU, custom-call.8.clone__onednn$convolution.
_OP = re.compile(r"^[a-z][\w-]*(\.\d+)*(\.\w+)?(\$\w+)?$")


class Breakdown(NamedTuple):
    """Milliseconds per step of a profiled window; `wall = compute + communication + host`."""

    steps: int
    wall_ms: float
    compute_ms: float
    communication_ms: float
    host_ms: float
    source: str  # "trace" (device ops) or "segments" (timed calls of an outside strategy)

    def line(self) -> str:
        return (f"{self.wall_ms:.1f} ms/step = compute {self.compute_ms:.1f} + communication "
                f"{self.communication_ms:.1f} + host {self.host_ms:.1f} (over {self.steps} steps, from the "
                f"{self.source})")


DEFAULT_WINDOW = (3, 12)  # steps traced without `profile_steps`: past the first steps, which compile


def default_window(total_steps: int) -> tuple[int, int]:
    """`DEFAULT_WINDOW` cut to a run of `total_steps` steps: a window that always fits."""
    first, last = DEFAULT_WINDOW
    return min(first, total_steps), min(last, total_steps)


def parse_steps(text: str) -> tuple[int, int]:
    """`profile_steps` "A:B" (the CLI's `--profile-steps A:B`) → (A, B), 1 ≤ A ≤ B.

    Raises:
      ConfigError: if it is not two such integers.
    """
    match = re.fullmatch(r"(\d+):(\d+)", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ConfigError(Arg("profile_steps", text), " must be A:B with 1 <= A <= B, e.g. ",
                          Arg("profile_steps", "5:14"), ".")
    return int(match[1]), int(match[2])


def op_own_seconds(trace: str | Path) -> dict[str, float]:
    """Seconds of each device op in a Perfetto/Chrome trace (`perfetto_trace.json.gz`), by the op's name, all
    devices summed.

    Ops are the events named like HLO instructions on XLA's execution threads (CPU: threads named
    `tf_XLA...`; accelerators: processes named `/device:...`). Each op counts its own time only,
    without ops nested in it (a `while` loop's body), so nothing is counted twice.
    """
    with gzip.open(trace, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e["pid"], e.get("tid") if e["name"] == "thread_name" else None): e["args"]["name"]
             for e in events if e.get("ph") == "M" and e.get("name") in ("thread_name", "process_name")}

    def on_device(e) -> bool:
        return (names.get((e["pid"], None), "").startswith("/device:")
                or names.get((e["pid"], e.get("tid")), "").startswith("tf_XLA"))

    threads: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for e in events:
        if e.get("ph") == "X" and _OP.match(e["name"]) and on_device(e):
            threads.setdefault((e["pid"], e.get("tid")), []).append((e["ts"], e.get("dur", 0.0), e["name"]))
    seconds: dict[str, float] = {}
    for ops in threads.values():
        ops.sort(key=lambda op: (op[0], -op[1]))  # a parent before the ops nested in it
        stack: list[list[Any]] = []  # [end, own time, name] of the enclosing ops
        for start, duration, name in ops:
            while stack and stack[-1][0] <= start:
                _, own, done = stack.pop()
                seconds[done] = seconds.get(done, 0.0) + own * 1e-6
            if stack:
                stack[-1][1] -= duration
            stack.append([start + duration, duration, name])
        for _, own, done in stack:
            seconds[done] = seconds.get(done, 0.0) + own * 1e-6
    return seconds


def by_kind(op_times: dict[str, float]) -> dict[str, float]:
    """Times by op name (`op_own_seconds`, in any unit) summed into {"compute": t, "communication": t}: the
    collectives apart from the other ops."""
    kinds = {"compute": 0.0, "communication": 0.0}
    for name, t in op_times.items():
        kinds["communication" if COLLECTIVE.match(name) else "compute"] += t
    return kinds


def format_heaviest(ops_ms: dict[str, float], count: int = 8) -> str:
    """The `count` ops that took longest, in ms per step, heaviest first: `name ms, name ms, ...`."""
    heaviest = sorted(ops_ms.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {ms:.2f}" for name, ms in heaviest)


def trace_directory(root: str | Path, process_index: int, process_count: int) -> Path:
    """Where one process writes its trace: `root` itself, or `root/process-I` when several processes trace
    (each traces its own devices; sharing one folder, they wrote over each other's files)."""
    return Path(root) if process_count == 1 else Path(root) / f"process-{process_index}"


class Profiler:
    """Traces steps `first`..`last` of a run into `directory` and computes their `Breakdown`.

    Give `segment` to `jdp.make_train_step` (it times an outside strategy's calls while tracing),
    and call `at(step, state)` with the steps done so far before the first call and after each.

    Args:
      directory: where `jax.profiler` writes the trace.
      first, last: the steps to trace, counted from 1 over the run.
      device_count: this process's devices, whose ops its trace records: to give the per-device share.
      strategy: the run's allreduce strategy: one inside the step is broken down from the trace, one outside
        it from its timed segments.
    """

    def __init__(self, directory: str | Path, first: int, last: int, device_count: int, strategy: Allreduce) -> None:
        self.directory, self.first, self.last = Path(directory), first, last
        self.device_count, self.from_trace = device_count, strategy.inside
        self.breakdown: Breakdown | None = None
        self.ops_ms: dict[str, float] = {}  # ms per step and device of each op, from the trace (inside strategies)
        self.trace: Path | None = None
        self._started: tuple[int, float] | None = None  # (steps done, time) when tracing began
        self._segments = {"compute": 0.0, "communication": 0.0}

    def segment(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, timed as `name` ("compute" or "communication") while tracing: it then waits for the devices."""

        def timed(*args):
            if self._started is None:
                return fn(*args)
            start = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"jdp:{name}"):
                out = jax.block_until_ready(fn(*args))
            self._segments[name] += time.perf_counter() - start
            return out

        return timed

    def at(self, step: int, state: PyTree) -> None:
        """Starts tracing once `first − 1` steps are done, stops once `last` are (waiting for `state`)."""
        if self._started is None and self.breakdown is None and self.first - 1 <= step < self.last:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self._started = (step, time.perf_counter())
        elif self._started is not None and step >= self.last:
            jax.block_until_ready(state)
            wall = time.perf_counter() - self._started[1]
            jax.profiler.stop_trace()
            steps = step - self._started[0]
            self._started = None
            self.trace = max(self.directory.glob("plugins/profile/*/perfetto_trace.json.gz"),
                             key=lambda p: p.stat().st_mtime)
            if self.from_trace:  # the trace read once: each op's time, and their sums by kind
                self.ops_ms = {name: 1e3 * s / self.device_count / steps
                               for name, s in op_own_seconds(self.trace).items()}
                ms = by_kind(self.ops_ms)
            else:
                ms = {kind: 1e3 * s / steps for kind, s in self._segments.items()}
            self.breakdown = Breakdown(steps, 1e3 * wall / steps, ms["compute"], ms["communication"],
                                       1e3 * wall / steps - ms["compute"] - ms["communication"],
                                       "trace" if self.from_trace else "segments")


def check_window(first: int, last: int, total_steps: int) -> None:
    """Raises ConfigError unless steps `first`..`last` fall within a run of `total_steps` steps."""
    if last > total_steps:
        raise ConfigError(Arg("profile_steps", f"{first}:{last}"), f" goes past the run's {total_steps} steps; "
                          f"choose B <= {total_steps}.")


def format_breakdowns(rows: Sequence[tuple[str, Breakdown]]) -> str:
    """A markdown table: one row per (name, breakdown)."""
    lines = ["| run | ms/step | compute | communication | host | from |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {b.wall_ms:.1f} | {b.compute_ms:.1f} | {b.communication_ms:.1f} | {b.host_ms:.1f} | "
              f"{b.source} |" for name, b in rows]
    return "\n".join(lines) + "\n"
