"""XLA flags that make the LeNet step faster on CPU, set only where the installed jaxlib knows them.

XLA reads `XLA_FLAGS` once, when JAX starts its first backend, and aborts the whole process on a
flag name it does not know. Both flags below are marked experimental and come and go between
jaxlib releases, so each is set only if its name is compiled into the installed jaxlib, and users
can turn them all off with `--no-xla-flags` or `JDP_NO_XLA_FLAGS=1`. Neither changes the math:
they choose which library runs a fusion or a convolution. What they are worth on the LeNet step
is measured in docs/performance.md.
"""

import mmap
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

DISABLE_ENV = "JDP_NO_XLA_FLAGS"

# name -> value. Why each helps, on CPU:
PERFORMANCE_FLAGS: Mapping[str, str] = {
    # YNNPACK fusions off: XLA's own kernels for the fusions and Eigen/oneDNN for convolutions, which
    # are faster for LeNet's small convolutions than YNNPACK's fallbacks on their backward pass.
    "xla_cpu_experimental_ynn_fusion_type": "",
    # Let XLA call oneDNN for matmuls and convolutions where it can.
    "xla_cpu_experimental_onednn_custom_call": "true",
}


def _jaxlib_libraries() -> list[Path]:
    import jaxlib  # importing jaxlib does not start a backend

    return sorted(Path(jaxlib.__file__).parent.glob("*.so"))


def supported(names: Iterable[str], libraries: Iterable[Path] | None = None) -> set[str]:
    """The flag names compiled into jaxlib's shared libraries (found as NUL-terminated strings).

    Args:
      names: flag names without the leading dashes.
      libraries: the files to search; default: every `.so` of the installed jaxlib.

    Returns:
      The subset of `names` that the installed XLA parses, so setting it cannot abort the process.
    """
    wanted = {name: f"{name}\0".encode() for name in names}
    found: set[str] = set()
    for path in _jaxlib_libraries() if libraries is None else libraries:
        if path.stat().st_size == 0:
            continue
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            found |= {name for name, needle in wanted.items() if name not in found and blob.find(needle) >= 0}
        if len(found) == len(wanted):
            break
    return found


def enable(*, disabled: bool = False) -> list[str]:
    """Adds the supported `PERFORMANCE_FLAGS` to `XLA_FLAGS`; call before JAX starts a backend.

    Flags the user already set in `XLA_FLAGS` are left as they are.

    Args:
      disabled: set nothing (the CLI's `--no-xla-flags`); `JDP_NO_XLA_FLAGS=1` does the same.

    Returns:
      The flags added, as `--name=value` strings (empty if disabled, unsupported, or too late
      because a backend is already running).
    """
    if disabled or os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return []
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return []
    current = os.environ.get("XLA_FLAGS", "")
    already = {item.lstrip("-").split("=", 1)[0] for item in current.split()}
    usable = supported(name for name in PERFORMANCE_FLAGS if name not in already)
    added = [f"--{name}={PERFORMANCE_FLAGS[name]}" for name in PERFORMANCE_FLAGS if name in usable]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
