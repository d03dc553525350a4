"""The library's errors in the CLI's words: each argument an error is about becomes the flag that sets it.

A `jdp.errors.JdpError` carries the arguments it names as `jdp.errors.Arg` values among its text;
`in_flags` spells each one whose name is the destination of one of the invoked command's options as
that option (`--accumulate 5`, `--shard-optimizer`), and every other one as Python does. The text
between them is printed as it is.
"""

import argparse

from jdp.errors import Arg, JdpError


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


def as_flag(arg: Arg, options: dict[str, argparse.Action]) -> str:
    """`arg` as the option of `options` that sets it, in backticks; as Python spells it if none does.

    `name=value` → `--flag value`; for an on/off flag, the value that turns it on → `--flag` and the
    other → `no --flag`; a bare `name` → `--flag`.
    """
    action = options.get(arg.name)
    if action is None:
        return str(arg)
    flag = _flag(action)
    if not arg.has_value:
        return f"`{flag}`"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and str(arg.value) in (
            "True", "False"):
        on = str(arg.value) == str(isinstance(action, argparse._StoreTrueAction))
        return f"`{flag}`" if on else f"`no {flag}`"
    return f"`{flag} {arg.value}`"


def in_flags(error: JdpError, options: dict[str, argparse.Action]) -> str:
    """`error`'s message with each of its arguments spelled as the command's flag (`as_flag`)."""
    return error.spelled(lambda arg: as_flag(arg, options))
