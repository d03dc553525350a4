"""The one exception family jdp raises for problems a user can fix, and the arguments they are about.

A message names the arguments it is about as data: `Arg("accumulate", 5)` among its strings,
`ConfigError(Arg("accumulate", 5), " cuts each device's 12 rows into uneven micro-batches.")`. The
library is called from Python, so `str(error)` spells each one as Python does (`accumulate=5`, in
backticks); the CLI spells the same `Arg` as the flag that sets it (`--accumulate 5`) where the
command has one (`JdpError.spelled`), before printing the message as a single line on stderr with
exit status 2. Text between the arguments is never rewritten: a package or a file named in
backticks stays what it is. Anything that is not a `JdpError` is a bug and keeps its traceback.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

_NAME_ONLY = object()  # an Arg without a value: the argument itself, not one setting of it


@dataclasses.dataclass(frozen=True, repr=False)
class Arg:
    """An argument (a `TrainConfig` field, a function's parameter) that an error message is about.

    Attributes:
      name: the Python name; the CLI's flag of that destination spells it there.
      value: the value it had or should have; left out, the message names the argument itself.
      python: how Python code sets it, where that is not `name=value` (a call: `simulate_cpu_devices(8)`).
    """

    name: str
    value: Any = _NAME_ONLY
    python: str | None = None

    @property
    def has_value(self) -> bool:
        return self.value is not _NAME_ONLY

    def __repr__(self) -> str:
        return f"Arg({self.name!r}, {self.value!r})" if self.has_value else f"Arg({self.name!r})"

    def __str__(self) -> str:
        """Python's spelling: `name`, or `name=value`, or `python`."""
        if self.python is not None:
            return f"`{self.python}`"
        return f"`{self.name}={self.value}`" if self.has_value else f"`{self.name}`"


class Message(str):
    """A piece of an error message built apart from its error: a `str` in Python's spelling that keeps its
    `parts` (text and `Arg`s), so the error it goes into still carries the arguments as data."""

    parts: tuple["str | Arg", ...]

    def __new__(cls, *parts: "str | Arg") -> "Message":
        flat = _flat(parts)
        message = super().__new__(cls, "".join(map(str, flat)))
        message.parts = flat
        return message


def _flat(parts: tuple["str | Arg", ...]) -> tuple["str | Arg", ...]:
    return tuple(inner for part in parts for inner in (part.parts if isinstance(part, Message) else (part,)))


class JdpError(Exception):
    """A problem with the user's input, data or environment, stated as a sentence with the fix.

    Made of `parts`, strings and the `Arg`s the sentence is about (a `Message` among them gives its own):
    `str(error)` spells them as Python does, `spelled(spell)` as a caller does (the CLI: as flags).
    """

    def __init__(self, *parts: "str | Arg") -> None:
        self.parts = _flat(parts)
        super().__init__("".join(map(str, self.parts)))

    @property
    def arguments(self) -> tuple[Arg, ...]:
        """The arguments the message is about, in its order."""
        return tuple(part for part in self.parts if isinstance(part, Arg))

    def spelled(self, spell: Callable[[Arg], str]) -> str:
        """The message with each argument written by `spell` and the text between them as it is."""
        return "".join(spell(part) if isinstance(part, Arg) else part for part in self.parts)


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
        raise ConfigError(Arg(name), f" must be a positive {unit}, got {value}.")


def moved_arguments(moved: dict[str, str]) -> Callable[[Callable], Callable]:
    """Decorates a function whose keyword arguments `moved` went elsewhere: passing one raises a TypeError
    that names where it went (`moved[name]`), for the release after the move (docs/api.md lists them)."""

    def decorate(function: Callable) -> Callable:
        called = function.__qualname__.removesuffix(".__init__")  # a class's constructor: the class's name

        @functools.wraps(function)
        def checked(*args, **kwargs):
            for name in kwargs.keys() & moved.keys():
                raise TypeError(f"`{called}({name}=...)` is gone: {moved[name]} (docs/api.md).")
            return function(*args, **kwargs)

        return checked

    return decorate
