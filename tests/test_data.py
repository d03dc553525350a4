import gzip
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from jdp import data
from jdp.errors import DataError

REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "fashion-mnist"


def write_idx(path: Path, array: np.ndarray, magic: int | None = None, truncate: int = 0) -> Path:
    magic = magic if magic is not None else (0x801 if array.ndim == 1 else 0x803)
    raw = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    with gzip.open(path, "wb") as f:
        f.write(raw[: len(raw) - truncate] if truncate else raw)
    return path


def fake_dir(tmp_path: Path, n_train=12, n_test=5) -> Path:
    rng = np.random.default_rng(0)
    write_idx(tmp_path / data.FILES["train_images"], rng.integers(0, 256, (n_train, 28, 28)))
    write_idx(tmp_path / data.FILES["train_labels"], rng.integers(0, 10, n_train))
    write_idx(tmp_path / data.FILES["test_images"], rng.integers(0, 256, (n_test, 28, 28)))
    write_idx(tmp_path / data.FILES["test_labels"], rng.integers(0, 10, n_test))
    return tmp_path


def test_reads_valid_idx(tmp_path):
    images = np.arange(2 * 28 * 28).reshape(2, 28, 28) % 256
    got = data.read_idx(write_idx(tmp_path / "x.gz", images), data.IMAGES_MAGIC)
    np.testing.assert_array_equal(got, images)


def test_truncated_idx_is_a_clear_error(tmp_path):
    path = write_idx(tmp_path / "x.gz", np.zeros((3, 28, 28)), truncate=100)
    with pytest.raises(DataError, match="truncated or corrupt"):
        data.read_idx(path, data.IMAGES_MAGIC)


def test_wrong_magic_is_a_clear_error(tmp_path):
    path = write_idx(tmp_path / "x.gz", np.zeros(4), magic=0x801)
    with pytest.raises(DataError, match="magic number 0x00000801"):
        data.read_idx(path, data.IMAGES_MAGIC)


def test_not_gzip_is_a_clear_error(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="not a complete gzip file"):
        data.read_idx(tmp_path / "x.gz", data.IMAGES_MAGIC)


def test_load_idx_scales_and_shapes(tmp_path):
    ds = data.load_idx(fake_dir(tmp_path))
    assert ds.train.images.shape == (12, 1, 28, 28) and ds.train.images.dtype == np.float32
    assert 0.0 <= ds.train.images.min() and ds.train.images.max() <= 1.0
    assert ds.test.labels.shape == (5,) and ds.test.labels.dtype == np.int32


def test_missing_file_is_named(tmp_path):
    fake_dir(tmp_path)
    (tmp_path / data.FILES["test_labels"]).unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        data.load_idx(tmp_path)


def test_count_mismatch_is_a_clear_error(tmp_path):
    fake_dir(tmp_path)
    write_idx(tmp_path / data.FILES["train_labels"], np.zeros(11))
    with pytest.raises(DataError, match="12 images, 11 labels"):
        data.load_idx(tmp_path)


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="Data directory not found"):
        data.load_idx(tmp_path / "nope")


def test_synthetic_is_seeded_and_learnable():
    a, b = data.synthetic(jax.random.key(0)), data.synthetic(jax.random.key(0))
    np.testing.assert_array_equal(a.train.images, b.train.images)
    assert a.train.images.shape == (2048, 1, 28, 28)
    # the label's rows are brighter than the rest: a trivial classifier already beats chance by far
    rows = a.test.images[:, 0, 4:24, :].mean(-1).reshape(-1, 10, 2).mean(-1)
    assert (rows.argmax(-1) == a.test.labels).mean() > 0.9


def test_tfds_data_source_with_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=20, policy=tfds.testing.MockPolicy.USE_CODE):
        ds = data.load_tfds()
    assert ds.train.images.shape == (20, 1, 28, 28) and ds.train.images.dtype == np.float32
    assert ds.train.labels.shape == (20,)
    assert ds.train.labels.min() >= 0 and ds.train.labels.max() < 10


def test_find_data_dir_without_download_names_the_places(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JDP_DATA_DIR", raising=False)
    with pytest.raises(DataError, match="Pass `data_dir`"):
        data.find_data_dir(None, download=False)


def test_find_data_dir_uses_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_DATA_DIR", str(fake_dir(tmp_path)))
    assert data.find_data_dir(None, download=False) == tmp_path


def test_checksums_come_from_tfds():
    sums = data._tfds_checksums()
    assert set(sums) == set(data.FILES.values())
    assert sums["train-images-idx3-ubyte.gz"][1] == 26421880


@pytest.mark.skipif(not REAL.is_dir(), reason="the real Fashion-MNIST copy exists only beside this checkout")
def test_real_fashion_mnist_loads():
    ds = data.load_idx(REAL)
    assert ds.train.images.shape == (60000, 1, 28, 28) and ds.test.images.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.train.labels).tolist() == [6000] * 10
