"""The one exception family jdp raises for problems a user can fix.

Messages name the Python arguments they are about, in backticks: a bare name (`accumulate`) or a
name with its value (`accumulate=5`, `shard_optimizer=True`), the name being the argument's or the
`TrainConfig` field's. The library is called from Python, so that is what its errors speak; the
CLI rewrites each name that is one of its flags into the flag (`--accumulate 5`,
`--shard-optimizer`) before printing the message as a single line on stderr with exit status 2.
So backticks hold arguments only: a package or another name that is not an argument is quoted
('tensorboard'), or the CLI would print the package as its flag.
Anything that is not a `JdpError` is a bug and keeps its traceback.
"""

import functools
from collections.abc import Callable


class JdpError(Exception):
    """A problem with the user's input, data or environment, stated as a sentence with the fix."""


class ConfigError(JdpError, ValueError):
    """An argument or setting has a value that jdp cannot use."""


class DataError(JdpError, ValueError):
    """A dataset file or directory is missing, truncated or malformed."""


class DeviceError(JdpError, RuntimeError):
    """The requested devices do not exist or can no longer be configured."""


class TrainingError(JdpError, RuntimeError):
    """A run stopped because its numbers went wrong (non-finite values, replicas that diverged)."""


class ProcessLostError(JdpError, RuntimeError):
    """Another process of a multi-process job died or stalled; this one cannot go on alone.

    The CLI prints it as one line too, but exits with status 75 (`jdp.runtime.faults.EXIT_PROCESS_LOST`),
    through `os._exit`: the job's shutdown would wait for the lost process.
    """


def check_positive(name: str, value: int, unit: str = "integer") -> None:
    """Raises ConfigError unless `value`, passed as the argument `name`, is at least 1.

    The one copy of this check: "`accumulate` must be a positive integer, got 0."
    """
    if value < 1:
        raise ConfigError(f"`{name}` must be a positive {unit}, got {value}.")


def moved_arguments(moved: dict[str, str]) -> Callable[[Callable], Callable]:
    """Decorates a function whose keyword arguments `moved` went elsewhere: passing one raises a TypeError
    that names where it went (`moved[name]`), for the release after the move (docs/api.md lists them)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def checked(*args, **kwargs):
            for name in kwargs.keys() & moved.keys():
                raise TypeError(f"`{function.__name__}({name}=...)` is gone: {moved[name]} (docs/api.md).")
            return function(*args, **kwargs)

        return checked

    return decorate
