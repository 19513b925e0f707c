"""A random-weight gpt-oss model at temperature 1 against every harmony output path:
0 × 5xx over ≥ 2,000 requests (issue 29, item 5).

    python benchmarks/harmony_fuzz_serve.py [--requests 2400] [--concurrency 16]
        [--out benchmarks/results/harmony_fuzz_serve.json]

One plain `kvrelay serve` (no tool flags: `tool_choice: "auto"` must work without them) on
the tiny o200k gpt-oss checkpoint the agent tests build (tests/agent/conftest.py: random
weights, gpt-oss's o200k harmony tokenizer). The requests cycle through chat completions
and the Responses API, each streamed and not; a third of them without tools, the rest
with two function tools under `tool_choice` auto / required / named / none and
`parallel_tool_calls` true / false / unset; temperature 1, `max_tokens` 2–32, a seed each.

A random model seldom writes harmony's special tokens, so half of the requests (on every
API and path) go through this module's logits processor `boost_harmony`, which adds 6, 9
or 12 (`boost_of` the request's seed) to the logits of harmony's 21 special tokens: from
about 5 % of the tokens (6) to most of them (12) are then `<|start|>`, `<|channel|>`,
`<|constrain|>`, `<|call|>`, `<|end|>`, reserved ids ... in every place. Each answer is
checked: the status (any 5xx is a failure), the JSON or the SSE framing, a finish reason
(chat) or a final `response.completed` / `response.incomplete` event (Responses), and at
most one call under `parallel_tool_calls: false`. The counts go to the JSON result.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HARMONY_IDS = list(range(199998, 200019))     # <|startoftext|> … <|reserved_200018|>
MODEL = "harmony-fuzz"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
PROMPTS = ["What is the weather in Paris?", "Tell me a story.", "What time is it in Tokyo?",
           "Write a haiku about the sea, then check the weather in Oslo.", "2 + 2 = ?"]


BOOSTS = (6.0, 9.0, 12.0)


def boost_of(seed: int | None) -> float:
    """How much a request's special tokens are boosted (0: not at all), from its seed (the
    request's number: bit 0 picks the API, bit 1 streaming, bit 2 the boost)."""
    if seed is None or (seed // 4) % 2 == 0:
        return 0.0
    return BOOSTS[(seed // 8) % len(BOOSTS)]


def boost_harmony(params: Any, prompt_ids: list[int]) -> Any:
    """The server's logits-processor factory (`--logits-processors`): half of the requests
    get harmony's special tokens boosted (`boost_of` their seed)."""
    boost = boost_of(params.seed)
    if not boost:
        return None

    def processor(output_ids: list[int], logits: Any) -> Any:
        logits[HARMONY_IDS] += boost
        return logits
    return processor


# ------------------------------------------------------------------ the checkpoint


def build_checkpoint(cache: Path) -> Path:
    """The agent tests' tiny o200k gpt-oss checkpoint (tests/agent/conftest.py), cached."""
    sys.path.insert(0, str(ROOT))
    from tests.factories import make_hf_model, save_checkpoint
    from tests.harmony_factories import GPT_OSS_VOCAB_SIZE, make_o200k_tokenizer_json
    path = cache / "agent-o200k-tiny-seed5"
    if (path / "tokenizer.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_checkpoint(make_hf_model(seed=5, vocab_size=GPT_OSS_VOCAB_SIZE, hidden_size=32,
                                  head_dim=8, intermediate_size=64, num_local_experts=2,
                                  num_hidden_layers=2), tmp)
    make_o200k_tokenizer_json(tmp)
    tmp.rename(path)
    return path


# ------------------------------------------------------------------ requests


def request_plan(i: int, rng: random.Random) -> tuple[str, bool, dict[str, Any]]:
    """(api, stream, body) of the i-th request."""
    api = "chat" if i % 2 == 0 else "responses"
    stream = (i // 2) % 2 == 1
    tools = rng.choice(["no tools", "auto", "auto", "required", "named", "none",
                        "no tools"])
    body: dict[str, Any] = {"model": MODEL, "temperature": 1.0, "seed": i,
                            "stream": stream}
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.randint(2, 32)
    if api == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    else:
        body |= {"input": prompt, "max_output_tokens": max_tokens, "store": False}
    if tools != "no tools":
        body["tools"] = CHAT_TOOLS if api == "chat" else RESPONSE_TOOLS
        if tools == "named":
            body["tool_choice"] = ({"type": "function", "function": {"name": "get_weather"}}
                                   if api == "chat" else {"type": "function",
                                                          "name": "get_weather"})
        else:
            body["tool_choice"] = tools
        parallel = rng.choice([None, True, False])
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
    return api, stream, body


def sse_payloads(text: str) -> list[str]:
    if not text.endswith("\n\n"):
        raise ValueError("the stream does not end with a blank line")
    payloads = []
    for event in text[:-2].split("\n\n"):
        line = event.split("\n")[-1]
        if not line.startswith("data: "):
            raise ValueError(f"an event without data: {event[:80]!r}")
        payloads.append(line[len("data: "):])
    return payloads


def check_chat(body: dict[str, Any], text: str, stream: bool) -> dict[str, Any]:
    """What a chat answer says (finish reason, calls, ...); ValueError when malformed."""
    if not stream:
        out = json.loads(text)
        choice = out["choices"][0]
        finish, calls = choice["finish_reason"], len(choice["message"].get("tool_calls") or [])
        content = bool(choice["message"].get("content"))
        reasoning = bool(choice["message"].get("reasoning"))
    else:
        payloads = sse_payloads(text)
        if payloads[-1] != "[DONE]":
            raise ValueError("the stream does not end with [DONE]")
        chunks = [json.loads(p) for p in payloads[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        if any(f is not None for f in finishes[:-1]):
            raise ValueError("a finish reason before the last chunk")
        finish = finishes[-1] if finishes else None
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        calls = len({tc["index"] for d in deltas for tc in d.get("tool_calls") or []})
        content = any(d.get("content") for d in deltas)
        reasoning = any(d.get("reasoning") for d in deltas)
    if finish not in ("stop", "length", "tool_calls"):
        raise ValueError(f"finish_reason {finish!r}")
    if (finish == "tool_calls") != bool(calls) and finish != "length":
        raise ValueError(f"finish_reason {finish} with {calls} calls")
    return {"finish": finish, "calls": calls, "content": content, "reasoning": reasoning}


def check_responses(body: dict[str, Any], text: str, stream: bool) -> dict[str, Any]:
    if not stream:
        response = json.loads(text)
    else:
        events = [json.loads(p) for p in sse_payloads(text)]
        if [e["sequence_number"] for e in events] != list(range(len(events))):
            raise ValueError("sequence numbers do not count from 0")
        if events[-1]["type"] not in ("response.completed", "response.incomplete"):
            raise ValueError(f"the stream ends with {events[-1]['type']}")
        added = sum(e["type"] == "response.output_item.added" for e in events)
        done = sum(e["type"] == "response.output_item.done" for e in events)
        if added != done:
            raise ValueError(f"{added} items added, {done} done")
        response = events[-1]["response"]
    status = response["status"]
    if status not in ("completed", "incomplete"):
        raise ValueError(f"status {status!r}")
    kinds = [i["type"] for i in response["output"]]
    if any(i["status"] not in ("completed", "incomplete") for i in response["output"]):
        raise ValueError("an item left open")
    return {"finish": status, "calls": kinds.count("function_call"),
            "content": "message" in kinds, "reasoning": "reasoning" in kinds}


# ------------------------------------------------------------------ the run


def run(url: str, requests: int, concurrency: int, seed: int) -> dict[str, Any]:
    import httpx
    from common import log
    rng = random.Random(seed)
    plans = [request_plan(i, rng) for i in range(requests)]
    lock = threading.Lock()
    counts: Counter = Counter()
    failures: list[dict[str, Any]] = []
    client = httpx.Client(base_url=url, timeout=120)

    def one(plan: tuple[str, bool, dict[str, Any]]) -> None:
        api, stream, body = plan
        path = "/v1/chat/completions" if api == "chat" else "/v1/responses"
        boost = boost_of(body["seed"])
        boosted = f"boost {boost:g}" if boost else "plain"
        key = f"{api}/{'stream' if stream else 'whole'}"
        try:
            r = client.post(path, json=body)
            status, text = r.status_code, r.text
        except httpx.HTTPError as e:
            status, text = 0, repr(e)
        seen: dict[str, Any] = {}
        problem = None
        if status == 200:
            try:
                seen = (check_chat if api == "chat" else check_responses)(body, text, stream)
                if body.get("parallel_tool_calls") is False and seen["calls"] > 1:
                    problem = f"{seen['calls']} calls under parallel_tool_calls false"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                problem = f"malformed: {e}"
        else:
            problem = f"HTTP {status}"
        with lock:
            counts["requests"] += 1
            if counts["requests"] % 400 == 0:
                log(f"{counts['requests']} requests, {counts['problems']} problems")
            counts[f"status {status // 100}xx" if status else "no answer"] += 1
            counts[f"{key} requests"] += 1
            counts[f"{boosted} requests"] += 1
            if status >= 500 or not status:
                counts[f"{boosted} 5xx or no answer"] += 1
            if status >= 500 or not status:
                counts["5xx or no answer"] += 1
            if problem:
                counts["problems"] += 1
                if len(failures) < 20:
                    failures.append({"api": key, "body": body, "problem": problem,
                                     "answer": text[:500]})
            for name, value in seen.items():
                if name == "finish":
                    counts[f"{key} finish {value}"] += 1
                elif name == "calls":
                    counts[f"answers with {min(value, 2)}{'+' if value >= 2 else ''} calls"] += 1
                elif value:
                    counts[f"answers with {name}"] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, plans))
    client.close()
    return {"counts": dict(sorted(counts.items())), "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path,
                    default=Path(tempfile.gettempdir()) / "kvrelay-bench")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "harmony_fuzz_serve.json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    from common import git_sha, log, machine_info

    from tests.processes import Server
    log("checkpoint ...")
    model = build_checkpoint(args.cache)
    log_path = Path(tempfile.gettempdir()) / "harmony_fuzz_serve.log"
    flags = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
             "--served-model-name", MODEL,
             "--logits-processors", "benchmarks.harmony_fuzz_serve:boost_harmony"]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    server = Server(str(model), flags, log_path, env=env)
    try:
        server.wait_ready(300)
        log(f"serving on {server.url}; {args.requests} requests at concurrency "
            f"{args.concurrency} ...")
        result = run(server.url, args.requests, args.concurrency, args.seed)
        alive = server.proc.poll() is None
    finally:
        server.stop()
    result |= {"server_alive_at_end": alive, "requests": args.requests,
               "concurrency": args.concurrency, "seed": args.seed,
               "boosts": list(BOOSTS),
               "model": "tiny random gpt-oss (tests/agent/conftest.py o200k_checkpoint)",
               "git": git_sha(), "machine": machine_info(), "load_after": os.getloadavg(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["counts"], indent=2))
    bad = result["counts"].get("5xx or no answer", 0) + result["counts"].get("problems", 0)
    log(f"{bad} failures; written {args.out}")
    return 1 if bad or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
