"""The one codec of the engine's messages (`engine/messages.py`): msgpack, by msgspec.

    encode(message) ──▶ bytes ──▶ a decoder typed with what may arrive there
                                  TO_ENGINE (the core's end of its pipe, a headless relay)
                                  FROM_ENGINE (the API's end; the head, from a node)
                                  HANDSHAKE (a node's first frame and the head's answer)

One encoder and these decoders serve both hops: the `multiprocessing` pipe between the
API process and an engine core (`MessagePipe` at the core's end; the API reads its end
itself, `AsyncEngine`), and the TCP link to a headless node (`engine/dp_link.py`).
A message of the wrong direction, or bytes that are no message, raise `CodecError`.

Only plain data crosses: no tensor, array or callable reaches these messages (the
sampler's logprobs are Python floats). The encoder refuses anything else by name —
a per-request logits processor (a callable in `SamplingParams`) stays in its process.
`SamplingParams` itself, a dataclass whose callables msgspec cannot type, travels as the
map of its fields and is built again on arrival (`ParamsOnWire`).
"""
from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

import msgspec

from kvrelay.engine.messages import FromEngine, Handshake, ParamsOnWire, ToEngine
from kvrelay.sampling_params import SamplingParams

M = TypeVar("M")


class CodecError(ValueError):
    """Bytes that are no engine message of the kind expected there."""


def _enc_hook(obj: Any) -> Any:
    if callable(obj):
        raise ValueError("per-request logits processors cannot leave their process (the "
                         "engine core or a replica on another node); use --logits-processors")
    raise TypeError(f"{type(obj).__name__} is not part of any engine message")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is ParamsOnWire and isinstance(obj, dict):
        return SamplingParams(**obj)
    raise TypeError(f"cannot decode {kind.__name__} from {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Any) -> bytes:
    """A message (or a tuple of a replica rank and a message) → msgpack bytes."""
    return _ENCODER.encode(message)


class Decoder(Generic[M]):
    """Bytes → a message of the union `kind`; CodecError otherwise."""

    def __init__(self, kind: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)

    def decode(self, data: bytes | bytearray | memoryview) -> M:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            raise CodecError(f"malformed engine message: {e}") from None


TO_ENGINE: Decoder[ToEngine] = Decoder(ToEngine)
FROM_ENGINE: Decoder[FromEngine] = Decoder(FromEngine)
HANDSHAKE: Decoder[Handshake] = Decoder(Handshake)


class MessagePipe(Generic[M]):
    """One end of a `multiprocessing` pipe that carries engine messages in the codec:
    `send` encodes, `recv` decodes what `incoming` says may arrive here."""

    def __init__(self, conn: Connection, incoming: Decoder[M]) -> None:
        self.conn, self.incoming = conn, incoming

    def send(self, message: Any) -> None:
        self.conn.send_bytes(encode(message))

    def recv(self) -> M:
        """The next message (blocks); EOFError when the other end closed."""
        return self.incoming.decode(self.conn.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
