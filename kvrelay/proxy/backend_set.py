"""The backends file (`kvrelay proxy --backends-file PATH`): the prefill and decode servers a
supervisor (`kvrelay deploy --backend ray`, an operator's script) wants the proxy to use,
re-read whenever it changes.

    {"prefill": [{"id": "prefill-0", "url": "http://10.0.0.5:8100", "kv_events_port": 5557},
                 {"id": "prefill-1", "url": "http://10.0.0.7:8100"}],
     "decode":  [{"id": "decode-0", "url": "http://10.0.0.6:8200"}]}

An id is a server's stable name; its url is where it answers now. Between two versions of
the file, per role (`diff`):

    id only in the old     removed: drained (no new requests; those in flight finish)
    id only in the new     added: used once its /health answers 200
    same id, other url     replaced (a restart elsewhere): the old url drained, the new added
    same id and url        unchanged (its KV-event ports may change: followed anew)

This module only reads, checks and compares versions (pure but for `BackendsFile` reading
the file); `ProxyState.apply` carries a change out. The writer replaces the file atomically
(write a temporary file, rename it over PATH); the proxy looks every `POLL_S` for a new
(mtime_ns, size, inode), and a version that does not parse or check is logged once and
ignored: the servers in use stay as they were.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger("kvrelay.proxy")

POLL_S = 0.1                       # how often the file's (mtime_ns, size, inode) is looked at
#                                    (a stat: a server that gets ready is routed to within 0.1 s)
ROLES = ("prefill", "decode")
ENTRY_KEYS = {"id", "url", "kv_events_port", "kv_events_replay_port"}
MAX_ID_CHARS = 200


class BackendsFileError(ValueError):
    """The backends file cannot be read, or does not describe a set of servers."""


@dataclass(frozen=True)
class BackendSpec:
    """One server as the file lists it."""

    role: str                               # "prefill" | "decode"
    id: str
    host: str
    port: int
    kv_events_port: int | None = None       # prefill: its KV events at tcp://host:PORT
    kv_events_replay_port: int | None = None

    @property
    def name(self) -> str:
        """host:port, as `routing.Backend.name` (the metrics' `backend` label)."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def events(self) -> tuple[int | None, int | None]:
        return self.kv_events_port, self.kv_events_replay_port


def parse(text: str) -> list[BackendSpec]:
    """The servers of a backends file's text, prefill first, in file order; a
    BackendsFileError names the first problem (`decode[1].url: ...`)."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BackendsFileError(f"not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BackendsFileError('not a JSON object {"prefill": [...], "decode": [...]}')
    unknown = sorted(set(doc) - set(ROLES))
    if unknown:
        raise BackendsFileError(f"unknown key {unknown[0]!r} (the keys are prefill, decode)")
    specs: list[BackendSpec] = []
    for role in ROLES:
        entries = doc.get(role)
        if not isinstance(entries, list):
            raise BackendsFileError(f"{role}: a list of servers is needed (it may be empty)")
        role_specs = [_entry(role, i, entry) for i, entry in enumerate(entries)]
        _no_duplicates(role, role_specs)
        specs += role_specs
    return specs


def _entry(role: str, i: int, entry: Any) -> BackendSpec:
    where = f"{role}[{i}]"
    if not isinstance(entry, dict):
        raise BackendsFileError(f'{where}: not an object {{"id": ..., "url": ...}}')
    unknown = sorted(set(entry) - ENTRY_KEYS)
    if unknown:
        raise BackendsFileError(f"{where}: unknown key {unknown[0]!r} (the keys are "
                                f"{', '.join(sorted(ENTRY_KEYS))})")
    server_id = entry.get("id")
    if not isinstance(server_id, str) or not server_id.strip() \
            or len(server_id) > MAX_ID_CHARS or not server_id.isprintable():
        raise BackendsFileError(f"{where}.id: a non-empty printable string of at most "
                                f"{MAX_ID_CHARS} characters is needed")
    host, port = _url(f"{where}.url", entry.get("url"))
    events = _port(f"{where}.kv_events_port", entry.get("kv_events_port"))
    replay = _port(f"{where}.kv_events_replay_port", entry.get("kv_events_replay_port"))
    if events is not None and role != "prefill":
        raise BackendsFileError(f"{where}.kv_events_port: only prefill servers' KV events are "
                                f"followed")
    if replay is not None and events is None:
        raise BackendsFileError(f"{where}.kv_events_replay_port needs kv_events_port")
    return BackendSpec(role, server_id, host, port, events, replay)


def _url(where: str, url: Any) -> tuple[str, int]:
    """(host, port) of "http://HOST:PORT" (an IPv6 host in brackets); nothing else."""
    if not isinstance(url, str):
        raise BackendsFileError(f'{where}: a string "http://HOST:PORT" is needed')
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise BackendsFileError(f"{where}: {url!r}: {e}") from None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username is not None:
        raise BackendsFileError(f'{where}: {url!r} is not "http://HOST:PORT"')
    if not 1 <= port <= 65535:
        raise BackendsFileError(f"{where}: {port} is not a TCP port (1-65535)")
    return parts.hostname, port


def _port(where: str, value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= 65535:
        raise BackendsFileError(f"{where}: {value!r} is not a TCP port (1-65535)")
    return value


def _no_duplicates(role: str, specs: list[BackendSpec]) -> None:
    for key, what in ((lambda s: s.id, "id"), (lambda s: s.name, "url")):
        seen: set[str] = set()
        for s in specs:
            if key(s) in seen:
                shown = s.id if what == "id" else s.url
                raise BackendsFileError(f"{role}: {what} {shown!r} listed twice")
            seen.add(key(s))


@dataclass(frozen=True)
class Change:
    """What one version of the file changes against the one before (see the module
    docstring); a replaced id is in both `drained` (its old url) and `added` (its new one)."""

    drained: tuple[BackendSpec, ...] = ()
    added: tuple[BackendSpec, ...] = ()
    updated: tuple[BackendSpec, ...] = ()    # same id and url, other KV-event ports

    def __bool__(self) -> bool:
        return bool(self.drained or self.added or self.updated)


def diff(old: Sequence[BackendSpec], new: Sequence[BackendSpec]) -> Change:
    before = {(s.role, s.id): s for s in old}
    after = {(s.role, s.id): s for s in new}
    drained, added, updated = [], [], []
    for key, s in before.items():
        if key not in after or after[key].name != s.name:
            drained.append(s)
    for key, s in after.items():
        if key not in before or before[key].name != s.name:
            added.append(s)
        elif before[key].events != s.events:
            updated.append(s)
    return Change(tuple(drained), tuple(added), tuple(updated))


class BackendsFile:
    """The file at `path`: `load` reads it (or raises), `poll` says whether a new version
    came and gives it when it is valid. One owner (the proxy's event loop): no locking."""

    def __init__(self, path: str | Path, poll_s: float = POLL_S) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._seen: tuple[int, int, int] | None = None      # the last version looked at
        self._specs: list[BackendSpec] | None = None         # the last valid version read
        self._reported: tuple[object, str] | None = None     # (version, problem) logged

    def load(self) -> list[BackendSpec]:
        """The current version; a BackendsFileError (naming the path) when it is missing or
        invalid."""
        try:
            self._seen = self._signature()
            self._specs = parse(self.path.read_text(encoding="utf-8"))
            return self._specs
        except OSError as e:
            raise BackendsFileError(f"{self.path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise BackendsFileError(f"{self.path}: not UTF-8 text ({e.reason})") from None
        except BackendsFileError as e:
            raise BackendsFileError(f"{self.path}: {e}") from None

    def current(self) -> list[BackendSpec]:
        """The last valid version read (read now if none was)."""
        return self.load() if self._specs is None else self._specs

    def poll(self) -> list[BackendSpec] | None:
        """The servers of a new valid version; None when the file did not change since the
        last look, or the new version is missing or invalid (logged once per problem)."""
        try:
            signature = self._signature()
        except OSError as e:
            self._report(None, f"cannot be read ({e.strerror or e})")
            return None
        if signature == self._seen:
            return None
        try:
            specs = self.load()
        except BackendsFileError as e:
            self._report(signature, str(e).removeprefix(f"{self.path}: "))
            return None
        self._reported = None
        return specs

    def _signature(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _report(self, version: object, problem: str) -> None:
        if (version, problem) != self._reported:
            logger.error("backends file %s: %s; the servers in use stay as they were",
                         self.path, problem)
            self._reported = (version, problem)
