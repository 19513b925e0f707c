"""The HTTP layer's side of bounded KV holds, in process over a fake engine (no model):
the per-client token bucket on do_remote_decode requests (429 + Retry-After), a prefill
whose hold share is full (503 + Retry-After), and the capability-checked explicit free."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvrelay.disagg.params import KVTransferConfig
from kvrelay.engine.client import KVHoldRefused
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.chat import TemplateChat
from kvrelay.server.hold_limit import HoldRateLimiter
from tests.agent.fakes import PLAIN_TEMPLATE, char_tokenizer

HOLD = {"do_remote_decode": True, "do_remote_prefill": False}
CAPABILITY = "cap-3f9a"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_burst_refill_and_clients_apart():
    clock = FakeClock()
    limiter = HoldRateLimiter(rate=2.0, burst=3, clock=clock)
    assert [limiter.take("a") for _ in range(3)] == [None, None, None]
    assert limiter.take("a") == pytest.approx(0.5)          # one token in 1/rate s
    assert limiter.take("b") is None                        # another client: its own bucket
    clock.now += 0.5
    assert limiter.take("a") is None and limiter.take("a") == pytest.approx(0.5)
    clock.now += 60                                         # refills to the burst, not past it
    assert [limiter.take("a") for _ in range(4)][-1] == pytest.approx(0.5)
    assert "hold_rate" in limiter.message(0.2) and "retry after 1 s" in limiter.message(0.2)


def test_token_bucket_forgets_the_least_recent_client_past_the_cap():
    clock = FakeClock()
    limiter = HoldRateLimiter(rate=1.0, burst=1, clock=clock, max_clients=2)
    assert limiter.take("a") is None and limiter.take("a") is not None
    limiter.take("b")
    limiter.take("c")                                       # "a" is forgotten
    assert len(limiter._buckets) == 2 and limiter.take("a") is None


def test_hold_rate_config_keys():
    kv = KVTransferConfig.from_json({"kv_role": "kv_producer"})
    assert (kv.hold_rate, kv.hold_burst) == (100.0, 200.0)
    kv = KVTransferConfig.from_json({"kv_role": "kv_producer", "kv_connector_extra_config":
                                     {"hold_rate": 0.5, "hold_burst": 4}})
    assert (kv.hold_rate, kv.hold_burst) == (0.5, 4.0)
    for bad in ({"hold_rate": -1}, {"hold_burst": 0.5}, {"hold_rate": "fast"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KVTransferConfig.from_json({"kv_connector_extra_config": bad})



def test_lease_from_vllms_abort_timeout_variable(monkeypatch):
    monkeypatch.delenv("KVRELAY_NIXL_ABORT_REQUEST_TIMEOUT", raising=False)
    monkeypatch.delenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", raising=False)
    assert KVTransferConfig.from_json({"kv_role": "kv_producer"}).lease_s == 120.0
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "7.5")
    assert KVTransferConfig.from_json({"kv_role": "kv_producer"}).lease_s == 7.5
    explicit = {"kv_role": "kv_producer", "kv_connector_extra_config": {"lease_s": 30}}
    assert KVTransferConfig.from_json(explicit).lease_s == 30.0     # the config file wins
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VLLM_NIXL_ABORT_REQUEST_TIMEOUT"):
        KVTransferConfig.from_json({"kv_role": "kv_producer"})

@dataclass
class FakePrefill:
    """Answers every request with one token; do_remote_decode requests get the prefill's
    kv_transfer_params (or KVHoldRefused when `full`). Frees need CAPABILITY."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dead: str | None = None
    info: dict[str, Any] = field(default_factory=lambda: {"max_model_len": 96})
    full: bool = False
    held: set[str] = field(default_factory=set)
    frees: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready.set()

    async def generate(self, request_id: str, prompt: list[int], params: Any,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        out = RequestOutput(request_id, None, list(prompt),
                            [CompletionOutput(0, "w5", [5], "length", delta_token_ids=[5])],
                            finished=True)
        if kv_transfer_params and kv_transfer_params.get("do_remote_decode"):
            if self.full:
                raise KVHoldRefused("KV hold refused: ... (at most 32: kv_connector_extra_config."
                                    "hold_share 0.5); retry later")
            self.held.add(request_id)
            out.kv_transfer_params = {"do_remote_prefill": True, "remote_request_id": request_id,
                                      "remote_capability": CAPABILITY}
        await asyncio.sleep(0)
        yield out

    async def free_remote(self, request_id: str, capability: str) -> bool:
        self.frees.append((request_id, capability))
        if request_id in self.held and capability == CAPABILITY:
            self.held.discard(request_id)
            return True
        return False


def _app(engine: FakePrefill, limiter: HoldRateLimiter | None, api_key: str | None = None):
    state = ServerState(engine=engine, tokenizer=None, served_names=["m"],  # type: ignore[arg-type]
                        max_model_len=96, max_logprobs=5, api_key=api_key, hold_limiter=limiter,
                        chat=TemplateChat(char_tokenizer(PLAIN_TEMPLATE)))
    return build_app(state)


def _client(app, host: str, api_key: str | None = None) -> TestClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return TestClient(app, client=(host, 40000), headers=headers)


def _hold(client: TestClient, chat: bool = False):
    if chat:
        return client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "kv_transfer_params": HOLD})
    return client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1,
                                                "kv_transfer_params": HOLD})


def _is_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_a_flooding_client_gets_429_while_another_is_served():
    clock = FakeClock()
    engine = FakePrefill()
    app = _app(engine, HoldRateLimiter(rate=0.5, burst=3, clock=clock))
    flooder, other = _client(app, "10.0.0.7"), _client(app, "10.0.0.8")
    assert [_hold(flooder).status_code for _ in range(3)] == [200, 200, 200]
    r = _hold(flooder)
    error = _is_openai_error(r, 429)
    assert error["type"] == "RateLimitError" and "hold_rate" in error["message"]
    assert r.headers["Retry-After"] == "2"                  # 1 / 0.5 holds per second
    assert _hold(other).status_code == 200                  # another client is served
    # plain requests of the flooder place no hold and are not bounded
    plain = flooder.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
    assert plain.status_code == 200
    clock.now += 2
    assert _hold(flooder).status_code == 200                # the bucket refilled
    assert len(engine.held) == 5                            # refused requests held nothing


def test_the_bucket_applies_to_chat_and_not_to_api_key_holders():
    clock = FakeClock()
    limiter = HoldRateLimiter(rate=1, burst=1, clock=clock)
    app = _app(FakePrefill(), limiter)
    client = _client(app, "10.0.0.9")
    assert _hold(client).status_code == 200
    assert _hold(client, chat=True).status_code == 429
    keyed = _app(FakePrefill(), HoldRateLimiter(rate=1, burst=1, clock=clock), api_key="k")
    proxy = _client(keyed, "10.0.0.10", api_key="k")
    assert [_hold(proxy).status_code for _ in range(5)] == [200] * 5


def test_a_full_hold_share_is_503_with_retry_after():
    engine = FakePrefill(full=True)
    client = _client(_app(engine, None), "10.0.0.11")
    r = _hold(client)
    error = _is_openai_error(r, 503)
    assert "hold_share" in error["message"] and error["type"] == "ServiceUnavailableError"
    assert r.headers["Retry-After"] == "1"
    engine.full = False
    assert _hold(client).status_code == 200                 # the server still serves


def test_free_needs_the_capability_and_tells_nothing_else():
    engine = FakePrefill()
    client = _client(_app(engine, None), "10.0.0.12")
    rid = _hold(client).json()["kv_transfer_params"]["remote_request_id"]
    missing = client.post("/v1/kv_transfer/free", json={"remote_request_id": rid})
    assert _is_openai_error(missing, 400)["param"] == "remote_capability"
    wrong = client.post("/v1/kv_transfer/free", json={"remote_request_id": rid,
                                                       "remote_capability": "guess"})
    unknown = client.post("/v1/kv_transfer/free", json={"remote_request_id": "nope",
                                                         "remote_capability": CAPABILITY})
    assert _is_openai_error(wrong, 404) == _is_openai_error(unknown, 404)   # same answer
    assert rid in engine.held
    right = client.post("/v1/kv_transfer/free", json={"remote_request_id": rid,
                                                       "remote_capability": CAPABILITY})
    assert right.status_code == 200 and rid not in engine.held


@pytest.mark.parametrize(("body", "param"), [
    ({"remote_capability": CAPABILITY}, "remote_request_id"),                  # missing
    ({"remote_request_id": "", "remote_capability": CAPABILITY}, "remote_request_id"),
    ({"remote_request_id": 7, "remote_capability": CAPABILITY}, "remote_request_id"),
    ({"remote_request_id": "r", "remote_capability": ""}, "remote_capability"),
    (["remote_request_id", "r"], None),                                        # not an object
])
def test_free_rejects_a_malformed_body_with_400(body, param):
    """What an `assert` once checked is a 400 with an OpenAI error body naming the field,
    and the engine is not asked to free anything."""
    engine = FakePrefill()
    client = _client(_app(engine, None), "10.0.0.13")
    rid = _hold(client).json()["kv_transfer_params"]["remote_request_id"]
    error = _is_openai_error(client.post("/v1/kv_transfer/free", json=body), 400)
    assert error["param"] == param and error["type"] == "BadRequestError"
    assert rid in engine.held
