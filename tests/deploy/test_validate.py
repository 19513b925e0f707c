"""`kvrelay validate` against a scripted fake server: every check passes on a good server
and each fails, with the right reason, when one thing is broken."""
from __future__ import annotations

import pytest

from kvrelay.deploy.validate import ValidateOptions, main, run_checks
from kvrelay.deploy.validate_answers import (
    EMBEDDED_DIR_STEM,
    EMBEDDED_MODEL_NAME,
    TUTORIAL_PROMPT,
    implausible,
)
from tests.deploy.fakes import FakeServer, Script


@pytest.fixture()
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


def verdicts(fake: FakeServer, **options) -> dict[str, tuple[bool, str]]:
    results = run_checks(ValidateOptions(base_url=fake.url, timeout=10, **options))
    return {r.name: (r.ok, r.detail) for r in results}


def failed(v: dict[str, tuple[bool, str]]) -> dict[str, str]:
    return {name: detail for name, (ok, detail) in v.items() if not ok}


def test_every_check_passes_on_a_good_server(fake):
    v = verdicts(fake, expect_di=True)
    assert list(v) == ["health", "models", "completion", "chat", "traffic", "kv-transfer"]
    assert failed(v) == {}
    assert v["health"][1] == "HTTP 200 (0 prefill, 1 decode behind it)"
    assert v["completion"][1].startswith(
        "16 tokens, finish_reason length, prompt_tokens 6, plausible text: ' Paris")
    assert v["chat"][1].startswith("16 tokens, finish_reason length, plausible text: ' Paris")
    assert v["traffic"][1].startswith("16/16 ok (8 streamed)")
    # completion + chat + 16 traffic requests, each one KV pull in the fake
    assert v["kv-transfer"][1].startswith("1 decode server(s) pulled KV 18 times")


def test_main_prints_one_line_per_check_and_exits_0(fake, capsys):
    assert main(["--base-url", fake.url, "--num-requests", "4", "--expect-di"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "PASS health", "PASS models", "PASS completion", "PASS chat", "PASS traffic",
        "PASS kv-transfer", "PASS"]
    assert lines[-1] == f"PASS: 6/6 checks passed against {fake.url}"


def test_main_exits_1_on_a_failure_and_2_on_bad_flags(fake, capsys):
    fake.script = Script(health=503)
    assert main(["--base-url", fake.url, "--num-requests", "2"]) == 1
    assert capsys.readouterr().out.splitlines()[0].startswith("FAIL health: HTTP 503")
    assert main(["--num-requests", "2"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["--base-url", fake.url, "--num-requests", "-1"]) == 2


def test_health_failure_names_the_servers_down(fake):
    fake.script = Script(health=503)
    assert failed(verdicts(fake, num_requests=0)) == {
        "health": "HTTP 503; down: prefill 127.0.0.1:1 (connection refused)"}


def test_unreachable_server_fails_every_check():
    v = verdicts(FakeServer(), num_requests=1)      # bound, never started: connections are refused
    assert all(not ok for ok, _ in v.values())
    assert v["health"][1].startswith("ConnectError")


@pytest.mark.parametrize("script, check, reason", [
    (Script(text=""), "completion", "choices[0].text is empty ('')"),
    (Script(finish_reason="abort"), "completion",
     "choices[0].finish_reason is 'abort', expected length or stop"),
    (Script(finish_reason=None), "completion",
     "choices[0].finish_reason is None, expected length or stop"),
    (Script(usage=None), "completion", "usage is missing"),
    (Script(usage={"prompt_tokens": 6, "completion_tokens": 0}), "completion",
     "usage.completion_tokens is 0, expected a positive integer"),
    (Script(usage={"prompt_tokens": 6}), "completion",
     "usage.completion_tokens is None, expected a positive integer"),
    (Script(usage={"prompt_tokens": 6, "completion_tokens": 16, "total_tokens": 30}), "completion",
     "usage.total_tokens 30 != prompt_tokens + completion_tokens"),
    (Script(chat_status=500), "chat", "HTTP 500"),
    (Script(model="other-model"), "models", "'fake-model' is not served (served: other-model)"),
])
def test_a_broken_response_fails_its_check(fake, script, check, reason):
    fake.script = script
    v = failed(verdicts(fake, model="fake-model", num_requests=0))
    assert check in v and v[check].startswith(reason), v


def test_traffic_counts_failed_requests(fake):
    fake.script = Script(fail_every=5)          # requests 5, 10, 15 of 18 (all in the traffic run)
    v = failed(verdicts(fake))
    assert list(v) == ["traffic"]
    # which three fail depends on arrival order; the first three failures are shown
    assert v["traffic"].startswith("3/16 failed: #") and v["traffic"].count(": HTTP 503: ") == 3


def test_traffic_needs_streams_to_end_with_done(fake):
    fake.script = Script(stream_done=False)
    v = failed(verdicts(fake, num_requests=4))
    assert v == {"traffic": "2/4 failed: #1 completion-stream: the stream ended without data: "
                            "[DONE]; #3 chat-stream: the stream ended without data: [DONE]"}


def test_kv_transfer_fails_when_decode_pulled_nothing(fake):
    fake.script = Script(pull=False)
    v = failed(verdicts(fake, expect_di=True, num_requests=2))
    assert v == {"kv-transfer": "the decode servers pulled no KV during this run "
                                "(kvrelay:kv_transfers unchanged): requests are not going through "
                                "prefill → decode"}


def test_kv_transfer_fails_on_handshake_errors_and_transfer_failures(fake):
    fake.script = Script(handshake_errors=2, transfer_failures_per_request=1)
    v = failed(verdicts(fake, expect_di=True, num_requests=2))
    key = f"decode {fake.url}"
    assert v == {"kv-transfer": f"{key}: 2 handshake errors; "
                                f"{key}: 4 KV transfer failures during this run"}


def test_kv_transfer_needs_to_know_the_decode_servers(fake):
    fake.script = Script(list_backends=False)
    v = failed(verdicts(fake, expect_di=True, num_requests=0))
    assert v["kv-transfer"].startswith("no decode servers known: pass --decode-url")
    # given explicitly, the same server's metrics are read
    assert failed(verdicts(fake, expect_di=True, num_requests=0, decode_urls=(fake.url,))) == {}


def test_kv_transfer_fails_when_the_decode_server_is_not_a_consumer(fake):
    fake.script = Script(metrics=False)
    v = failed(verdicts(fake, expect_di=True, num_requests=0))
    assert v == {"kv-transfer": f"decode {fake.url}: no kvrelay:kv_transfers_total metric (not a "
                                "kv_consumer?)"}


# -- plausible answers ----------------------------------------------------------------------

def test_the_completion_and_chat_checks_ask_greedily(fake):
    verdicts(fake, num_requests=0)
    completion, chat = fake.bodies
    assert completion["prompt"] == TUTORIAL_PROMPT == "The capital of France is"
    assert completion["temperature"] == 0 and chat["temperature"] == 0


@pytest.mark.parametrize("text, reason", [
    ("1.26269002482531", "the answer has no letters, only digits, punctuation or symbols"),
    (" 12, 34.5 -- ?!", "the answer has no letters, only digits, punctuation or symbols"),
    ("  \n\t ", "the answer is blank"),
    ("\x00\x01\x02\x03ab\x04\x05", "only 25% of the answer's characters are printable"),
    ("\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffd\ufffdok", "only 20% of the answer's characters"),
])
def test_nonsense_fails_the_plausibility_check(fake, text, reason):
    """An unknown model's answer must at least look like language: the README's old example
    (sampled nonsense that validate used to pass) fails, naming the check."""
    assert implausible(text) is not None and implausible(text).startswith(reason)
    fake.script = Script(text=text)
    v = failed(verdicts(fake, num_requests=0))
    assert list(v) == ["completion", "chat"], v
    for check in ("completion", "chat"):
        assert v[check].startswith(f"implausible answer: {reason}"), v[check]
        assert "no expected word for this model" in v[check]


@pytest.mark.parametrize("text", [" Paris.", " w80 w121 w95", "Das ist 42.", " 東京", "\n\nThe"])
def test_language_passes_the_plausibility_check(text):
    assert implausible(text) is None


def test_main_reports_a_nonsense_answer_and_exits_1(fake, capsys):
    fake.script = Script(text="1.26269002482531")
    assert main(["--base-url", fake.url, "--num-requests", "0"]) == 1
    out = capsys.readouterr().out
    assert ("FAIL completion: implausible answer: the answer has no letters, only digits, "
            "punctuation or symbols") in out and "'1.26269002482531'" in out
    assert out.splitlines()[-1].startswith("FAIL: 3/5 checks passed")


def test_the_embedded_model_must_answer_paris(fake):
    """The embedded model's greedy answers are known: plausible words are not enough."""
    fake.script = Script(model=EMBEDDED_MODEL_NAME, text=" London, the capital.")
    v = failed(verdicts(fake, num_requests=0))
    assert v == {
        "completion": "the answer does not contain 'Paris' (kvrelay/smollm2-135m-gpt-oss's greedy "
                      "answer to 'The capital of France is'): ' London, the capital.'",
        "chat": "the answer does not contain 'Paris' (kvrelay/smollm2-135m-gpt-oss's greedy "
                "answer to 'What is the capital of France? Answer in one word.'): "
                "' London, the capital.'"}
    fake.script = Script(model=EMBEDDED_MODEL_NAME, text=" Paris.")
    v = verdicts(fake, num_requests=0)
    assert failed(v) == {} and "contains 'Paris'" in v["completion"][1]


def test_the_embedded_model_is_recognised_by_its_root_under_another_name(fake):
    root = f"/home/u/.cache/kvrelay/models/{EMBEDDED_DIR_STEM}-v1"
    fake.script = Script(model="openai/gpt-oss-120b", root=root, text=" London.")
    assert set(failed(verdicts(fake, num_requests=0))) == {"completion", "chat"}
    # another checkpoint under the same name: the plausibility check only
    fake.script = Script(model="openai/gpt-oss-120b", root="/models/gpt-oss-120b", text=" London.")
    assert failed(verdicts(fake, num_requests=0)) == {}


def test_a_custom_prompt_of_the_embedded_model_gets_the_plausibility_check(fake):
    fake.script = Script(model=EMBEDDED_MODEL_NAME, text=" blue.")
    v = failed(verdicts(fake, num_requests=0, prompt="The sky is"))
    assert list(v) == ["chat"]                 # the chat message is still the known one


def test_expect_names_the_word_for_any_model(fake, capsys):
    fake.script = Script(text=" Lyon is nice.")
    assert main(["--base-url", fake.url, "--num-requests", "0", "--expect", "Paris"]) == 1
    assert ("FAIL completion: the answer does not contain 'Paris' (--expect): ' Lyon is nice.'"
            in capsys.readouterr().out)
    assert main(["--base-url", fake.url, "--num-requests", "0", "--expect", "lyon"]) == 0
    assert "PASS completion: 16 tokens, finish_reason length, prompt_tokens 6, contains 'lyon'" \
        in capsys.readouterr().out
    assert main(["--base-url", fake.url, "--expect", " "]) == 2


def test_the_embedded_models_directory_is_recognised_under_any_served_name(tmp_path):
    """The directory `kvrelay serve` builds the embedded model into (its `root`) names the
    model, whatever --served-model-name says; another directory does not."""
    from kvrelay.deploy.validate_answers import known_model
    from kvrelay.model import embedded
    root = str(tmp_path / embedded.CACHE_SUBDIR)
    assert known_model([{"id": "openai/gpt-oss-120b", "root": root}],
                       "openai/gpt-oss-120b") == EMBEDDED_MODEL_NAME
    assert known_model([{"id": "m", "root": str(tmp_path / "other")}], "m") is None
