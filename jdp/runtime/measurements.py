"""Committed measurements that choose jdp's defaults, kept as data under `experiments/results/`.

Each table sits beside the raw output it was read from (`formulations/table.json`: the formulation
`--formulation auto` picks per machine kind; `bench-train/baselines.json`: what `jdp bench train`
reports speed-ups against), so a new measurement changes a data file, not the code. They are read
from the checkout jdp runs from (`pip install -e .`, as `make install` does); an install without
`experiments/` has no committed tables, and its defaults are those of an unmeasured machine.
"""

import json
from pathlib import Path
from typing import Any

from jdp.errors import DataError

RESULTS = Path(__file__).resolve().parents[2] / "experiments" / "results"


def read(name: str, key: str) -> list[Any]:
    """The list under `key` of the JSON file `experiments/results/<name>`; [] if there is no such file.

    Raises:
      DataError: if the file exists but is not JSON with a list under `key`.
    """
    path = RESULTS / name
    if not path.exists():
        return []
    try:
        values = json.loads(path.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a table of measurements ({type(e).__name__}: {e}); restore it from git.") from None
    if not isinstance(values, list):
        raise DataError(f"{path} holds no list under `{key}`; restore it from git.")
    return values
