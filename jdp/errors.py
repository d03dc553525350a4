"""The one exception family jdp raises for problems a user can fix.

The CLI turns any `JdpError` into a single line on stderr and exit status 2; anything else is a bug
and keeps its traceback.
"""


class JdpError(Exception):
    """A problem with the user's input, data or environment, stated as a sentence with the fix."""


class ConfigError(JdpError, ValueError):
    """A flag or argument has a value that jdp cannot use."""


class DataError(JdpError, ValueError):
    """A dataset file or directory is missing, truncated or malformed."""


class DeviceError(JdpError, RuntimeError):
    """The requested devices do not exist or can no longer be configured."""


class TrainingError(JdpError, RuntimeError):
    """A run stopped because its numbers went wrong (non-finite values, replicas that diverged)."""


def check_positive(flag: str, value: int, unit: str = "integer") -> None:
    """Raises ConfigError unless `value`, given as `flag`, is at least 1 (the one copy of this check)."""
    if value < 1:
        raise ConfigError(f"`{flag}` must be a positive {unit}, got {value}.")
