"""docs/data.md's npz example holds: its Python block writes a file that flockfl's own loader
reads as the format table says, its YAML config loads and partitions that file by its natural
clients and groups, and one round runs on it (in-process, no Prefect or MLflow)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_MD = ROOT / "docs" / "data.md"


def example_block(marker: str) -> str:
    """The fenced code block that follows ``<!-- npz-example:<marker> -->`` in docs/data.md."""
    found = re.search(rf"^<!-- npz-example:{marker} -->\n```\w*\n(.*?)^```$", DATA_MD.read_text(), re.S | re.M)
    assert found, f"docs/data.md lost its <!-- npz-example:{marker} --> code block"
    return found.group(1)


@pytest.fixture
def example(tmp_path, monkeypatch):
    """The example's files, written by its own code in a fresh folder (the cwd)."""
    monkeypatch.chdir(tmp_path)
    exec(compile(example_block("python"), "docs/data.md (npz example)", "exec"), {"__name__": "npz_example"})
    (tmp_path / "my_data.yaml").write_text(example_block("yaml"))
    assert (tmp_path / "my_data.npz").is_file()
    return tmp_path


def test_the_example_file_loads_as_the_format_table_says(example):
    from flockfl.config import DatasetConfig
    from flockfl.data.datasets import load_dataset

    ds = load_dataset(DatasetConfig(name="npz", path="my_data.npz"), 0, None)
    assert ds.task == "classification" and ds.num_classes == 3
    assert ds.input_shape == (1, 8, 8) and ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0  # used as stored: the example gives [0, 1]
    assert len(ds.x_train) == len(ds.y_train) == len(ds.client_train) == 6 * 60
    assert len(ds.x_test) == len(ds.y_test) == len(ds.client_test) == 6 * 15
    assert sorted(np.unique(ds.client_train)) == list(range(6))
    assert ds.group.tolist() == [0, 0, 0, 1, 1, 1]


def test_the_example_config_partitions_by_the_files_clients_and_runs_a_round(example):
    from flockfl.data.store import build_partition
    from flockfl.experiments import load_experiment
    from flockfl.rounds import prepare, run_rounds

    cfg = load_experiment("my_data.yaml", ["train.rounds=1", "tracking.enabled=false", "train.engine=vectorized"],
                          example / "no-params.yaml")
    assert cfg.dataset.name == "npz" and cfg.dataset.path == "my_data.npz" and cfg.partition.scheme == "natural"
    part = build_partition(cfg, example / "partitions")[1]
    assert part.num_clients == 6 and part.group.tolist() == [0, 0, 0, 1, 1, 1]
    state = run_rounds(prepare(cfg, example / "partitions"))
    assert state.round == 1 and state.history and "accuracy" in state.history[-1]


def test_the_refusals_the_doc_lists_are_one_line_errors(tmp_path):
    """Rows of the doc's table of refusals that the loader raises (every other row the loader
    raises is tested in test_npz_errors.py; the ones raised by the schema and the partition in
    test_data.py and test_experiments.py)."""
    from flockfl.config import DatasetConfig
    from flockfl.data.npz import load_npz
    from flockfl.errors import ConfigError

    text = DATA_MD.read_text()
    x, y = np.zeros((4, 8, 8), np.float32), np.arange(4)
    cases = {
        "missing.npz": (None, "is not a file"),
        "no_test.npz": (dict(x_train=x, y_train=y, x_test=x), "missing arrays ['y_test']"),
        "lengths.npz": (dict(x_train=x, y_train=y[:3], x_test=x, y_test=y), "x and y lengths differ"),
        "clients.npz": (dict(x_train=x, y_train=y, x_test=x, y_test=y, client_train=y), "has client_train but no client_test"),
        "ids.npz": (dict(x_train=x, y_train=y, x_test=x, y_test=y, client_train=y[:2], client_test=y),
                    "client_train/client_test need one client id per sample"),
    }
    for name, (arrays, message) in cases.items():
        if arrays is not None:
            np.savez(tmp_path / name, **arrays)
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            load_npz(DatasetConfig(name="npz", path=str(tmp_path / name)), 0)
        assert "\n" not in str(err.value)
        assert message in text, f"docs/data.md's table of refusals lacks {message!r}"
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(ConfigError, match="is not a readable .npz"):
        load_npz(DatasetConfig(name="npz", path=str(tmp_path / "text.npz")), 0)
