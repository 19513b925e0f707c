"""KV cache events for external routers (`kvrelay serve --kv-events-config`), as vLLM has them.

    config.py     KVEventsConfig: the flag's JSON (vLLM's fields and defaults), checked
    wire.py       vLLM's wire format: msgpack batches of BlockStored / BlockRemoved /
                  AllBlocksCleared (msgspec), the ZMQ framing constants, a tolerant decoder
    publisher.py  the engine-core side: a thread with a bounded queue, the PUB socket, the
                  replay buffer and its ROUTER socket (pyzmq, imported when enabled)
    curve.py      `"auth": "kv_secret"`: CURVE keys derived from the KV secret, the key check
                  (an unset endpoint binds loopback: config.py)

The prefix cache records its changes (kv_cache/events.py); `LLMEngine` hands them over once
per step. Subscribers: `kvrelay/proxy/kv_events.py` (`kvrelay proxy --kv-events-port`);
docs/serving.md, "KV cache events"; who may subscribe: docs/security.md.
Nothing here imports torch, and pyzmq is imported only when a publisher or subscriber is made.
"""
