"""Counting the host's reads of device arrays, for tests that the training loop makes none per step.

On a CPU, `jax.transfer_guard_device_to_host("disallow")` does not see every read: numpy takes a
single-device CPU array through the buffer protocol, with no transfer to guard. So besides the guard,
every way Python reads a `jax.Array`'s values is counted: `np.asarray`/`np.array` of one, its
`__array__`, `_value`, `item`, `tolist` and conversions to Python scalars.
"""

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

_METHODS = ("__float__", "__int__", "__bool__", "__index__", "item", "tolist", "__array__", "_value")
_NUMPY = ("asarray", "array", "ascontiguousarray")


@contextlib.contextmanager
def counting_reads() -> Iterator[list[str]]:
    """Within the block, every read of a device array's values appends the way it was read to the list yielded."""
    reads: list[str] = []
    array_type = type(jnp.zeros(()))
    saved = {(array_type, name): getattr(array_type, name) for name in _METHODS}
    saved |= {(np, name): getattr(np, name) for name in _NUMPY}

    def counted_method(name, original):
        if isinstance(original, property):
            return property(lambda self: (reads.append(name), original.fget(self))[1])

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return method

    def counted_numpy(name, original):
        @functools.wraps(original)
        def function(x, *args, **kwargs):
            if isinstance(x, jax.Array):
                reads.append(f"np.{name}")
            return original(x, *args, **kwargs)

        return function

    for (owner, name), original in saved.items():
        setattr(owner, name, (counted_method if owner is array_type else counted_numpy)(name, original))
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            yield reads
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
