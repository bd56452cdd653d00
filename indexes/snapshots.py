"""Resident-index snapshots: one file per collection and engine, written atomically (temp file of this
process, fsync, rename, fsync of the directory), carrying the change seq it covers (its watermark), the token of
that commit in PostgreSQL's change log, and the content digest of its rows.

A snapshot is a cache of what Postgres holds: one that is missing, unreadable, made for another configuration,
whose rows do not hash to its digest, or whose commit PostgreSQL does not have (a database restored from an
older backup) is ignored and the index rebuilt from Postgres, never trusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .replica import Replica
    from .store import CollectionStore

log = logging.getLogger("switchyard.snapshots")

FORMAT = 4  # 3: the payload index and the calibration; 4: its columns sparse (rows that have the key)
ARRAYS = ("ids", "vectors", "alive")


def path_for(directory: Path, collection_id: int, engine: str) -> Path:
    return directory / f"collection-{collection_id}.{engine}.snapshot"


def save(path: Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Workers sharing a data dir, and threads of one, each write their own temp file; the last rename wins.
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}-{threading.get_ident()}.tmp")
    header = {**meta, "format": FORMAT, "watermark": int(state["watermark"]), "token": state.get("token"),
              "digest": state["digest"], "index_type": state["index_type"], "calibration": state.get("calibration"),
              "payloads": state["payload_meta"]}
    with open(tmp, "wb") as raw:
        with zipfile.ZipFile(raw, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr("meta.json", json.dumps(header))
            arrays = {**{name: state[name] for name in ARRAYS}, **state["payload_arrays"]}
            for name, array in arrays.items():
                with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.save(f, array, allow_pickle=False)
            if state["index_bytes"] is not None:
                z.writestr("index.bin", state["index_bytes"])
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path, expect: dict[str, Any]) -> dict[str, Any] | None:
    """The saved state, or None (with the reason logged) when it is absent, unreadable or does not match."""
    if not path.exists():
        return None
    try:
        with zipfile.ZipFile(path) as z:
            meta = json.loads(z.read("meta.json"))
            if meta.get("format") != FORMAT:
                log.warning("snapshot %s has format %s, not %s: rebuilding", path, meta.get("format"), FORMAT)
                return None
            mismatch = {k: (meta.get(k), v) for k, v in expect.items() if meta.get(k) != v}
            if mismatch:
                log.warning("snapshot %s was made for another configuration %s: rebuilding", path, mismatch)
                return None
            state: dict[str, Any] = {name: np.load(z.open(f"{name}.npy"), allow_pickle=False) for name in ARRAYS}
            state["payload_arrays"] = {name[:-4]: np.load(z.open(name), allow_pickle=False) for name in z.namelist()
                                       if name.startswith("payload") and name.endswith(".npy")}
            state["index_bytes"] = z.read("index.bin") if "index.bin" in z.namelist() else None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, json.JSONDecodeError) as exc:
        log.warning("snapshot %s is unreadable (%s): rebuilding", path, exc)
        return None
    n = len(state["ids"])
    if state["vectors"].shape != (n, expect.get("dim", state["vectors"].shape[1])) or len(state["alive"]) != n:
        log.warning("snapshot %s has inconsistent arrays: rebuilding", path)
        return None
    state["watermark"] = int(meta["watermark"])
    state["token"] = meta.get("token")
    state["digest"] = meta.get("digest")
    state["index_type"] = meta["index_type"]
    state["calibration"] = meta.get("calibration")
    state["payload_meta"] = meta["payloads"]
    return state


def peek(path: Path) -> int | None:
    """The seq a snapshot covers, from its header alone; None where there is no readable one."""
    try:
        with zipfile.ZipFile(path) as z:
            return int(json.loads(z.read("meta.json"))["watermark"])
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
        return None


def lock_path_for(path: Path) -> Path:
    """The file beside a snapshot whose lock the processes sharing its directory take around a rebuild."""
    return path.with_suffix(".build-lock")


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    for tmp in path.parent.glob(path.name + ".*.tmp"):
        tmp.unlink(missing_ok=True)


class Snapshots:
    """The snapshots of one data directory, checked against PostgreSQL's change log."""

    def __init__(self, directory: Path, store: "CollectionStore") -> None:
        self.directory, self.store = directory, store
        self.removed: set[int] = set()  # collections dropped while this process ran: never snapshot them again

    def _path(self, r: "Replica") -> Path:
        return path_for(self.directory, r.collection.id, r.index.backend.name)

    @staticmethod
    def _meta(r: "Replica") -> dict[str, Any]:
        c = r.collection
        return {"collection_id": c.id, "name": c.name, "dim": c.dim, "metric": c.metric,
                "configured_type": c.index_type, "params": c.index_params, "engine": r.index.backend.name}

    async def usable(self, r: "Replica") -> dict[str, Any] | None:
        """The replica's snapshot, if it is readable, made for this configuration, and of this database's history:
        not ahead of PostgreSQL's head, and its commit still in the log with the same token."""
        state = await asyncio.to_thread(load, self._path(r), self._meta(r))
        if state is None:
            return None
        c = r.collection
        head = await self.store.head(c)
        if state["watermark"] > head:
            log.warning("collection %s: the snapshot covers seq %d but PostgreSQL's head is %d (a database restored "
                        "from a backup?): rebuilding from PostgreSQL", c.name, state["watermark"], head)
            return None
        if state["watermark"] and await self.store.commit_token(c, state["watermark"]) != state["token"]:
            log.warning("collection %s: PostgreSQL's change log has no commit %d of the snapshot's history: "
                        "rebuilding from PostgreSQL", c.name, state["watermark"])
            return None
        return state

    def lock_path(self, r: "Replica") -> Path:
        """The replica's rebuild lock file (build_lock.py)."""
        return lock_path_for(self._path(r))

    async def newer(self, r: "Replica", than: int) -> dict[str, Any] | None:
        """The replica's snapshot if it covers a later seq than `than` and is usable: another process's rebuild."""
        seq = await asyncio.to_thread(peek, self._path(r))
        if seq is None or seq <= than:
            return None
        state = await self.usable(r)
        return state if state is not None and state["watermark"] > than else None

    async def save(self, r: "Replica") -> None:
        """Write the replica's state, unless it is what the last snapshot already holds. A collection dropped
        while its snapshot is written leaves no file: remove() may take the temp file before its rename (which
        then finds nothing to rename), or come before it was made (the file written is then removed here)."""
        cid = r.collection.id
        if cid in self.removed:
            return
        state = await r.run(r.index.state)
        mark = (state["watermark"], state["digest"], state["index_type"])
        if mark == r.saved:
            return
        state["token"] = await self.store.commit_token(r.collection, state["watermark"]) if state["watermark"] else None
        try:
            await asyncio.to_thread(save, self._path(r), state, self._meta(r))
        except FileNotFoundError:
            if cid not in self.removed:
                raise
        if cid in self.removed:  # checked on the event loop, as remove() runs: one of the two removes the file
            remove(self._path(r))
            return
        r.saved = mark

    def remove(self, collection_id: int) -> None:
        self.removed.add(collection_id)
        for path in self.directory.glob(path_for(Path(), collection_id, "*").name):  # whichever engine wrote it
            remove(path)
            lock_path_for(path).unlink(missing_ok=True)
