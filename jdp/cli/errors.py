"""The library's error messages in the CLI's words: Python names become the flags that set them.

A `jdp.errors.JdpError` names Python arguments in backticks (`accumulate=5`, `shard_optimizer`,
`shard_optimizer=True`); on the command line the same setting is a flag. `as_flags` rewrites each
such name that is the destination of one of the invoked command's options, and leaves everything
else (file names, values, names the command has no flag for) as it was.
"""

import argparse
import re

_BACKTICKED = re.compile(r"`([^`\n]*)`")
_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?", re.DOTALL)


def option_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, argparse.Action]:
    """dest -> option of the (sub)command `args` was parsed into, following the chosen subcommands down."""
    options: dict[str, argparse.Action] = {}
    while parser is not None:
        chosen = None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(args, action.dest, None))
            elif action.option_strings and action.dest != argparse.SUPPRESS and not isinstance(
                    action, (argparse._HelpAction, argparse._VersionAction)):
                options[action.dest] = action
        parser = chosen
    return options


def _flag(action: argparse.Action) -> str:
    """The option's long spelling (`--batch-size`), else its first."""
    return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])


def as_flags(message: str, options: dict[str, argparse.Action]) -> str:
    """`message` with each backticked `name` / `name=value` of `options` written as its flag.

    `name=value` → `--flag value`; for an on/off flag (store_true), `name=True` → `--flag` and
    `name=False` → `no --flag`; a bare `name` → `--flag`.
    """

    def rewrite(match: re.Match) -> str:
        named = _NAME.fullmatch(match.group(1))
        if named is None or named.group(1) not in options:
            return match.group(0)
        name, value = named.group(1), named.group(2)
        action = options[name]
        flag = _flag(action)
        if value is None:
            return f"`{flag}`"
        if isinstance(action, argparse._StoreTrueAction) and value in ("True", "False"):
            return f"`{flag}`" if value == "True" else f"`no {flag}`"
        if isinstance(action, argparse._StoreFalseAction) and value in ("True", "False"):
            return f"`{flag}`" if value == "False" else f"`no {flag}`"
        return f"`{flag} {value}`"

    return _BACKTICKED.sub(rewrite, message)
