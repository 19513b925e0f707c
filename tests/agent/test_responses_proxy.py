"""The proxy's Responses bookkeeping (kvrelay/proxy/responses.py), exact values: the prefill
body, the id → decode server LRU, and the response id read from a relayed stream's first
event however the chunks split it. The end-to-end checks are in test_agent_disagg.py."""
from __future__ import annotations

import json

from kvrelay import rawjson
from kvrelay.proxy import responses
from kvrelay.proxy.routing import PREFILL_KV_TRANSFER_PARAMS, Backend


def test_prefill_body():
    body = {"model": "m", "input": [{"role": "user", "content": "hi"}], "stream": True,
            "max_output_tokens": 50, "kv_transfer_params": {"x": 1}, "text": {"format": {}}}
    out = responses.prefill_body(body)
    assert out == {**body, "max_output_tokens": 1, "stream": False, "store": False,
                   "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    assert body["stream"] is True and body["kv_transfer_params"] == {"x": 1}   # not mutated


def test_homes_lru():
    a, b = Backend("decode", "h", 1), Backend("decode", "h", 2)
    homes = responses.ResponseHomes(max_entries=2)
    homes.remember("r1", a)
    homes.remember("r2", b)
    assert homes.home("r1") is a                     # r1 is now the newest
    homes.remember("r3", b)
    assert (homes.home("r2"), homes.home("r1"), homes.home("r3"), len(homes)) == (None, a, b, 2)
    homes.forget("r1")
    assert homes.home("r1") is None and len(homes) == 1


def test_stream_sniffer_across_chunks():
    event = {"type": "response.created", "response": {"id": "resp_abc", "output": []},
             "sequence_number": 0}
    raw = (f"event: response.created\ndata: {json.dumps(event)}\n\n"
           "event: response.in_progress\ndata: {}\n\n").encode()
    for size in (1, 7, len(raw)):
        sniffer = responses.StreamSniffer()
        for i in range(0, len(raw), size):
            sniffer.feed(raw[i:i + size])
        assert sniffer.done and sniffer.response_id == "resp_abc"


def test_stream_sniffer_gives_up():
    sniffer = responses.StreamSniffer()
    sniffer.feed(b"data: " + b"x" * (responses.MAX_SNIFF_BYTES + 1))
    assert sniffer.done and sniffer.response_id is None
    sniffer = responses.StreamSniffer()
    sniffer.feed(b"data: not json\n\n")
    assert sniffer.done and sniffer.response_id is None


def test_id_from_json():
    assert responses.id_from_json(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    assert responses.id_from_json(b"[1]") is None and responses.id_from_json(b"nope") is None


def test_key_body_keys_the_prompt():
    from kvrelay.proxy.prefix import Hasher
    hasher = Hasher()
    long = "why is the sky blue? " * 40
    key = hasher.key(responses.PATH, responses.key_body({"model": "m", "input": long}))
    assert key.tokens > 100 and key.hashes        # not an empty prompt (auto would skip prefill)
    items = [{"role": "user", "content": [{"type": "input_text", "text": long}]},
             {"type": "function_call_output", "call_id": "c", "output": "sunny"}]
    request = {"model": "m", "instructions": "be brief", "input": items}
    assert list(responses.key_body(request)["messages"]) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": items[0]["content"]}, items[1]]
    longer = hasher.key(responses.PATH, responses.key_body(request))
    assert longer.hashes[:1] != key.hashes[:1]    # the instructions come first


def test_approves_a_call():
    """A body approving an MCP call skips the prefill (its first prompt holds the call's
    result); declined approvals, other bodies and a type named in text do not."""
    from kvrelay.proxy.body import parse_body

    def approves(body: dict) -> bool:
        raw = json.dumps(body).encode()
        return responses.approves_a_call(raw, parse_body(raw).fields)

    answer = {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True}
    asked = {"type": "mcp_approval_request", "id": "mcpr_1", "server_label": "calc",
             "name": "add", "arguments": "{}"}
    assert approves({"model": "m", "input": [answer], "previous_response_id": "resp_1"})
    assert approves({"model": "m", "input": [{"role": "user", "content": "x"}, asked, answer]})
    assert not approves({"model": "m", "input": [asked, {**answer, "approve": False}]})
    assert not approves({"model": "m", "input": "say mcp_approval_response"})
    assert not approves({"model": "m", "input": [{"role": "user",
                                                  "content": '"mcp_approval_response"'}]})
    long = [{"role": "user", "content": "x" * 70_000}]         # input left raw (RawJSON)
    raw = json.dumps({"model": "m", "input": long}).encode()
    assert isinstance(parse_body(raw).fields["input"], rawjson.RawJSON)
    assert approves({"model": "m", "input": [*long, asked, answer]})
    assert not approves({"model": "m", "input": [*long, asked]})
