"""Type aliases shared by every layer."""

from typing import Any

PyTree = Any  # a nested structure of containers (dict, list, tuple, NamedTuple) with arrays at the leaves
