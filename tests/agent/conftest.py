from __future__ import annotations

import json

import pytest

from tests.factories import make_hf_model, save_checkpoint
from tests.harmony_factories import (
    GPT_OSS_VOCAB_SIZE,
    make_o200k_tokenizer_json,
    scripted_harmony_answer,
    scripted_tool_call,
)
from tests.processes import Server

MODEL = "gpt-oss-tiny"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}
CALL_ARGS = '{"city":"Paris"}'
REASONING, ANSWER = "I should check the weather tool.", "It is sunny in Paris."
AGENT_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "openai",
               "--reasoning-parser", "openai_gptoss"]


def agent_scripts() -> dict[str, list[int]]:
    return {"call": scripted_tool_call("get_weather", CALL_ARGS, reasoning=REASONING),
            "answer": scripted_harmony_answer("The tool said sunny.", ANSWER)}


@pytest.fixture(scope="session")
def o200k_checkpoint(tmp_path_factory):
    """A tiny random gpt-oss checkpoint with gpt-oss's o200k harmony tokenizer."""
    path = tmp_path_factory.mktemp("agent-o200k-tiny")
    save_checkpoint(make_hf_model(seed=5, vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=32,
                                  head_dim=8, intermediate_size=64, num_local_experts=2,
                                  num_hidden_layers=2), path)
    make_o200k_tokenizer_json(path)
    return path


@pytest.fixture(scope="module")
def agent_server(o200k_checkpoint, tmp_path_factory):
    """`kvrelay serve` with vLLM's tool flags; the engine is scripted (tests/agent/scripted.py):
    a tool call while no tool result is in the prompt, then a final answer."""
    s = Server(str(o200k_checkpoint),
               ["--dtype", "float32", "--max-model-len", "1024", "--served-model-name", MODEL,
                *AGENT_FLAGS, "--logits-processors", "tests.agent.scripted:agent_script"],
               tmp_path_factory.mktemp("agent-server") / "serve.log",
               env={"KVRELAY_AGENT_SCRIPTS": json.dumps(agent_scripts())})
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
