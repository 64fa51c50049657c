"""Per-client algorithm state that does not have to fit in memory: :class:`ClientTable`.

SCAFFOLD's control variates c_i, FedAC's client models ω_i, Sub-FedAvg's masks and the
curriculum's last local models are one row per client. Held as dense ``[N, ...]`` tensors they
cost N × row bytes in memory and in every checkpoint (10,000 SCAFFOLD clients of a 159,010-weight
MLP: 6.4 GB, rewritten each round). A ``ClientTable`` holds instead:

- for every client, the SHA-256 of its current row (a client never written has the table's
  default row, e.g. zeros);
- the rows written since the last checkpoint (``dirty``), as bytes in memory;
- a directory of content-addressed row files, ``<root>/<client // 1000>/<client>-<sha256>.row``,
  written once and never changed.

A round reads the rows of its cohort (``gather``) and writes theirs back (``scatter``, which
returns a new table: the old state is untouched, as with every other state tensor). A checkpoint
(:func:`flockfl.state.save_checkpoint`) writes only the dirty rows (``flush``) and stores the
digests, so its size does not grow with the row size, and a round writes only the rows it
changed. Every row read from disk is verified against its digest: a corrupt or missing file is
refused with :class:`flockfl.state.CheckpointError`. When a checkpoint is pruned, the rows it
referred to that no kept checkpoint refers to are deleted (:func:`collect_garbage`): work in
the rows that changed, with no scan of the row directory.

Rows written or read stay in a bounded in-memory cache (:data:`flockfl.rowfiles.ROW_CACHE`, least recently used
first out; ``FLOCKFL_ROW_CACHE_MB``, default 256, 0 turns it off), keyed by (directory, client,
digest) and checked against its file's inode, size and mtime (a file removed or replaced is read
again, and refused if it is missing or corrupt; a file rewritten in place at its size within the
file system's timestamp tick can be served from memory: the bytes verified when cached, which
are the value the state's digest names). A cached row is not read or hashed again.

Memory: N × 33 bytes of digests plus the rows the round touches (and the cache); a checkpoint holds the digests
of the written clients only while they are the fewer (see :meth:`ClientTable.payload`). Rows are
stored in the bytes of their tensors (CPU, C order), names in sorted order; a row's digest is the
SHA-256 of those bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from flockfl import rowfiles
from flockfl.errors import CheckpointError
from flockfl.engine.runtime import in_background, in_threads
from flockfl.rowfiles import signature, write_all, row_path


class ClientTable:
    """One row per client: a dict of named tensors, the same shapes and dtypes for every client."""

    def __init__(self, num_clients: int, default: dict[str, torch.Tensor], root: Optional[Path] = None):
        self.names = sorted(default)  # the byte layout of a row
        self.order = list(default)  # the order rows come back in (the model's parameter order)
        self.shapes = {k: tuple(default[k].shape) for k in self.names}
        self.dtypes = {k: default[k].dtype for k in self.names}
        self.layout: dict[str, tuple[int, int]] = {}  # each name's (offset, bytes) within a row
        off = 0
        for k in self.names:
            size = int(np.prod(self.shapes[k], dtype=np.int64)) * _np_dtype(self.dtypes[k]).itemsize
            self.layout[k] = (off, size)
            off += size
        self.num_clients = int(num_clients)
        row = _row_bytes({k: default[k].detach().cpu() for k in self.names}, self.names)
        self.default = np.frombuffer(row, np.uint8).copy()
        self.default_digest = hashlib.sha256(row).digest()
        self.row_nbytes = len(row)
        # raw SHA-256 per client (a uint8 matrix: numpy's fixed bytes would drop trailing NULs)
        self._digests = np.zeros((self.num_clients, 32), np.uint8)
        self._hashing = None  # the future of the rows the last scatter is hashing (see ``digests``)
        self.has = np.zeros(self.num_clients, bool)  # False: the client reads the default row
        self.dirty: dict[int, np.ndarray] = {}  # rows written since the last flush (uint8 views)
        self.root = Path(root) if root is not None else None

    @property
    def digests(self) -> np.ndarray:
        """Every client's row digest (zeros for a client never written). The rows a scatter wrote are
        hashed on the background thread (:func:`~flockfl.engine.runtime.in_background`) while the
        round goes on (its evaluation): their digests are first read at the checkpoint's flush,
        and reading them waits for the hashing. Rows not yet hashed are in ``dirty``, so a
        gather never needs their digests."""
        if self._hashing is not None:
            self._hashing.result()
            self._hashing = None
        return self._digests

    @digests.setter
    def digests(self, value: np.ndarray) -> None:
        self._hashing = None
        self._digests = value

    # ------------------------------------------------------------------ reading
    def written(self, clients: Optional[np.ndarray] = None) -> np.ndarray:
        """Per listed client (default: all): has its row ever been written?"""
        return self.has.copy() if clients is None else self.has[np.asarray(clients, np.int64)]

    def digest(self, c: int) -> bytes:
        """Client ``c``'s row digest (only for a written row)."""
        return self.digests[c].tobytes()

    def gather(self, clients, device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
        """The listed clients' rows, stacked: ``{name: [len(clients), *shape]}``. Rows not in memory
        are read and verified on torch's threads' worth of threads (file reads and SHA-256 let go
        of the interpreter lock)."""
        clients = np.asarray(clients, np.int64).reshape(-1)
        found, missing = [], []
        for i, c in enumerate(clients):
            row = self._held(int(c))
            found.append(row)
            if row is None:
                missing.append(i)
        loaded = in_threads(lambda i: self._load(int(clients[i])), missing)
        for i, (row, sig) in zip(missing, loaded):
            c = int(clients[i])
            rowfiles.ROW_CACHE.put((str(self.root), c, self.digest(c)), row, sig)
            found[i] = row
        parts = {k: np.empty((len(clients), size), np.uint8) for k, (_, size) in self.layout.items()}
        for i, row in enumerate(found):  # straight into one array per name: no second copy of the rows
            for k, (off, size) in self.layout.items():
                parts[k][i] = row[off:off + size]
        return self._tensors(parts, len(clients), device)

    def dense(self, device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
        """Every client's row, stacked (``[N, *shape]``): for tests and small populations."""
        return self.gather(np.arange(self.num_clients), device)

    def _held(self, c: int) -> Optional[np.ndarray]:
        """Client ``c``'s row if it is in memory (written this round, the default, or cached);
        None if it must be read from its file. (A checkpoint may be flushing this table on its
        thread meanwhile: it sets the new root before it empties ``dirty``, so a row is always
        in one or the other.)"""
        row = self.dirty.get(c)
        if row is not None:
            return row
        if not self.has[c]:
            return self.default
        self._check_root(c)
        path = row_path(self.root, c, self.digest(c))
        try:
            return rowfiles.ROW_CACHE.get((str(self.root), c, self.digest(c)), signature(path))
        except OSError:
            return None  # _load says what is wrong

    def _check_root(self, c: int) -> None:
        if self.root is None:
            raise CheckpointError(f"client state row of client {c}: the table has no directory to read it from")

    def _load(self, c: int) -> tuple[np.ndarray, tuple]:
        """Client ``c``'s row read from its file and verified against its digest, with the file's signature."""
        self._check_root(c)
        digest = self.digest(c)
        path = row_path(self.root, c, digest)
        try:
            sig = signature(path)
            data = path.read_bytes()
        except OSError:
            raise CheckpointError(f"client state row {path}: missing; the run directory is incomplete") from None
        if hashlib.sha256(data).digest() != digest or len(data) != self.row_nbytes:
            raise CheckpointError(f"client state row {path}: checksum mismatch (truncated or corrupt)")
        return np.frombuffer(data, np.uint8), sig

    def _tensors(self, parts: dict[str, np.ndarray], n: int, device) -> dict[str, torch.Tensor]:
        out = {}
        for k in self.order:
            t = torch.from_numpy(parts[k].view(_np_dtype(self.dtypes[k])).reshape(n, *self.shapes[k]))
            out[k] = t.to(device) if device is not None else t
        return out

    def _unpack(self, buf: np.ndarray, device) -> dict[str, torch.Tensor]:
        return self._tensors({k: np.ascontiguousarray(buf[:, off:off + size]) for k, (off, size) in self.layout.items()},
                             buf.shape[0], device)

    # ------------------------------------------------------------------ writing
    def scatter(self, clients, rows: dict[str, torch.Tensor]) -> "ClientTable":
        """A new table with the listed clients' rows replaced (``rows[name]`` is ``[C, *shape]``).

        This table is unchanged (states are values): the new one shares its files."""
        clients = np.asarray(clients, np.int64).reshape(-1)
        if sorted(rows) != self.names:
            raise ValueError(f"ClientTable.scatter: rows {sorted(rows)} do not match the table's {self.names}")
        parts = []
        for k in self.names:
            v = rows[k].detach()
            if tuple(v.shape[1:]) != self.shapes[k] or v.shape[0] != len(clients):
                raise ValueError(f"ClientTable.scatter: {k} has shape {tuple(v.shape)}, expected "
                                 f"{(len(clients), *self.shapes[k])}")
            parts.append(v.to("cpu", self.dtypes[k]).contiguous().numpy().reshape(len(clients), -1).view(np.uint8))
        buf = np.concatenate(parts, 1) if parts else np.zeros((len(clients), 0), np.uint8)
        new = self._copy()
        for i, c in enumerate(clients):
            new.dirty[int(c)] = buf[i]
            new.has[int(c)] = True
        # hashed behind the round (the same digests, later): see ``digests``
        new._hashing = in_background(_hash_rows, new._digests, clients, buf)
        return new

    def __getstate__(self) -> dict:  # pickled (Dask, deepcopy): settled, without the future
        return {**self.__dict__, "_digests": self.digests, "_hashing": None}

    def _copy(self) -> "ClientTable":
        digests = self.digests.copy()  # after this table's own hashing
        held = dict(self.__dict__)  # one snapshot: a flush on the checkpoint thread may move root and dirty
        new = object.__new__(ClientTable)
        new.__dict__.update(held)
        new._digests, new._hashing = digests, None
        new.has = held["has"].copy()
        new.dirty = dict(held["dirty"])
        return new

    def flush(self, root: Path) -> int:
        """Write the dirty rows under ``root`` (content-addressed, atomic); returns bytes written.

        The table then reads from ``root``; its value (and digest) is unchanged."""
        root = Path(root)
        if self.root is not None and Path(self.root).resolve() != root.resolve() and self.written().any():
            _copy_rows(self, root)  # a table moving to another run directory brings its rows along
        paths = {c: row_path(root, c, self.digest(c)) for c in self.dirty}
        todo = {paths[c]: row for c, row in self.dirty.items() if not paths[c].exists()}
        write_all(todo)
        for c, row in self.dirty.items():  # what was just written is what the next round reads
            rowfiles.ROW_CACHE.put((str(root), c, self.digest(c)), row, signature(paths[c]))
        self.root = root  # before dirty empties: a reader on another thread finds each row in one of them
        self.dirty = {}
        return sum(len(r) for r in todo.values())

    # ------------------------------------------------------------------ identity and persistence
    def all_digests(self) -> np.ndarray:
        """Every client's row digest (the default row's for a client never written)."""
        out = self.digests.copy()
        out[~self.has] = np.frombuffer(self.default_digest, np.uint8)
        return out

    def update_hash(self, h) -> None:
        """Feed the table's value into a hash (the state's digest): shapes, then every row digest."""
        h.update(repr([(k, self.shapes[k], str(self.dtypes[k])) for k in self.names]).encode())
        h.update(self.all_digests().tobytes())

    def payload(self) -> dict[str, Any]:
        """What a checkpoint stores: the layout, the digests and any rows not yet flushed (inline).

        The digests go in whichever form is smaller: every client's (33 bytes a client), or only
        the written clients' ids and digests (36 or 40 bytes each). A million clients trained
        1,000 a round have written few rows for a long time: the checkpoint then holds those,
        not 33 MB, most of them the default row's zeros (format 2; format 1 is the dense one)."""
        out = {"num_clients": self.num_clients, "default": self._unpack(self.default[None], None),
               "root": str(self.root) if self.root else None, "dirty": {c: bytes(r) for c, r in self.dirty.items()}}
        written = np.flatnonzero(self.has)
        ids = written.astype(np.int32 if self.num_clients < 2**31 else np.int64)
        if len(written) * (32 + ids.itemsize) < self.num_clients * 33:
            return {"__client_table__": 2, **out, "written": ids.tobytes(), "id_bytes": ids.itemsize,
                    "digests": self.digests[written].tobytes()}
        return {"__client_table__": 1, **out, "digests": self.digests.tobytes(), "has": self.has.tobytes()}

    @classmethod
    def from_payload(cls, p: dict[str, Any], root: Optional[Path] = None) -> "ClientTable":
        t = cls(p["num_clients"], {k: v[0] for k, v in p["default"].items()}, root or p.get("root"))  # payload keeps order
        if p["__client_table__"] == 2:
            written = np.frombuffer(p["written"], np.int32 if p["id_bytes"] == 4 else np.int64)
            t.digests[written] = np.frombuffer(p["digests"], np.uint8).reshape(-1, 32)
            t.has[written] = True
        else:
            t.digests = np.frombuffer(p["digests"], np.uint8).reshape(-1, 32).copy()
            t.has = np.frombuffer(p["has"], bool).copy()
        t.dirty = {int(c): np.frombuffer(r, np.uint8) for c, r in p["dirty"].items()}
        return t

    def files(self) -> set[str]:
        """The row files this table refers to (names relative to its root)."""
        return {str(row_path(Path(), int(c), self.digest(int(c)))) for c in np.flatnonzero(self.has)
                if int(c) not in self.dirty}

    def __repr__(self) -> str:
        return (f"ClientTable({self.num_clients} clients, {self.row_nbytes} bytes per row, "
                f"{int(self.written().sum())} written, {len(self.dirty)} unflushed)")


def _hash_rows(digests: np.ndarray, clients: np.ndarray, buf: np.ndarray) -> None:
    """``digests[c] = SHA-256(buf[i])`` for the i-th listed client, one row after another (on the
    background thread: torch's threads, and :func:`in_threads`' pool, stay the round's)."""
    for i, c in enumerate(clients):
        digests[int(c)] = np.frombuffer(hashlib.sha256(buf[i]).digest(), np.uint8)


def _row_bytes(row: dict[str, torch.Tensor], names: list[str]) -> bytes:
    return b"".join(row[k].contiguous().numpy().tobytes() for k in names)


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _copy_rows(table: ClientTable, root: Path, batch: int = 1024) -> None:
    """Copy the table's row files under ``root``, ``batch`` rows in memory at a time."""
    todo: dict[Path, np.ndarray] = {}
    for name in sorted(table.files()):
        src, dst = Path(table.root) / name, root / name
        if not dst.exists():
            todo[dst] = np.frombuffer(src.read_bytes(), np.uint8)
        if len(todo) >= batch:
            write_all(todo)
            todo = {}
    write_all(todo)


# ---------------------------------------------------------------------- streaming over clients


def chunks(clients: np.ndarray, size: int) -> Iterator[np.ndarray]:
    """Consecutive pieces of ``clients`` of at most ``size`` (none for no clients)."""
    clients = np.asarray(clients, np.int64)
    for a in range(0, len(clients), size):
        yield clients[a:a + size]


def joined(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Per-chunk tuples of per-client arrays, concatenated field by field."""
    if not parts:
        return np.zeros(0), np.zeros(0), np.zeros(0, np.int64)
    return tuple(np.concatenate([p[j] for p in parts]) for j in range(len(parts[0])))


# ---------------------------------------------------------------------- walking a state's algo tree


def tables(tree: Any, prefix: str = "") -> Iterator[tuple[str, ClientTable]]:
    """Every ClientTable in a nested dict, with its dotted path, in sorted order."""
    if isinstance(tree, ClientTable):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            yield from tables(tree[k], f"{prefix}.{k}" if prefix else str(k))


def table_root(run_dir: Path, path: str) -> Path:
    return Path(run_dir) / "client_state" / path


def flush_all(algo: dict, run_dir: Path) -> int:
    """Flush every table of a state under ``run_dir/client_state/<path>``; bytes written."""
    return sum(t.flush(table_root(run_dir, path)) for path, t in tables(algo))


def collect_garbage(run_dir: Path, pruned_algos: list[dict], kept_algos: list[dict]) -> int:
    """Delete the row files of pruned checkpoints (``pruned_algos``) that no kept checkpoint
    (``kept_algos``) refers to; returns the number removed.

    A row file is named by (client, digest), so a pruned checkpoint's row is still needed iff
    some kept checkpoint holds the same digest for that client: one vectorised comparison per
    table, and only the files that become garbage are touched."""
    kept: dict[str, list[ClientTable]] = {}
    for algo in kept_algos:
        for path, t in tables(algo):
            kept.setdefault(path, []).append(t)
    removed = 0
    for algo in pruned_algos:
        for path, old in tables(algo):
            needed = ~old.has  # an unwritten row has no file
            for t in kept.get(path, []):
                needed |= t.has & (t.digests == old.digests).all(1)
            root = table_root(run_dir, path)
            for c in np.flatnonzero(~needed):
                f = row_path(root, int(c), old.digest(int(c)))
                if f.exists():
                    f.unlink()
                    removed += 1
    return removed
