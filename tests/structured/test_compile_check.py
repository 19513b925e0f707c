"""Where constraints compile (kvrelay/structured/compile_check.py, backend.py): the API
server's check runs in worker processes, so a compile that overflows the stack or runs
past its budget costs a worker (killed, replaced) and answers "too complex"; the engine
compiles on a thread whose stack holds what an 8 MiB one cannot. Every worker a test
starts is gone when it ends."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvrelay.structured.compile_check import TOO_COMPLEX, CompileChecker
from kvrelay.structured.params import StructuredOutputsParams as Constraint
from tests.processes import alive
from tests.structured import bombs
from tests.structured.schemas import WEATHER

HONEST = Constraint(json=WEATHER)


def _tokenizer():
    from kvrelay.model.embedded import embedded_model_dir
    return embedded_model_dir() / "tokenizer.json"


@pytest.fixture
def checkers():
    made: list[CompileChecker] = []
    seen: set[int] = set()

    def make(**kw) -> CompileChecker:
        checker = CompileChecker(**kw)
        made.append(checker)
        return checker

    def track() -> None:
        for checker in made:
            seen.update(checker.pids)

    make.track = track  # type: ignore[attr-defined]
    yield make
    track()
    for checker in made:
        checker.close()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in seen if alive(pid)], "a compile-check worker outlived its test"


def test_a_crashing_compile_kills_only_its_worker(checkers):
    """A Lark chain of 3,000 rules (no bounds here: the checker compiles what it is given)
    overflows the worker's 8 MiB stack: SIGSEGV there, "too complex" here; the next check
    gets a fresh worker."""
    checker = checkers(tokenizer=_tokenizer())
    assert checker.check(HONEST) is None
    [first] = checker.pids
    error = checker.check(Constraint(grammar=bombs.lark_chain(3000)))
    assert error is not None and error.startswith(TOO_COMPLEX)
    assert "exit status -11" in error
    assert checker.restarts == 1 and not alive(first)
    assert checker.check(HONEST) is None
    checkers.track()
    assert checker.pids and first not in checker.pids
    bad = checker.check(Constraint(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}}))
    assert bad is not None and not bad.startswith(TOO_COMPLEX)   # an ordinary error: kept
    assert checker.restarts == 1


def test_a_runaway_compile_is_cut_at_the_budget(checkers):
    """Converting a 3,000-rule GBNF takes ~4 s (quadratic, in Python): past a 0.5 s budget
    the worker is killed and the answer is "too complex", in well under the 4 s."""
    checker = checkers(budget_s=0.5)
    assert checker.check(HONEST) is None                  # the worker is up
    [worker] = checker.pids
    start = time.monotonic()
    error = checker.check(Constraint(grammar=bombs.gbnf_chain(3000)))
    assert time.monotonic() - start < 3.0
    assert error == f"{TOO_COMPLEX}: it did not compile within 0.5 s"
    assert not alive(worker)
    assert checker.check(HONEST) is None
    checkers.track()


def test_the_check_is_the_engines_compile_with_the_tokenizer(checkers):
    """An integer multipleOf of 10^6 validates in milliseconds without a tokenizer but
    compiles for ~7 s (560 MB) against one, as the engine would: only the worker that has
    the checkpoint's tokenizer catches it."""
    runaway = Constraint(json={"type": "integer", "multipleOf": 1000003})
    with_tokenizer = checkers(tokenizer=_tokenizer(), budget_s=2.0)
    without = checkers(budget_s=2.0)
    assert without.check(runaway) is None
    error = with_tokenizer.check(runaway)
    assert error == f"{TOO_COMPLEX}: it did not compile within 2 s"
    checkers.track()


def test_the_engine_compile_thread_holds_what_kills_an_8_mib_stack():
    """A 1,200-definition $ref chain (issue 26; past the bounds on purpose) compiled on the
    main thread kills the process; on the engine's compile thread it compiles."""
    script = textwrap.dedent("""
        import sys
        from kvrelay.structured import backend
        from kvrelay.structured.params import StructuredOutputsParams
        from tests.structured import bombs
        p = StructuredOutputsParams(json=bombs.ref_chain(1200))
        if sys.argv[1] == "thread":
            backend.compile_in_thread(backend.validate, p)
        else:
            backend.validate(p)
        print("compiled")
        """)
    runs = {where: subprocess.run([sys.executable, "-c", script, where], capture_output=True,
                                  text=True, timeout=120)
            for where in ("main", "thread")}
    assert runs["main"].returncode == -11                 # SIGSEGV: why the thread exists
    assert runs["thread"].returncode == 0 and "compiled" in runs["thread"].stdout


def test_the_server_answers_a_crashed_check_with_a_400(checkers, monkeypatch):
    """If a constraint ever got past the bounds and crashed the compiler, the client gets
    a 400 naming its field (and the server is still there to send it)."""
    from kvrelay.server import grammar_check
    from kvrelay.server.protocol import OpenAIError
    from kvrelay.structured import compile_check, limits
    monkeypatch.setattr(compile_check, "_DEFAULT", checkers())
    monkeypatch.setattr(limits, "check", lambda p: None)          # as if the bounds missed it
    with pytest.raises(OpenAIError) as e:
        grammar_check.check_constraint(Constraint(grammar=bombs.lark_chain(3001)),
                                       "guided_grammar")
    assert e.value.status == 400 and e.value.param == "guided_grammar"
    assert e.value.message.startswith(f"guided_grammar: {TOO_COMPLEX}: it stopped the compiler")
    grammar_check.check_constraint(HONEST, "guided_json")         # a fresh worker answers
    checkers.track()
