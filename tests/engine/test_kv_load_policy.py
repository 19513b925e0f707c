"""`kv_load_failure_policy`: a decode engine whose KV load fails either recomputes the
prompt locally (the client gets the same tokens as without disaggregation) or fails
that request alone with an error naming the transfer (the engine serves the rest).

Three failures, in-process (TCP transport, side channel on an ephemeral port):
  - the prefill server is gone (the handshake cannot connect),
  - the prefill freed the request's blocks before the decode read them (the claim is
    refused after a good handshake),
  - the read itself fails (the transport reports an error for it: the failure arrives
    through the connector's polling, steps after the load started).
"""
from __future__ import annotations

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.disagg.transport import TransferError
from kvrelay.engine.outputs import RequestOutput
from tests.processes import free_port

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [(5 * i + 2) % 150 for i in range(19)]
OTHER = [(3 * i + 1) % 150 for i in range(9)]


def _kv_config(role: str, policy: str = "fail") -> dict:
    return {"kv_connector": "TcpConnector", "kv_role": role, "kv_load_failure_policy": policy}


@pytest.fixture(scope="module")
def engines(tiny):
    """A prefill engine, one decode engine per policy, and a plain one (the reference)."""
    common = {"dtype": "float32", "max_model_len": 128, "block_size": 4}
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVRELAY_NIXL_SIDE_CHANNEL_PORT", "0")   # an ephemeral port, not 5600
        made["prefill"] = LLM(str(tiny[0]), kv_transfer_config=_kv_config("kv_producer"), **common)
    try:
        made["plain"] = LLM(str(tiny[0]), **common)
        for policy in ("recompute", "fail"):
            made[policy] = LLM(str(tiny[0]), kv_transfer_config=_kv_config("kv_consumer", policy),
                               **common)
        yield made
    finally:
        for llm in made.values():
            llm.shutdown()


def _run(llm: LLM, requests: dict[str, tuple[list[int], dict | None]],
         params: SamplingParams = GREEDY) -> dict[str, RequestOutput]:
    engine = llm.engine
    for request_id, (prompt, transfer) in requests.items():
        engine.add_request(request_id, prompt, params, kv_transfer_params=transfer)
    done: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests() and len(done) == len(requests):
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == set(requests)
    return done


def _prefilled(engines, request_id: str) -> dict:
    """Prefill PROMPT for a remote decode (one token, as the proxy asks); returns the
    kv_transfer_params it hands out."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = _run(engines["prefill"], {request_id: (PROMPT, {"do_remote_decode": True})}, one)
    out = out[request_id]
    assert out.error is None and out.kv_transfer_params["do_remote_prefill"]
    return out.kv_transfer_params


def _gone_prefill() -> dict:
    port = free_port()                                  # nothing listens there
    return {"do_remote_prefill": True, "remote_engine_id": f"gone-{port}",
            "remote_block_ids": [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], "remote_host": "127.0.0.1",
            "remote_port": port, "remote_request_id": "r", "remote_capability": "c"}


def _freed_prefill(engines, request_id: str) -> dict:
    params = _prefilled(engines, request_id)
    prefill = engines["prefill"].engine
    assert prefill.free_remote(params["remote_request_id"], params["remote_capability"])
    prefill.assert_no_leaks()
    return params


def _failed_read(engines, request_id: str, decode: LLM, mp: pytest.MonkeyPatch) -> dict:
    transport = decode.engine.connector.transport

    def failing_poll(handle):
        raise TransferError("injected: the connection to the prefill dropped")
    mp.setattr(transport, "poll", failing_poll)
    return _prefilled(engines, request_id)


FAILURES = {
    "prefill gone": lambda engines, rid, decode, mp: _gone_prefill(),
    "blocks freed": lambda engines, rid, decode, mp: _freed_prefill(engines, rid),
    "read fails": _failed_read,
}


def _prefill_is_clean(engines, params: dict) -> None:
    """The decode never read (a real proxy then frees explicitly, or the lease ends)."""
    prefill = engines["prefill"].engine
    if "remote_capability" in params and params["remote_capability"] != "c":
        prefill.free_remote(params["remote_request_id"], params["remote_capability"])
    prefill.assert_no_leaks()


@pytest.mark.parametrize("failure", FAILURES)
def test_recompute_policy_gives_the_local_tokens(engines, failure, monkeypatch):
    want = engines["plain"].generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    decode = engines["recompute"].engine
    failed_before = decode.connector.stats.failed
    params = FAILURES[failure](engines, f"rc-{failure}", engines["recompute"], monkeypatch)
    out = _run(engines["recompute"], {"a": (PROMPT, params), "b": (OTHER, None)})
    assert out["a"].error is None
    assert out["a"].outputs[0].token_ids == want
    assert out["a"].outputs[0].finish_reason == "length"
    assert out["b"].error is None and len(out["b"].outputs[0].token_ids) == GREEDY.max_tokens
    assert decode.connector.stats.failed > failed_before
    decode.assert_no_leaks()
    _prefill_is_clean(engines, params)


@pytest.mark.parametrize("failure", FAILURES)
def test_fail_policy_fails_that_request_alone(engines, failure, monkeypatch):
    want_other = engines["plain"].generate([OTHER], GREEDY)[0].outputs[0].token_ids
    params = FAILURES[failure](engines, f"fail-{failure}", engines["fail"], monkeypatch)
    out = _run(engines["fail"], {"a": (PROMPT, params), "b": (OTHER, None)})
    assert out["a"].error is not None and "KV transfer" in out["a"].error
    # a claim the prefill refuses (blocks freed: the params are stale) is the client's 400;
    # a transfer that breaks is a 502
    assert out["a"].error_status == (400 if failure == "blocks freed" else 502)
    assert out["a"].outputs[0].token_ids == [] and out["a"].outputs[0].finish_reason == "abort"
    assert out["b"].error is None and out["b"].outputs[0].token_ids == want_other
    engines["fail"].engine.assert_no_leaks()
    _prefill_is_clean(engines, params)
