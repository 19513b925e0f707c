"""The one gate every output constraint passes before the engine compiles it.

Owner: structured outputs (server side). `check_constraint(p, param)` is called for the
request's own fields (server/structured.py: response_format, structured_outputs,
guided_*), tool choice and the Responses API's `text.format` (server/structured_hooks.py):

1. the bounds of kvrelay/structured/limits.py: a 400 naming the field and the limit;
2. one compile in a worker process (kvrelay/structured/compile_check.py), with the
   checkpoint's tokenizer once `configure` ran (`kvrelay serve` start-up): a grammar that
   does not compile is a 400 with llguidance's reason, one that crashes the worker or
   outlasts the compile budget a 400 "too complex"; the API process never compiles a
   grammar itself. No worker can be started: 503.

Both are plain synchronous calls (the server runs them on its preparation threads, off
the event loop). Verdicts are remembered by the digest of the constraint (an agent sends
the same tools every turn); a timeout is not, as it depends on the machine's load.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

from kvrelay.server.protocol import OpenAIError
from kvrelay.structured import compile_check, limits
from kvrelay.structured.manager import analysis_budget
from kvrelay.structured.params import StructuredOutputsParams


def configure(model_dir: Path | None) -> None:
    """At server start: compile checks use the checkpoint's tokenizer (the engine's own
    compile), and the first worker starts loading it now."""
    path = None if model_dir is None else Path(model_dir) / "tokenizer.json"
    compile_check.configure(path if path is not None and path.is_file() else None)


def check_constraint(p: StructuredOutputsParams, param: str) -> None:
    """400 naming `param` when `p` is over a bound or does not compile (in a compile-check
    worker; the verdict is cached); 503 when no worker can be started."""
    try:
        limits.check(p)
    except ValueError as e:             # LimitExceeded (a GrammarError), a schema text's error
        raise OpenAIError(f"{param}: {e}", param=param) from None
    error = _compile_error(p)
    if error:
        raise OpenAIError(f"{param}: {error}", param=param)


_VERDICTS: OrderedDict[bytes, str | None] = OrderedDict()
_VERDICTS_LOCK = threading.Lock()
_MAX_VERDICTS = 1024


def _compile_error(p: StructuredOutputsParams) -> str | None:
    """Why `p` does not compile (None: it does); see the module docstring."""
    key = hashlib.sha256(p.cache_key().encode()).digest()
    with _VERDICTS_LOCK:
        if key in _VERDICTS:
            _VERDICTS.move_to_end(key)
            return _VERDICTS[key]
    try:
        error = compile_check.default().check(p, analysis_budget(p, None))
    except compile_check.CheckUnavailable as e:
        raise OpenAIError(f"structured outputs are unavailable: {e}", 503,
                          "ServiceUnavailableError") from None
    if error is not None and error.startswith(compile_check.TIMED_OUT):
        return error
    with _VERDICTS_LOCK:
        _VERDICTS[key] = error
        while len(_VERDICTS) > _MAX_VERDICTS:
            _VERDICTS.popitem(last=False)
    return error
