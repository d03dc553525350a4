"""Checks a documented code block against the API it uses, without running it: every `jdp.X` it names exists,
and every call of a jdp function passes only keywords that the function takes. The fast sibling of the slow
tests that run the docs' examples: a renamed name or argument fails here in milliseconds."""

import ast
import inspect
from typing import Any

import jdp


def _dotted(node: ast.expr) -> list[str] | None:
    """["jdp", "testing", "check_allreduce"] for `jdp.testing.check_allreduce`, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "jdp":
        return ["jdp", *reversed(names)]
    return None


def _resolve(path: list[str]) -> Any:
    value = jdp
    for i, name in enumerate(path[1:], start=1):
        if not hasattr(value, name):
            raise AttributeError(f"`{'.'.join(path[:i + 1])}` does not exist")
        value = getattr(value, name)
    return value


def api_problems(code: str) -> list[str]:
    """What in `code` does not match jdp's API: missing names, keywords a jdp callable does not take."""
    problems: dict[str, None] = {}  # in order, once each
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute) and (path := _dotted(node)) is not None:
            try:
                _resolve(path)
            except AttributeError as e:
                problems[str(e)] = None
        if isinstance(node, ast.Call) and (path := _dotted(node.func)) is not None:
            try:
                signature = inspect.signature(_resolve(path))
            except (AttributeError, TypeError, ValueError):
                continue  # reported above, or a callable without a signature
            keywords = {k.arg: None for k in node.keywords if k.arg is not None}
            try:
                signature.bind_partial(**keywords)
            except TypeError as e:
                problems[f"`{'.'.join(path)}(...)`: {e}"] = None
    return list(problems)
