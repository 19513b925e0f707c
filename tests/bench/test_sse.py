"""SSE parsing of streamed chunks, however the bytes are split."""
from __future__ import annotations

import json

import pytest

from kvrelay.bench.client import chunk_text
from kvrelay.bench.sse import SSEParser

STREAM = ('data: {"choices":[{"text":"a"}]}\n\n'
          ': keep-alive comment\n\n'
          'data: {"choices":[{"text":"b"}]}\r\n\r\n'
          'event: message\nid: 3\ndata: {"x":\ndata: 1}\n\n'
          'data:[DONE]\n\n')
EXPECTED = ['{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b"}]}', '{"x":\n1}', "[DONE]"]


def test_whole_stream():
    assert SSEParser().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 13])
def test_any_split_gives_the_same_events(size):
    p = SSEParser()
    events = []
    for i in range(0, len(STREAM), size):
        events += p.feed(STREAM[i:i + size])
    assert events == EXPECTED


def test_cr_only_line_endings_and_a_missing_final_blank_line():
    p = SSEParser()
    assert p.feed("data: 1\r\rdata: 2\r") == ["1"]
    assert p.flush() == ["2"]
    assert p.flush() == []


def test_chunk_text_reads_completions_and_chat_deltas():
    assert chunk_text({"choices": [{"index": 0, "text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "x"}}]}) == "x"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    both = {"choices": [{"delta": {"reasoning": "think", "reasoning_content": "think"}}]}
    assert chunk_text(both) == "think"                          # one text under two names
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "r"}}]}) == "r"
    assert chunk_text(json.loads('{"choices":[],"usage":{"completion_tokens":3}}')) == ""
