"""The ``npz`` loader: a user's own arrays read from one ``.npz`` file (docs/data.md's npz
format), with natural client ids and ground-truth groups where the file has them, and every
problem docs/data.md's table of refusals lists as a one-line :class:`~flockfl.errors.ConfigError`
naming the file, the array and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from flockfl.config import DatasetConfig
from flockfl.data.dataset import Dataset
from flockfl.errors import ConfigError


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
