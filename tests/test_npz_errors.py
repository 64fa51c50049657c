"""Bad npz files (issue 32): every one is a one-line ConfigError that names the file, the array,
what is wrong and the fix, and docs/data.md's table of refusals lists it; through the real
`flockfl run` it is one stderr line, exit code 2, no traceback. Files the loader must keep
accepting (and values it must not touch) are checked too."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conftest import run_flock

ROOT = Path(__file__).resolve().parents[1]
DATA_MD = ROOT / "docs" / "data.md"

X = np.linspace(0, 1, 4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8)
Y = np.arange(4)
GOOD = dict(x_train=X, y_train=Y, x_test=X, y_test=Y)


def _nan_x():
    x = X.copy()
    x[2, 3, 3] = np.nan
    return x


# id: (the file's arrays, the array the message must name, a fix the message must give, what docs/data.md's
# table of refusals must hold for it: the problem's row or the message it quotes)
BAD = {
    "missing_array": (dict(x_train=X, y_train=Y, x_test=X), "y_test", "an npz dataset needs x_train, y_train, x_test, y_test",
                      "missing arrays ['y_test'] (it has x_train, y_train, x_test)"),
    "negative_labels": (dict(GOOD, y_train=Y - 1), "y_train", "renumber the labels", "holds negative values (-1 at index 0)"),
    "negative_test_labels": (dict(GOOD, y_test=Y - 2), "y_test", "renumber the labels", "classes are 0..C-1"),
    "x_test_shape": (dict(GOOD, x_test=np.zeros((4, 7, 8), np.float32)), "x_test",
                     "give both splits the same per-sample shape", "x_test's samples have shape (7, 8), x_train's (8, 8)"),
    "x_1d": (dict(GOOD, x_train=np.zeros(4), x_test=np.zeros(4)), "x_train", "x[:, None] for a single feature",
             "x_train is 1-D (shape (4,))"),
    "empty_train": (dict(GOOD, x_train=np.zeros((0, 8, 8)), y_train=np.zeros(0, np.int64)), "x_train",
                    "give at least one train sample", "has no samples"),
    "empty_test": (dict(GOOD, x_test=np.zeros((0, 8, 8)), y_test=np.zeros(0, np.int64)), "x_test",
                   "give at least one test sample", "x_test has no samples (shape (0, 8, 8))"),
    "empty_samples": (dict(GOOD, x_train=np.zeros((4, 0)), x_test=np.zeros((4, 0))), "x_train",
                      "give at least one feature per sample", "samples of size 0"),
    "string_labels": (dict(GOOD, y_train=np.array(["cat", "dog", "cat", "dog"])), "y_train",
                      "np.unique(y, return_inverse=True)[1]", "y_train holds strings ('cat', 'dog', ...)"),
    "string_x": (dict(GOOD, x_test=np.array([["a"]] * 4)), "x_test", "save x_test with a real numeric dtype", "holds strings"),
    "complex_x": (dict(GOOD, x_train=X + 1j), "x_train", "save x_train with a real numeric dtype",
                  "x must be real numbers (integer, bool or float)"),
    "labels_2d": (dict(GOOD, y_train=Y[:, None]), "y_train", "save y_train.reshape(-1)",
                  "y_train has shape (4, 1); labels need shape (N,)"),
    "length_mismatch": (dict(GOOD, y_train=Y[:3]), "y_train", "each x_* needs one label per sample",
                        "x and y lengths differ: x_train has 4 samples, y_train 3 labels"),
    "length_mismatch_test": (dict(GOOD, x_test=X[:2]), "x_test", "each x_* needs one label per sample", "x and y lengths differ"),
    "nan_x": (dict(GOOD, x_train=_nan_x()), "x_train", "(the first in sample 2); replace them (np.nan_to_num)",
              "NaN or ±inf in x (after the cast to float32)"),
    "inf_x": (dict(GOOD, x_test=np.full((4, 8, 8), np.inf)), "x_test", "drop those samples before saving",
              "NaN or infinite values as float32"),
    "beyond_float32": (dict(GOOD, x_test=np.full((4, 8, 8), 1e300)), "x_test", "np.nan_to_num", "as float32"),
    "nan_regression_target": (dict(GOOD, y_train=np.array([0.5, np.nan, 1.0, 2.0])), "y_train", "np.nan_to_num",
                              "NaN or infinite value"),
    "fractional_test_labels": (dict(GOOD, y_test=np.array([0.5, 1.0, 2.0, 3.0])), "y_test",
                               "give y_test integer class labels too", "y_test holds a non-integer value (0.5 at index 0)"),
    "client_train_only": (dict(GOOD, client_train=Y), "client_test", "give both to use natural clients",
                          "has client_train but no client_test"),
    "client_test_only": (dict(GOOD, client_test=Y), "client_train", "give both to use natural clients", "give both"),
    "client_ids_too_few": (dict(GOOD, client_train=Y, client_test=Y[:2]), "client_test",
                           "give every sample the integer id (0..n-1) of its client",
                           "client_test has shape (2,) for the 4 samples of x_test"),
    "client_ids_too_many": (dict(GOOD, client_train=np.arange(5), client_test=Y), "client_train",
                            "one client id per sample", "client_train/client_test need one client id per sample"),
    "client_ids_negative": (dict(GOOD, client_train=Y - 1, client_test=Y), "client_train", "renumber the clients",
                            "client_train holds negative values (-1 at index 0)"),
    "client_ids_negative_test": (dict(GOOD, client_train=Y, client_test=-Y), "client_test", "renumber the clients",
                                 "client ids are 0..n-1"),
    "client_ids_fractional": (dict(GOOD, client_train=Y + 0.5, client_test=Y), "client_train",
                              "give every sample the integer id", "client ids that are negative, fractional"),
    "group_2d": (dict(GOOD, client_train=Y, client_test=Y, group=np.zeros((2, 2), np.int64)), "group",
                 "give one integer ground-truth group per natural client", "group has shape (2, 2)"),
}


def _load(path: Path):
    from flockfl.config import DatasetConfig
    from flockfl.data.datasets import load_dataset

    return load_dataset(DatasetConfig(name="npz", path=str(path)), 0, None)


def _refusals() -> str:
    """docs/data.md's table of what the npz loader refuses."""
    text = DATA_MD.read_text()
    start = text.index("What is refused, each with one line and exit code 2")
    return text[start:text.index("\n\n", text.index("| problem | the error |", start))]


def _assert_one_line(message: str, path: Path, array: str, fix: str) -> None:
    assert "\n" not in message, message
    assert str(path) in message, f"the message does not name the file: {message}"
    assert re.search(rf"\b{array}\b", message), f"the message does not name {array}: {message}"
    assert fix in message, f"the message lacks the fix {fix!r}: {message}"
    assert "Traceback" not in message


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_npz_is_a_one_line_error_naming_the_array_and_the_fix(tmp_path, case):
    from flockfl.errors import ConfigError

    arrays, array, fix, documented = BAD[case]
    path = tmp_path / f"{case}.npz"
    np.savez(path, **arrays)
    with pytest.raises(ConfigError) as err:
        _load(path)
    message = str(err.value)
    _assert_one_line(message, path, array, fix)
    assert documented in _refusals(), f"docs/data.md's table of refusals lacks {documented!r} (for: {message})"


def test_an_object_array_is_refused_in_one_line(tmp_path):
    from flockfl.errors import ConfigError

    path = tmp_path / "objects.npz"
    np.savez(path, **dict(GOOD, y_train=np.array([1, "a", None, 2], dtype=object)))  # savez pickles it
    with pytest.raises(ConfigError) as err:
        _load(path)
    _assert_one_line(str(err.value), path, "y_train", "np.asarray(y_train, dtype=np.int64)")
    assert "y_train is an object array (dtype=object" in _refusals()


def test_a_npy_file_in_place_of_an_npz_is_refused_in_one_line(tmp_path):
    from flockfl.errors import ConfigError

    path = tmp_path / "x.npy"
    np.save(path, X)
    with pytest.raises(ConfigError) as err:
        _load(path)
    _assert_one_line(str(err.value), path, "x_train", "numpy.savez(PATH, x_train=..., y_train=..., x_test=..., y_test=...)")
    assert "dataset.path:" in str(err.value) and "is a single .npy array (shape (4, 8, 8))" in _refusals()


def test_a_damaged_member_is_refused_in_one_line(tmp_path):
    """A member whose compressed bytes are corrupt: the archive opens, the array does not read."""
    import zipfile

    from flockfl.errors import ConfigError

    good = tmp_path / "good.npz"
    np.savez_compressed(good, **GOOD)
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info.filename, data[:-40] if info.filename == "x_test.npy" else data)
    with pytest.raises(ConfigError) as err:
        _load(bad)
    _assert_one_line(str(err.value), bad, "x_test", "re-save the file with numpy.savez")


def test_the_files_it_accepts_load_as_documented(tmp_path):
    """Whole-float y_test and client ids with integer y_train, float y_train as regression, bool
    labels, feature vectors, and values used exactly as stored (uint8 0–255 is not rescaled)."""
    u8 = (np.arange(4 * 8 * 8) % 256).astype(np.uint8).reshape(4, 8, 8)
    path = tmp_path / "ok.npz"
    np.savez(path, x_train=u8, y_train=Y, x_test=u8, y_test=Y.astype(np.float64), client_train=Y.astype(np.float32),
             client_test=Y, group=np.array([0, 0, 1, 1]))
    ds = _load(path)
    assert ds.task == "classification" and ds.num_classes == 4 and ds.y_test.dtype == np.int64
    assert ds.input_shape == (1, 8, 8) and ds.x_train.dtype == np.float32
    np.testing.assert_array_equal(ds.x_train[:, 0], u8.astype(np.float32))  # 0..255, as stored
    assert ds.x_train.max() == 255.0
    assert ds.client_train.dtype == np.int64 and ds.client_train.tolist() == [0, 1, 2, 3]

    path = tmp_path / "regression.npz"
    np.savez(path, x_train=np.ones((5, 3)), y_train=np.linspace(-1, 1, 5), x_test=np.ones((2, 3)), y_test=np.array([1, 2]))
    ds = _load(path)
    assert ds.task == "regression" and ds.num_classes == 0 and ds.y_test.dtype == np.float32
    assert ds.y_train.min() == -1.0  # negative targets are fine for regression

    path = tmp_path / "bool.npz"
    np.savez(path, x_train=np.ones((4, 2), bool), y_train=Y % 2 == 0, x_test=np.ones((2, 2), bool), y_test=np.array([True, False]))
    ds = _load(path)
    assert ds.task == "classification" and ds.num_classes == 2


def test_every_builtin_loader_and_scheme_has_a_docstring_sentence():
    """`flockfl list datasets` / `flockfl list schemes` print each one's first sentence."""
    from flockfl.data.datasets import LOADERS
    from flockfl.data.schemes import SCHEMES
    from flockfl.reference import builtin
    from flows.listing import _first_line

    for registry in (LOADERS, SCHEMES):
        for name, fn in builtin(registry).items():
            line = _first_line(fn)
            assert line and len(line) >= 20, f"built-in {registry.kind} {name!r} has no docstring sentence"


@pytest.mark.slow
def test_flockfl_run_with_a_bad_npz_is_one_stderr_line_and_exit_2(tmp_path):
    """The real command: a YAML config naming an npz with negative labels."""
    np.savez(tmp_path / "bad.npz", **dict(GOOD, y_train=Y - 1))
    (tmp_path / "bad.yaml").write_text("name: bad_npz\ndataset: {name: npz, path: bad.npz}\n"
                                       "model: {name: mlp, hidden: 8}\ntrain: {rounds: 1}\n")
    res = run_flock(["run", "bad.yaml", "--tracking-uri", f"sqlite:///{tmp_path}/m.db"], tmp_path, timeout=240)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert lines[0].startswith("flockfl: error: bad.npz: y_train holds negative values"), lines[0]
    assert "renumber the labels" in lines[0]
