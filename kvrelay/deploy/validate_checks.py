"""`kvrelay validate`, the checks: `Validator` runs them in order against a running server or
proxy (health, models, completion, chat, traffic, kv-transfer; validate.py lists what each
asks) and collects one `CheckResult` each; validate_answers.py judges the answers."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrelay.deploy.validate_answers import (
    CHAT_MESSAGE,
    FAILURES,
    FALLBACK,
    HANDSHAKE_ERRORS,
    KNOWN_ANSWERS,
    TRANSFER_BYTES,
    TRANSFERS,
    TUTORIAL_PROMPT,
    ShapeError,
    check_chat,
    check_completion,
    http_error,
    known_model,
    parse_metrics,
    plausibility,
    read_stream,
    short,
)

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

    def _check(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
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
            return False, http_error(resp)
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
            return False, http_error(resp)
        text, reason, usage = check_completion(resp.json())
        ok, checked = plausibility(text, *self.expected(self.options.prompt, self.options.expect))
        if not ok:
            return False, checked
        return True, (f"{usage['completion_tokens']} tokens, finish_reason {reason}, "
                      f"prompt_tokens {usage['prompt_tokens']}, {checked}: {short(text)}")

    def chat(self) -> tuple[bool, str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": CHAT_MESSAGE}],
                "max_tokens": self.options.max_tokens, "temperature": 0}
        resp = self.client.post("/v1/chat/completions", json=body)
        if resp.status_code != 200:
            return False, http_error(resp)
        text, reason, usage = check_chat(resp.json())
        ok, checked = plausibility(text, *self.expected(CHAT_MESSAGE))
        if not ok:
            return False, checked
        return True, (f"{usage['completion_tokens']} tokens, finish_reason {reason}, {checked}: "
                      f"{short(text)}")

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
                tokens = await read_stream(client, path, body, chat)
            else:
                resp = await client.post(path, json=body)
                if resp.status_code != 200:
                    raise ShapeError(http_error(resp))
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


def run_checks(options: ValidateOptions) -> list[CheckResult]:
    return Validator(options).run()
