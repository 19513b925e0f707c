"""The Responses store in a SQLite file: stored responses survive a restart.

`kvrelay serve` keeps it at `<--state-dir>/responses-<port>.sqlite3` (one file per port, so
the servers of one host never share one; a second process opening the same file is refused
at start-up). The rules (budgets, least recently used first, owners) are `ResponseStore`'s;
this class only keeps the payloads:

    event loop / prep workers                       writer thread ("responses-store")
      put:    index + budget (under the lock),        takes every queued op, applies them in
              entry into `_pending`, op queued ──▶     one transaction (WAL), then drops the
      delete / eviction / read (LRU order): op ──▶     written entries from `_pending`
      get:    `_pending` first, else one SELECT
              (never on the event loop: callers
              use a thread)

so the event loop never waits for the disk: a put costs its JSON encoding (which the byte
budget needs anyway) and a queue append; a response is readable from `_pending` at once.
The connection is shared by the writer and the readers under `_db_lock`.

At open, the index is rebuilt from the rows (least recently used first, the budgets applied
again in case they shrank), and a background response the last process did not finish
(status queued / in_progress) is marked failed: nothing runs it any more. The payloads are
written at exit (an `atexit` hook joins the writer; it is a daemon thread, so a process
that is killed loses at most the last moments' writes, never the file: WAL).
"""
from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvrelay.server.response_store import (
    UNFINISHED,
    Encoded,
    MemoryResponseStore,
    ResponseStore,
    StoredResponse,
    StoreLimits,
)
from kvrelay.server.tools import AgentOptions

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id       TEXT PRIMARY KEY,
    owner    TEXT NOT NULL,
    status   TEXT,
    used     INTEGER NOT NULL,      -- larger: used more recently (LRU order across restarts)
    size     INTEGER NOT NULL,      -- bytes counted against the budget
    body     TEXT NOT NULL,         -- the response object, JSON
    messages TEXT NOT NULL          -- the conversation through it, JSON
);
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (used);
"""
INTERRUPTED = {"code": "server_error",
               "message": "the server stopped before this background response finished"}
_BATCH = 256                        # ops written in one transaction at most


@dataclass(frozen=True)
class _Put:
    item: StoredResponse
    encoded: Encoded
    used: int


@dataclass(frozen=True)
class _Delete:
    response_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Touch:
    response_id: str
    used: int


@dataclass(frozen=True)
class _Flush:
    done: threading.Event           # set once every op queued before it is written


_Op = _Put | _Delete | _Touch | _Flush | None        # None: stop the writer


def open_store(agent: AgentOptions) -> ResponseStore:
    """The store `kvrelay serve`'s flags ask for: SQLite at `responses_store_path`, else
    memory (also when the store is off: an empty one that keeps nothing)."""
    limits = StoreLimits(agent.responses_store_size, agent.responses_store_max_bytes,
                         agent.responses_store_max_entry_bytes)
    if agent.responses_store_path is None or not limits.max_entries:
        return MemoryResponseStore(limits)
    return SqliteResponseStore(Path(agent.responses_store_path), limits)


class SqliteResponseStore(ResponseStore):
    """Owner of the SQLite file and its writer thread (see module)."""

    def __init__(self, path: Path, limits: StoreLimits) -> None:
        super().__init__(limits)
        self.path = path
        self._lock_file = _claim(path)
        self._db = _connect(path)
        self._db_lock = threading.Lock()
        self._pending: dict[str, StoredResponse] = {}
        self._ops: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._used = 0
        self._recover()
        self._writer = threading.Thread(target=self._write_loop, name="responses-store",
                                        daemon=True)
        self._writer.start()
        self._closed = False
        atexit.register(self.close)

    # -- open

    def _recover(self) -> None:
        """The index from the rows; unfinished background responses marked failed; the
        budgets applied (the limits may be smaller than the last process's)."""
        db = self._db
        for response_id, body in db.execute(
                "SELECT id, body FROM responses WHERE status IN (?, ?)", UNFINISHED).fetchall():
            failed = {**json.loads(body), "status": "failed", "error": INTERRUPTED}
            db.execute("UPDATE responses SET status = 'failed', body = ? WHERE id = ?",
                       (json.dumps(failed, ensure_ascii=False), response_id))
        too_large = []
        for response_id, owner, size, used in db.execute(
                "SELECT id, owner, size, used FROM responses ORDER BY used"):
            if size > self.limits.max_entry_bytes:
                too_large.append(response_id)
                continue
            self._reindex(response_id, owner, size)
            self._used = max(self._used, used)
        evicted = self._over_budget() + too_large
        db.executemany("DELETE FROM responses WHERE id = ?", [(i,) for i in evicted])
        db.commit()
        logger.info("responses store: %s (%d responses, %d bytes kept%s)", self.path,
                    len(self._index), self.bytes,
                    f"; {len(evicted)} evicted to fit the limits" if evicted else "")

    # -- the payload hooks (the index lock is held)

    def _keep(self, item: StoredResponse, encoded: Encoded) -> None:
        self._pending[item.id] = item
        self._ops.put(_Put(item, encoded, self._next_use()))

    def _discard(self, response_ids: list[str]) -> None:
        for response_id in response_ids:
            self._pending.pop(response_id, None)
        self._ops.put(_Delete(tuple(response_ids)))

    def _touched(self, response_id: str) -> None:
        self._ops.put(_Touch(response_id, self._next_use()))

    def _next_use(self) -> int:
        self._used += 1
        return self._used

    def _load(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            pending = self._pending.get(response_id)
        if pending is not None:
            return pending
        with self._db_lock:
            row = self._db.execute("SELECT owner, body, messages, size FROM responses "
                                   "WHERE id = ?", (response_id,)).fetchone()
        if row is None:
            return None
        owner, body, messages, size = row
        return StoredResponse(json.loads(body), json.loads(messages), owner, size)

    # -- the writer thread

    def _write_loop(self) -> None:
        running = True
        while running:
            ops = [self._ops.get()]
            while len(ops) < _BATCH:
                try:
                    ops.append(self._ops.get_nowait())
                except queue.Empty:
                    break
            running = None not in ops
            try:
                self._apply(ops)
                self._written([op for op in ops if isinstance(op, _Put)])
            except sqlite3.Error as e:          # a full disk: the entries stay readable
                logger.error("responses store: writing %s failed: %s", self.path, e)
            for op in ops:                       # from _pending until replaced or evicted
                if isinstance(op, _Flush):
                    op.done.set()

    def _apply(self, ops: list[_Op]) -> None:
        with self._db_lock, self._db:           # one transaction
            for op in ops:
                if op is None or isinstance(op, _Flush):
                    continue
                if isinstance(op, _Put):
                    item, enc = op.item, op.encoded
                    self._db.execute(
                        "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (item.id, item.owner, item.body.get("status"), op.used, enc.size,
                         enc.body, enc.messages))
                elif isinstance(op, _Delete):
                    self._db.executemany("DELETE FROM responses WHERE id = ?",
                                         [(i,) for i in op.response_ids])
                else:
                    self._db.execute("UPDATE responses SET used = ? WHERE id = ?",
                                     (op.used, op.response_id))

    def _written(self, puts: list[_Put]) -> None:
        with self._lock:
            for op in puts:
                if self._pending.get(op.item.id) is op.item:    # not replaced meanwhile
                    del self._pending[op.item.id]

    def flush(self, timeout: float = 30) -> bool:
        """Wait until every op queued so far is written; False on timeout."""
        done = threading.Event()
        self._ops.put(_Flush(done))
        return done.wait(timeout)

    def close(self) -> None:
        """Write out what is queued and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._ops.put(None)
        self._writer.join(timeout=30)
        with self._db_lock:
            self._db.close()
        self._lock_file.close()
        atexit.unregister(self.close)


def _claim(path: Path) -> IO[str]:
    """This process's exclusive claim on the store file (released when it exits): two
    servers writing one file would evict each other's responses without knowing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = open(f"{path}.lock", "a")  # noqa: SIM115 -- held for the store's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise OSError(f"the responses store {path} is in use by another process (one store "
                      f"per server: give each its own --state-dir or port, or "
                      f"--responses-store memory)") from None
    return lock


def _connect(path: Path) -> sqlite3.Connection:
    """The file (readable by this user only: it holds users' conversations), in WAL mode,
    its schema checked."""
    os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))
    try:
        db = sqlite3.connect(path, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")      # WAL: durable at checkpoints, never corrupt
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise OSError(f"the responses store {path} has schema version {version}, this "
                          f"kvrelay writes {SCHEMA_VERSION}: move the file away")
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return db
    except sqlite3.Error as e:
        raise OSError(f"the responses store {path} cannot be opened: {e}") from None
