"""The link between a data-parallel head and its headless nodes: frames, the layout both
sides must agree on, and the check of a node's Hello.

A frame is a 4-byte big-endian length, then that many bytes of msgpack in the engine's
one codec (`engine/codec.py`; never pickle over the network): an array
`[replica rank | None, message]`, the message one of `engine/messages.py`. The
handshake's frames carry no rank:

    node → head   Hello(version 3, Layout(data_parallel_size, tensor_parallel_size,
                        enable_expert_parallel, model_config hash), start_rank, local_size)
    head → node   Welcome(master_port | None) or Reject(error)

then the head sends each replica's `ToEngine` messages and the node its replicas'
`FromEngine` ones, each frame decoded straight into the direction's union (a message
that does not belong there is a `CodecError`).
"""
from __future__ import annotations

import hashlib
import socket
import struct

from kvrelay.config import EngineArgs
from kvrelay.engine import codec
from kvrelay.engine.codec import Decoder
from kvrelay.engine.messages import FromEngine, Handshake, Hello, Layout, Message, ToEngine
from kvrelay.framing import OversizedFrame, recv_exact
from kvrelay.model.locate import resolve_model_dir

VERSION = 3           # 3: msgpack frames of the codec (2: JSON frames)
MAX_FRAME = 64 << 20
_HEADER = struct.Struct(">I")

_TO_NODE: Decoder[tuple[int, ToEngine]] = Decoder(tuple[int, ToEngine])
_FROM_NODE: Decoder[tuple[int, FromEngine]] = Decoder(tuple[int, FromEngine])
_HANDSHAKE: Decoder[tuple[None, Handshake]] = Decoder(tuple[None, Handshake])
_ANY: Decoder[tuple[int | None, Message]] = Decoder(tuple[int | None, Message])


def encode(message: Message, replica: int | None = None) -> bytes:
    """A frame's body: `message` for `replica` (None: a handshake message)."""
    return codec.encode((replica, message))


def send_message(sock: socket.socket, body: bytes) -> None:
    if len(body) > MAX_FRAME:
        raise OversizedFrame(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte "
                             f"frame limit")
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> bytes:
    """One frame's body; ConnectionError when the peer closed the link."""
    head = recv_exact(sock, _HEADER.size)
    if head is None:
        raise ConnectionError("connection closed")
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME:
        raise OversizedFrame(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    body = recv_exact(sock, n) if n else b""
    if body is None:
        raise ConnectionError("connection closed inside a frame")
    return body


def to_node(body: bytes) -> tuple[int, ToEngine]:
    """A frame from the head: (replica, message for it); CodecError otherwise."""
    return _TO_NODE.decode(body)


def from_node(body: bytes) -> tuple[int, FromEngine]:
    """A frame from a headless node: (replica, its message); CodecError otherwise."""
    return _FROM_NODE.decode(body)


def handshake(body: bytes) -> Handshake:
    return _HANDSHAKE.decode(body)[1]


def decode(body: bytes) -> Message:
    """Any frame's message, whichever direction (tests, tools)."""
    return _ANY.decode(body)[1]


# -- the layout both sides must agree on -------------------------------------------------------
def layout_of(args: EngineArgs) -> Layout:
    raw = (resolve_model_dir(args.model, args.download_dir) / "config.json").read_bytes()
    return Layout(data_parallel_size=args.data_parallel_size,
                  tensor_parallel_size=args.tensor_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel,
                  model_config=hashlib.sha256(raw).hexdigest()[:16])


_FLAGS = {"data_parallel_size": "--data-parallel-size",
          "tensor_parallel_size": "--tensor-parallel-size",
          "enable_expert_parallel": "--enable-expert-parallel",
          "model_config": "the model's config.json"}


def check_hello(hello: Handshake, mine: Layout, claimed: set[int], head_local: int) -> list[int]:
    """The replica ranks a headless node may run, or ValueError naming the mismatch."""
    if not isinstance(hello, Hello) or hello.version != VERSION:
        version = hello.version if isinstance(hello, Hello) else None
        raise ValueError(f"expected a version {VERSION} hello, got {hello.tag!r} "
                         f"version {version!r}")
    for key, flag in _FLAGS.items():
        ours, theirs = getattr(mine, key), getattr(hello.layout, key)
        if theirs != ours:
            raise ValueError(f"{flag} differs: the head has {ours}, the headless node {theirs}")
    start, local = hello.start_rank, hello.local_size
    ranks = list(range(start, start + local))
    dp = mine.data_parallel_size
    if not ranks or start < head_local or start + local > dp:
        raise ValueError(f"replica ranks [{start}, {start + local}) are not in "
                         f"[{head_local}, {dp}) (the head runs ranks [0, {head_local}) of "
                         f"--data-parallel-size {dp})")
    taken = sorted(claimed & set(ranks))
    if taken:
        raise ValueError(f"replica rank {taken[0]} is already run by another headless node")
    return ranks
