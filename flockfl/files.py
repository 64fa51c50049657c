"""Durable writes: a file is written to a temp name, fsynced, renamed over the target and its
directory fsynced, so a crash leaves the old file or the new one, never a torn one."""

from __future__ import annotations

import os
from pathlib import Path

from flockfl.faults import maybe_crash


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, round: int = -1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    maybe_crash("checkpoint_tmp", round)
    os.replace(tmp, path)
    fsync_dir(path.parent)
