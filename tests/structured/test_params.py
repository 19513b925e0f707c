"""StructuredOutputsParams: validation, JSON round trips (incl. the head ⇄ headless wire)."""
from __future__ import annotations

import socket

import pytest

from kvrelay.engine.dp_link import decode, encode, recv_message, send_message
from kvrelay.engine.messages import AddRequest
from kvrelay.sampling_params import SamplingParams
from kvrelay.structured.params import FunctionSpec, StructuredOutputsParams, ToolCallConstraint


def test_one_format_at_most():
    with pytest.raises(ValueError, match="only one of"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="need one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="cannot be combined"):
        StructuredOutputsParams(regex="a", tool_call=ToolCallConstraint((FunctionSpec("f"),)))
    with pytest.raises(ValueError, match="duplicate"):
        ToolCallConstraint((FunctionSpec("f"), FunctionSpec("f")))
    p = StructuredOutputsParams(regex="a",
                                tool_call=ToolCallConstraint((FunctionSpec("f"),), False))
    assert p.formats() == ["regex"]


def test_headless_wire_round_trips_the_constraint():
    tools = ToolCallConstraint((FunctionSpec("get", {"type": "object"}),))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        tool_call=tools, harmony=True, analysis_budget=7))
    a, b = socket.socketpair()
    with a, b:
        send_message(a, encode(AddRequest("r1", [1, 2], params, None), 0))
        got = decode(recv_message(b)).params
    assert got == params and got.structured_outputs.tool_call.functions[0].name == "get"
