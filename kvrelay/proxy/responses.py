"""`/v1/responses` through the proxy: which decode server holds a stored response.

A stored response (and so `previous_response_id`, GET and DELETE) lives only in the memory
of the decode server that answered it. The proxy learns each response's id from what it
relays (the JSON body, or the first SSE event, `response.created`) and keeps id → decode
server in a bounded LRU (`ResponseHomes`). A follow-up naming a known id goes straight to
that server (no prefill leg: the prefill server has not got the history); GET and DELETE
go there too.

The prefill leg of a request without `previous_response_id` is the client's body with
`max_output_tokens: 1`, `stream: false`, `store: false` (nothing kept on the prefill) and
the usual `kv_transfer_params`; see `prefill_body`. A request that approves an MCP call
(`approves_a_call`) has no prefill leg either: the decode server makes the call first and
its first prompt holds the result, so the prefill's KV of the body's prompt would be read
by nobody.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

from kvrelay import rawjson
from kvrelay.proxy.routing import PREFILL_KV_TRANSFER_PARAMS, Backend, edited

PATH = "/v1/responses"
MAX_HOMES = 65536                 # ids remembered (~100 bytes each); the oldest used go first
MAX_SNIFF_BYTES = 64 * 1024       # a stream whose first event is longer is not remembered


class ResponseHomes:
    """Response id → the decode server that answered (and stored) it, least recently used
    evicted first. One event loop owns it: no locking."""

    def __init__(self, max_entries: int = MAX_HOMES) -> None:
        self.max_entries = max_entries
        self._homes: OrderedDict[str, Backend] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def remember(self, response_id: str, backend: Backend) -> None:
        self._homes[response_id] = backend
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> Backend | None:
        backend = self._homes.get(response_id)
        if backend is not None:
            self._homes.move_to_end(response_id)
        return backend

    def forget(self, response_id: str) -> None:
        self._homes.pop(response_id, None)


def prefill_edit(body: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """How a Responses body differs for the prefill server: one output token, not
    streamed, not stored, KV kept for the decode server."""
    return {"max_output_tokens": 1, "stream": False, "store": False,
            "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS)}, ()


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses body as the prefill server gets it (`prefill_edit` applied)."""
    return edited(body, *prefill_edit(body))


APPROVAL_RESPONSE = b'"mcp_approval_response"'


def approves_a_call(raw: bytes | bytearray, body: Mapping[str, Any]) -> bool:
    """Whether the input holds an `mcp_approval_response` with `approve: true`. The server
    makes an approved call before the first round and renders that round's prompt with the
    call's result in it, a prompt the prefill cannot make (it calls nothing): a prefill
    leg would compute KV that no decode reads, held until the prefill's lease. `raw`: the
    whole body, searched first (fast), so other bodies' inputs are not walked."""
    if APPROVAL_RESPONSE not in raw:
        return False
    items = body.get("input")
    if not rawjson.is_array(items):
        return False
    for item in rawjson.elements(items):
        fields = rawjson.members(item) if rawjson.is_object(item) else None
        if fields is not None and fields.get("type") == "mcp_approval_response" \
                and fields.get("approve") is True:
            return True
    return False


def key_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Responses body in chat form, for the prompt key only (`prefix.Hasher.key`): the
    instructions as the system message, then the input items, in the order the server
    renders them. Without this every Responses body keys as an empty prompt, which would
    send them all straight to decode under `--disagg-policy auto`. The values may be raw
    (`rawjson`): the messages are then made one at a time, as the key reads them."""
    return {"model": body.get("model"), "tools": body.get("tools"),
            "messages": _key_messages(body)}


def _key_messages(body: Mapping[str, Any]) -> Iterator[Any]:
    instructions = body.get("instructions")
    if rawjson.is_string(instructions):
        yield {"role": "system", "content": instructions}
    raw = body.get("input")
    if rawjson.is_string(raw):
        yield {"role": "user", "content": raw}
        return
    for item in rawjson.elements(raw) if rawjson.is_array(raw) else [raw]:
        fields = rawjson.members(item) if rawjson.is_object(item) else None
        if fields is not None and fields.get("type", "message") == "message":
            yield {"role": fields.get("role"), "content": fields.get("content")}
        else:                           # reasoning, calls, call outputs: their JSON stands in
            yield item


def id_from_json(content: bytes) -> str | None:
    """The `id` of a whole response object, if it is one."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    rid = body.get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) else None


class StreamSniffer:
    """Reads the start of a relayed SSE stream until its first event (`response.created`,
    which carries the response object) and takes the response id from it."""

    def __init__(self) -> None:
        self._head = b""
        self.done = False
        self.response_id: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self._head += chunk
        end = self._head.find(b"\n\n")
        if end < 0:
            self.done = len(self._head) > MAX_SNIFF_BYTES
            return
        self.done = True
        for line in self._head[:end].split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    return
                response = event.get("response") if isinstance(event, dict) else None
                rid = response.get("id") if isinstance(response, dict) else None
                self.response_id = rid if isinstance(rid, str) else None
        self._head = b""
