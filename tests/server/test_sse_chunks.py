"""Streamed /v1/completions chunks come from a template serialised once per response: byte
for byte what serialising each chunk's whole dict gives (the encoding they replace)."""

from __future__ import annotations

import json

import pytest

from kvrelay.server.serving import CompletionChunks, _sse


def _reference(base_id: str, created: int, model: str, index: int, text: str, lp, finish,
               stop) -> str:
    payload = {"id": base_id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": index, "text": text, "logprobs": lp,
                            "finish_reason": finish, "stop_reason": stop}]}
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@pytest.mark.parametrize("index,text,lp,finish,stop", [
    (0, " the", None, None, None),
    (7, "", None, "length", None),
    (1, 'é "quoted"\n\t\\ \u2028 \x00 😀', None, "stop", "</s>"),
    (2, "\ud800", None, "stop", 128001),                 # a lone surrogate, as json keeps it
    (0, " a", {"tokens": [" a"], "token_logprobs": [-0.25], "top_logprobs": [{" a": -0.25}],
               "text_offset": [0]}, None, None),
])
def test_chunk_bytes_equal_the_serialised_dict(index, text, lp, finish, stop):
    chunks = CompletionChunks('cmpl-"odd\\id"', 1796170194, "módel/ü")
    got = chunks.chunk(index, text, lp, finish, stop)
    assert got == _reference('cmpl-"odd\\id"', 1796170194, "módel/ü", index, text, lp, finish,
                             stop)
    payload = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": index, "text": text, "logprobs": lp,
                            "finish_reason": finish, "stop_reason": stop}]}
    assert _sse(payload) == _reference("x", 1, "m", index, text, lp, finish, stop)
    assert json.loads(got.removeprefix("data: "))["choices"][0]["text"] == text
