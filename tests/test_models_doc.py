"""docs/models.md's examples of NNX, Linen and Equinox models run as written: the section's python blocks, in order."""

import re
from pathlib import Path

import jax
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SECTION = re.search(r"^## Flax NNX, Flax Linen and Equinox models$(.*?)^## ", DOC.read_text(), re.S | re.M).group(1)
BLOCKS = re.findall(r"^```python\n(.*?)^```$", SECTION, re.S | re.M)


def test_the_section_has_an_example_of_each_library():
    assert [re.search(r"jdp\.from_(\w+)\(", block).group(1) for block in BLOCKS] == ["nnx", "linen", "equinox"]


def test_examples_run_in_order():
    pytest.importorskip("equinox")
    namespace = {"devices": jax.devices()[:8]}
    for i, code in enumerate(BLOCKS):
        exec(compile(code, f"{DOC.name}: example {i + 1}", "exec"), namespace)
