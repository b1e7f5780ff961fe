"""Where session state outlives a connection, a process and a machine.

A `Store` holds three things per session (DESIGN sections 3, 8 and 10):

- the **event log**: every accepted input and setting change, in the order the engine applied
  it, as schema'd JSON records (`kind`, `n`, `ts`, ...). It is the source of truth: replaying it
  rebuilds the session's caches and greedy answers (streamer.recovery). A record is durable
  when `append` returns, and only then is the input acknowledged to the client;
- the **directory entry**: which worker owns the session (workers heartbeat; an entry whose
  owner stopped beating is orphaned and may be adopted);
- a **snapshot**: the session's current state for dashboards (written at a bounded rate).

Implementations: `MemoryStore` (streamer.store_base, with the interface and the errors;
in-process: sessions outlive connections but not the process), `FileStore` (the embedded default of `streamer serve`: one append-only JSON-lines
file per session under a directory; survives kill -9 and restarts of a single worker) and
`RedisStore` (streamer.redis_store: Redis Streams, hashes and keys shared by many workers).

Compaction and retention: a live session's log is compacted at each checkpoint
(`compact`): the records between its creation and the checkpoint go (replay starts from the
checkpoint, streamer.recovery), so the log holds its creation plus the records since the last
checkpoint; positions `n` keep their values (a compacted log has a gap after record 1). A
blob (a frame, a checkpoint's K/V) that a log still names never expires; one no log names any
more expires `retention_s` after its last put. When a session closes its log, snapshot and
entry are kept for `retention_s` (default one day) and then removed, and so are the blobs
only it named.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .store_base import (DEFAULT_RETENTION_S, HEARTBEAT_S, WORKER_TTL_S, Conflict, LogGap, MemoryStore, NotOwner, Store,
                         StoreError, StoreLost, _check_digest, _check_position, _gap_ok, beat, heartbeat_loop,
                         lease_lapsed)

__all__ = ["DEFAULT_RETENTION_S", "HEARTBEAT_S", "WORKER_TTL_S", "Conflict", "FileStore", "LogGap", "MemoryStore",
           "NotOwner", "Store", "StoreError", "StoreLost", "beat", "heartbeat_loop", "lease_lapsed", "open_store"]

_SAFE_ID = re.compile(r"[^A-Za-z0-9_.-]")


class FileStore(Store):
    """One append-only JSON-lines log per session under `root/logs/`; each record is written
    and flushed (and fsync'ed when `fsync`) before `append` returns, so an acknowledged input
    survives kill -9 (and, with fsync, power loss). A torn last line (the process died in the
    middle of a write) is ignored on read: its input was never acknowledged. One worker per
    directory: ownership is this process."""

    kind = "file"

    def __init__(self, root: str | Path, worker_id: str | None = None, fsync: bool = False,
                 retention_s: float = DEFAULT_RETENTION_S) -> None:
        super().__init__(worker_id, retention_s)
        self.root = Path(root).expanduser()
        self.fsync = fsync
        self._files: dict[str, object] = {}
        self._counts: dict[str, int] = {}

    async def start(self) -> "FileStore":
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._expire_files()
        return self

    async def put_blob(self, digest: str, data: bytes) -> None:
        """`root/blobs/<digest>`, written whole (a temporary file renamed into place); a blob
        already there is only touched (its retention starts again)."""
        _check_digest(digest)
        path = self.root / "blobs" / digest
        try:
            if path.exists():
                os.utime(path)
                return
            tmp = path.with_name(f".{digest}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise StoreError(f"cannot write blob {digest[:16]} under {self.root}: {exc}") from None

    async def get_blob(self, digest: str, take: bool = False) -> bytes | None:
        _check_digest(digest)
        path = self.root / "blobs" / digest
        try:
            if take:  # renamed away first: of two readers only one gets it
                taken = path.with_name(f".{digest}.{os.getpid()}.{id(path)}.taken")
                os.rename(path, taken)
                try:
                    return taken.read_bytes()
                finally:
                    taken.unlink(missing_ok=True)
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read blob {digest[:16]} under {self.root}: {exc}") from None

    def _path(self, session_id: str) -> Path:
        # ids are printable strings of at most 64 characters; the hex digest keeps two ids that
        # escape to the same name apart
        safe = _SAFE_ID.sub("_", session_id)
        return self.root / "logs" / f"{safe}.{_short_hash(session_id)}.jsonl"

    async def append(self, session_id: str, record: dict, n: int | None = None, rid: str | None = None) -> int:
        try:
            f = self._files.get(session_id)
            if f is None:
                log = await self.read_log(session_id)
                count = log[-1]["n"] if log else 0
                f = self._files[session_id] = open(self._path(session_id), "a", encoding="utf-8")
                self._counts[session_id] = count
            count = self._counts[session_id]
            if n is not None:
                _check_position(session_id, n, rid, count, lambda: self._rid_at(session_id, n), _gap_ok(record))
                if n <= count:
                    return n
            n = max(n or 0, count + 1)
            line = json.dumps({**record, "n": n, "session_id": session_id, **({"rid": rid} if rid else {})},
                              ensure_ascii=False, separators=(",", ":"))
            start = f.tell()
            try:
                f.write(line + "\n")
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            except OSError:  # a partial line must not hide the records written after it
                self._files.pop(session_id, None)
                try:
                    f.close()
                except OSError:
                    pass
                with open(self._path(session_id), "r+b") as raw:
                    raw.truncate(start)
                raise
        except OSError as exc:
            raise StoreError(f"writing the log of session {session_id}: {exc}") from None
        self._counts[session_id] = n
        return n

    def _rid_at(self, session_id: str, n: int) -> str | None:
        for line in self._path(session_id).read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("n") == n:
                return record.get("rid")
        return None

    async def log_length(self, session_id: str) -> int:
        if session_id in self._counts:
            return self._counts[session_id]
        log = await self.read_log(session_id)
        return log[-1]["n"] if log else 0

    async def compact(self, session_id: str, upto: int, superseded: tuple[str, ...] = ()) -> int:
        """Re-write the log without the records between its creation and position `upto`: the
        kept lines go to a temporary file that is renamed over the log (a crash leaves the old
        log or the new one, never half of one); appends go on in the new file."""
        path = self._path(session_id)
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = []
            for line in lines:
                try:
                    n = json.loads(line)["n"]
                except (ValueError, KeyError):  # a torn last line: never acknowledged
                    break
                if n == 1 or n >= upto:
                    kept.append(line if line.endswith("\n") else line + "\n")
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "w", encoding="utf-8") as out:
                out.writelines(kept)
                out.flush()
                if self.fsync:
                    os.fsync(out.fileno())
            f = self._files.pop(session_id, None)
            if f is not None:
                f.close()
            os.replace(tmp, path)
            self._files[session_id] = open(path, "a", encoding="utf-8")
            named = {json.loads(line).get("blob") for line in kept}
            for digest in superseded:
                if digest not in named:
                    _check_digest(digest)
                    (self.root / "blobs" / digest).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"compacting the log of session {session_id}: {exc}") from None
        return len(lines) - len(kept)

    async def read_log(self, session_id: str) -> list[dict]:
        path = self._path(session_id)
        if not path.exists():
            return []
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a torn final write: never acknowledged
                break
            if record.get("session_id") != session_id:
                raise StoreError(f"log {path} holds records of session {record.get('session_id')!r}")
            records.append(record)
        return records

    async def closed(self, session_id: str) -> None:
        f = self._files.pop(session_id, None)
        if f is not None:
            f.close()
        self._counts.pop(session_id, None)
        await super().closed(session_id)
        self._expire_files()

    def _expire_files(self) -> None:
        """Remove logs whose last record is a close older than the retention time."""
        cutoff, live = time.time() - self.retention_s, set()
        for path in (self.root / "logs").glob("*.jsonl"):
            records = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:
                    break
            last = records[-1] if records else None
            if path.stat().st_mtime <= cutoff and last is not None and last.get("kind") == "close":
                path.unlink(missing_ok=True)
                continue
            live.update(r["blob"] for r in records if isinstance(r.get("blob"), str))
        for path in (self.root / "blobs").glob("*"):  # blobs no kept log names, not put again within the retention
            if path.name not in live and path.stat().st_mtime <= cutoff:
                path.unlink(missing_ok=True)

    def expire(self) -> None:
        """Remove what outlived the retention time now (also done at start and at each close)."""
        self._expire_files()

    async def flush(self) -> None:
        for f in self._files.values():
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())

    async def close(self) -> None:
        await self.flush()
        for f in self._files.values():
            f.close()
        self._files.clear()


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:10]


def open_store(url: str | None, worker_id: str | None = None, retention_s: float = DEFAULT_RETENTION_S) -> Store:
    """A store from a URL: None or `memory:` (in-process), `file:///path` or a plain path
    (append-only files), `redis://host:port/db[?prefix=NAME]` (shared by workers; needs the
    `redis` extra)."""
    if url is None or url in ("memory", "memory:"):
        return Store(worker_id, retention_s)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisStore  # needs the `redis` package (the redis extra)

        parts = urlsplit(url)  # ?prefix=NAME picks the key prefix (default "streamer")
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("prefix", "streamer")
        url = urlunsplit(parts._replace(query=urlencode(query)))
        return RedisStore(url, prefix=prefix, worker_id=worker_id, retention_s=retention_s)
    if url.startswith("file://"):
        url = url[len("file://"):]
    if "://" in url:
        raise StoreError(f"unknown store URL {url!r}: use memory:, file:///path or redis://host:port/db")
    return FileStore(url, worker_id=worker_id, retention_s=retention_s)
