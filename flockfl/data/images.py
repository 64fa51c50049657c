"""The image loaders: ``digits`` (scikit-learn's bundled 8×8 digits), ``fashion_mnist`` /
``mnist`` (their IDX files, searched in ``dataset.path``, ``data/raw/<name>/`` and the Debian
package's folder) and ``mix`` (several of them side by side, each with its own 10 labels).
"""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from flockfl.config import DatasetConfig
from flockfl.data.dataset import Dataset
from flockfl.errors import ConfigError
from flockfl.rng import np_rng


# ---------------------------------------------------------------------- digits


def load_digits(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """scikit-learn's bundled 8×8 handwritten digits: 1,797 images of 10 classes, offline.

    Pixels 0–16 are scaled to [0, 1], as 1×8×8 images. The test set is a fixed stratified split:
    ``dataset.test_fraction`` of every class, drawn from the (seed, "digits_split") stream."""
    images, target = _bundled_digits()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = target.astype(np.int64)
    # A fixed stratified split: the same test_fraction of every class is held out.
    rng = np_rng(seed, purpose="digits_split")
    test_mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_mask[idx[: int(round(cfg.test_fraction * len(idx)))]] = True
    return Dataset("digits", x[~test_mask], y[~test_mask], x[test_mask], y[test_mask], num_classes=10)


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``digits.csv.gz`` read as its ``load_digits`` reads it (float64 pixels,
    the label in the last column), from the installed package's data folder without importing
    scikit-learn (about 1.5 s a run); through ``sklearn.datasets`` where that file is not found.
    Parsed once per process (27 ms of text a load; a sweep or a test session loads it hundreds
    of times); every caller gets its own copy."""
    images, target = _parsed_digits()
    return images.copy(), target.copy()


@functools.lru_cache(maxsize=1)
def _parsed_digits() -> tuple[np.ndarray, np.ndarray]:
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as _sk_digits

        bunch = _sk_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


# ---------------------------------------------------------------------- IDX (MNIST / Fashion-MNIST)

IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
SYSTEM_DIRS = {"fashion_mnist": "/usr/share/datasets/fashion-mnist", "mnist": "/usr/share/datasets/mnist"}
APT_HINT = {
    "fashion_mnist": "apt-get update && apt-get install -y dataset-fashion-mnist",
    "mnist": "copy the four MNIST IDX files there",
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed) into a NumPy array."""
    path = Path(path)
    opener: Callable = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ConfigError(f"{path}: not an IDX file (bad magic number); re-download or re-install it")
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ConfigError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ConfigError(f"{path}: truncated IDX file ({data.size} of {int(np.prod(dims))} values); replace it")
    return data.reshape(dims)


def _find_idx_dir(name: str, data_dir: Optional[str]) -> Path:
    candidates = ([Path(data_dir)] if data_dir else []) + [Path("data/raw") / name, Path(SYSTEM_DIRS[name])]
    for d in candidates:
        if all((d / f).exists() or (d / (f + ".gz")).exists() for f in IDX_FILES.values()):
            return d
    names = ", ".join(str(d) for d in candidates)
    raise ConfigError(
        f"{name}: IDX files not found in {names}; pass dataset.path=DIR, put them in data/raw/{name}/, or run: {APT_HINT[name]}"
    )


def load_idx_dataset(cfg: DatasetConfig, seed: int) -> Dataset:
    """The four IDX files of ``cfg.name`` (fashion_mnist or mnist) as 1×28×28 images in [0, 1]
    (bytes / 255) with int64 labels, the files' own train/test split."""
    d = _find_idx_dir(cfg.name, cfg.path)
    arrays = {}
    for key, stem in IDX_FILES.items():
        f = d / stem if (d / stem).exists() else d / (stem + ".gz")
        arrays[key] = read_idx(f)
    for split in ("train", "test"):
        if len(arrays[f"x_{split}"]) != len(arrays[f"y_{split}"]):
            raise ConfigError(f"{d}: {split} images and labels differ in count; the IDX files do not belong together")
    x_tr = (arrays["x_train"].astype(np.float32) / 255.0)[:, None]
    x_te = (arrays["x_test"].astype(np.float32) / 255.0)[:, None]
    return Dataset(
        cfg.name, x_tr, arrays["y_train"].astype(np.int64), x_te, arrays["y_test"].astype(np.int64),
        num_classes=10, meta={"source": str(d)},
    )


def load_fashion_mnist(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """Fashion-MNIST: 28×28 grey images of clothing, 10 classes, read from its four IDX files.

    60,000 train and 10,000 test images, scaled to [0, 1]. The files are searched in
    ``dataset.path``, then ``data/raw/fashion_mnist/``, then the Debian package's folder
    (:func:`load_idx_dataset`)."""
    return load_idx_dataset(cfg, seed)


def load_mnist(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """MNIST: 28×28 grey images of handwritten digits, 10 classes, read from its four IDX files.

    60,000 train and 10,000 test images, scaled to [0, 1]. The files are searched in
    ``dataset.path``, then ``data/raw/mnist/``, then ``/usr/share/datasets/mnist``
    (:func:`load_idx_dataset`)."""
    return load_idx_dataset(cfg, seed)


# ---------------------------------------------------------------------- mix


def default_mix_sources(data_dir: Optional[str] = None) -> list[str]:
    """Fashion-MNIST and digits, plus MNIST when its IDX files are found (appended last, so the
    label offsets of the first two do not depend on it)."""
    try:
        _find_idx_dir("mnist", str(Path(data_dir) / "mnist") if data_dir else None)
        return ["fashion_mnist", "digits", "mnist"]
    except ConfigError:
        return ["fashion_mnist", "digits"]


def load_mix(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """Several image sources side by side, each with its own 10 labels (MIX, thesis §3.5).

    MIX-4 adapted to the sources at hand: ``dataset.sources``, by default Fashion-MNIST and
    digits, plus MNIST when its files are found.

    Source s keeps its own train/test split; its labels are offset by 10·s, so the label spaces
    are disjoint (num_classes = 10·S), and every sample's source is in ``source_train`` /
    ``source_test``. All images are 1×28×28 in [0, 1]: digits' 8×8 images are upsampled
    bilinearly (``torch.nn.functional.interpolate``, align_corners=False). With ``dataset.path``
    set, an IDX source is looked for in ``<path>/<source>/`` first.
    """
    import torch

    names = list(cfg.sources) if cfg.sources is not None else default_mix_sources(cfg.path)
    if len(names) == 0 or len(set(names)) != len(names):
        raise ConfigError(f"dataset.sources: {names} must name at least one source, each once; e.g. [fashion_mnist, digits]")
    parts, where = [], []
    for name in names:
        sub = cfg.model_copy(update={"name": name, "path": str(Path(cfg.path) / name) if cfg.path else None})
        if name == "digits":
            ds = load_digits(sub, seed)
            up = lambda a: torch.nn.functional.interpolate(  # noqa: E731
                torch.from_numpy(a), size=(28, 28), mode="bilinear", align_corners=False).numpy()
            ds.x_train, ds.x_test = up(ds.x_train), up(ds.x_test)
            where.append("sklearn digits (8×8 → 28×28)")
        else:
            ds = load_idx_dataset(sub, seed)
            where.append(ds.meta["source"])
        parts.append(ds)
    cat = lambda key: np.concatenate([getattr(d, key) for d in parts])  # noqa: E731
    offset = lambda key: np.concatenate([getattr(d, key) + 10 * s for s, d in enumerate(parts)])  # noqa: E731
    src = lambda key: np.concatenate([np.full(len(getattr(d, key)), s, np.int64) for s, d in enumerate(parts)])  # noqa: E731
    return Dataset(
        "mix", cat("x_train"), offset("y_train"), cat("x_test"), offset("y_test"), num_classes=10 * len(parts),
        meta={"sources": names, "source_dirs": where}, source_train=src("y_train"), source_test=src("y_test"),
    )
