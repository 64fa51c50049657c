"""flows/prefect_patches.py: the patched result-key path is the path Prefect's own walk gives."""

from __future__ import annotations

import os

import pytest


def test_result_keys_are_the_paths_prefects_walk_gives(tmp_path, monkeypatch):
    import flows.experiment  # noqa: F401  (applies the patches)
    from prefect.filesystems import LocalFileSystem

    fast = LocalFileSystem._resolve_path
    assert getattr(fast, "flockfl_patched", False)
    slow = fast.__wrapped__
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)  # a base path through a symlink
    monkeypatch.chdir(tmp_path)
    for base in (str(tmp_path / "link"), "link", "~", None):
        fs = LocalFileSystem(basepath=base)
        for key in ("3f2a9c0d1e", "a_b-C9"):
            assert fast(fs, key) == slow(fs, key)
        assert fast(fs, None) == slow(fs, None)
    fs = LocalFileSystem(basepath=str(tmp_path / "link"))
    assert fast(fs, "sub/../k") == slow(fs, "sub/../k")  # not a plain name: walked as before
    with pytest.raises(ValueError):
        fast(fs, "../outside")
    assert os.path.isabs(fast(fs, "x"))
