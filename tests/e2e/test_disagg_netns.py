"""1P1D across two "hosts": prefill and decode in separate network namespaces joined by
a veth pair, KV pulled with NIXL/UCX over TCP on the veth. The prefill's side channel
listens on 0.0.0.0 (as the tutorial sets it) and must advertise its veth address —
there is no default route to find it by — so the decode can dial it."""
from __future__ import annotations

import time

import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.disagg import COMMON, kv_config
from tests.e2e.netns import NetnsProcess, VethPair, http
from tests.factories import greedy_mismatch

PROMPTS = [[(11 * i + j) % 150 + 5 for i in range(n)] for j, n in enumerate([3, 9, 17, 30])]
MAX_TOKENS = 6
HTTP_PORT, SIDE_PORT = 8100, 5559           # fixed ports: each namespace has its own port space


@pytest.fixture(scope="module")
def hosts():
    why = VethPair.unavailable()
    if why:
        pytest.skip(f"network namespaces not usable: {why}")
    pair = VethPair()
    try:
        pair.up()
        yield pair
    finally:
        pair.down()


def _metrics(netns: str, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = http(netns, [{"method": "GET", "url": f"{url}/metrics"}])[0]["body"]
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _wait_ready(server: NetnsProcess, netns: str, url: str) -> None:
    server.wait_for_line("Application startup complete", timeout=180)
    assert http(netns, [{"method": "GET", "url": f"{url}/health"}])[0]["status"] == 200


def test_1p1d_across_namespaces_over_ucx(tiny, hosts, tmp_path):
    p, d = hosts.prefill, hosts.decode
    ucx = {"UCX_TLS": "tcp"}
    prefill = NetnsProcess(p.netns, ["serve", str(tiny[0]), "--host", "0.0.0.0", "--port",
                                     str(HTTP_PORT), *COMMON,
                                     "--kv-transfer-config", kv_config("kv_producer")],
                           tmp_path / "prefill.log",
                           env=ucx | {"UCX_NET_DEVICES": p.device,
                                      "VLLM_NIXL_SIDE_CHANNEL_HOST": "0.0.0.0",
                                      "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT),
                                      # one port in both namespaces: a responses store each
                                      "KVRELAY_STATE_DIR": str(tmp_path / "prefill-state")})
    decode = NetnsProcess(d.netns, ["serve", str(tiny[0]), "--port", str(HTTP_PORT), *COMMON,
                                    "--kv-transfer-config", kv_config("kv_consumer")],
                          tmp_path / "decode.log",
                          env=ucx | {"UCX_NET_DEVICES": d.device,
                                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_PORT),
                                     "KVRELAY_STATE_DIR": str(tmp_path / "decode-state")})
    prefill_url, decode_url = f"http://{p.address}:{HTTP_PORT}", f"http://127.0.0.1:{HTTP_PORT}"
    try:
        _wait_ready(prefill, d.netns, prefill_url)  # reached from the decode host, over the veth
        _wait_ready(decode, d.netns, decode_url)
        assert f"advertised {p.address}:{SIDE_PORT}" in prefill.log()
        llm = LLM(str(tiny[0]), dtype="float32", max_model_len=96, block_size=4)
        want = llm.generate(PROMPTS,
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        calls = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            calls.append({"method": "POST", "url": f"{prefill_url}/v1/completions",
                          "json": dict(body, max_tokens=1,
                                       kv_transfer_params={"do_remote_decode": True})})
            calls.append({"method": "POST", "url": f"{decode_url}/v1/completions",
                          "json": dict(body, **{"$prefill_params": True})})
        answers = http(d.netns, calls)
        for i, (prompt, w) in enumerate(zip(PROMPTS, want)):
            first, second = answers[2 * i], answers[2 * i + 1]
            assert first["status"] == 200 and second["status"] == 200, (first, second)
            assert first["body"]["kv_transfer_params"]["remote_host"] == p.address
            text = second["body"]["choices"][0]["text"]
            if text != w.outputs[0].text:
                ids = [int(t.removeprefix("w")) for t in text.split()]
                assert greedy_mismatch(tiny[1], prompt, ids) is None
        m = _metrics(d.netns, decode_url)
        assert m["kvrelay:kv_transfers_total"] == len(PROMPTS)
        assert m["kvrelay:kv_transfer_failures_total"] == 0
        assert m["kvrelay:kv_transfer_bytes_total"] > 0 and m["kvrelay:kv_transport_fallback"] == 0
        deadline = time.monotonic() + 20
        while ((m := _metrics(d.netns, prefill_url))["kvrelay:kv_blocks_used"]
               and time.monotonic() < deadline):
            time.sleep(0.3)
        assert m["kvrelay:kv_blocks_used"] == 0
        assert m["kvrelay:kv_read_done_notices_total"] == len(PROMPTS)
    finally:
        prefill.stop()
        decode.stop()
