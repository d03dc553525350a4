"""Every row of the README's bad-input table through the real CLI: one line on stderr, exit 2, nothing
already saved overwritten. (Rows that need simulated devices are in test_cli.py, run as subprocesses.)"""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from jdp import data
from jdp.cli import main as cli
from jdp.training import checkpoint

SAVED = {"history.json": b'{"saved": "by an earlier run"}\n', "accuracy.png": b"\x89PNG earlier"}


def write_idx(path: Path, array: np.ndarray, magic: int | None = None, cut: int = 0) -> None:
    magic = magic if magic is not None else (data.LABELS_MAGIC if array.ndim == 1 else data.IMAGES_MAGIC)
    raw = struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(raw[: len(raw) - cut])


def fashion_dir(tmp_path: Path, n_train: int = 16, n_test: int = 8) -> Path:
    """A valid little copy of the four Fashion-MNIST files, for a test to break one thing in."""
    folder = tmp_path / "fashion"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("test", n_test)):
        write_idx(folder / data.FILES[f"{split}_images"], rng.integers(0, 256, (n, 28, 28)))
        write_idx(folder / data.FILES[f"{split}_labels"], rng.integers(0, 10, n))
    return folder


@pytest.fixture
def out(tmp_path) -> Path:
    """An --out folder holding an earlier run's results, which a failing run must leave untouched."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name, content in SAVED.items():
        (folder / name).write_bytes(content)
    yield folder
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == SAVED


def fails(capsys, *args: str) -> str:
    """Runs `jdp train ARGS` in this process; asserts exit 2 and one line on stderr; returns that line."""
    try:
        code = cli.main(["train", "--dataset", "synthetic", "--epochs", "1", "--no-progress", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, captured
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(("jdp: error: ", "jdp train: error: ")), err
    return err


# ---- data ----------------------------------------------------------------------------------------

def test_missing_data_dir(capsys, tmp_path, out):
    err = fails(capsys, "--dataset", "fashion_mnist", "--data-dir", str(tmp_path / "nope"), "--out", str(out))
    assert "Data directory not found" in err and "--data-dir" in err


@pytest.mark.parametrize("missing", sorted(data.FILES.values()))
def test_missing_one_of_the_four_files(capsys, tmp_path, out, missing):
    folder = fashion_dir(tmp_path)
    (folder / missing).unlink()
    err = fails(capsys, "--dataset", "fashion_mnist", "--data-dir", str(folder), "--out", str(out))
    assert f"lacks {missing}" in err


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("idx", "holds 12536 data bytes but its header announces shape (16, 28, 28) = 12544 bytes"),
        ("gzip", "is not a complete gzip file"),
        ("magic", "has magic number 0x00000801 but an IDX file of 3-D unsigned bytes has 0x00000803"),
    ],
)
def test_truncated_or_wrong_magic_idx(capsys, tmp_path, out, breakage, message):
    folder = fashion_dir(tmp_path)
    images = folder / data.FILES["train_images"]
    if breakage == "idx":  # a valid gzip stream whose IDX payload is 8 bytes short
        write_idx(images, np.zeros((16, 28, 28)), cut=8)
    elif breakage == "gzip":  # a download cut short: the gzip stream itself ends early
        images.write_bytes(images.read_bytes()[:-20])
    else:  # the labels file where the images file should be
        write_idx(images, np.zeros(16), magic=data.LABELS_MAGIC)
    assert message in fails(capsys, "--dataset", "fashion_mnist", "--data-dir", str(folder), "--out", str(out))


def test_images_labels_count_mismatch(capsys, tmp_path, out):
    folder = fashion_dir(tmp_path)
    write_idx(folder / data.FILES["test_labels"], np.zeros(7))
    err = fails(capsys, "--dataset", "fashion_mnist", "--data-dir", str(folder), "--out", str(out))
    assert "Images and labels differ in count: 8 images, 7 labels" in err


# ---- flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "0"], "`--lr` must be positive, got 0.0"),
        (["--lr", "nan"], "`--lr` must be positive, got nan"),
        (["--epochs", "-1"], "`--epochs` must be a positive integer, got -1"),
        (["--batch-size", "0"], "`--batch-size` must be a positive integer, got 0"),
        (["--batch-size", "-8"], "`--batch-size` must be a positive integer, got -8"),
        (["--batch-size", "abc"], "argument --batch-size: invalid int value: 'abc'"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (["--dataset", "mnist"], "argument --dataset: invalid choice: 'mnist'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["--checkpoint-every", "0"], "`--checkpoint-every` must be a positive number of steps, got 0"),
        (["--checkpoint-every", "5"], "`--checkpoint-every` needs `--checkpoint-dir DIR`"),
        (["--resume"], "`--resume` needs `--checkpoint-dir DIR`"),
        (["--check-replicas", "0"], "`--check-replicas` must be a positive number of steps, got 0"),
        (["--model", "resnet50"], "`--model` must be one of lenet, lenet_flax, resnet18, got `resnet50`"),
        (["--batchnorm", "sync"], "`--batchnorm` applies to models with BatchNorm (resnet18), not `--model lenet`"),
        (["--model", "resnet18", "--batchnorm", "per-replica", "--backend", "shard_map"],
         "`--batchnorm per-replica` keeps different statistics on each device"),
    ],
)
def test_bad_flag_values(capsys, out, args, message):
    assert message in fails(capsys, *args, "--out", str(out))


def test_out_is_a_file(capsys, tmp_path):
    (tmp_path / "results").write_bytes(b"mine")
    assert "`--out" in fails(capsys, "--out", str(tmp_path / "results"))
    assert (tmp_path / "results").read_bytes() == b"mine"


def test_out_cannot_be_created(capsys, tmp_path):
    (tmp_path / "results").write_bytes(b"mine")
    err = fails(capsys, "--out", str(tmp_path / "results" / "run1"))
    assert "cannot be created: Not a directory" in err
    assert (tmp_path / "results").read_bytes() == b"mine"


# ---- checkpoint directory ------------------------------------------------------------------------

def test_checkpoint_dir_holding_other_files(capsys, tmp_path, out):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    err = fails(capsys, "--checkpoint-dir", str(folder), "--out", str(out))
    assert "holds files that are not jdp checkpoints (notes.txt)" in err
    assert [p.name for p in folder.iterdir()] == ["notes.txt"] and (folder / "notes.txt").read_text() == "mine"


def test_checkpoint_dir_that_is_a_file(capsys, tmp_path, out):
    (tmp_path / "ckpt").write_text("mine")
    assert "is a file, not a directory" in fails(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out))
    assert (tmp_path / "ckpt").read_text() == "mine"


def test_checkpoint_dir_with_checkpoints_needs_resume(capsys, tmp_path, out):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    garbage = folder / "checkpoint-000000008.msgpack"
    garbage.write_bytes(b"not really a checkpoint")
    err = fails(capsys, "--checkpoint-dir", str(folder), "--out", str(out))
    assert "already holds checkpoints (newest: checkpoint-000000008.msgpack); pass `--resume`" in err
    assert garbage.read_bytes() == b"not really a checkpoint"


@pytest.mark.parametrize("content", [b"garbage", checkpoint.MAGIC + b"\0" * 64])
def test_resume_from_a_garbage_checkpoint(capsys, tmp_path, out, content):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    garbage = folder / "checkpoint-000000008.msgpack"
    garbage.write_bytes(content)
    err = fails(capsys, "--checkpoint-dir", str(folder), "--resume", "--out", str(out))
    assert "No intact checkpoint in `--checkpoint-dir" in err and "checkpoint-000000008.msgpack" in err
    assert [p.name for p in folder.iterdir()] == [garbage.name] and garbage.read_bytes() == content
