"""`kvrelay validate`: the tutorial's "Confirm your work" checks against a running deployment.

    kvrelay validate --base-url http://PREFILL_HOST:8000 --model openai/gpt-oss-120b --expect-di

Checks, in order (one line each: `PASS name: detail` or `FAIL name: detail`; exit 0 only
when every check passed):

    health       GET /health answers 200 (through a proxy: every prefill and decode server is up)
    models       GET /v1/models lists the model (or names the one to use when --model is absent)
    completion   the tutorial's request ("The capital of France is", max_tokens 16) at
                 temperature 0: OpenAI shape, non-empty choices[0].text, finish_reason
                 length|stop, usage populated, and a plausible answer (below)
    chat         a chat completion of the same shape at temperature 0 (content, or harmony
                 reasoning, non-empty), and a plausible answer
    traffic      --num-requests concurrent requests, mixed prompt and output lengths, completions
                 and chat, streamed (SSE to [DONE], usage chunk) and not: zero failures
    kv-transfer  (--expect-di) the decode servers pulled KV during this run, with no transfer
                 failures and no handshake errors (their /metrics; the servers come from
                 --decode-url/--prefill-url or from the proxy's /health listing)

A plausible answer: when validate knows the model's greedy answer to the prompt (the
embedded model, recognised by its name or by /v1/models' `root`, the checkpoint it loaded:
"Paris" to both default prompts), or `--expect WORD` names one, the text must contain that
word; otherwise it must look like language: not blank, at least 90 % printable characters,
and some letters (not only digits, punctuation or symbols, as "1.26269002482531" is).

The checks use plain httpx, no torch, so validate runs from any machine that reaches the URL.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NoReturn

import httpx

from kvrelay import envs
from kvrelay.cli_flags import HelpFormatter
from kvrelay.model.embedded import CACHE_SUBDIR, EMBEDDED_MODEL_NAME

PROG = "kvrelay validate"
# The tutorial's prompt without its trailing space: a BPE model has seen " Paris" after "is",
# so a small one answers it greedily (the embedded model: " Paris."; with the space it
# continues "21st-century Paris.").
TUTORIAL_PROMPT = "The capital of France is"
CHAT_MESSAGE = "What is the capital of France? Answer in one word."
# the stem of the embedded model's cache directory (CACHE_SUBDIR's last part, less its version)
EMBEDDED_DIR_STEM = CACHE_SUBDIR.rsplit("/", 1)[-1].rsplit("-v", 1)[0]
# greedy answers validate knows: model → {prompt or chat message: a word the answer contains}
KNOWN_ANSWERS = {EMBEDDED_MODEL_NAME: {TUTORIAL_PROMPT: "Paris", CHAT_MESSAGE: "Paris"}}
MIN_PRINTABLE = 0.9
FINISH_REASONS = ("length", "stop")
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven",
         "wise", "owls", "count", "silver", "stars", "above", "a", "quiet", "harbour", "full", "of",
         "boats"]
PROMPT_WORDS = (8, 24, 48)            # traffic prompt lengths, in words
TRAFFIC_MAX_TOKENS = (8, 16, 32)      # and output lengths
KINDS = ("completion", "completion-stream", "chat", "chat-stream")


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


@dataclass(frozen=True)
class ValidateOptions:
    base_url: str
    model: str | None = None
    expect_di: bool = False
    decode_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    num_requests: int = 16
    timeout: float = 120.0
    api_key: str | None = None
    prompt: str = TUTORIAL_PROMPT
    max_tokens: int = 16
    expect: str | None = None         # a word the completion must contain (--expect)


class ShapeError(ValueError):
    """A response that is not the OpenAI shape the tutorial expects."""


# ---------------------------------------------------------------------------- response shapes

def check_completion(body: Any) -> tuple[str, str, dict[str, int]]:
    """(text, finish_reason, usage) of a /v1/completions JSON body, or ShapeError saying why not."""
    choice = _first_choice(body)
    text = choice.get("text")
    if not isinstance(text, str) or not text:
        raise ShapeError(f"choices[0].text is empty ({text!r})")
    return text, _finish_reason(choice), _usage(body)


def check_chat(body: Any) -> tuple[str, str, dict[str, int]]:
    """(content or reasoning, finish_reason, usage) of a /v1/chat/completions JSON body."""
    message = _first_choice(body).get("message")
    if not isinstance(message, dict):
        raise ShapeError("choices[0].message is missing")
    text = _message_text(message)
    if not text:
        raise ShapeError("choices[0].message has no content (nor reasoning)")
    return text, _finish_reason(_first_choice(body)), _usage(body)


def _first_choice(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ShapeError("the body is not a JSON object")
    if "error" in body:
        raise ShapeError(f"error object: {body['error']}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ShapeError("choices is missing or empty")
    return choices[0]


def _message_text(message: dict[str, Any]) -> str:
    """Content, else the harmony analysis channel (a short max_tokens may end inside it)."""
    for key in ("content", "reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _finish_reason(choice: dict[str, Any]) -> str:
    reason = choice.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise ShapeError(f"choices[0].finish_reason is {reason!r}, expected length or stop")
    return reason


def _usage(body: dict[str, Any]) -> dict[str, int]:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        raise ShapeError("usage is missing")
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShapeError(f"usage.{key} is {value!r}, expected a positive integer")
    total = usage.get("total_tokens")
    if total is not None and total != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise ShapeError(f"usage.total_tokens {total} != prompt_tokens + completion_tokens")
    return usage


# ---------------------------------------------------------------------------- plausibility

def implausible(text: str) -> str | None:
    """Why `text` does not look like a language model's answer (None: it does): blank, mostly
    unprintable, or no letters at all (only digits, punctuation or symbols)."""
    if not text.strip():
        return "the answer is blank"
    printable = sum((c.isprintable() and c != "\ufffd") or c in "\n\r\t" for c in text)
    if printable < MIN_PRINTABLE * len(text):
        return (f"only {100 * printable / len(text):.0f}% of the answer's characters are "
                f"printable (at least {100 * MIN_PRINTABLE:.0f}% expected)")
    if not any(c.isalpha() for c in text):
        return "the answer has no letters, only digits, punctuation or symbols"
    return None


def known_model(entries: list[dict[str, Any]], model: str | None) -> str | None:
    """The KNOWN_ANSWERS model that `model` is, from its /v1/models entry: its id or its
    `root` (kvrelay gives the checkpoint directory it loaded; vLLM the model as given)."""
    entry = next((e for e in entries if e.get("id") == model), {"id": model})
    for value in (entry.get("id"), entry.get("root")):
        if not isinstance(value, str):
            continue
        if value in KNOWN_ANSWERS:
            return value
        if value.rstrip("/").rsplit("/", 1)[-1].startswith(EMBEDDED_DIR_STEM):
            return EMBEDDED_MODEL_NAME
    return None


def plausibility(text: str, expect: str | None, why: str) -> tuple[bool, str]:
    """(ok, what was checked or why it failed) for an answer; `expect` a word it must contain
    (`why`: where that expectation comes from), else the weaker `implausible` check."""
    if expect is not None:
        if expect.casefold() in text.casefold():
            return True, f"contains {expect!r}"
        return False, f"the answer does not contain {expect!r} ({why}): {_short(text, 60)}"
    problem = implausible(text)
    if problem:
        return False, (f"implausible answer: {problem} (no expected word for this model, so "
                       f"the plausibility check; --expect WORD makes it exact): {_short(text, 60)}")
    return True, "plausible text"


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


def _http_error(resp: httpx.Response) -> str:
    return f"HTTP {resp.status_code}: {resp.text[:200].strip()}"


# ---------------------------------------------------------------------------- metrics

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over labels}."""
    from prometheus_client.parser import text_string_to_metric_families
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


TRANSFERS = "kvrelay:kv_transfers_total"
FAILURES = "kvrelay:kv_transfer_failures_total"
HANDSHAKE_ERRORS = "kvrelay:kv_handshake_errors_total"
TRANSFER_BYTES = "kvrelay:kv_transfer_bytes_total"
FALLBACK = "kvrelay:kv_transport_fallback"


# ---------------------------------------------------------------------------- the checks

@dataclass
class Validator:
    """Runs the checks against `options.base_url`; owns its HTTP client."""

    options: ValidateOptions
    model: str | None = None
    results: list[CheckResult] = field(default_factory=list)
    entries: list[dict[str, Any]] = field(default_factory=list)   # /v1/models' data

    def __post_init__(self) -> None:
        key = self.options.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.headers = headers
        self.client = httpx.Client(base_url=self.options.base_url.rstrip("/"),
                                   timeout=self.options.timeout, headers=headers, trust_env=False)
        self.model = self.options.model

    def run(self) -> list[CheckResult]:
        try:
            self._check("health", self.health)
            self._check("models", self.models)
            before = self._di_snapshot() if self.options.expect_di else None
            self._check("completion", self.completion)
            self._check("chat", self.chat)
            self._check("traffic", self.traffic)
            if before is not None:
                self._check("kv-transfer", lambda: self.kv_transfer(before))
        finally:
            self.client.close()
        return self.results

    def _check(self, name: str, fn) -> None:
        try:
            ok, detail = fn()
        except ShapeError as e:
            ok, detail = False, str(e)
        except httpx.HTTPError as e:
            ok, detail = False, _describe(e, self.options.timeout)
        self.results.append(CheckResult(name, ok, detail))

    # -- health and models ----------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        resp = self.client.get("/health")
        if resp.status_code != 200:
            down = _down_servers(resp)
            return False, f"HTTP {resp.status_code}" + (f"; down: {down}" if down else "")
        servers = self._listed_servers(resp)
        listing = (f" ({len(servers['prefill'])} prefill, {len(servers['decode'])} decode "
                   "behind it)") if servers["prefill"] or servers["decode"] else ""
        return True, f"HTTP 200{listing}"

    def models(self) -> tuple[bool, str]:
        resp = self.client.get("/v1/models")
        if resp.status_code != 200:
            return False, _http_error(resp)
        self.entries = [m for m in resp.json().get("data", [])
                        if isinstance(m, dict) and isinstance(m.get("id"), str)]
        ids = [m["id"] for m in self.entries]
        if not ids:
            return False, "no models listed"
        if self.model is None:
            self.model = ids[0]
            return True, f"serving {', '.join(ids)}; using {self.model}"
        if self.model not in ids:
            return False, f"{self.model!r} is not served (served: {', '.join(map(str, ids))})"
        return True, f"serving {', '.join(ids)}"

    # -- the tutorial's requests ----------------------------------------------------------------
    def expected(self, prompt: str, explicit: str | None = None) -> tuple[str | None, str]:
        """(the word the answer to `prompt` must contain, or None; where that comes from)."""
        if explicit is not None:
            return explicit, "--expect"
        known = known_model(self.entries, self.model)
        word = KNOWN_ANSWERS.get(known or "", {}).get(prompt)
        return word, f"{known}'s greedy answer to {prompt!r}"

    def completion(self) -> tuple[bool, str]:
        body = {"model": self.model, "prompt": self.options.prompt,
                "max_tokens": self.options.max_tokens, "temperature": 0}
        resp = self.client.post("/v1/completions", json=body)
        if resp.status_code != 200:
            return False, _http_error(resp)
        text, reason, usage = check_completion(resp.json())
        ok, checked = plausibility(text, *self.expected(self.options.prompt, self.options.expect))
        if not ok:
            return False, checked
        return True, (f"{usage['completion_tokens']} tokens, finish_reason {reason}, "
                      f"prompt_tokens {usage['prompt_tokens']}, {checked}: {_short(text)}")

    def chat(self) -> tuple[bool, str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": CHAT_MESSAGE}],
                "max_tokens": self.options.max_tokens, "temperature": 0}
        resp = self.client.post("/v1/chat/completions", json=body)
        if resp.status_code != 200:
            return False, _http_error(resp)
        text, reason, usage = check_chat(resp.json())
        ok, checked = plausibility(text, *self.expected(CHAT_MESSAGE))
        if not ok:
            return False, checked
        return True, (f"{usage['completion_tokens']} tokens, finish_reason {reason}, {checked}: "
                      f"{_short(text)}")

    # -- representative traffic ----------------------------------------------------------------
    def traffic(self) -> tuple[bool, str]:
        n = self.options.num_requests
        if n < 1:
            return True, "skipped (--num-requests 0)"
        t0 = time.perf_counter()
        outcomes = asyncio.run(self._traffic(n))
        wall = time.perf_counter() - t0
        failed = [(i, kind, err) for i, (kind, err, _, _) in enumerate(outcomes) if err]
        tokens = sum(o[2] for o in outcomes)
        latencies = sorted(o[3] for o in outcomes)
        streamed = sum(k.endswith("stream") for k, *_ in outcomes)
        if failed:
            shown = "; ".join(f"#{i} {kind}: {err}" for i, kind, err in failed[:3])
            more = f" (+{len(failed) - 3} more)" if len(failed) > 3 else ""
            return False, f"{len(failed)}/{n} failed: {shown}{more}"
        return True, (f"{n}/{n} ok ({streamed} streamed) in {wall:.1f}s; {tokens} completion "
                      f"tokens, {tokens / wall:.1f} tok/s; latency p50 "
                      f"{latencies[len(latencies) // 2]:.2f}s max {latencies[-1]:.2f}s")

    async def _traffic(self, n: int) -> list[tuple[str, str | None, int, float]]:
        nonce = uuid.uuid4().hex[:8]
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=self.options.base_url.rstrip("/"),
                                     timeout=self.options.timeout,
                                     headers=self.headers, trust_env=False,
                                     limits=limits) as client:
            return await asyncio.gather(*(self._one(client, i, nonce) for i in range(n)))

    async def _one(self, client: httpx.AsyncClient, i: int,
                   nonce: str) -> tuple[str, str | None, int, float]:
        kind = KINDS[i % len(KINDS)]
        words = PROMPT_WORDS[i % len(PROMPT_WORDS)]
        text = f"Request {nonce} {i}: " + " ".join(WORDS[(i + k) % len(WORDS)]
                                                   for k in range(words))
        body: dict[str, Any] = {"model": self.model,
                                "max_tokens":
                                    TRAFFIC_MAX_TOKENS[(i // 2) % len(TRAFFIC_MAX_TOKENS)]}
        chat = kind.startswith("chat")
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        stream = kind.endswith("stream")
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        try:
            if stream:
                tokens = await _streamed(client, path, body, chat)
            else:
                resp = await client.post(path, json=body)
                if resp.status_code != 200:
                    raise ShapeError(_http_error(resp))
                tokens = (check_chat if chat
                          else check_completion)(resp.json())[2]["completion_tokens"]
        except (ShapeError, httpx.HTTPError, json.JSONDecodeError) as e:
            error = _describe(e, self.options.timeout)
            return kind, error, 0, time.perf_counter() - t0
        return kind, None, tokens, time.perf_counter() - t0

    # -- disaggregation ------------------------------------------------------------------------
    def _servers(self) -> dict[str, list[str]]:
        servers = {"prefill": list(self.options.prefill_urls),
                   "decode": list(self.options.decode_urls)}
        if servers["decode"]:
            return servers
        try:
            listed = self._listed_servers(self.client.get("/health"))
        except httpx.HTTPError:
            return servers
        return {role: servers[role] or listed[role] for role in servers}

    def _listed_servers(self, resp: httpx.Response) -> dict[str, list[str]]:
        """The backends `kvrelay proxy` lists in its /health body
        ({"servers": [{role, server}]})."""
        out: dict[str, list[str]] = {"prefill": [], "decode": []}
        try:
            body = resp.json()
        except ValueError:
            return out
        for s in body.get("servers", []) if isinstance(body, dict) else []:
            if isinstance(s, dict) and s.get("role") in out and isinstance(s.get("server"), str):
                out[s["role"]].append(f"http://{s['server']}")
        return out

    def _di_snapshot(self) -> dict[str, dict[str, float] | str]:
        """Each known server's metrics now (or why they could not be read)."""
        servers = self._servers()
        snap: dict[str, dict[str, float] | str] = {}
        for role in ("decode", "prefill"):
            for url in servers[role]:
                snap[f"{role} {url}"] = self._metrics(url)
        return snap

    def _metrics(self, url: str) -> dict[str, float] | str:
        try:
            resp = httpx.get(f"{url}/metrics", timeout=10, trust_env=False, headers=self.headers)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
        if resp.status_code != 200:
            return f"HTTP {resp.status_code}"
        return parse_metrics(resp.text)

    def kv_transfer(self, before: dict[str, dict[str, float] | str]) -> tuple[bool, str]:
        if not any(k.startswith("decode ") for k in before):
            return False, ("no decode servers known: pass --decode-url (the server at "
                           f"{self.options.base_url} lists none in /health)")
        after = self._di_snapshot()
        problems, pulled, nbytes, notes = [], 0.0, 0.0, []
        for key, now in after.items():
            then = before.get(key)
            if isinstance(now, str) or isinstance(then, str) or then is None:
                problems.append(f"{key}: metrics unreadable "
                                f"({now if isinstance(now, str) else then})")
                continue
            if key.startswith("decode ") and TRANSFERS not in now:
                problems.append(f"{key}: no {TRANSFERS} metric (not a kv_consumer?)")
                continue
            if now.get(HANDSHAKE_ERRORS, 0):
                problems.append(f"{key}: {now[HANDSHAKE_ERRORS]:.0f} handshake errors")
            failed = now.get(FAILURES, 0) - then.get(FAILURES, 0)
            if failed:
                problems.append(f"{key}: {failed:.0f} KV transfer failures during this run")
            if now.get(FALLBACK, 0):
                notes.append(f"{key.split()[1]} fell back from the requested KV backend")
            if key.startswith("decode "):
                pulled += now.get(TRANSFERS, 0) - then.get(TRANSFERS, 0)
                nbytes += now.get(TRANSFER_BYTES, 0) - then.get(TRANSFER_BYTES, 0)
        if not problems and pulled < 1:
            problems.append("the decode servers pulled no KV during this run (kvrelay:kv_transfers "
                            "unchanged): requests are not going through prefill → decode")
        decodes = sum(k.startswith("decode ") for k in after)
        if problems:
            return False, "; ".join(problems)
        note = f"; note: {', '.join(notes)}" if notes else ""
        return True, (f"{decodes} decode server(s) pulled KV {pulled:.0f} times "
                      f"({nbytes / 2**20:.2f} MiB) during this run; 0 transfer failures, 0 "
                      f"handshake errors on {len(after)} server(s){note}")


def _describe(e: Exception, timeout: float) -> str:
    if isinstance(e, ShapeError):
        return str(e)
    if isinstance(e, httpx.TimeoutException):
        return (f"no answer within {timeout:g}s ({type(e).__name__}; raise --timeout on a slow "
                "machine)")
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _down_servers(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return ""
    down = body.get("down") if isinstance(body, dict) else None
    if not isinstance(down, list):
        return ""
    return ", ".join(f"{d.get('role')} {d.get('server')} ({d.get('error')})" for d in down
                     if isinstance(d, dict))


async def _streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any], chat: bool) -> int:
    """Read an SSE response to [DONE]; returns the usage chunk's completion_tokens."""
    reason, usage, text, done = None, None, "", False
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise ShapeError(_http_error(resp))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise ShapeError(f"error event in the stream: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = choice.get("delta", {}) if chat else choice
                text += _message_text(piece) if chat else (piece.get("text") or "")
                reason = choice.get("finish_reason") or reason
    if not done:
        raise ShapeError("the stream ended without data: [DONE]")
    if reason not in FINISH_REASONS:
        raise ShapeError(f"stream finish_reason {reason!r}, expected length or stop")
    if not text:
        raise ShapeError("the stream carried no text")
    if not isinstance(usage, dict):
        raise ShapeError("no usage chunk (stream_options.include_usage)")
    return _usage({"usage": usage})["completion_tokens"]


def run_checks(options: ValidateOptions) -> list[CheckResult]:
    return Validator(options).run()


# ---------------------------------------------------------------------------- the command

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG,
                description="The tutorial's 'Confirm your work' checks against a server or proxy.",
                formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, metavar="URL",
                   help="the proxy (DI) or the server, e.g. http://127.0.0.1:8000 (required)")
    p.add_argument("--model", default=None,
                   help="model name for requests (default: the first of /v1/models)")
    p.add_argument("--expect-di", action="store_true",
                   help="also check that decode servers pulled KV with no failures or handshake "
                        "errors")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL",
                   help="a decode server whose /metrics to read (repeatable; default: the proxy's "
                        "listing)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                   help="a prefill server whose /metrics to read (repeatable; default: the proxy's "
                        "listing)")
    p.add_argument("--num-requests", type=int, default=16, metavar="N",
                   help="concurrent requests of the traffic check")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds allowed for each request")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--prompt", default=TUTORIAL_PROMPT, help="the completion check's prompt")
    p.add_argument("--expect", default=None, metavar="WORD",
                   help="a word the completion check's answer must contain (default: the known "
                        "answer for the embedded model and the default prompt, else a "
                        "plausibility check)")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="max_tokens of the completion and chat checks")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvrelay validate [flags]`; exit 0 when every check passed, 1 otherwise, 2 for bad flags."""
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    if args.expect is not None and not args.expect.strip():
        print(f"{PROG}: error: --expect needs a word", file=sys.stderr)
        return 2
    if args.num_requests < 0 or args.timeout <= 0 or args.max_tokens < 1:
        print(f"{PROG}: error: --num-requests must be ≥ 0, --timeout and --max-tokens positive",
              file=sys.stderr)
        return 2
    options = ValidateOptions(
        base_url=args.base_url, model=args.model, expect_di=args.expect_di,
        decode_urls=tuple(u.rstrip("/") for u in args.decode_url),
        prefill_urls=tuple(u.rstrip("/") for u in args.prefill_url), num_requests=args.num_requests,
        timeout=args.timeout, api_key=args.api_key or envs.OPENAI_API_KEY.raw(),
        prompt=args.prompt, max_tokens=args.max_tokens, expect=args.expect)
    results = run_checks(options)
    for r in results:
        print(r.line(), flush=True)
    ok = all(r.ok for r in results)
    print(f"{'PASS' if ok else 'FAIL'}: {sum(r.ok for r in results)}/{len(results)} checks passed "
          f"against {args.base_url}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
