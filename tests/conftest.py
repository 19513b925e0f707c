from __future__ import annotations

import contextlib
import logging
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

# One intra-op thread per process: tests run a test process and server/engine processes
# side by side on 2 cores, and oversubscribed OpenMP barriers make small ops ~100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# transformers warns about the tiny configs' YaRN context ratio; it is irrelevant here
logging.getLogger("transformers").setLevel(logging.ERROR)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")     # read when a test first imports it


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """Quiet transformers for the tests that use it, without importing it for the rest."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    yield


@pytest.fixture(autouse=True)
def _fresh_execution_plan() -> Iterator[None]:
    """Every test starts from this process's execution plan as its environment says now
    (tests set KVRELAY_* kernel variables before building models), not one an earlier
    test's environment left cached."""
    plan = sys.modules.get("kvrelay.model.execution_plan")
    if plan is not None:
        plan.current.cache_clear()
    yield
    plan = sys.modules.get("kvrelay.model.execution_plan")
    if plan is not None:
        plan.current.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    """The servers tests start keep their responses store (`kvrelay serve`'s default: SQLite
    under the state directory) in the session's temporary directory, not the user's."""
    os.environ.setdefault("KVRELAY_STATE_DIR", str(tmp_path_factory.mktemp("kvrelay-state")))


@pytest.fixture()
def serve_config(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """`serve_config(*argv)`: the ServeConfig `kvrelay serve ARGV` would launch — every flag
    checked as the command checks it (ValueError naming the flag), nothing started."""
    from kvrelay import cli
    launched: list[cli.ServeConfig] = []

    def launch(config: cli.ServeConfig) -> int:
        launched.append(config)
        return 0

    monkeypatch.setattr(cli, "_launch", launch)

    def make(*argv: str) -> cli.ServeConfig:
        assert cli._serve(cli.build_parser().parse_args(["serve", *argv])) == 0
        return launched.pop()
    return make


def pytest_report_header(config: pytest.Config) -> str:
    """Which ISA builds of the native kernels this CPU runs (the kernel tests run each of
    them) and which it cannot, with the features it lacks (those tests skip, saying so)."""
    from kvrelay.model.kernels import isa
    return isa.report()


@pytest.fixture(scope="session", autouse=True)
def _paged_decode_kernel():
    """Build the native kernels (MoE, paged decode attention) once, before any test starts
    a server: they are cached on disk, and a cold build (a minute quiet, minutes on a
    loaded machine) inside an engine's warm-up would eat the server fixtures' start-up
    timeout."""
    from kvrelay.model import kernels
    kernels.status()


# -- markers: unit, e2e, slow (registered in pyproject.toml) ------------------------------
#
# Every test gets exactly one: `e2e` when it (or a fixture it uses) starts processes
# (kvrelay servers, proxies, TP workers, a `python -c` check), `slow` when it runs in
# this process but takes seconds even on a quiet machine, `unit` otherwise. The lists
# below came from one `--durations` run with a plugin recording which tests and
# fixtures start processes; `_unit_starts_no_process` below keeps the e2e lists true.
# Entries are node-id prefixes (a directory, a file, or file::test).

E2E_PATHS = (
    "tests/e2e/",
    "tests/agent/test_agent_disagg.py",
    "tests/agent/test_agent_enforced.py",
    "tests/agent/test_agent_server.py",
    "tests/agent/test_agents_sdk.py",
    "tests/agent/test_mcp_e2e.py",
    "tests/agent/test_responses_background.py",
    "tests/bench/test_e2e_serve.py",
    "tests/bench/test_report_cli.py::test_the_bench_imports_no_torch",
    "tests/deploy/test_deploy_e2e.py",
    "tests/deploy/test_deploy_ray.py",
    "tests/deploy/test_launch.py",
    "tests/disagg/test_transport.py::test_read_from_a_crashed_producer_fails_cleanly",
    "tests/disagg/test_nixl_progress.py::test_ucx_tcp_reads_complete_without_progress_thread",
    "tests/distributed/test_data_parallel.py",
    "tests/distributed/test_expert_parallel_dp.py",
    "tests/distributed/test_multinode_dp.py",
    "tests/distributed/test_ray_backend.py",
    "tests/distributed/test_tensor_parallel.py",
    "tests/distributed/test_worker_death.py",
    "tests/engine/test_cpu_isa_generic.py",
    "tests/engine/test_spec_decode_e2e.py",
    "tests/model/test_loader_memory.py",
    "tests/proxy/test_backends_file.py::test_a_proxy_process_follows_the_file",
    "tests/proxy/test_cli.py",
    "tests/proxy/test_kv_events_routing.py::test_two_prefills_one_decode_route_by_their_events",
    "tests/server/test_admission_e2e.py",
    "tests/server/test_async_scheduling_e2e.py",
    "tests/server/test_embedded_server.py",
    "tests/server/test_fuzz.py",
    "tests/server/test_hardening.py",
    "tests/server/test_heavy_requests_e2e.py",
    "tests/server/test_harmony_server.py",
    "tests/server/test_lifecycle.py",
    "tests/server/test_native_metrics.py",
    "tests/server/test_grammar_bombs.py",
    "tests/structured/test_compile_check.py",
    "tests/structured/test_disagg.py",
    "tests/structured/test_server.py",
    "tests/unit/test_kv_cache.py::test_hashes_are_stable_across_processes",
)

# shared fixtures that start processes: (defining module, name)
E2E_FIXTURES = {
    ("tests.server.conftest", "server"),
    ("tests.agent.conftest", "agent_server"),
    ("tests.proxy.conftest", "proxies"),
    ("tests.proxy.test_cache_routing", "routed"),
    ("tests.disagg.test_transport", "pair"),
}

# in-process, over ~1.5 s each on 2 loaded cores
SLOW_PATHS = (
    "tests/model/test_embedded.py",                       # the 135M embedded model vs transformers
    "tests/kv_events/test_engine_events.py",              # two tiny engines publishing KV events
    "tests/engine/test_screened_greedy.py",               # 4 x 520 greedy tokens, o200k vocabulary
    # Inductor compiles (its own helper subprocesses included): 15-120 s
    "tests/engine/test_engine_greedy.py::test_compiled_decode_matches_transformers",
    "tests/structured/test_engine.py::test_harmony_turn_constrained_from_the_first_token",
    "tests/agent/test_agent_api.py::test_responses_constraints",
    "tests/agent/test_responses_proxy.py::test_key_body_keys_the_prompt",
    "tests/agent/test_harmony_fuzz.py",     # hypothesis: 60+ examples x 3 requests, 3-6 s a test
    "tests/disagg/test_kv_auth.py::test_tcp_transport_allocates_as_bytes_arrive_and_caps_threads",
    "tests/disagg/test_kv_auth.py::test_side_channel_frames_announcing_megabytes_cost_nothing",
    "tests/disagg/test_nixl_progress.py::test_idle_nixl_transport_costs_no_cpu",
)

SLOW_FIXTURES = {
    ("tests.unit.test_harmony", "o200k_tok"),         # builds the real o200k tokenizer.json
}

# -- smoke: the contributor's fast subset ---------------------------------------------------
#
# `python -m pytest -m "unit or smoke" -q`: every unit test plus these few e2e tests, one per
# kind of process a change most often breaks — the README's main job (the embedded model
# answering the README's request and passing `kvrelay validate`), the OpenAI API on a tiny
# server, disaggregated prefill/decode behind the proxy, `kvrelay bench serve`, and
# `kvrelay serve`'s fast errors. Each keeps its kind marker too; CI (`python -m pytest -q`,
# the README's test command) runs everything.
SMOKE_PATHS = (
    "tests/e2e/test_cli_fast_errors.py",
    "tests/server/test_embedded_server.py::test_the_readme_completion_answers_paris",
    "tests/server/test_embedded_server.py::test_validate_passes_and_knows_the_answers",
    "tests/server/test_openai_api.py::test_streaming_completion_equals_non_streaming",
    "tests/server/test_openai_api.py::test_chat_completion_and_stream",
    "tests/e2e/test_disagg_proxy.py::test_tutorial_validation_through_the_proxy",
    "tests/bench/test_e2e_serve.py::test_chat_random_without_tokenizer_counts_with_the_served",
)


def _uses_fixture(item: pytest.Item, fixtures: set[tuple[str, str]]) -> bool:
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in item.fixturenames:
        for fixturedef in defs.get(name, ())[-1:]:        # the definition this test gets
            if (getattr(fixturedef.func, "__module__", ""), name) in fixtures:
                return True
    return False


def kind_of(item: pytest.Item) -> str:
    """unit, e2e or slow (see the lists above)."""
    if item.nodeid.startswith(E2E_PATHS) or _uses_fixture(item, E2E_FIXTURES):
        return "e2e"
    if item.nodeid.startswith(SLOW_PATHS) or _uses_fixture(item, SLOW_FIXTURES):
        return "slow"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(kind_of(item))
        if item.nodeid.startswith(SMOKE_PATHS):
            item.add_marker("smoke")


@contextlib.contextmanager
def _python_processes_started() -> Iterator[list[str]]:
    """Records the Python processes (subprocess or multiprocessing) started meanwhile.
    Libraries' helper commands (`uname -p` for `platform.processor()`, the compiler
    building the native kernels) are not counted."""
    started: list[str] = []
    popen, start = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start

    def counting_popen(self, args, executable, *rest, **kwargs):   # type: ignore[no-untyped-def]
        program = executable or (args if isinstance(args, (str, bytes)) else args[0])
        if "python" in os.path.basename(os.fsdecode(program)) or program == sys.executable:
            started.append(f"subprocess {args!r:.80}")
        return popen(self, args, executable, *rest, **kwargs)

    def counting_start(self):                               # type: ignore[no-untyped-def]
        started.append(f"multiprocessing {self.name}")
        return start(self)

    subprocess.Popen._execute_child = counting_popen     # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = counting_start   # type: ignore[method-assign]
    try:
        yield started
    finally:
        subprocess.Popen._execute_child = popen          # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = start   # type: ignore[method-assign]


def _unit_starts_no_process(item: pytest.Item) -> Iterator[None]:
    """A `unit` test (or a fixture it sets up) that starts a Python process — a kvrelay
    server, a proxy, a worker, a `python -c` check — fails: it belongs in the e2e lists."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    with _python_processes_started() as started:
        result = yield
    if started:
        pytest.fail(f"a unit test started {started[0]}: add it to E2E_PATHS or E2E_FIXTURES "
                    f"in tests/conftest.py", pytrace=False)
    return result


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_unit_starts_no_process)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_unit_starts_no_process)
