"""Dataset loaders: one function per source, all returning a :class:`Dataset`.

- ``digits``: scikit-learn's bundled 8×8 digits (offline default);
- ``fashion_mnist`` / ``mnist``: IDX or IDX.gz files (searched in ``dataset.path``, then
  ``data/raw/<name>/``, then the Debian package's folder);
- ``npz``: a user's own arrays, optionally with natural client ids and ground-truth groups;
- ``synthetic_linreg``: IFCA's mixture of linear regressions (spec §4.1);
- ``synthetic_fedprox``: FedProx's Synthetic(α, β), one natural client per device (flexcfl.md §7);
- ``mix``: several of the above side by side, each with its own 10 labels (MIX-4, thesis §3.4.2).

``dataset.normalize=per_channel`` standardises the images of any of them as they are loaded
(:func:`standardise_channels`); ``partition.test_split=local`` pools the train and test sets into
one (:func:`merge_splits`).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from flockfl.errors import ConfigError
from flockfl.config import DatasetConfig
from flockfl.plugins import Registry
from flockfl.rng import np_rng


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    task: str = "classification"  # or "regression"
    num_classes: int = 0
    client_train: Optional[np.ndarray] = None  # natural client id of every train sample
    client_test: Optional[np.ndarray] = None
    group: Optional[np.ndarray] = None  # ground-truth cluster of every natural client
    meta: dict = field(default_factory=dict)
    source_train: Optional[np.ndarray] = None  # mix: the source (index into meta["sources"]) of every sample
    source_test: Optional[np.ndarray] = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_outputs(self) -> int:
        return 1 if self.task == "regression" else self.num_classes

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for a in (self.x_train, self.y_train, self.x_test, self.y_test):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()


# ---------------------------------------------------------------------- digits


def load_digits(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """scikit-learn's bundled 8×8 handwritten digits: 1,797 images of 10 classes, offline.

    Pixels 0–16 are scaled to [0, 1], as 1×8×8 images. The test set is a fixed stratified split:
    ``dataset.test_fraction`` of every class, drawn from the (seed, "digits_split") stream."""
    from sklearn.datasets import load_digits as _sk_digits

    bunch = _sk_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    # A fixed stratified split: the same test_fraction of every class is held out.
    rng = np_rng(seed, purpose="digits_split")
    test_mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_mask[idx[: int(round(cfg.test_fraction * len(idx)))]] = True
    return Dataset("digits", x[~test_mask], y[~test_mask], x[test_mask], y[test_mask], num_classes=10)


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


# ---------------------------------------------------------------------- npz


NPZ_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
NPZ_SAVE = "numpy.savez(PATH, x_train=..., y_train=..., x_test=..., y_test=...)"


def _npz_array(z, path: Path, key: str) -> np.ndarray:
    """One array of the archive, or a one-line ConfigError: an object array (pickled Python
    objects, refused by ``allow_pickle=False``) or a member that cannot be read."""
    try:
        return np.asarray(z[key])
    except ValueError as err:
        if "allow_pickle" in str(err) or "pickled" in str(err):
            dtype = "float32" if key.startswith("x_") else "int64"
            raise ConfigError(f"{path}: {key} is an object array (dtype=object; pickled Python objects are not "
                              f"loaded); save it as a numeric array, e.g. np.asarray({key}, dtype=np.{dtype})") from None
        unreadable = err
    except Exception as err:  # a damaged member: zipfile.BadZipFile, zlib.error, EOFError
        unreadable = err
    raise ConfigError(f"{path}: {key} cannot be read ({type(unreadable).__name__}); re-save the file with {NPZ_SAVE}")


def _check_npz_kind(path: Path, key: str, a: np.ndarray, allowed: str, what: str, fix: str) -> None:
    if a.dtype.kind in "USO":
        sample = ", ".join(repr(str(v)) for v in a.ravel()[:2])
        raise ConfigError(f"{path}: {key} holds {'strings' if a.dtype.kind in 'US' else 'Python objects'} "
                          f"({sample}{', ...' if a.size > 2 else ''}); {what}; {fix}")
    if a.dtype.kind not in allowed:
        raise ConfigError(f"{path}: {key} has dtype {a.dtype}; {what}; {fix}")


def _check_whole(path: Path, key: str, a: np.ndarray, fix: str) -> np.ndarray:
    """``a`` as int64 when its values are whole numbers (any integer or bool dtype, or floats such
    as 3.0), else a one-line ConfigError naming the first fractional or non-finite value."""
    if a.dtype.kind in "biu":
        return a.astype(np.int64)
    bad = ~np.isfinite(a) | (a != np.round(a))
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        raise ConfigError(f"{path}: {key} holds a non-integer value ({a.ravel()[i].item()!r} at index {i}); {fix}")
    return a.astype(np.int64)


def _check_nonnegative(path: Path, key: str, a: np.ndarray, fix: str) -> None:
    if a.size and a.min() < 0:
        i = int(np.argmin(a))
        raise ConfigError(f"{path}: {key} holds negative values ({int(a[i])} at index {i}); {fix}")


def _check_finite(path: Path, key: str, a: np.ndarray) -> None:
    finite = np.isfinite(a)
    if not finite.all():
        n, i = int(a.size - finite.sum()), int(np.flatnonzero(~finite.ravel())[0]) // max(1, int(np.prod(a.shape[1:])))
        raise ConfigError(f"{path}: {key} holds {n} NaN or infinite value{'s' if n > 1 else ''} as float32 (the first "
                          f"in sample {i}); replace them (np.nan_to_num) or drop those samples before saving")


def load_npz(cfg: DatasetConfig, seed: int, num_clients: Optional[int] = None) -> Dataset:
    """Your own arrays, read from the ``.npz`` file at ``dataset.path`` (docs/data.md's npz format).

    ``x_train``, ``y_train``, ``x_test``, ``y_test``, optionally ``client_train`` / ``client_test``
    (natural clients) and ``group`` (their ground-truth clusters); other arrays are ignored.
    Integer (or bool) labels make a classification task with max label + 1 classes; float labels
    make a regression task. x is used as stored, cast to float32 and never rescaled (an N×H×W x
    gets the channel axis, N×1×H×W). Everything docs/data.md's table of refusals lists is a
    one-line :class:`ConfigError` naming the file, the array, the problem and the fix.
    """
    path = Path(cfg.path or "")
    if not path.is_file():
        raise ConfigError(f"dataset.path: {str(path)!r} is not a file; point it at an .npz with x_train, y_train, x_test, y_test")
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as err:  # zipfile/ValueError: a damaged or non-npz file
        raise ConfigError(f"dataset.path: {path} is not a readable .npz ({type(err).__name__}); re-save it with numpy.savez") from None
    if not isinstance(z, np.lib.npyio.NpzFile):  # a .npy file: one bare array, not an archive of named ones
        raise ConfigError(f"dataset.path: {path} is a single .npy array (shape {tuple(z.shape)}), not an .npz "
                          f"archive of named arrays; save the four with {NPZ_SAVE}")
    with z:
        return _read_npz(z, path)


def _read_npz(z, path: Path) -> Dataset:
    missing = [k for k in NPZ_ARRAYS if k not in z.files]
    if missing:
        have = f" (it has {', '.join(z.files)})" if z.files else " (it has no arrays)"
        raise ConfigError(f"{path}: missing arrays {missing}{have}; "
                          "an npz dataset needs x_train, y_train, x_test, y_test")
    arrays = {k: _npz_array(z, path, k) for k in NPZ_ARRAYS}
    label_fix = "map classes to 0..C-1 with np.unique(y, return_inverse=True)[1], or give float targets for regression"
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        _check_npz_kind(path, f"x_{split}", x, "biuf", "x must be real numbers (integer, bool or float)",
                        f"save x_{split} with a real numeric dtype, e.g. np.float32")
        _check_npz_kind(path, f"y_{split}", y, "biuf", "labels must be integers (classes) or floats (regression)",
                        label_fix)
        if x.ndim < 2:
            raise ConfigError(f"{path}: x_{split} is {x.ndim}-D (shape {x.shape}); give one row per sample: "
                              f"N×d features (x[:, None] for a single feature), N×H×W or N×C×H×W images")
        if y.ndim != 1:
            raise ConfigError(f"{path}: y_{split} has shape {y.shape}; labels need shape (N,), one per sample: "
                              f"save y_{split}.reshape(-1)"
                              + (" (y.argmax(axis=1) for one-hot rows)" if y.ndim == 2 else ""))
        if len(x) == 0:
            raise ConfigError(f"{path}: x_{split} has no samples (shape {x.shape}); give at least one {split} sample")
        if x[0].size == 0:
            raise ConfigError(f"{path}: x_{split}'s samples are empty (shape {x.shape}); "
                              "give at least one feature per sample")
        if len(x) != len(y):
            raise ConfigError(f"{path}: x and y lengths differ: x_{split} has {len(x)} samples, y_{split} "
                              f"{len(y)} labels; each x_* needs one label per sample")
    x_tr, y_tr, x_te, y_te = (arrays[k] for k in NPZ_ARRAYS)
    if x_te.shape[1:] != x_tr.shape[1:]:
        raise ConfigError(f"{path}: x_test's samples have shape {x_te.shape[1:]}, x_train's {x_tr.shape[1:]}; "
                          f"give both splits the same per-sample shape")
    if x_tr.ndim == 3:  # N×H×W images: add the channel axis
        x_tr, x_te = x_tr[:, None], x_te[:, None]
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32's range: inf, refused just below
        x_tr, x_te = x_tr.astype(np.float32), x_te.astype(np.float32)  # used as stored: no rescaling
    _check_finite(path, "x_train", x_tr)
    _check_finite(path, "x_test", x_te)
    regression = np.issubdtype(y_tr.dtype, np.floating)  # float labels: a regression task
    if regression:
        with np.errstate(over="ignore", invalid="ignore"):
            y_tr, y_te = y_tr.astype(np.float32), y_te.astype(np.float32)
        _check_finite(path, "y_train", y_tr)
        _check_finite(path, "y_test", y_te)
        num_classes = 0
    else:
        y_te = _check_whole(path, "y_test", y_te, "y_train's integer labels make this a classification task: "
                            "give y_test integer class labels too (or float y_train and y_test for regression)")
        y_tr = y_tr.astype(np.int64)
        for key, y in (("y_train", y_tr), ("y_test", y_te)):
            _check_nonnegative(path, key, y,
                               "classes are 0..C-1: renumber the labels (np.unique(y, return_inverse=True)[1])")
        num_classes = int(max(y_tr.max(), y_te.max()) + 1)
    ds = Dataset(
        "npz", x_tr, y_tr, x_te, y_te, task="regression" if regression else "classification",
        num_classes=num_classes, meta={"source": str(path)},
    )
    has = [k for k in ("client_train", "client_test") if k in z.files]
    if len(has) == 1:
        other = ({"client_train", "client_test"} - set(has)).pop()
        raise ConfigError(f"{path}: has {has[0]} but no {other}; give both to use natural clients")
    if has:
        id_fix = "give every sample the integer id (0..n-1) of its client"
        for split, y in (("train", y_tr), ("test", y_te)):
            key = f"client_{split}"
            c = _npz_array(z, path, key)
            _check_npz_kind(path, key, c, "biuf", "client ids must be integers", id_fix)
            if c.ndim != 1 or len(c) != len(y):
                raise ConfigError(f"{path}: client_train/client_test need one client id per sample: {key} has shape "
                                  f"{c.shape} for the {len(y)} samples of x_{split}; {id_fix}")
            c = _check_whole(path, key, c, id_fix)
            _check_nonnegative(path, key, c, "client ids are 0..n-1: renumber the clients")
            setattr(ds, key, c)
    if "group" in z.files:
        g = _npz_array(z, path, "group")
        fix = "give one integer ground-truth group per natural client (shape (n,))"
        _check_npz_kind(path, "group", g, "biuf", "groups must be integers", fix)
        if g.ndim != 1:
            raise ConfigError(f"{path}: group has shape {g.shape}; {fix}")
        ds.group = _check_whole(path, "group", g, fix)
    return ds


# ---------------------------------------------------------------------- synthetic


def make_synthetic_linreg(cfg: DatasetConfig, seed: int, num_clients: int) -> Dataset:
    """IFCA's mixture of linear regressions (spec §4.1).

    θ*_j = R·b_j with b_j ~ Bernoulli(0.5)^d; client i belongs to cluster ⌊i·k/m⌋ (contiguous
    equal blocks); x ~ N(0, I_d) and y = ⟨x, θ*⟩ + σ·ε.
    """
    num_clients = 10 if num_clients is None else num_clients  # partition.num_clients unset: the default 10
    k, d, n, n_te = cfg.clusters, cfg.dim, cfg.samples_per_client, cfg.test_samples_per_client
    if k > num_clients:
        raise ConfigError(f"dataset.clusters: {k} clusters need at least {k} clients (partition.num_clients={num_clients})")
    rng = np_rng(seed, purpose="synthetic_linreg")
    theta = cfg.separation * rng.binomial(1, 0.5, size=(k, d)).astype(np.float64)
    group = (np.arange(num_clients) * k) // num_clients
    xs, ys, xt, yt = [], [], [], []
    for i in range(num_clients):
        for n_i, xo, yo in ((n, xs, ys), (n_te, xt, yt)):
            x = rng.standard_normal((n_i, d))
            xo.append(x)
            yo.append(x @ theta[group[i]] + cfg.noise * rng.standard_normal(n_i))
    return Dataset(
        "synthetic_linreg",
        np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.float32),
        np.concatenate(xt).astype(np.float32), np.concatenate(yt).astype(np.float32),
        task="regression",
        client_train=np.repeat(np.arange(num_clients), n), client_test=np.repeat(np.arange(num_clients), n_te),
        group=group.astype(np.int64), meta={"theta": theta.astype(np.float32)},
    )


FEDPROX_FEATURES, FEDPROX_CLASSES = 60, 10
NATURAL_ONLY = ("synthetic_fedprox",)  # datasets whose clients are the generator's devices


def make_synthetic_fedprox(cfg: DatasetConfig, seed: int, num_clients: Optional[int]) -> Dataset:
    """FedProx's Synthetic(α, β) (Li et al., arXiv 1812.06127; flexcfl.md §7), offline.

    60 features, 10 classes, N devices (``partition.num_clients``, 100 when unset, as in
    FlexCFL's Table II). Device k draws u_k ~ N(0, α) and B_k ~ N(0, β) (α = ``syn_alpha``,
    β = ``syn_beta``; the second argument is a standard deviation, as numpy's scale);
    W_k ∈ R^{60×10} and b_k ∈ R^10 with entries ~ N(u_k, 1); v_k ∈ R^60 with entries
    ~ N(B_k, 1); n_k = int(lognormal(4, 2)) + 50 samples x ~ N(v_k, Σ), Σ = diag(j^−1.2),
    j = 1..60, labelled y = argmax(x W_k + b_k) (softmax does not move the argmax). Each device's
    samples are shuffled and split int(0.9·n_k) train / the rest test. The device is the natural
    client (``client_train`` / ``client_test``), so ``partition.scheme=natural`` uses it; there
    is no ground-truth grouping (every device has its own model).

    Draws come from the (seed, "synthetic_fedprox") stream (sizes, u, B, then device by device
    v_k, W_k, b_k, x, shuffle), so the data is a pure function of (seed, α, β, N). Features are
    float32, labels int64.
    """
    n_dev = 100 if num_clients is None else int(num_clients)
    d, c = FEDPROX_FEATURES, FEDPROX_CLASSES
    rng = np_rng(seed, purpose="synthetic_fedprox")
    sizes = rng.lognormal(4, 2, n_dev).astype(np.int64) + 50
    u = rng.normal(0, cfg.syn_alpha, n_dev)  # mean of W_k and of b_k
    big_b = rng.normal(0, cfg.syn_beta, n_dev)  # mean of v_k
    sd = np.arange(1, d + 1, dtype=np.float64) ** -0.6  # √diag(Σ) = j^(−1.2/2)
    parts = {"xtr": [], "ytr": [], "xte": [], "yte": [], "ctr": [], "cte": []}
    for k in range(n_dev):
        v = rng.normal(big_b[k], 1, d)
        w = rng.normal(u[k], 1, (d, c))
        b = rng.normal(u[k], 1, c)
        x = v + sd * rng.standard_normal((sizes[k], d))
        y = np.argmax(x @ w + b, axis=1)
        order = rng.permutation(sizes[k])
        x, y = x[order], y[order]
        n_tr = int(0.9 * sizes[k])
        for key, arr in (("xtr", x[:n_tr]), ("ytr", y[:n_tr]), ("xte", x[n_tr:]), ("yte", y[n_tr:])):
            parts[key].append(arr)
        parts["ctr"].append(np.full(n_tr, k, np.int64))
        parts["cte"].append(np.full(sizes[k] - n_tr, k, np.int64))
    cat = lambda key: np.concatenate(parts[key])  # noqa: E731
    return Dataset(
        "synthetic_fedprox", cat("xtr").astype(np.float32), cat("ytr").astype(np.int64),
        cat("xte").astype(np.float32), cat("yte").astype(np.int64), num_classes=c,
        client_train=cat("ctr"), client_test=cat("cte"),
        meta={"alpha": cfg.syn_alpha, "beta": cfg.syn_beta, "devices": n_dev, "samples_per_device": sizes.tolist()},
    )


def check_natural_only(dataset: str, scheme: str) -> None:
    """ValueError (one line) when a dataset whose clients are its devices is re-partitioned:
    Synthetic(α, β)'s heterogeneity *is* its per-device models, and pooling the devices to deal
    them out again (iid, dirichlet, ...) would throw that away."""
    if dataset in NATURAL_ONLY and scheme != "natural":
        raise ValueError(f"partition.scheme: {dataset} is generated device by device (each device is a client); "
                         f"use partition.scheme=natural, not {scheme!r}")


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


def _check_loader(name: str, fn: object) -> str:
    return "" if callable(fn) else f"{fn!r} is not a function (cfg: DatasetConfig, seed, num_clients) -> Dataset"


# the registry of ``dataset.name`` (the schema's list is checked against its built-ins by the tests), then the
# plugins' (flockfl.plugins.register_dataset)
LOADERS: Registry = Registry("dataset", {
    "digits": load_digits,
    "fashion_mnist": load_fashion_mnist,
    "mnist": load_mnist,
    "npz": load_npz,
    "synthetic_linreg": make_synthetic_linreg,
    "mix": load_mix,
    "synthetic_fedprox": make_synthetic_fedprox,
}, check=_check_loader)


def load_dataset(cfg: DatasetConfig, seed: int, num_clients: Optional[int]) -> Dataset:
    ds = LOADERS[cfg.name](cfg, seed, num_clients)
    return standardise_channels(ds, cfg) if cfg.normalize == "per_channel" else ds


def standardise_channels(ds: Dataset, cfg: DatasetConfig) -> Dataset:
    """``dataset.normalize=per_channel``: x ← (x − mean_c)/std_c on the train and test images,
    channel by channel, before any partition or client sees them (torchvision's ``Normalize``
    once, for the whole run). The statistics are ``normalize_mean`` / ``normalize_std`` when
    given, else the training images' own (float64 mean and population std; a constant channel
    keeps std 1); they are kept in ``meta['normalize']``."""
    if ds.x_train.ndim != 4:
        raise ConfigError(f"dataset.normalize: per_channel standardises image channels; {ds.name} samples have shape "
                          f"{ds.input_shape}; use dataset.normalize=none")
    channels = ds.x_train.shape[1]
    if cfg.normalize_mean is not None:
        if len(cfg.normalize_mean) != channels:
            raise ConfigError(f"dataset.normalize_mean: {len(cfg.normalize_mean)} values for {channels}-channel images; "
                              f"give {channels} values (and as many in normalize_std)")
        mean, std = np.asarray(cfg.normalize_mean, np.float64), np.asarray(cfg.normalize_std, np.float64)
    else:
        mean = ds.x_train.mean(axis=(0, 2, 3), dtype=np.float64)
        std = ds.x_train.std(axis=(0, 2, 3), dtype=np.float64)
        std = np.where(std > 0, std, 1.0)
    m32, s32 = mean.astype(np.float32).reshape(1, -1, 1, 1), std.astype(np.float32).reshape(1, -1, 1, 1)
    scale = lambda x: ((x - m32) / s32).astype(np.float32)  # noqa: E731
    return dataclasses.replace(ds, x_train=scale(ds.x_train), x_test=scale(ds.x_test),
                               meta={**ds.meta, "normalize": {"mean": mean.tolist(), "std": std.tolist()}})


def merge_splits(ds: Dataset) -> Dataset:
    """``partition.test_split=local`` (PFLlib): the train and test sets pooled, the train samples
    first, so that a partition deals the union over the clients and splits each client's own
    samples. ``x_train`` and ``x_test`` (and the labels, natural client ids and mix sources) are
    then one and the same array, so a partition's train and test indices both point into it.

    In place, and once (``meta['merged_splits']`` records the sizes it pooled): the run builds its
    partition and its client data from the same loaded object (``flockfl.rounds.prepare``)."""
    if "merged_splits" in ds.meta:
        return ds
    cat = lambda a, b: None if a is None else np.concatenate([a, b])  # noqa: E731
    n_train, n_test = len(ds.y_train), len(ds.y_test)
    ds.x_train = ds.x_test = cat(ds.x_train, ds.x_test)
    ds.y_train = ds.y_test = cat(ds.y_train, ds.y_test)
    if ds.client_train is not None:
        ds.client_train = ds.client_test = cat(ds.client_train, ds.client_test)
    if ds.source_train is not None:
        ds.source_train = ds.source_test = cat(ds.source_train, ds.source_test)
    ds.meta = {**ds.meta, "merged_splits": {"train": n_train, "test": n_test}}
    return ds
