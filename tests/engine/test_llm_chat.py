"""`LLM.chat()` (vLLM's offline chat): a conversation is rendered with the checkpoint's chat
template, as `/v1/chat/completions` renders it, and generates exactly what `generate` does
on the rendered prompt's token ids. The tiny checkpoint's template (tests/factories.py):
`w1 CONTENT w2` per message, then `w4` for the assistant's turn."""
from __future__ import annotations

import pytest

from kvrelay.sampling_params import SamplingParams
from kvrelay.server.chat_types import Rendered

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_chat_is_generate_on_the_rendered_prompt(make_llm):
    llm = make_llm()
    messages = [{"role": "user", "content": "w7 w8"}]
    chat = llm.chat(messages, GREEDY)
    assert len(chat) == 1
    # the template's tokens, written out: w1 w7 w8 w2, then the generation prompt w4
    assert chat[0].prompt_token_ids == [1, 7, 8, 2, 4]
    plain = llm.generate({"prompt_token_ids": [1, 7, 8, 2, 4]}, GREEDY)[0]
    assert chat[0].outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat[0].outputs[0].text == plain.outputs[0].text
    assert len(chat[0].outputs[0].token_ids) == 8


def test_several_conversations_come_back_in_order(make_llm):
    llm = make_llm()
    first = [{"role": "user", "content": "w7 w8"}]
    second = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w10"},
              {"role": "assistant", "content": "w11"}, {"role": "user", "content": "w12"}]
    both = llm.chat([first, second], GREEDY)
    assert [o.prompt_token_ids for o in both] == [
        [1, 7, 8, 2, 4], [1, 9, 2, 1, 10, 2, 1, 11, 2, 1, 12, 2, 4]]
    alone = [llm.chat(c, GREEDY)[0] for c in (first, second)]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in alone]


def test_chat_template_and_generation_prompt(make_llm):
    llm = make_llm()
    messages = [{"role": "user", "content": "w7"}]
    out = llm.chat(messages, GREEDY, add_generation_prompt=False)
    assert out[0].prompt_token_ids == [1, 7, 2]
    custom = "{% for m in messages %}w5 {{ m['content'] }} {% endfor %}w6"
    out = llm.chat(messages, GREEDY, chat_template=custom)
    assert out[0].prompt_token_ids == [5, 7, 6]
    assert llm.get_tokenizer().chat_template != custom       # the checkpoint's is kept


def test_bad_input_is_a_value_error_naming_it(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="chat_template_kwargs: 'enable_thinking'"):
        llm.chat([{"role": "user", "content": "w7"}], chat_template_kwargs={
            "enable_thinking": True})
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"content": "w7"}])                          # no role
    with pytest.raises(ValueError, match="messages"):
        llm.chat([])
    with pytest.raises(ValueError, match="2 conversations but 1 sampling params"):
        llm.chat([[{"role": "user", "content": "w7"}]] * 2, [GREEDY])


def test_harmony_stop_ids_are_added_to_a_copy_of_the_params():
    from kvrelay.llm import _with_chat_stops
    params = SamplingParams(temperature=0, stop_token_ids=[7])
    rendered = Rendered([1, 2, 3], stop_token_ids=[200002, 200012, 7])
    merged = _with_chat_stops(params, rendered)
    assert merged.stop_token_ids == [7, 200002, 200012]
    assert params.stop_token_ids == [7] and merged.temperature == 0
    assert _with_chat_stops(params, Rendered([1])) is params
