"""`jdp` on the command line (`jdp.cli.main`), and the flags the benchmarks share (`jdp.cli.flags`)."""
