"""The Responses store (kvrelay/server/response_store.py, response_sqlite.py): OpenAI's
metadata limits are 400s; the entry and byte budgets evict the least recently used first;
an entry over its limit is answered but not kept; a response belongs to the key (or owner
header) that created it — another gets 404 on GET, DELETE, cancel and previous_response_id;
the SQLite store keeps all of it across a reopen (the restart of a server), marks the
background responses the last process did not finish as failed, and refuses a second
process. Each rule runs against both kinds, in-process over the real app with a scripted
engine or on the store itself."""
from __future__ import annotations

import json
import os
import sqlite3
import stat

import pytest

from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_sqlite import INTERRUPTED, SqliteResponseStore, open_store
from kvrelay.server.response_store import (
    MemoryResponseStore,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    check_metadata,
    entry_size,
    owner_of,
    previous_conversation,
)
from kvrelay.server.tools import AgentOptions
from tests.agent.fakes import MODEL, ScriptedEngine, make_state
from tests.agent.test_agent_api import _decode
from tests.harmony_factories import scripted_harmony_answer

KINDS = ("memory", "sqlite")


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def _options(kind: str, tmp_path, **kw) -> AgentOptions:
    path = str(tmp_path / "responses.sqlite3") if kind == "sqlite" else None
    return AgentOptions(responses_store_path=path, **kw)


def _app(agent: AgentOptions, api_key: str | None = None):
    from starlette.testclient import TestClient

    from kvrelay.server.api import build_app
    engine = ScriptedEngine(lambda prompt: scripted_harmony_answer("", "Hi"), _decode)
    state = make_state(engine, True, agent)
    state.api_key = api_key
    return TestClient(build_app(state), base_url="http://testserver")


def _store(http) -> ResponseStore:
    return http.app.state.responses_store


def _create(http, headers: dict[str, str] | None = None, **body) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", **body},
                  headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def _open(kind: str, tmp_path, limits: StoreLimits) -> ResponseStore:
    if kind == "memory":
        return MemoryResponseStore(limits)
    return SqliteResponseStore(tmp_path / "responses.sqlite3", limits)


def _item(i: int | str, owner: str = "o", text: str = "a" * 1000, **body) -> StoredResponse:
    return StoredResponse({"id": f"r{i}", "x": text, **body}, [{"role": "user", "content": "q"}],
                          owner)


@pytest.fixture
def opened():
    """Stores a test opens, closed after it (the SQLite writer thread and file lock)."""
    stores: list[ResponseStore] = []
    yield stores
    for store in stores:
        store.close()


# ------------------------------------------------------------------ over the app


@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"k": "v" * 513}, "metadata.k"),
    ({"k": 1}, "metadata.k"),
    ({"k": "v" * 25_000_000}, "metadata.k"),
])
def test_metadata_over_openais_limits_is_400(metadata, param):
    http = _app(AgentOptions())
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", "metadata": metadata})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError"
    assert len(_store(http)) == 0


def test_metadata_at_openais_limits_is_kept():
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    check_metadata(metadata)
    http = _app(AgentOptions())
    out = _create(http, metadata=metadata)
    assert http.get(f"/v1/responses/{out['id']}").json()["metadata"] == metadata


def test_the_byte_budget_evicts_least_recently_used_first(kind, tmp_path):
    http = _app(_options(kind, tmp_path / "probe"))
    _create(http)
    size = _store(http).bytes
    assert size > 0
    _store(http).close()
    # room for exactly two entries of this size
    http = _app(_options(kind, tmp_path, responses_store_max_bytes=2 * size + size // 2))
    store = _store(http)
    a, b = _create(http), _create(http)
    assert http.get(f"/v1/responses/{a['id']}").status_code == 200      # a is now newest
    c = _create(http)
    assert http.get(f"/v1/responses/{b['id']}").status_code == 404      # b evicted by bytes
    assert http.get(f"/v1/responses/{a['id']}").status_code == 200
    assert http.get(f"/v1/responses/{c['id']}").status_code == 200
    assert len(store) == 2 and store.bytes <= store.limits.max_bytes
    assert b["id"] not in store and a["id"] in store
    store.close()


def test_an_entry_over_its_limit_is_answered_but_not_kept(kind, tmp_path):
    http = _app(_options(kind, tmp_path, responses_store_max_entry_bytes=64))
    out = _create(http)
    assert out["store"] is False and out["output"]
    assert http.get(f"/v1/responses/{out['id']}").status_code == 404
    assert len(_store(http)) == 0 and _store(http).bytes == 0
    _store(http).close()


def test_stored_responses_belong_to_the_key_that_created_them(kind, tmp_path):
    http = _app(_options(kind, tmp_path))
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    out = _create(http, alice)
    path = f"/v1/responses/{out['id']}"
    assert http.get(path, headers=alice).status_code == 200
    for method, where in (("GET", path), ("DELETE", path), ("POST", f"{path}/cancel")):
        for headers in (bob, {}):
            r = http.request(method, where, headers=headers)
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = http.post("/v1/responses", headers=bob,
                  json={"model": MODEL, "input": "y", "previous_response_id": out["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "not found" in r.json()["error"]["message"]
    follow = _create(http, alice, previous_response_id=out["id"])
    assert follow["previous_response_id"] == out["id"]
    assert http.delete(path, headers=alice).status_code == 200
    assert http.get(path, headers=alice).status_code == 404
    _store(http).close()


def test_an_owner_header_scopes_responses_behind_a_gateway():
    http = _app(AgentOptions(responses_owner_header="X-User"))
    key = {"Authorization": "Bearer shared"}
    out = _create(http, {**key, "X-User": "alice"})
    path = f"/v1/responses/{out['id']}"
    assert http.get(path, headers={**key, "X-User": "alice"}).status_code == 200
    assert http.get(path, headers={**key, "X-User": "bob"}).status_code == 404
    assert http.get(path, headers=key).status_code == 404


def test_open_store_follows_the_flags(tmp_path):
    assert isinstance(open_store(AgentOptions()), MemoryResponseStore)
    off = open_store(AgentOptions(responses_store_size=0,
                                  responses_store_path=str(tmp_path / "r.sqlite3")))
    assert isinstance(off, MemoryResponseStore) and not off.enabled
    assert not (tmp_path / "r.sqlite3").exists()         # an off store writes nothing
    on = open_store(AgentOptions(responses_store_path=str(tmp_path / "s" / "r.sqlite3")))
    assert isinstance(on, SqliteResponseStore) and on.enabled
    on.close()


# ------------------------------------------------------------------ the store itself


def test_store_arithmetic_and_owner_digests(kind, tmp_path, opened):
    store = _open(kind, tmp_path, StoreLimits(max_entries=3, max_bytes=10_000,
                                              max_entry_bytes=5_000))
    opened.append(store)
    items = [_item(i) for i in range(5)]
    for item in items:
        assert store.put(item)
    assert list(store._index) == ["r2", "r3", "r4"] and store.bytes == 3 * entry_size(items[0])
    assert store.put(_item(4, text="b"))                                  # replaces r4
    assert store.bytes == 2 * entry_size(items[0]) + entry_size(_item(4, text="b"))
    assert not store.put(_item("big", text="a" * 6000))
    assert store.get("r3", "other") is None and not store.delete("r3", "other")
    assert store.delete("r3", "o") and store.get("r3", "o") is None
    got = store.get("r4", "o")
    assert got is not None and got.body == {"id": "r4", "x": "b"} and got.owner == "o"
    assert got.messages == [{"role": "user", "content": "q"}]
    assert owner_of({}, None) == "" and owner_of({"authorization": "Bearer k"}, None) != "Bearer k"
    assert owner_of({"x-user": "a"}, "X-User") != owner_of({"x-user": "b"}, "X-User")
    with pytest.raises(OpenAIError):
        check_metadata(["not", "a", "mapping"])
    with pytest.raises(ValueError):
        AgentOptions(responses_owner_header="bad header\r\n")


def test_the_entry_budget_evicts_least_recently_read_first(kind, tmp_path, opened):
    store = _open(kind, tmp_path, StoreLimits(max_entries=2))
    opened.append(store)
    store.put(_item(0))
    store.put(_item(1))
    assert store.get("r0", "o") is not None          # r1 is now the least recently used
    store.put(_item(2))
    assert sorted(store._index) == ["r0", "r2"] and store.get("r1", "o") is None


def test_sqlite_keeps_everything_across_a_reopen(tmp_path):
    path = tmp_path / "responses.sqlite3"
    limits = StoreLimits(max_entries=3)
    store = SqliteResponseStore(path, limits)
    for i in range(4):
        store.put(_item(i, owner=f"owner{i % 2}"))
    store.get("r1", "owner1")                        # r1 read: r2 is least recently used now
    assert store.delete("r3", "owner1")
    assert store.get("r2", "owner0") is not None     # readable at once, before it is written
    store.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600       # users' conversations

    again = SqliteResponseStore(path, limits)
    try:
        assert list(again._index) == ["r1", "r2"]   # LRU order kept; r0 evicted, r3 deleted
        assert again.bytes == 2 * entry_size(_item(1))
        got = again.get("r1", "owner1")
        assert got is not None and got.body == _item(1).body and got.owner == "owner1"
        assert got.messages == _item(1).messages and again.get("r1", "owner0") is None
    finally:
        again.close()
    rows = sqlite3.connect(path).execute("SELECT id FROM responses ORDER BY id").fetchall()
    assert rows == [("r1",), ("r2",)]                # evictions and deletes reached the file


def test_sqlite_reopened_with_smaller_limits_evicts_to_fit(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(path, StoreLimits(max_entries=10))
    for i in range(5):
        store.put(_item(i))
    store.put(_item("huge", text="h" * 3000))
    store.close()
    again = SqliteResponseStore(path, StoreLimits(max_entries=2, max_entry_bytes=2000))
    try:
        assert list(again._index) == ["r3", "r4"]   # the huge one is over the entry limit
        assert again.bytes == 2 * entry_size(_item(0))
    finally:
        again.close()


def test_sqlite_marks_unfinished_background_responses_failed(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(path, StoreLimits())
    for status in ("queued", "in_progress", "completed", "cancelled"):
        store.put(_item(status, status=status, background=True))
    store.close()
    again = SqliteResponseStore(path, StoreLimits())
    try:
        statuses = {s: again.get(f"r{s}", "o").body for s in  # type: ignore[union-attr]
                    ("queued", "in_progress", "completed", "cancelled")}
    finally:
        again.close()
    assert {s: b["status"] for s, b in statuses.items()} == {
        "queued": "failed", "in_progress": "failed", "completed": "completed",
        "cancelled": "cancelled"}
    assert statuses["queued"]["error"] == INTERRUPTED and "error" not in statuses["completed"]


def test_sqlite_refuses_a_second_process_and_other_schemas(tmp_path):
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(path, StoreLimits())
    with pytest.raises(OSError, match="in use by another process"):
        SqliteResponseStore(path, StoreLimits())
    store.close()
    SqliteResponseStore(path, StoreLimits()).close()      # free again once closed
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 7")
    db.commit()
    db.close()
    with pytest.raises(OSError, match="schema version 7"):
        SqliteResponseStore(path, StoreLimits())


def test_sqlite_writes_off_the_callers_thread(tmp_path, opened):
    """put / delete return before the disk is touched: the entry is served from memory until
    its row is written, then from the file."""
    store = SqliteResponseStore(tmp_path / "responses.sqlite3", StoreLimits())
    opened.append(store)
    with store._db_lock:                            # the writer cannot write meanwhile
        assert store.put(_item(0))
        assert store.get("r0", "o") is not None and "r0" in store._pending
    assert store.flush()
    assert not store._pending and store.get("r0", "o").body == _item(0).body  # type: ignore[union-attr]
    row = store._db.execute("SELECT owner, status, size, body FROM responses").fetchone()
    assert row[:3] == ("o", None, entry_size(_item(0))) and json.loads(row[3]) == _item(0).body


def test_an_unfinished_response_cannot_be_continued():
    for status in ("queued", "in_progress"):
        with pytest.raises(OpenAIError, match="has not finished") as e:
            previous_conversation(_item(0, status=status))
        assert e.value.param == "previous_response_id"
    assert previous_conversation(_item(0, status="cancelled")) == _item(0).messages
