"""--kv-events-config and vLLM's wire format: the config's fields and defaults, the encoder
against bytes written out by hand from the MessagePack spec, and the tolerant decoder."""
from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvrelay.kv_cache.events import Cleared, Removed, Stored
from kvrelay.kv_events.config import KVEventsConfig, offset_endpoint
from kvrelay.kv_events.wire import (
    GroupSpec,
    WireCleared,
    WireError,
    WireFormat,
    WireRemoved,
    WireStored,
    decode_batch,
    external_hash,
)

# a 32-byte block hash whose last 8 bytes are 01..08: its int form is 0x0102030405060708
H = bytes(24) + bytes(range(1, 9))


def s(text: str) -> str:
    """A msgpack fixstr (up to 31 bytes): 0xa0 | length, then the UTF-8 bytes."""
    return f"{0xa0 | len(text):02x}" + text.encode().hex()


# -- the config ---------------------------------------------------------------------------------
def test_defaults_are_vllms_but_the_endpoint_binds_loopback():
    """vLLM's defaults, but for the endpoint: unset, it binds 127.0.0.1:5557 (vLLM: every
    interface); written out, vLLM's bind/connect rule holds unless `bind` says otherwise."""
    c = KVEventsConfig()
    assert (c.enable_kv_cache_events, c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps,
            c.hwm, c.max_queue_size, c.topic) == (False, "null", None, None, 10_000,
                                                  100_000, 100_000, "")
    assert (c.pub_endpoint, c.pub_binds) == ("tcp://127.0.0.1:5557", True)
    on = KVEventsConfig.from_json({"enable_kv_cache_events": True})
    assert on.exposed() == []
    wild = KVEventsConfig.from_json({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557",
                                     "replay_endpoint": "tcp://0.0.0.0:5558"})
    assert wild.pub_binds and wild.exposed() == ["tcp://*:5557", "tcp://0.0.0.0:5558"]
    named = {"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.5:5557"}
    assert not KVEventsConfig.from_json(named).pub_binds                  # vLLM: connects
    assert KVEventsConfig.from_json(named | {"bind": True}).pub_binds
    assert KVEventsConfig.from_json(named).exposed() == ["tcp://10.0.0.5:5557"]
    local = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:6000", "bind": True,
             "replay_endpoint": "tcp://localhost:6001"}
    assert KVEventsConfig.from_json(local).exposed() == []
    assert KVEventsConfig.from_json(None) is None
    on = KVEventsConfig.from_json({"enable_kv_cache_events": True})
    assert on.publisher == "zmq" and on.active                  # vLLM: unset publisher → zmq
    assert not KVEventsConfig.from_json({"enable_kv_cache_events": True,
                                         "publisher": "null"}).active
    assert not KVEventsConfig.from_json({"publisher": "zmq"}).active      # not enabled
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"


@pytest.mark.parametrize("raw, message", [
    ({"enable_kv_cache_events": True, "endpont": "x"}, "unknown key 'endpont'"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be bool"),
    ({"buffer_steps": True}, "buffer_steps must be int"),
    ({"publisher": "kafka"}, "publisher 'kafka' is not one of null, zmq"),
    ({"endpoint": "http://x:1"}, "must start with tcp://"),
    ({"endpoint": "tcp://host"}, "is not tcp://HOST:PORT"),
    ({"replay_endpoint": "tcp://h:70000"}, "is not tcp://HOST:PORT"),
    ({"max_queue_size": 0}, "max_queue_size must be ≥ 1"),
    ({"hwm": -1}, "must be ≥ 0"),
    ({"bind": True}, "bind needs an endpoint"),
    ({"auth": "password"}, "auth 'password' is not one of kv_secret"),
    ({"secret_file": "/x"}, "secret_file is read only with"),
    ({"enable_kv_cache_events": True, "auth": "kv_secret", "secret_file": "/nonexistent/k"},
     "cannot read the secret file '/nonexistent/k'"),
])
def test_bad_configs_name_the_flag_and_key(raw, message):
    with pytest.raises(ValueError, match="--kv-events-config") as e:
        KVEventsConfig.from_json(raw)
    assert message in str(e.value)


def test_kv_secret_auth_needs_the_secret(monkeypatch, tmp_path):
    monkeypatch.delenv("KVRELAY_KV_SECRET", raising=False)
    raw = {"enable_kv_cache_events": True, "auth": "kv_secret"}
    with pytest.raises(ValueError, match="needs the KV secret: set KVRELAY_KV_SECRET"):
        KVEventsConfig.from_json(raw)
    (tmp_path / "k").write_text("s3cret\n")
    assert KVEventsConfig.from_json(raw | {"secret_file": str(tmp_path / "k")}).auth
    monkeypatch.setenv("KVRELAY_KV_SECRET", "from-env")
    assert KVEventsConfig.from_json(raw).auth == "kv_secret"


def test_data_parallel_ranks_offset_the_ports_as_vllm():
    c = KVEventsConfig.from_json({"enable_kv_cache_events": True,
                                  "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5657"})
    assert c.for_rank(0) == c
    assert (c.for_rank(3).endpoint, c.for_rank(3).replay_endpoint) == ("tcp://*:5560",
                                                                        "tcp://*:5660")
    default = KVEventsConfig.from_json({"enable_kv_cache_events": True}).for_rank(2)
    assert (default.pub_endpoint, default.pub_binds) == ("tcp://127.0.0.1:5559", True)
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"          # the OS picks: unchanged
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint(None, 1) is None


# -- encoding -------------------------------------------------------------------------------------
def test_hashes_are_the_digests_last_8_bytes_big_endian():
    assert external_hash(H) == 0x0102030405060708
    assert external_hash(H, as_int=False) == H
    for i in range(50):                                            # vLLM: int(bytes) & (2^64 - 1)
        d = hashlib.sha256(bytes([i])).digest()
        assert external_hash(d) == int.from_bytes(d, "big") & ((1 << 64) - 1)


def test_a_batch_encodes_to_the_bytes_of_the_spec():
    wire = WireFormat(2, [GroupSpec.of_window(None), GroupSpec.of_window(8)])
    got = wire.encode(1.5, [Stored(0, [H], None, [1, 2]), Stored(1, [H], H, [1, 2]),
                            Removed(0, H), Cleared()], data_parallel_rank=0)
    u64 = "cf0102030405060708"          # uint 64: 0xcf + 8 bytes big-endian
    stored_common = (s("block_size") + "02" + s("lora_id") + "c0" + s("medium") + s("GPU")
                     + s("lora_name") + "c0" + s("extra_keys") + "91c0")
    want = (
        "93"                                     # the batch: fixarray of 3 (array_like struct)
        "cb3ff8000000000000"                     # ts: float 64, 1.5
        "94"                                     # 4 events
        # BlockStored: 11 entries under a map 16 header (de 000b): msgspec sizes the header for
        # the struct's 16 possible entries, then writes the count of those not omitted
        "de000b" + s("type") + s("BlockStored")
        + s("block_hashes") + "91" + u64 + s("parent_block_hash") + "c0"
        + s("token_ids") + "920102" + stored_common
        + s("group_idx") + "00" + s("kv_cache_spec_kind") + s("full_attention")
        # the sliding-window group's: its parent, group 1 and the window (12 entries)
        + "de000c" + s("type") + s("BlockStored")
        + s("block_hashes") + "91" + u64 + s("parent_block_hash") + u64
        + s("token_ids") + "920102" + stored_common
        + s("group_idx") + "01" + s("kv_cache_spec_kind") + s("sliding_window")
        + "bc" + b"kv_cache_spec_sliding_window".hex() + "08"
        # BlockRemoved: fixmap of 4 (of at most 6 entries)
        + "84" + s("type") + s("BlockRemoved") + s("block_hashes") + "91" + u64
        + s("medium") + s("GPU") + s("group_idx") + "00"
        # AllBlocksCleared: fixmap of 1, the tag alone
        + "81" + s("type") + "b0" + b"AllBlocksCleared".hex()
        + "00"                                   # data_parallel_rank 0
    )
    assert got.hex() == want


def test_the_positional_encoding_of_vllm_0_23_and_byte_hashes():
    wire = WireFormat(2, [GroupSpec.of_window(None)], int_hashes=False, encoding="array")
    got = wire.encode(0.0, [Stored(0, [H], None, [7, 8]), Removed(0, H), Cleared()], 2)
    b32 = "c420" + H.hex()                        # bin 8, 32 bytes
    want = ("93" "cb0000000000000000" "93"
            # ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name,
            #  extra_keys, group_idx, kind, window]: every field, defaults included
            "9c" + s("BlockStored") + "91" + b32 + "c0" + "920708" + "02" + "c0" + s("GPU")
            + "c0" + "91c0" + "00" + s("full_attention") + "c0"
            + "94" + s("BlockRemoved") + "91" + b32 + s("GPU") + "00"
            + "91" + "b0" + b"AllBlocksCleared".hex()
            + "02")
    assert got.hex() == want


# -- decoding ---------------------------------------------------------------------------------
def test_the_decoder_reads_both_encodings_and_unknown_fields():
    for encoding in ("map", "array"):
        for int_hashes in (True, False):
            wire = WireFormat(2, [GroupSpec.of_window(None)], int_hashes, encoding)
            batch = decode_batch(wire.encode(3.0, [Stored(0, [H], None, [1, 2]),
                                                   Removed(0, H), Cleared()], 1))
            h = external_hash(H, int_hashes)
            assert batch.ts == 3.0 and batch.data_parallel_rank == 1
            assert batch.events == [WireStored([h], None, [1, 2], 2, "GPU", 0),
                                    WireRemoved([h], "GPU", 0), WireCleared()]
    # vLLM 0.10's 7-field BlockStored, an event with fields from the future, an unknown event
    payload = msgspec.msgpack.encode([1.0, [
        ["BlockStored", [5], 4, [1, 2], 2, None, "GPU"],
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "locality": "LOCAL",
         "invented_later": {"x": 1}},
        {"type": "BlockMoved", "block_hashes": [5]}]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [WireStored([5], 4, [1, 2], 2, "GPU", None),
                            WireRemoved([5], "CPU", None)]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode([1.0]),
                                     msgspec.msgpack.encode([1.0, [[1, 2]]]),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])])
def test_malformed_batches_are_wire_errors(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


def test_the_serve_flag_reaches_the_engine_args_and_is_checked_before_the_model(tmp_path,
                                                                             serve_config):
    import json

    from tests.factories import TINY
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"} | TINY))
    raw = '{"enable_kv_cache_events": true, "topic": "kv@pod@m"}'
    engine_args = serve_config(str(tmp_path), "--kv-events-config", raw).engine
    assert engine_args.kv_events_config == {"enable_kv_cache_events": True, "topic": "kv@pod@m"}
    with pytest.raises(ValueError, match="--kv-events-config: unknown key 'topc'"):
        serve_config(str(tmp_path), "--kv-events-config",
                     '{"enable_kv_cache_events": true, "topc": "x"}')
