"""What every experiment script shares: flags, devices, data, and writing JSON + markdown outputs."""

import argparse
import json
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion-mnist"


def parser(description: str, default_out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="seconds-long smoke run on synthetic data (what the tests run)")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="folder with the four Fashion-MNIST IDX files")
    p.add_argument("--out", default=default_out, help="where to write the JSON, PNG and markdown table")
    return p


def load_data(args: argparse.Namespace, n_train: int, n_test: int):
    """Fashion-MNIST from `--data-dir`, or in `--quick` mode `n_train` and `n_test` synthetic images.

    Call it after the devices are set up: it imports jdp (and JAX).
    """
    import jdp

    if not args.quick:
        return jdp.load_dataset("fashion_mnist", args.data_dir)
    full = jdp.load_dataset("synthetic", seed=0)  # the public API's synthetic set: 2048 train, 512 test images
    return jdp.Dataset(jdp.Split(full.train.images[:n_train], full.train.labels[:n_train]),
                       jdp.Split(full.test.images[:n_test], full.test.labels[:n_test]))


def machine() -> str:
    """One line naming the CPU and core count, recorded next to every measurement."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip() or "?"
    return f"{model}, {cores} cores, {platform.system()} (no GPU; devices are simulated CPU devices)"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, name: str, record: dict, table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
    print(table)
    print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}")


def train_and_compare(modes: dict[str, list[str]], runs: Path, out: Path, flags: Sequence[str],
                      reuse: bool = False) -> dict[str, dict]:
    """One `jdp train --out runs/NAME *flags *modes[NAME]` process per mode, one after the other (with `reuse`,
    only those without a history.json yet), then `jdp compare` of them all into `out`; their histories."""
    for name, extra in modes.items():
        if reuse and (runs / name / "history.json").exists():
            continue
        command = [sys.executable, "-m", "jdp", "train", "--no-progress", "--out", str(runs / name), *flags, *extra]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "jdp", "compare", *(str(runs / name) for name in modes),
                    "--out", str(out)], check=True)
    return {name: json.loads((runs / name / "history.json").read_text()) for name in modes}
