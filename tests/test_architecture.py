"""docs/architecture.md's recipes run as written: every ```python block, in order, in one namespace."""

import re
from pathlib import Path

import jax
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BLOCKS = re.findall(r"^### (.+?)$.*?^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)


def test_every_recipe_has_a_program():
    assert [title for title, _ in BLOCKS] == ["A new allreduce strategy", "A new model",
                                              "A new optimizer, or a new optimizer-state variant",
                                              "A new sync algorithm"]


@pytest.mark.parametrize("title,code", BLOCKS, ids=[title for title, _ in BLOCKS])
def test_recipe_runs(title, code, registry_restored):
    exec(compile(code, f"{DOC.name}: {title}", "exec"), {"devices": jax.devices()[:8]})


@pytest.fixture
def registry_restored():
    from jdp.parallel import allreduce

    saved = dict(allreduce._STRATEGIES)
    yield
    allreduce._STRATEGIES.clear()
    allreduce._STRATEGIES.update(saved)
