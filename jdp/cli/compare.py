"""`jdp compare RUN_DIR...`: several runs' history.json side by side, one figure and one table.

The everyday "psum vs manual vs compressed" view. Each run is labelled by the settings in which the
runs' configs differ (e.g. `compress=powersgd powersgd_rank=2`), not by where it was written.
"""

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jdp.errors import ConfigError
from jdp.flags import check_out_dir
from jdp.training.resume import RENAMED

# Settings that say where or how a run was recorded, not what it computed: never a label.
NOT_A_DIFFERENCE = ("out", "no_progress", "checkpoint_dir", "checkpoint_every", "resume", "check_replicas",
                    "profile", "profile_steps", "tensorboard")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `compare` to the `jdp` subcommands."""
    p = commands.add_parser(
        "compare", help="put several runs' history.json side by side: one figure, one markdown table",
        description="Read RUN_DIR/history.json of each run (written by `jdp train --out RUN_DIR`), or its "
        "TensorBoard events (`jdp train --tensorboard RUN_DIR`), and write compare.png (test accuracy and train "
        "loss per epoch, and test accuracy against the MB each device sent; one curve per run) and compare.md, "
        "labelling each run by the settings in which the runs differ.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="directories written by `jdp train --out` or `--tensorboard`")
    p.add_argument("--out", default=".", metavar="DIR", help="where to write compare.png and compare.md")
    p.set_defaults(run=run_compare)


def load(run_dir: str | Path) -> dict[str, Any]:
    """RUN_DIR/history.json, or the run that `jdp train --tensorboard RUN_DIR` wrote there.

    Raises:
      ConfigError: if it is missing or not a `jdp train` history.
    """
    path = Path(run_dir) / "history.json"
    if not path.exists() and any(Path(run_dir).glob("events.out.tfevents.*")):
        from jdp.training.tensorboard import read_run

        return read_run(run_dir)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"`{run_dir}` has no readable history.json ({e}); pass directories written by "
                          "`jdp train --out`.") from None
    if not isinstance(record, dict) or not {"config", "epochs"} <= record.keys():
        raise ConfigError(f"`{path}` is not a `jdp train` history (no config and epochs); pass directories "
                          "written by `jdp train --out`.")
    return record


def labels(records: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Run dir -> the settings in which its config differs from the others' ("name=value ..."), or its dir."""
    configs = {run: {RENAMED.get(k, k): v for k, v in record["config"].items()} for run, record in records.items()}
    keys = sorted({k for c in configs.values() for k in c} - set(NOT_A_DIFFERENCE))
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs.values()}) > 1]
    named = {run: " ".join(f"{k}={c.get(k)}" for k in differ if c.get(k) is not None) or Path(run).name
             for run, c in configs.items()}
    if len(set(named.values())) < len(named):  # same settings (e.g. repeats): add the directory
        named = {run: f"{label} ({Path(run).name})" for run, label in named.items()}
    return named


def table(records: dict[str, dict[str, Any]], names: dict[str, str]) -> str:
    """A markdown table: final and best test accuracy, final train loss, s/epoch, bytes per step (averaged
    over the run: a local sync mode sends once per H steps) and in all, if recorded."""
    rows = [("| run | epochs | final test acc | best test acc | final train loss | s/epoch | allreduce bytes/step "
             "| MB sent per device |"), "|---|---|---|---|---|---|---|---|"]
    for run, record in records.items():
        epochs = record["epochs"]
        per_step = record.get("bytes_per_step", record.get("allreduce_payload_bytes"))
        total = bytes_sent(record)
        rows.append(f"| {names[run]} | {len(epochs)} | {epochs[-1]['test_acc']:.4f} | "
                    f"{max(e['test_acc'] for e in epochs):.4f} | {epochs[-1]['train_loss']:.4f} | "
                    f"{sum(e['seconds'] for e in epochs) / len(epochs):.1f} | "
                    f"{'' if per_step is None else f'{per_step:.0f}'} | "
                    f"{'' if total is None else f'{total[-1] / 2**20:.1f}'} |")
    return "\n".join(rows) + "\n"


def bytes_sent(record: dict[str, Any]) -> list[float] | None:
    """Bytes each device sent by the end of each epoch, or None for a history from before they were recorded."""
    sent = [e.get("bytes_sent") for e in record["epochs"]]
    return None if None in sent else sent


def compare(run_dirs: Sequence[str | Path]) -> tuple[Any, str]:
    """(figure, markdown table) of the runs in `run_dirs`."""
    from jdp import plot  # matplotlib: only for `jdp compare`, not for every command's parser

    records = {str(run): load(run) for run in run_dirs}
    names = labels(records)
    sent = {names[r]: bytes_sent(rec) for r, rec in records.items()}
    figure = plot.runs_per_epoch(
        {names[r]: [e["test_acc"] for e in rec["epochs"]] for r, rec in records.items()},
        {names[r]: [e["train_loss"] for e in rec["epochs"]] for r, rec in records.items()},
        title=f"{len(records)} runs; labelled by the settings that differ",
        bytes_sent=sent if any(v is not None for v in sent.values()) else None,
    )
    return figure, table(records, names)


def run_compare(args: argparse.Namespace) -> int:
    from jdp import plot

    figure, text = compare(args.runs)
    out = check_out_dir(args.out)
    plot.save(figure, out / "compare.png")
    (out / "compare.md").write_text(text)
    print(text, end="")
    print(f"wrote {out / 'compare.png'} and {out / 'compare.md'}")
    return 0
