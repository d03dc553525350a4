"""docs/models.md's examples of NNX, Linen and Equinox models run as written: the section's python blocks, in order."""

import re
from pathlib import Path

import jax
import pytest
from doc_code import api_problems

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SECTION = re.search(r"^## Flax NNX, Flax Linen and Equinox models$(.*?)^## ", DOC.read_text(), re.S | re.M).group(1)
BLOCKS = re.findall(r"^```python\n(.*?)^```$", SECTION, re.S | re.M)


def test_the_section_has_an_example_of_each_library():
    assert [re.search(r"jdp\.from_(\w+)\(", block).group(1) for block in BLOCKS] == ["nnx", "linen", "equinox"]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_example_names_only_what_jdp_has(index):
    assert api_problems(BLOCKS[index]) == []


@pytest.mark.slow  # trains three models; the test above is its fast sibling
def test_examples_run_in_order():
    pytest.importorskip("equinox")
    namespace = {"devices": jax.devices()[:8]}
    for i, code in enumerate(BLOCKS):
        exec(compile(code, f"{DOC.name}: example {i + 1}", "exec"), namespace)
