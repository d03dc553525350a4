"""Fashion-MNIST from its canonical gzipped IDX files, from tfds, or synthetic; all as host arrays.

A `Dataset` holds images as float32 in [0, 1] with shape (N, 1, 28, 28) (NCHW, the lesson's
layout) and labels as int32. The IDX files are the source of truth and are validated on read.
"""

import gzip
import hashlib
import os
import shutil
import struct
import tempfile
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jdp.errors import Arg, DataError

FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801  # ubyte data with 3 dims / 1 dim
DATASETS = ("fashion_mnist", "tfds", "synthetic")  # what `load` reads: the IDX files, tfds's copy, generated
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class Split(NamedTuple):
    images: np.ndarray  # (N, 1, 28, 28) float32 in [0, 1]
    labels: np.ndarray  # (N,) int32


class Dataset(NamedTuple):
    train: Split
    test: Split


def read_idx(path: str | os.PathLike, magic: int) -> np.ndarray:
    """Reads a gzipped IDX file of unsigned bytes, checking its magic number and length.

    Raises:
      DataError: if the file is missing, not gzip, has another magic number, or holds fewer or
        more bytes than its header announces.
    """
    path = Path(path)
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"IDX file not found: {path}.") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path} is not a complete gzip file ({e}); download it again.") from None
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < 4 or struct.unpack(">I", raw[:4])[0] != magic:
        found = struct.unpack(">I", raw[:4])[0] if len(raw) >= 4 else None
        raise DataError(
            f"{path} has magic number {found:#010x} but an IDX file of {ndim}-D unsigned bytes has "
            f"{magic:#010x}; is it the right file?" if found is not None else f"{path} is empty."
        )
    if len(raw) < header:
        raise DataError(f"{path} is truncated: its header needs {header} bytes, the file has {len(raw)}.")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise DataError(
            f"{path} holds {len(raw) - header} data bytes but its header announces shape {shape} "
            f"= {expected} bytes; the file is truncated or corrupt."
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def to_split(images_u8: np.ndarray, labels_u8: np.ndarray) -> Split:
    """Scales uint8 images (N, 28, 28) to float32 [0, 1] in (N, 1, 28, 28) and checks counts."""
    if len(images_u8) != len(labels_u8):
        raise DataError(f"Images and labels differ in count: {len(images_u8)} images, {len(labels_u8)} labels.")
    images = (images_u8.astype(np.float32) / 255.0).reshape(len(images_u8), 1, *images_u8.shape[-2:])
    return Split(images, labels_u8.astype(np.int32))


def load_idx(data_dir: str | os.PathLike) -> Dataset:
    """Loads the four canonical Fashion-MNIST IDX files from `data_dir`."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"Data directory not found: {data_dir}. Pass ", Arg("data_dir"), " or set $JDP_DATA_DIR.")
    missing = [name for name in FILES.values() if not (data_dir / name).is_file()]
    if missing:
        raise DataError(f"{data_dir} lacks {', '.join(missing)}; it needs all four Fashion-MNIST IDX files.")
    arrays = {
        key: read_idx(data_dir / name, IMAGES_MAGIC if key.endswith("images") else LABELS_MAGIC)
        for key, name in FILES.items()
    }
    try:
        return Dataset(
            to_split(arrays["train_images"], arrays["train_labels"]),
            to_split(arrays["test_images"], arrays["test_labels"]),
        )
    except DataError as e:
        raise DataError(f"{data_dir}: ", *e.parts) from None


def default_data_dirs() -> list[Path]:
    """Where jdp looks when no `data_dir` is given, in order."""
    dirs = [Path(os.environ["JDP_DATA_DIR"])] if os.environ.get("JDP_DATA_DIR") else []
    return dirs + [Path("../shared/data/fashion-mnist"), Path.home() / ".cache" / "jdp" / "fashion-mnist"]


def find_data_dir(data_dir: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """`data_dir` if given, else the first default directory holding the four files, else a download.

    Raises:
      DataError: if nothing is found and the download is off or fails.
    """
    if data_dir is not None:
        return Path(data_dir)
    for candidate in default_data_dirs():
        if all((candidate / name).is_file() for name in FILES.values()):
            return candidate
    target = default_data_dirs()[-1]
    if not download:
        raise DataError(
            "Fashion-MNIST not found in " + ", ".join(map(str, default_data_dirs())) + ". Pass ", Arg("data_dir"),
            ", a directory holding the four IDX files, or set $JDP_DATA_DIR."
        )
    return download_fashion_mnist(target)


def _tfds_checksums() -> dict[str, tuple[str, int, str]]:
    """filename -> (url, size, sha256) from the checksum list tfds ships (read without TensorFlow)."""
    text = resources.files("tensorflow_datasets").joinpath("url_checksums/fashion_mnist.txt").read_text()
    rows = (line.split("\t") for line in text.splitlines() if line.strip())
    return {row[3]: (row[0], int(row[1]), row[2]) for row in rows}


def download_fashion_mnist(target: str | os.PathLike) -> Path:
    """Downloads the four files to `target`, verifying size and sha256 against tfds's checksums.

    Each file is written to a temporary name and renamed only once verified, so an interrupted or
    corrupt download never leaves a file that looks valid.
    """
    import urllib.request  # a fifth of `import jdp`'s own time otherwise, for a download that rarely happens

    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for name, (url, size, sha256) in _tfds_checksums().items():
        if (target / name).is_file():
            continue
        with tempfile.NamedTemporaryFile(dir=target, delete=False) as tmp:
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    shutil.copyfileobj(response, tmp)
            except OSError as e:
                os.unlink(tmp.name)
                raise DataError(
                    f"Could not download {url} ({e}). Without network access, pass ", Arg("data_dir"),
                    " pointing at the four Fashion-MNIST IDX files."
                ) from None
        digest = hashlib.sha256(Path(tmp.name).read_bytes()).hexdigest()
        if os.path.getsize(tmp.name) != size or digest != sha256:
            os.unlink(tmp.name)
            raise DataError(f"Download of {url} failed verification (size or sha256 mismatch).")
        os.replace(tmp.name, target / name)
    return target


def load_tfds(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST already prepared by tfds, read with `tfds.data_source` (no TensorFlow needed)."""
    import tensorflow_datasets as tfds  # imported here: it is slow to import and only this needs it

    try:
        sources = {s: tfds.data_source("fashion_mnist", split=s, data_dir=data_dir) for s in ("train", "test")}
    except Exception as e:  # tfds raises several types for a dataset that is not prepared
        raise DataError(f"tfds could not open prepared fashion_mnist in {data_dir}: {e}") from None

    def split(source) -> Split:
        records = [source[i] for i in range(len(source))]
        images = np.stack([np.asarray(r["image"]) for r in records]).reshape(len(records), 28, 28)
        labels = np.asarray([r["label"] for r in records])
        return to_split(images, labels)

    return Dataset(split(sources["train"]), split(sources["test"]))


def synthetic(key: jax.Array, n_train: int = 2048, n_test: int = 512) -> Dataset:
    """Seeded noise with Fashion-MNIST's shapes, where class c brightens rows 2c..2c+2.

    The label is visible in the image, so a smoke run's loss falls and its accuracy rises.
    """
    label_key, noise_key = jax.random.split(key)
    n = n_train + n_test
    labels = np.asarray(jax.random.randint(label_key, (n,), 0, len(CLASSES)))
    images = 0.5 * np.asarray(jax.random.uniform(noise_key, (n, 28, 28)))
    for offset in (0, 1):
        images[np.arange(n), 2 * labels + offset + 4, :] += 0.5
    u8 = (images * 255).astype(np.uint8)
    return Dataset(to_split(u8[:n_train], labels[:n_train]), to_split(u8[n_train:], labels[n_train:]))


def load(name: str, data_dir: str | os.PathLike | None = None, *, seed: int = 0) -> Dataset:
    """The dataset called `name`, one of `DATASETS`: "fashion_mnist" (IDX files), "tfds" (tfds-prepared) or
    "synthetic" (`synthetic` with `seed`); `data_dir` as `find_data_dir` (fashion_mnist) or tfds's (tfds)."""
    if name == "fashion_mnist":
        return load_idx(find_data_dir(data_dir))
    if name == "tfds":
        return load_tfds(data_dir)
    if name == "synthetic":
        return synthetic(jax.random.key(seed))
    raise DataError(f"Unknown dataset `{name}`: `name` must be one of {', '.join(DATASETS)}.")
