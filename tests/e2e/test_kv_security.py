"""The KV plane under attack, with real processes on 127.0.0.1 (NIXL/UCX and TCP): a 1P1D
pair sharing KVRELAY_KV_SECRET serves honest requests token-exactly, while strangers on
its KV ports, forged or relayed kv_transfer_params, relayed handshakes, cache poisoning,
forged releases, hold floods and connection floods get nothing (docs/security.md names
each claim's test)."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.disagg.auth import AUTH_FAILED, AuthError, client_authenticate
from kvrelay.disagg.side_channel import SideChannelError, recv_frame, send_frame, side_channel_call
from tests.e2e.disagg import prefill_then_decode, start, wait_metric
from tests.factories import greedy_mismatch
from tests.processes import KvrelayProcess, Server, descendants, free_port, stop_all

SECRET = "e2e-kv-secret-4f9c"
NUM_BLOCKS = 64  # the prefill's pool: hold_share 0.5 → at most 32 blocks held
MAX_TOKENS = 4


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * seed) % 150 + 5 for i in range(n)]


def listening(server: Server) -> dict[int, list[str]]:
    """pid → the TCP addresses it listens on, for the server's whole process tree."""
    pids = {server.proc.pid, *descendants(server.proc.pid)}
    out: dict[int, list[str]] = {}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    for line in lines.splitlines():
        for pid in pids:
            if f"pid={pid}," in line:
                out.setdefault(pid, []).append(line.split()[3])
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module", params=["UCX", "TCP"])
def secured(request, tiny, tmp_path_factory):
    """A prefill and a decode with the same KV secret. The prefill's UCX_NET_DEVICES is
    left unset: kvrelay must restrict UCX to the side channel's interface itself."""
    logs = tmp_path_factory.mktemp(f"kvsec-{request.param}")
    side = free_port()
    prefill = start(
        str(tiny[0]),
        "kv_producer",
        logs / "prefill.log",
        request.param,
        flags=["--num-gpu-blocks-override", str(NUM_BLOCKS)],
        env={
            "KVRELAY_KV_SECRET": SECRET,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
            "UCX_NET_DEVICES": "",
        },
        lease_s=30,
    )
    decode = start(  # its UCX_NET_DEVICES unset too, its side-channel host set (as deploy does)
        str(tiny[0]),
        "kv_consumer",
        logs / "decode.log",
        request.param,
        env={"KVRELAY_KV_SECRET": SECRET, "UCX_NET_DEVICES": "",
             "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"},
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield request.param, prefill, decode, ("127.0.0.1", side)
    finally:
        stop_all([prefill, decode])


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
    lens = [3, 9, 13]
    outs = llm.generate(
        [_prompt(n) for n in lens],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    return {n: o.outputs[0].token_ids for n, o in zip(lens, outs)}


def _ids(body: dict) -> list[int]:
    return [int(t.strip().removeprefix("w")) for t in body["choices"][0]["logprobs"]["tokens"]]


def _body(n: int, seed: int = 0) -> dict:
    return {
        "prompt": _prompt(n, seed),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }


def _prefill_leg(prefill: Server, body: dict) -> httpx.Response:
    return httpx.post(
        f"{prefill.url}/v1/completions",
        timeout=60,
        json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )


def test_honest_requests_with_a_secret_equal_single_instance(tiny, secured, reference):
    _, prefill, decode, _ = secured
    for n, want in reference.items():
        params, d = prefill_then_decode(prefill, decode, _body(n), f"honest-{n}")
        assert d.status_code == 200, d.text
        assert (
            isinstance(params["remote_capability"], str) and len(params["remote_capability"]) >= 40
        )
        got = _ids(d.json())
        if got != want:
            assert greedy_mismatch(tiny[1], _prompt(n), got) is None, f"prompt length {n}"
    m = wait_metric(prefill, "kvrelay:kv_requests_held_for_remote", 0)
    assert m["kvrelay:kv_requests_held_for_remote"] == 0 and m["kvrelay:kv_blocks_used"] == 0
    assert decode.metrics()["kvrelay:kv_handshake_errors_total"] == 0


def test_strangers_on_the_kv_ports_learn_only_authentication_failed(secured):
    kind, prefill, decode, side = secured
    hello = {
        "type": "handshake",
        "version": 2,
        "engine_id": "x",
        "tp_size": 1,
        "spec": {"block_size": 999},
    }
    for secret in (None, b"wrong"):
        with pytest.raises(SideChannelError) as e:
            side_channel_call(*side, hello, secret=secret)
        assert AUTH_FAILED in str(e.value) and "block_size" not in str(e.value)
    with socket.create_connection(side, timeout=5) as s:  # the raw reply, exactly
        send_frame(s, hello)
        assert recv_frame(s) == {"ok": False, "error": AUTH_FAILED}
        assert s.recv(1) == b""
    # with the secret, a wrong spec is explained (only to an authenticated peer)
    explained = side_channel_call(*side, hello, secret=SECRET.encode())
    assert explained["ok"] is False and "block_size: prefill 4, decode 999" in explained["error"]
    if kind != "TCP":
        return
    # both TCP KV listeners: the prefill's (from the authenticated handshake) and the decode's
    ports = [
        int(a.rsplit(":", 1)[1])
        for pid, addrs in listening(prefill).items()
        for a in addrs
        if not a.endswith(f":{side[1]}") and not a.endswith(f":{prefill.port}")
    ]
    ports += [
        int(a.rsplit(":", 1)[1])
        for pid, addrs in listening(decode).items()
        for a in addrs
        if not a.endswith(f":{decode.port}")
    ]
    assert len(ports) >= 2, ports
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            send_frame(s, {"op": "read", "descs": [[0, 0, 64]], "notify": "eA=="})
            reply = recv_frame(s)
            assert reply == {"ok": False, "error": AUTH_FAILED}, (port, reply)


def _decode_leg(decode: Server, body: dict, params: dict) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", timeout=60,
                      json=dict(body, kv_transfer_params=params))


def _refused_as_params(r: httpx.Response, why: str) -> None:
    """A 400 OpenAI error naming kv_transfer_params, for the reason `why`."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params" and why in err["message"], err


def _loads_started(decode: Server) -> tuple[float, ...]:
    """The decode's handshakes, finished and failed loads: all unchanged means that no
    load started (every started load ends as one of the two)."""
    m = decode.metrics()
    return tuple(m[f"kvrelay:kv_{k}_total"] for k in ("handshakes", "transfers",
                                                      "transfer_failures"))


def _free(prefill: Server, params: dict) -> None:
    httpx.post(f"{prefill.url}/v1/kv_transfer/free", timeout=30, json={
        "remote_request_id": params["remote_request_id"],
        "remote_capability": params["remote_capability"]})


def test_forged_kv_transfer_params_read_nothing(tiny, secured):
    """A client sends a decode server params naming the prefill: without the capability,
    with a guessed one, with another request's block ids, mixed from two signed params, or
    another prompt's: each is a 400 naming kv_transfer_params (the MAC, before anything is
    dialed). The victim's request still completes exactly afterwards. (Prompts the decode
    has not seen: a prefix-cache hit there would need no KV from the prefill.)"""
    _, prefill, decode, _ = secured
    victim_body = _body(13, seed=5)
    victim = _prefill_leg(prefill, victim_body).json()["kv_transfer_params"]
    mine = _prefill_leg(prefill, _body(9, seed=6)).json()["kv_transfer_params"]
    assert isinstance(victim["remote_mac"], str)
    started = _loads_started(decode)
    no_cap = {k: v for k, v in victim.items() if k != "remote_capability"}
    _refused_as_params(_decode_leg(decode, victim_body, no_cap), "remote_capability")
    for forged in (
        dict(victim, remote_capability="A" * 43),
        dict(mine, remote_block_ids=victim["remote_block_ids"]),      # another's block ids
        dict(victim, remote_capability=mine["remote_capability"]),    # a mix of two
        dict(victim, remote_request_id=mine["remote_request_id"]),
        {k: v for k, v in victim.items() if k != "remote_mac"},
    ):
        _refused_as_params(_decode_leg(decode, victim_body, forged), "remote_mac")
    # the victim's own signed params for another prompt (its KV would be cached under that
    # prompt's hashes): refused the same way
    replay_body = dict(victim_body, prompt=victim_body["prompt"][:1] + [7] * 12)
    _refused_as_params(_decode_leg(decode, replay_body, victim), "another prompt")
    assert _loads_started(decode) == started        # refused before anything was dialed
    d = _decode_leg(decode, victim_body, victim)
    assert d.status_code == 200, d.text
    assert greedy_mismatch(tiny[1], victim_body["prompt"], _ids(d.json())) is None
    _free(prefill, mine)
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_claims_the_prefill_refuses_are_400_not_502(secured):
    """Signed params whose capability was claimed already (a replay, or another server of
    the topology read them first): the prefill refuses the claim, nothing is read, and the
    decode answers 400 naming kv_transfer_params (a client's mistake), not 502."""
    _, prefill, decode, side = secured
    body = _body(9, seed=7)
    params = _prefill_leg(prefill, body).json()["kv_transfer_params"]
    claim = {"type": "claim", "request_id": params["remote_request_id"],
             "capability": params["remote_capability"]}
    assert side_channel_call(*side, claim, secret=SECRET.encode())["block_ids"] == \
        params["remote_block_ids"]
    r = _decode_leg(decode, body, params)
    _refused_as_params(r, "KV transfer refused")
    assert "claimed already" in r.json()["error"]["message"]
    _free(prefill, params)
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


class _Attacker:
    """A listener the attacker controls, that records every connection and relays it to
    `target` (the real prefill's side channel) frame by frame, optionally naming the real
    prefill in the hello. After the client's part it tries to use the upstream connection
    itself: `upstream` records what the prefill answered a handshake request there."""

    def __init__(self, target: tuple[str, int], rename: bool = False) -> None:
        self.target, self.rename = target, rename
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.connections = 0
        self.upstream: list[dict | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                continue
            self.connections += 1
            with client, socket.create_connection(self.target, timeout=10) as up:
                self._relay(client, up)

    def _relay(self, client: socket.socket, up: socket.socket) -> None:
        client.settimeout(10)
        try:
            while (msg := recv_frame(client)) is not None:
                if self.rename and msg.get("auth") == "hello":
                    msg = dict(msg, endpoint=list(self.target))
                send_frame(up, msg)
                reply = recv_frame(up)
                if reply is None:
                    break
                send_frame(client, reply)
        except OSError:
            pass
        try:                       # the attacker's own request on the relayed connection
            send_frame(up, {"type": "handshake", "version": 2, "engine_id": "x",
                            "tp_size": 1, "spec": {}})
            self.upstream.append(recv_frame(up))
        except OSError:
            self.upstream.append(None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.listener.close()


@pytest.fixture()
def attacker(secured):
    made: list[_Attacker] = []

    def make(rename: bool = False) -> _Attacker:
        made.append(_Attacker(secured[3], rename))
        return made[-1]

    yield make
    for a in made:
        a.close()


def test_a_relaying_attacker_gets_no_session_and_no_dial(tiny, secured, attacker):
    """Issue 26's attack end to end. (1) Params that point the decode at the attacker's
    listener — unsigned, or signed params with the host/port changed — are a 400 and the
    attacker sees no connection. (2) Even a client that does dial the attacker (as a
    decode did before) cannot be relayed into a session: the client refuses, and the
    relayed connection at the real prefill's side channel never authenticates."""
    _, prefill, decode, _ = secured
    body = _body(13, seed=8)
    signed = _prefill_leg(prefill, body).json()["kv_transfer_params"]
    for rename in (False, True):
        evil = attacker(rename)
        at = {"remote_host": evil.address[0], "remote_port": evil.address[1]}
        unsigned = {k: v for k, v in signed.items() if k != "remote_mac"}
        _refused_as_params(_decode_leg(decode, body, dict(unsigned, **at)), "remote_mac")
        _refused_as_params(_decode_leg(decode, body, dict(signed, **at)), "remote_mac")
        time.sleep(0.3)
        assert evil.connections == 0
        with socket.create_connection(evil.address, timeout=10) as s, \
                pytest.raises(AuthError, match=AUTH_FAILED):
            client_authenticate(s, SECRET.encode(), endpoint=evil.address,
                                identity="kv_consumer:victim")
        deadline = time.monotonic() + 10
        while not evil.upstream and time.monotonic() < deadline:
            time.sleep(0.05)
        assert evil.connections == 1
        assert evil.upstream in ([None], [{"ok": False, "error": AUTH_FAILED}]), evil.upstream
    # the honest request of that prompt still works and equals single instance
    d = _decode_leg(decode, body, signed)
    assert d.status_code == 200, d.text
    assert greedy_mismatch(tiny[1], body["prompt"], _ids(d.json())) is None


def test_cache_poisoning_is_refused_before_any_read(tiny, secured, attacker):
    """The attacker wants chosen KV stored in the decode's prefix cache under a real
    prompt's hashes: with its own signed params for another prompt of the same length,
    or through a fake prefill that relays to the real one. Both are a 400 before any
    read or dial; afterwards an honest request of that prompt equals single instance."""
    _, prefill, decode, _ = secured
    victim_body, own_body = _body(13, seed=9), _body(13, seed=10)
    own = _prefill_leg(prefill, own_body).json()["kv_transfer_params"]
    fake = attacker(rename=True)
    started = _loads_started(decode)
    _refused_as_params(_decode_leg(decode, victim_body, own), "another prompt")
    _refused_as_params(
        _decode_leg(decode, victim_body,
                    dict(own, remote_host=fake.address[0], remote_port=fake.address[1])),
        "remote_mac")
    assert fake.connections == 0
    assert _loads_started(decode) == started
    _free(prefill, own)
    _, d = prefill_then_decode(prefill, decode, victim_body, "after-poisoning")
    assert d.status_code == 200, d.text
    assert greedy_mismatch(tiny[1], victim_body["prompt"], _ids(d.json())) is None
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_forged_release_frees_nothing(secured):
    _, prefill, decode, side = secured
    params = _prefill_leg(prefill, _body(9, seed=2)).json()["kv_transfer_params"]
    held = prefill.metrics()["kvrelay:kv_blocks_used"]
    assert held > 0
    key = SECRET.encode()
    for cap in (None, "", "forged", params["remote_capability"][:-1] + "x"):
        with pytest.raises(SideChannelError, match="unknown request or wrong capability"):
            side_channel_call(
                *side,
                {"type": "release", "request_id": params["remote_request_id"], "capability": cap},
                secret=key,
            )
    with pytest.raises(SideChannelError, match=AUTH_FAILED):  # and strangers cannot even ask
        side_channel_call(
            *side,
            {
                "type": "release",
                "request_id": params["remote_request_id"],
                "capability": params["remote_capability"],
            },
        )
    time.sleep(0.5)
    assert prefill.metrics()["kvrelay:kv_blocks_used"] == held
    d = httpx.post(
        f"{decode.url}/v1/completions",
        timeout=60,
        json=dict(_body(9, seed=2), kv_transfer_params=params),
    )
    assert d.status_code == 200, d.text
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_free_over_http_needs_the_capability(secured):
    """POST /v1/kv_transfer/free (the proxy's notice) frees nothing without the request's
    remote_capability or with a wrong one, and answers an unknown id exactly like a
    wrong capability; the right capability frees the blocks."""
    _, prefill, _, _ = secured
    params = _prefill_leg(prefill, _body(9, seed=3)).json()["kv_transfer_params"]
    rid, cap = params["remote_request_id"], params["remote_capability"]
    held = prefill.metrics()["kvrelay:kv_blocks_used"]
    assert held > 0

    def free(body: dict) -> httpx.Response:
        return httpx.post(f"{prefill.url}/v1/kv_transfer/free", json=body, timeout=30)

    missing = free({"remote_request_id": rid})
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "remote_capability"
    answers = [free({"remote_request_id": r, "remote_capability": c})
               for r, c in ((rid, cap[:-1] + "x"), (rid, "forged"), ("no-such-request", cap))]
    assert {a.status_code for a in answers} == {404}
    assert len({a.text for a in answers}) == 1             # an unknown id looks the same
    assert set(answers[0].json()["error"]) == {"message", "type", "param", "code"}
    time.sleep(0.3)
    assert prefill.metrics()["kvrelay:kv_blocks_used"] == held
    right = free({"remote_request_id": rid, "remote_capability": cap})
    assert right.status_code == 200, right.text
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0
    assert free({"remote_request_id": rid, "remote_capability": cap}).status_code == 404


@pytest.mark.parametrize("secured", ["UCX"], indirect=True)
def test_the_proxy_frees_with_the_capability_and_passes_retry_after(secured, tmp_path):
    """kvrelay proxy's free notice (the decode refused the request) carries the prefill's
    remote_capability, so the blocks come back at once instead of after the 30 s lease;
    a prefill's 503 for a full hold share reaches the client with its Retry-After. One
    transport: the proxy only speaks HTTP to the servers, and the capability check on
    /v1/kv_transfer/free is test_free_over_http_needs_the_capability's, for both."""
    _, prefill, decode, _ = secured
    port = free_port()
    # a busy prefill (503) is retried for --prefill-busy-retry (10 s by default) before the
    # 503 is passed on: 0.2 s is enough to see it retried and passed on
    proxy = KvrelayProcess(["proxy", "--port", str(port), "--prefiller-host", "127.0.0.1",
                            "--prefiller-port", str(prefill.port), "--decoder-host", "127.0.0.1",
                            "--decoder-port", str(decode.port), "--prefill-busy-retry", "0.2"],
                           tmp_path / "proxy.log")
    url = f"http://127.0.0.1:{port}/v1/completions"
    held: list[dict] = []
    try:
        proxy.wait_for_line("Application startup complete")
        expired = prefill.metrics()["kvrelay:kv_leases_expired_total"]
        # max_tokens past the context: the prefill leg (max_tokens 1) holds, decode says 400
        r = httpx.post(url, timeout=60, json=dict(_body(9, seed=5), max_tokens=500))
        assert r.status_code == 400, r.text
        m = wait_metric(prefill, "kvrelay:kv_blocks_used", 0, timeout=10)
        assert m["kvrelay:kv_blocks_used"] == 0
        assert m["kvrelay:kv_leases_expired_total"] == expired
        for seed in range(40):                 # fill the hold share straight on the prefill
            r = _prefill_leg(prefill, _body(30, seed=seed + 60))
            if r.status_code != 200:
                break
            held.append(r.json()["kv_transfer_params"])
        r = httpx.post(url, timeout=60, json=_body(30, seed=99))
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "hold_share" in r.json()["error"]["message"]
    finally:
        proxy.stop()
        for p in held:
            httpx.post(f"{prefill.url}/v1/kv_transfer/free", timeout=30, json={
                "remote_request_id": p["remote_request_id"],
                "remote_capability": p["remote_capability"]})
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0


def test_connection_flood_keeps_memory_flat_and_handshakes_working(tiny, secured, reference):
    """200 connections each announce a frame just under 16 MiB (the old limit) and send two
    bytes: the prefill's engine process grows by < 40 MiB and a 1P1D request still works."""
    _, prefill, decode, side = secured
    owner = [
        pid
        for pid, addrs in listening(prefill).items()
        if any(a.endswith(f":{side[1]}") for a in addrs)
    ]
    assert len(owner) == 1
    before = rss_mib(owner[0])
    flood = []
    try:
        for _ in range(200):
            s = socket.create_connection(side, timeout=5)
            s.sendall(struct.pack(">I", 16 * 1024 * 1024 - 1) + b'{"')
            flood.append(s)
        time.sleep(1.0)
        grown = rss_mib(owner[0]) - before
        _, d = prefill_then_decode(prefill, decode, _body(3), "after-flood")
        assert d.status_code == 200, d.text
        assert (
            _ids(d.json()) == reference[3]
            or greedy_mismatch(tiny[1], _prompt(3), _ids(d.json())) is None
        )
    finally:
        for s in flood:
            s.close()
    assert grown < 40, f"engine RSS grew {grown:.0f} MiB"
    # an authenticated peer's channel still answers after the flood
    with socket.create_connection(side, timeout=5) as s:
        client_authenticate(s, SECRET.encode(), endpoint=side)


def test_ucx_listens_only_where_the_side_channel_does(secured):
    """On both sides (the decode dials out, but UCX would listen on every interface)."""
    kind, prefill, decode, _ = secured
    if kind != "UCX":
        pytest.skip("NIXL only")
    for server in (prefill, decode):
        addrs = [a for found in listening(server).values() for a in found]
        assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), addrs
        assert "NIXL/UCX: network transports restricted to lo" in server.log()


def test_direct_hold_flood_is_bounded(secured):
    """do_remote_decode requests sent straight to the prefill (no decode ever reads) hold
    at most hold_share of its pool; past it the request is a 503 with Retry-After and an
    OpenAI error body naming hold_share, and its blocks are freed at once; plain requests
    keep being served, and the holds come back when freed with their capabilities."""
    _, prefill, _, _ = secured
    held, refused = [], None
    for seed in range(40):
        r = _prefill_leg(prefill, _body(30, seed=seed + 10))
        if r.status_code != 200:
            refused = r
            break
        held.append(r.json()["kv_transfer_params"])
        assert prefill.metrics()["kvrelay:kv_blocks_used"] <= NUM_BLOCKS // 2
    assert refused is not None and held, "the hold share never applied"
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    err = refused.json()["error"]
    assert "hold_share" in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "ServiceUnavailableError"
    m = prefill.metrics()
    assert m["kvrelay:kv_blocks_used"] <= NUM_BLOCKS // 2
    assert m["kvrelay:kv_requests_held_for_remote"] == len(held)
    t0 = time.monotonic()
    plain = httpx.post(f"{prefill.url}/v1/completions", timeout=60, json=_body(30, seed=99))
    assert plain.status_code == 200 and time.monotonic() - t0 < 20
    for p in held:
        r = httpx.post(f"{prefill.url}/v1/kv_transfer/free", timeout=30, json={
            "remote_request_id": p["remote_request_id"],
            "remote_capability": p["remote_capability"]})
        assert r.status_code == 200, r.text
    assert wait_metric(prefill, "kvrelay:kv_blocks_used", 0)["kvrelay:kv_blocks_used"] == 0
