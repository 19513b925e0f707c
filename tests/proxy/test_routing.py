"""Unit tests: flag pairing, backend selection and body rewriting (exact values)."""
from __future__ import annotations

import re

import pytest

from kvrelay.proxy.main import build_parser, settings_from_args
from kvrelay.proxy.policy import Router
from kvrelay.proxy.routing import (
    PREFILL_KV_TRANSFER_PARAMS,
    Backend,
    EndpointError,
    decode_body,
    expand_endpoints,
    free_notice,
    prefill_body,
    routable_kv_params,
)

NULL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
PREFILLED_KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-1",
                "remote_block_ids": [[1, 2], [5]], "remote_host": "10.0.0.7", "remote_port": 5559,
                "remote_request_id": "cmpl-42", "tp_size": 4}


# ---------------------------------------------------------------- flags

@pytest.mark.parametrize("hosts, ports, expected", [
    (["h"], [8100], [("h", 8100)]),
    (["h"], [8100, 8101, 8102], [("h", 8100), ("h", 8101), ("h", 8102)]),
    (["a", "b"], [8100, 8101], [("a", 8100), ("b", 8101)]),
    (["a", "b", "c"], [8100], [("a", 8100), ("b", 8100), ("c", 8100)]),
])
def test_expand_endpoints(hosts, ports, expected):
    assert expand_endpoints(hosts, ports, "prefiller") == expected


@pytest.mark.parametrize("hosts, ports, message", [
    (["a", "b"], [1, 2, 3],
     "--decoder-host has 2 values and --decoder-port has 3: give one host, one port, or as many "
     "hosts as ports"),
    (["a"], [0], "--decoder-port: 0 is not a TCP port (1-65535)"),
    (["a"], [8200, 8200], "--decoder-host/--decoder-port: a:8200 listed twice"),
    ([""], [8200], "--decoder-host: empty host name"),
])
def test_expand_endpoints_errors(hosts, ports, message):
    with pytest.raises(EndpointError) as e:
        expand_endpoints(hosts, ports, "decoder")
    assert str(e.value) == message


def test_tutorial_flags_and_defaults():
    args = build_parser().parse_args(["--port", "8000", "--host", "0.0.0.0",
                                      "--prefiller-host", "p",
                                      "--prefiller-port", "8100", "8101", "8102",
                                      "--decoder-host", "d", "--decoder-port", "8200"])
    s = settings_from_args(args)
    assert (s.host, s.port) == ("0.0.0.0", 8000)
    assert s.prefill == [("p", 8100), ("p", 8101), ("p", 8102)]
    assert s.decode == [("d", 8200)]
    d = settings_from_args(build_parser().parse_args([]))
    assert (d.host, d.port, d.prefill, d.decode) == ("127.0.0.1", 8000, [("127.0.0.1", 8100)],
                                                     [("127.0.0.1", 8200)])


def test_vllm_plural_flag_spellings():
    args = build_parser().parse_args(["--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2",
                                      "--decoder-hosts", "c", "--decoder-ports", "3"])
    s = settings_from_args(args)
    assert s.prefill == [("a", 1), ("b", 2)] and s.decode == [("c", 3)]


# ---------------------------------------------------------------- selection

def _backends(n: int, role: str = "prefill") -> list[Backend]:
    return [Backend(role, "h", 8100 + i) for i in range(n)]


def test_round_robin_rotates():
    bs = _backends(3)
    rr = Router(bs, "round_robin")
    assert [[b.port for b in rr.choose(None).order] for _ in range(4)] == [
        [8100, 8101, 8102], [8101, 8102, 8100], [8102, 8100, 8101], [8100, 8101, 8102]]


def test_round_robin_tries_failed_servers_last():
    bs = _backends(3)
    bs[0].mark_failed()
    rr = Router(bs, "round_robin")
    assert [b.port for b in rr.choose(None).order] == [8101, 8102, 8100]
    assert [b.port for b in rr.choose(None).order] == [8101, 8102, 8100]
    assert [b.port for b in rr.choose(None).order] == [8102, 8101, 8100]
    bs[0].mark_ok()
    assert [b.port for b in rr.choose(None).order] == [8100, 8101, 8102]
    assert bs[0].failures == 1


def test_least_in_flight_with_round_robin_ties():
    bs = _backends(3, "decode")
    lif = Router(bs, "least_loaded")
    assert [b.port for b in lif.choose(None).order] == [8100, 8101, 8102]
    assert [b.port for b in lif.choose(None).order] == [8101, 8102, 8100]          # tie: rotate
    bs[0].in_flight, bs[1].in_flight, bs[2].in_flight = 2, 0, 1
    assert [b.port for b in lif.choose(None).order] == [8101, 8102, 8100]
    bs[1].mark_failed()
    assert [b.port for b in lif.choose(None).order] == [8102, 8100, 8101]


def test_backend_url():
    assert Backend("decode", "10.0.0.2", 8200).url == "http://10.0.0.2:8200"
    assert Backend("decode", "::1", 8200).url == "http://[::1]:8200"


# ---------------------------------------------------------------- bodies

def test_prefill_body_completions():
    body = {"model": "m", "prompt": "p", "max_tokens": 16, "stream": True, "temperature": 0.5,
            "stream_options": {"include_usage": True}, "min_tokens": 4,
            "kv_transfer_params": {"x": 1}}
    assert prefill_body(body) == {"model": "m", "prompt": "p", "max_tokens": 1, "stream": False,
                                  "temperature": 0.5, "kv_transfer_params": NULL_KV}
    # untouched
    assert body["max_tokens"] == 16 and body["stream_options"] == {"include_usage": True}


def test_prefill_body_chat():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 50, "min_completion_tokens": 3}
    assert prefill_body(body) == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                  "kv_transfer_params": NULL_KV}
    assert PREFILL_KV_TRANSFER_PARAMS == NULL_KV
    prefill_body(body)["kv_transfer_params"]["remote_host"] = "x"        # a copy each time
    assert PREFILL_KV_TRANSFER_PARAMS == NULL_KV


def test_decode_body_is_the_original_with_prefill_params():
    body = {"model": "m", "prompt": "p", "max_tokens": 16, "stream": True, "min_tokens": 4,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {"x": 1}}
    assert decode_body(body, PREFILLED_KV) == {"model": "m", "prompt": "p", "max_tokens": 16,
                                               "stream": True, "min_tokens": 4,
                                               "stream_options": {"include_usage": True},
                                               "kv_transfer_params": PREFILLED_KV}


@pytest.mark.parametrize("advertised, expected", [
    ("10.0.0.7", "10.0.0.7"), ("0.0.0.0", "prefill-a"), ("", "prefill-a"), (None, "prefill-a"),
    ("::", "prefill-a"),
])
def test_routable_kv_params(advertised, expected):
    out = routable_kv_params(PREFILLED_KV | {"remote_host": advertised}, "prefill-a")
    assert out == PREFILLED_KV | {"remote_host": expected}


def test_free_notice():
    assert free_notice(PREFILLED_KV) == {"remote_request_id": "cmpl-42",
                                         "remote_engine_id": "eng-1"}
    assert free_notice({"remote_engine_id": "eng-1"}) is None


@pytest.mark.parametrize("flags, message", [
    (["--routing-load-margin", "-1"], "--routing-load-margin: -1 is negative"),
    (["--routing-block-size", "0"], "--routing-block-size: 0 is not positive"),
    (["--routing-chars-per-token", "0"], "--routing-chars-per-token: 0 is not positive"),
    (["--direct-max-tokens", "-5"], "--direct-max-tokens: -5 is negative"),
    (["--direct-cached-fraction", "1.5"], "--direct-cached-fraction: 1.5 is not in (0, 1]"),
])
def test_bad_routing_flags(flags, message):
    with pytest.raises(EndpointError, match=re.escape(message)):
        settings_from_args(build_parser().parse_args(flags))


def test_routing_flags_reach_the_settings():
    s = settings_from_args(build_parser().parse_args(
        ["--routing", "least_loaded", "--disagg-policy", "auto", "--direct-max-tokens", "40",
         "--routing-block-size", "32"]))
    assert (s.routing.routing, s.routing.disagg.policy, s.routing.disagg.direct_max_tokens,
            s.routing.block_size) == ("least_loaded", "auto", 40, 32)
    default = settings_from_args(build_parser().parse_args([])).routing
    assert (default.routing, default.disagg.policy) == ("cache_aware", "always")
