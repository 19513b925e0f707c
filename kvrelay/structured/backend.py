"""The grammar engine (llguidance): compile constraints into matchers, one per sequence.

Owner of: the llguidance tokenizer of one checkpoint, the cache of compiled grammars
(keyed by the constraint and the analysis budget; the tokenizer is fixed per backend), the
thread every compile of the process runs on, and the executor that fills several
sequences' masks in parallel (outside the GIL).

Hostile grammars (limits.py has the measurements): every constraint passes
`limits.check` before it compiles, and compiles on one thread with a 256 MiB stack
(`COMPILE_STACK_BYTES`, 32× the main thread's 8 MiB). llguidance's recursion follows the
input's nesting; the shallowest input measured to overflow 8 MiB is ~8× the bounds, and
this stack holds ~30× deeper (a 1,200-definition `$ref` chain that kills an 8 MiB stack
compiles here; a Lark chain first overflows it at ~88,000 rules), so nothing that passed
the bounds can overflow the engine's stack. The stack is address space reserved once
(pages are touched only as deep as a compile goes). A matcher that fails later (a token it refuses,
a limit llguidance hits while computing a mask) records why in `failed`; the engine then
ends that request with an error (engine/core.py), never with text that breaks the
constraint. llguidance's errors are kept non-verbose (its verbose ones quote the parser
state and the grammar).

A harmony turn with a max_tokens also finishes within it (closing.py): its matcher holds an
`Ending`, and while one is being taken its mask allows that ending's next token alone.

Why llguidance (docs/benchmarks.md, "Structured outputs: grammar engine"): compiling a JSON
schema takes ~0.5-2 ms against xgrammar's 18-30 ms at the o200k vocabulary (agents send a
new tool schema per conversation), its Lark grammars name special tokens and bound a rule's
token count, which the harmony envelope needs, and its masks (10-20 us median per token) are
small next to a step.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvrelay.structured import limits
from kvrelay.structured.closing import MAX_ENDING, Closer, Ending
from kvrelay.structured.grammar import GrammarError, build_grammar
from kvrelay.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256               # compiled grammars kept (least recently used evicted)
COMPILE_STACK_BYTES = 256 << 20   # the compile thread's stack (see the module docstring)

T = TypeVar("T")


class _CompileThread:
    """The one thread, with a `COMPILE_STACK_BYTES` stack, that runs every compile of the
    process; callers wait for their compile as they did when it ran on their own thread."""

    def __init__(self, stack_bytes: int) -> None:
        self.stack_bytes = stack_bytes
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
                previous = threading.stack_size(self.stack_bytes)
                try:                            # the pool starts its thread on this submit
                    pool.submit(int).result()
                finally:
                    threading.stack_size(previous)
                self._pool = pool
        return self._pool.submit(fn, *args).result()


_COMPILER = _CompileThread(COMPILE_STACK_BYTES)


def compile_in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the process's compile thread (its large stack), waited for."""
    return _COMPILER.run(fn, *args)


def parser_limits() -> Any:
    """llguidance's own limits, left at their defaults, with short error messages."""
    import llguidance
    return llguidance.LLParserLimits(verbose_errors=False)


class GrammarMatcher:
    """One sequence's position in its grammar. Owner: the Request it is attached to;
    advanced by `Request.append_token` with every accepted token."""

    def __init__(self, matcher: Any, backend: GrammarBackend, ending: Ending | None = None,
                 ) -> None:
        self.matcher = matcher
        self.backend = backend
        self.failed: str | None = None
        # harmony turns with a max_tokens: when to take the grammar's ending (closing.py);
        # None (every other constraint): nothing is checked per token
        self.ending = ending

    def fork(self) -> GrammarMatcher:
        """A matcher at the same position, advancing independently (n > 1 children)."""
        return GrammarMatcher(self.matcher.deep_copy(), self.backend,
                              None if self.ending is None else self.ending.copy())

    def end_within(self, max_tokens: int) -> None:
        """Finish within `max_tokens` tokens from here (the start of the output): near the
        end, the mask allows only the next token of an ending of the grammar."""
        self.ending = Ending(max_tokens)
        self._check_ending()

    def accept(self, token_id: int) -> None:
        if self.failed is None and not self.matcher.consume_token(token_id):
            self.fail(_first_line(self.matcher.get_error())
                      or f"token {token_id} is not allowed here")
        if self.ending is not None:
            self.ending.accepted(token_id)
            self._check_ending()

    def _check_ending(self) -> None:
        ending = self.ending
        if (ending is not None and self.failed is None and ending.due()
                and not self.matcher.is_stopped()):
            ending.check(self.matcher, self.backend.closer)

    @property
    def forced_token(self) -> int | None:
        """The only token the next mask allows while an ending is being taken."""
        return None if self.ending is None else self.ending.next_forced

    def fail(self, reason: str) -> None:
        """The grammar cannot go on (the request ends with an error: engine/core.py)."""
        if self.failed is None:
            self.failed = reason
            logger.error("structured output failed: %s", reason)

    def check(self) -> None:
        """After a mask was computed: a limit llguidance hit there fails the matcher."""
        if self.failed is None and self.matcher.is_error():
            self.fail(_first_line(self.matcher.get_error()) or "the grammar engine failed")

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` is allowed next (its bit in the next mask), without the mask:
        a lexer step over the token's bytes."""
        if self.failed is not None:
            return False
        forced = self.forced_token
        if forced is not None:
            return token_id == forced
        return self.matcher.validate_tokens([token_id]) == 1

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops)."""
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class _Key:
    constraint: str
    analysis_budget: int


class GrammarBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        import llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor()
        self.eos_token_ids = eos_token_ids
        self._cache: OrderedDict[_Key, Any] = OrderedDict()
        self.hits = self.misses = 0
        self._closer: Closer | None = None
        self._answer_tokens: OrderedDict[str, int | None] = OrderedDict()
        self._overhead: int | None = None

    @property
    def closer(self) -> Closer:
        """The ending search of this tokenizer (closing.py), built on first use."""
        if self._closer is None:
            self._closer = Closer(self.tokenizer, self.eos_token_ids)
        return self._closer

    def answer_tokens(self, p: StructuredOutputsParams) -> int | None:
        """Harmony: the fewest tokens of `p`'s answer the closer finds from the start of the
        turn without an analysis message (`<|channel|>` … `<|call|>` / `<|return|>`): what
        the analysis budget must leave. None when it finds no ending (then nothing is
        reserved). Cached per constraint."""
        key = p.cache_key()
        if key not in self._answer_tokens:
            path = self.closer.path(self.matcher(p, 0).matcher, MAX_ENDING)
            self._answer_tokens[key] = None if path is None else len(path)
            if len(self._answer_tokens) > CACHE_SIZE:
                self._answer_tokens.popitem(last=False)
        self._answer_tokens.move_to_end(key)
        return self._answer_tokens[key]

    def analysis_overhead(self) -> int:
        """The tokens of an analysis message beyond its text: `<|channel|>analysis<|message|>`
        and `<|end|><|start|>assistant` (6 with o200k)."""
        if self._overhead is None:
            self._overhead = sum(
                len(self.tokenizer.tokenize_str(t, parse_special=True))
                for t in ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"))
        return self._overhead

    def matcher(self, p: StructuredOutputsParams, analysis_budget: int) -> GrammarMatcher:
        """A fresh matcher for `p`; GrammarError (a ValueError) when it is over a bound
        (limits.py) or does not compile."""
        key = _Key(p.cache_key(), analysis_budget)
        template = self._cache.get(key)
        if template is None:
            self.misses += 1
            limits.check(p)
            template = compile_in_thread(self._compile, p, analysis_budget)
            self._cache[key] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self.hits += 1
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy(), self)

    def _compile(self, p: StructuredOutputsParams, analysis_budget: int) -> Any:
        return compile_matcher(self.tokenizer, p, analysis_budget)

    def fill(self, rows: list[tuple[GrammarMatcher, int]], bitmask_ptr: int, batch: int,
             parallel: bool = True) -> None:
        """Write each matcher's allowed-token bitmask (int32 words, bit i of word j = token
        32 j + i) into row `index` of the [batch, words] buffer at `bitmask_ptr`. `parallel`:
        rows spread over llguidance's executor threads; else filled one by one on the calling
        thread, which for a few rows saves the hand-off to the pool and back (on a busy CPU
        the wait to be scheduled again cost more than the masks: 7 ms of wall time against
        0.1 ms of CPU for 8 rows of o200k under load 5)."""
        words = (self.vocab_size + 31) // 32
        free = [(m, i) for m, i in rows if m.forced_token is None]
        if parallel and free:
            self.executor.unsafe_compute_mask_ptr([(m.matcher, i) for m, i in free], bitmask_ptr,
                                                  words * 4, batch)
        elif free:
            for m, i in free:
                m.matcher.unsafe_compute_mask_ptr(bitmask_ptr + i * words * 4, words * 4)
        for m, i in rows:
            forced = m.forced_token
            if forced is not None:       # taking an ending (closing.py): that token alone
                _write_one(bitmask_ptr + i * words * 4, words, forced)
        for m, _ in free:                # a limit llguidance hit computing a mask
            m.check()


def _write_one(row_ptr: int, words: int, token: int) -> None:
    """A bitmask row (int32 words at `row_ptr`) that allows `token` alone."""
    ctypes.memset(row_ptr, 0, words * 4)
    ctypes.c_uint32.from_address(row_ptr + (token // 32) * 4).value = 1 << (token % 32)


def compile_matcher(tokenizer: Any, p: StructuredOutputsParams, analysis_budget: int) -> Any:
    """`p` compiled against `tokenizer` (an LLTokenizer): an LLMatcher at the start of the
    output; GrammarError naming the problem when it does not compile. No bounds checked."""
    import llguidance
    grammar = build_grammar(p, analysis_budget)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise GrammarError(_short(matcher.get_error()))
    return matcher


def validate(p: StructuredOutputsParams, tokenizer: Any = None, analysis_budget: int = 0,
             ) -> None:
    """Check that `p` compiles (the API server's early 400; compile_check.py runs it in a
    worker process). With the checkpoint's `tokenizer` (an LLTokenizer) it is the engine's
    own compile; without one, llguidance's validation of the grammar (a harmony envelope's
    special tokens need a tokenizer: then its pieces are checked alone). No bounds
    checked (limits.check). GrammarError names the problem."""
    import llguidance
    if tokenizer is not None:
        compile_matcher(tokenizer, p, analysis_budget)
        return
    grammar = build_grammar(p, analysis_budget=0)
    if p.harmony:                 # special tokens need a tokenizer: check the pieces alone
        grammar = build_grammar(_without_envelope(p), analysis_budget=0)
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error and not error.startswith("WARNING"):
        raise GrammarError(_short(error))


def _without_envelope(p: StructuredOutputsParams) -> StructuredOutputsParams:
    from dataclasses import replace
    return replace(p, harmony=False)


def _first_line(error: str | None) -> str:
    return next((line.strip() for line in (error or "").splitlines() if line.strip()), "")


def _short(error: str) -> str:
    """llguidance's message on one line: its first line plus an `error: ...` detail line
    (it also quotes the pattern and our grammar with carets, which we leave out)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()
