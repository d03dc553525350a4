"""`jdp` on the command line: the parser and commands (`jdp.cli.main`), `jdp compare` (`jdp.cli.compare`),
and the library's errors in flag words (`jdp.cli.errors`). Nothing outside jdp/cli imports it."""
