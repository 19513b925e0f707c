"""Harmony chat through a live server on an o200k-vocab tiny gpt-oss checkpoint: the
engine is forced (logits-processor seam) to emit a scripted harmony answer, so
rendering, channel parsing, streaming and stop handling run through the real engine."""
from __future__ import annotations

import json

import openai
import pytest

from tests.factories import make_hf_model, save_checkpoint
from tests.harmony_factories import (
    GPT_OSS_VOCAB_SIZE,
    make_o200k_tokenizer_json,
    scripted_harmony_answer,
)
from tests.processes import Server

REASONING = "The user asks for a capital. France's is Paris."
FINAL = "Paris is the capital of France."


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("o200k-tiny")
    save_checkpoint(make_hf_model(seed=3, vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=32, head_dim=8,
                                  intermediate_size=64, num_local_experts=2), path)
    make_o200k_tokenizer_json(path)
    script = scripted_harmony_answer(REASONING, FINAL)
    s = Server(str(path), ["--dtype", "float32", "--max-model-len", "512", "--served-model-name",
                           "gpt-oss-tiny",
                           "--logits-processors", "tests.server.scripted:force_script"],
               path / "serve.log", env={"KVRELAY_TEST_SCRIPT": json.dumps(script)})
    try:
        s.wait_ready()
        yield s, script
    finally:
        s.stop()


def test_prompt_is_harmony_rendering(harmony_server):
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        HarmonyEncodingName,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        load_harmony_encoding,
    )
    server, _ = harmony_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="gpt-oss-tiny", reasoning_effort="low", messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Capital of France?"}])
    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    conv = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM,
                                      SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(Role.DEVELOPER,
                                      DeveloperContent.new().with_instructions("Answer briefly.")),
        Message.from_role_and_content(Role.USER, "Capital of France?")])
    assert out.usage.prompt_tokens == len(enc.render_conversation_for_completion(conv,
                                                                                 Role.ASSISTANT))


def test_channels_split_into_reasoning_and_content(harmony_server):
    server, script = harmony_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model="gpt-oss-tiny",
                                         messages=[{"role": "user", "content": "Capital?"}])
    choice = out.choices[0]
    assert choice.message.content == FINAL
    extra = choice.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == REASONING
    assert choice.finish_reason == "stop" and choice.stop_reason == 200002   # <|return|>
    assert out.usage.completion_tokens == len(script)


def test_streamed_channel_by_channel(harmony_server):
    server, _ = harmony_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Capital?"}]
    chunks = list(client.chat.completions.create(model="gpt-oss-tiny", stream=True,
                                                 messages=messages))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (REASONING, FINAL)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    last_reasoning = max(i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning"))
    assert last_reasoning < first_content                     # analysis streams before final
    assert chunks[-1].choices[0].finish_reason == "stop"
