"""Bounding how many dispatched computations may run ahead of the host.

JAX dispatches asynchronously. Steps that use collectives, piled up without bound on a CPU with
few cores, can starve XLA's rendezvous threads until the process aborts (docs/testing.md). Waiting
for step t−1 while step t runs keeps the pipeline full and the queue bounded.
"""

from collections import deque
from collections.abc import Callable
from typing import Any

import jax


class InFlight:
    """A window of at most `limit` unfinished results; `push` waits for the oldest beyond it."""

    def __init__(self, limit: int = 2) -> None:
        if limit < 1:
            raise ValueError(f"`limit` must be at least 1, got {limit}.")
        self._limit = limit
        self._pending: deque[Any] = deque()

    def push(self, result: Any) -> None:
        """Registers a just-dispatched result, blocking until at most `limit` remain unfinished."""
        self._pending.append(result)
        while len(self._pending) > self._limit:
            jax.block_until_ready(self._pending.popleft())

    def drain(self) -> None:
        """Waits for everything still in flight."""
        while self._pending:
            jax.block_until_ready(self._pending.popleft())


def repeat_step(step: Callable, state: tuple[Any, Any], x: jax.Array, y: jax.Array, count: int) -> tuple[Any, Any]:
    """Runs `step(params, opt_state, x, y)` `count` times on one placed batch, at most 2 in flight.

    The compute floor the benchmarks compare jdp's loop with: no data movement, no Python between steps
    beyond the dispatch.
    """
    (params, opt_state), window = state, InFlight(limit=2)
    for _ in range(count):
        params, opt_state, loss = step(params, opt_state, x, y)
        window.push(loss)
    window.drain()
    return jax.block_until_ready((params, opt_state))
