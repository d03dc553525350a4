"""`jdp` on the command line (`jdp.cli.main`), and the flags the benchmarks share (`jdp.cli.flags`)."""

from jdp.cli.main import main

__all__ = ["main"]
