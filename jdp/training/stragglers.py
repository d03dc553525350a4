"""A simulated straggler, and where every process's time goes while one is slow.

`--simulate-straggler PROCESS:SECONDS[:EVERY]` makes one process of a multi-process job sleep before
every EVERY-th step, as a slow host would. Every process then times its own steps and syncs, each to
completion (`jax.block_until_ready`), so the time a process spends waiting for the slow one inside a
collective shows where it happens: in every step's allreduce (every-step sync), or once per H steps
at the sync (local SGD, DiLoCo). The first step and the first sync compile and are not timed. The
times of all processes are gathered at the end.
"""

import dataclasses
import re
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jdp.errors import Arg, ConfigError
from jdp.parallel.layout import per_process

_SPEC = re.compile(r"(\d+):(\d+(?:\.\d*)?|\.\d+)(?::(\d+))?")


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Process `process` sleeps `seconds` before every `every`-th step (1-based steps of the run)."""

    process: int
    seconds: float
    every: int = 1

    @classmethod
    def parse(cls, text: str) -> "Straggler":
        """`PROCESS:SECONDS[:EVERY]`, e.g. `1:0.05` or `1:0.5:16`.

        Raises:
          ConfigError: naming `simulate_straggler` if `text` is not of that form.
        """
        match = _SPEC.fullmatch(text)
        if match is None or (match[3] is not None and int(match[3]) < 1):
            raise ConfigError(Arg("simulate_straggler", text), " is not PROCESS:SECONDS[:EVERY] (e.g. 1:0.05 or "
                              "1:0.5:16, EVERY at least 1).")
        return cls(int(match[1]), float(match[2]), int(match[3] or 1))

    def check(self, process_count: int) -> None:
        """Raises ConfigError unless `process` is a process of the job."""
        if self.process >= process_count:
            raise ConfigError(Arg("simulate_straggler", f"{self.process}:{self.seconds}:{self.every}"),
                              f" delays process {self.process}, but the job has {process_count} process(es), "
                              f"0 to {process_count - 1}.")


@dataclasses.dataclass
class Stopwatch:
    """This process's time: in steps and syncs (each timed to completion, but the first step and the first
    meeting of each key, which compile) and asleep as the straggler."""

    straggler: Straggler
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: {"step": 0.0, "sync": 0.0})
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: {"step": 0, "sync": 0})
    delayed_seconds: float = 0.0
    _compiled: set = dataclasses.field(default_factory=set)  # the programs already run once: "step", ("sync", key)

    def step(self, step: Callable, number: Callable[[], int]) -> Callable:
        """`step`, preceded by the straggler's sleep (on its process, every `every`-th `number()`) and timed."""

        def delayed(*args: Any) -> Any:
            if jax.process_index() == self.straggler.process and number() % self.straggler.every == 0:
                time.sleep(self.straggler.seconds)
                self.delayed_seconds += self.straggler.seconds
            return self._timed("step", "step", step, args)

        return delayed

    def sync(self, meet: Callable) -> Callable:
        """`meet(params, opt_state, key)` (a local mode's sync), timed to completion from its key's second call."""

        def timed(params: Any, opt_state: Any, key: Any) -> Any:
            return self._timed("sync", ("sync", key), meet, (params, opt_state, key))

        return timed

    def _timed(self, what: str, program: Hashable, fn: Callable, args: tuple) -> Any:
        """`fn(*args)` to completion, counted under `what` unless it is `program`'s first run (which compiles)."""
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        if program in self._compiled:
            self.seconds[what] += time.perf_counter() - start
            self.counts[what] += 1
        self._compiled.add(program)
        return out

    def report(self) -> list[dict[str, float]]:
        """Every process's times, in process order (a collective: every process calls it)."""
        steps, syncs = self.counts["step"], self.counts["sync"]
        rows = per_process(np.array([steps, self.seconds["step"], syncs, self.seconds["sync"], self.delayed_seconds]))
        return [{"process": p, "steps": int(r[0]), "step_s": float(r[1] / max(r[0], 1)), "syncs": int(r[2]),
                 "sync_s": float(r[3] / max(r[2], 1)), "delayed_s": float(r[4])} for p, r in enumerate(rows)]


def format_report(rows: list[dict[str, float]]) -> str:
    """One line per process: mean step and sync times, the straggler's sleep."""
    return "\n".join(
        f"process {r['process']}: {r['steps']} steps timed, {1e3 * r['step_s']:.1f} ms/step; {r['syncs']} syncs, "
        f"{1e3 * r['sync_s']:.1f} ms/sync; asleep {r['delayed_s']:.1f} s (simulated straggler)" for r in rows)
