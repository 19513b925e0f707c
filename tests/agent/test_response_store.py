"""The Responses store's bounds and owners (kvrelay/server/response_store.py), in-process
over the real app with a scripted engine: OpenAI's metadata limits are 400s, the byte
budget evicts, an entry over its limit is answered but not kept, and a response belongs to
the key (or owner header) that created it — another gets 404 on GET, DELETE and
previous_response_id."""
from __future__ import annotations

import pytest

from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_store import (
    ResponseStore,
    StoredResponse,
    StoreLimits,
    check_metadata,
    entry_size,
    owner_of,
)
from kvrelay.server.tools import AgentOptions
from tests.agent.fakes import MODEL, ScriptedEngine, make_state
from tests.agent.test_agent_api import _decode
from tests.harmony_factories import scripted_harmony_answer


def _app(agent: AgentOptions, api_key: str | None = None):
    from starlette.testclient import TestClient

    from kvrelay.server.api import build_app
    engine = ScriptedEngine(lambda prompt: scripted_harmony_answer("", "Hi"), _decode)
    state = make_state(engine, True, agent)
    state.api_key = api_key
    return TestClient(build_app(state), base_url="http://testserver")


def _create(http, headers: dict[str, str] | None = None, **body) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x", **body},
                  headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


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
    assert len(http.app.state.responses_store) == 0


def test_metadata_at_openais_limits_is_kept():
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    check_metadata(metadata)
    http = _app(AgentOptions())
    out = _create(http, metadata=metadata)
    assert http.get(f"/v1/responses/{out['id']}").json()["metadata"] == metadata


def test_the_byte_budget_evicts_least_recently_used_first():
    http = _app(AgentOptions())
    one = _create(http)
    store: ResponseStore = http.app.state.responses_store
    size = store.bytes
    assert size > 0
    # room for exactly two entries of this size
    http = _app(AgentOptions(responses_store_max_bytes=2 * size + size // 2))
    store = http.app.state.responses_store
    a, b = _create(http), _create(http)
    assert http.get(f"/v1/responses/{a['id']}").status_code == 200      # a is now newest
    c = _create(http)
    assert http.get(f"/v1/responses/{b['id']}").status_code == 404      # b evicted by bytes
    assert http.get(f"/v1/responses/{a['id']}").status_code == 200
    assert http.get(f"/v1/responses/{c['id']}").status_code == 200
    assert len(store) == 2 and store.bytes == sum(i.size for i in store._items.values())
    assert store.bytes <= store.limits.max_bytes and one["id"] not in store._items


def test_an_entry_over_its_limit_is_answered_but_not_kept():
    http = _app(AgentOptions(responses_store_max_entry_bytes=64))
    out = _create(http)
    assert out["store"] is False and out["output"]
    assert http.get(f"/v1/responses/{out['id']}").status_code == 404
    assert len(http.app.state.responses_store) == 0 and http.app.state.responses_store.bytes == 0


def test_stored_responses_belong_to_the_key_that_created_them():
    http = _app(AgentOptions())
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    out = _create(http, alice)
    path = f"/v1/responses/{out['id']}"
    assert http.get(path, headers=alice).status_code == 200
    for method in ("GET", "DELETE"):
        for headers in (bob, {}):
            r = http.request(method, path, headers=headers)
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = http.post("/v1/responses", headers=bob,
                  json={"model": MODEL, "input": "y", "previous_response_id": out["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "not found" in r.json()["error"]["message"]
    follow = _create(http, alice, previous_response_id=out["id"])
    assert follow["previous_response_id"] == out["id"]
    assert http.delete(path, headers=alice).status_code == 200
    assert http.get(path, headers=alice).status_code == 404


def test_an_owner_header_scopes_responses_behind_a_gateway():
    http = _app(AgentOptions(responses_owner_header="X-User"))
    key = {"Authorization": "Bearer shared"}
    out = _create(http, {**key, "X-User": "alice"})
    path = f"/v1/responses/{out['id']}"
    assert http.get(path, headers={**key, "X-User": "alice"}).status_code == 200
    assert http.get(path, headers={**key, "X-User": "bob"}).status_code == 404
    assert http.get(path, headers=key).status_code == 404


def test_store_arithmetic_and_owner_digests():
    store = ResponseStore(StoreLimits(max_entries=3, max_bytes=10_000, max_entry_bytes=5_000))
    items = [StoredResponse({"id": f"r{i}", "x": "a" * 1000}, [], "o") for i in range(5)]
    for item in items:
        assert store.put(item)
    assert list(store._items) == ["r2", "r3", "r4"] and store.bytes == 3 * entry_size(items[0])
    assert store.put(StoredResponse({"id": "r4", "x": "b"}, [], "o"))      # replaces r4
    assert store.bytes == 2 * entry_size(items[0]) + store._items["r4"].size
    assert not store.put(StoredResponse({"id": "big", "x": "a" * 6000}, [], "o"))
    assert store.get("r3", "other") is None and not store.delete("r3", "other")
    assert store.delete("r3", "o") and store.get("r3", "o") is None
    assert owner_of({}, None) == "" and owner_of({"authorization": "Bearer k"}, None) != "Bearer k"
    assert owner_of({"x-user": "a"}, "X-User") != owner_of({"x-user": "b"}, "X-User")
    with pytest.raises(OpenAIError):
        check_metadata(["not", "a", "mapping"])
    with pytest.raises(ValueError):
        AgentOptions(responses_owner_header="bad header\r\n")
