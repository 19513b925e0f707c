"""Fixtures: fake backends (threads) and real proxy processes, all stopped on teardown.

Topologies (started once per session, in parallel):
- `main`:     prefill 127.0.0.1 × 3 ports (A B C), decode D; --routing round_robin
- `skipping`: prefill [refused, A], decode [refused, D]   (dead servers are skipped)
- `no_prefill`: prefill [refused, refused], decode D       (every prefill down → 503)
- `no_decode`:  prefill A, decode [refused]                (decode down → 503 + free notice)
- `keyed`:      as `main`, with --api-key (and OPENAI_API_KEY, the backends' key)
- `open_with_backend_key`: as `main`, no --api-key, OPENAI_API_KEY set
- `crashing_prefills`:  prefill [X, Y], decode D   (X, Y read the request, close without answering)
- `resetting_prefills`: prefill [R, S], decode D   (the same, closing with an RST)
- `crashing_decodes`:   prefill A, decode [X, Y]
- `idle_closing`:       prefill I, decode J        (I, J close connections idle for 0.5 s)
- `refused_first`:      prefill [refused, B], decode [refused, D]   (one test's alone)

All but `main` and `keyed` run without the background health probe, so their requests meet
the dead servers themselves (the connection-failure path).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.processes import free_port
from tests.proxy.fakes import FakeBackend, NoAnswer, ProxyProcess, proxy_args, refused_port

LOCAL = "127.0.0.1"
PROXY_KEY = "sk-proxy-clients"
BACKEND_KEY = "sk-backends-only"
IDLE_CLOSE_S = 0.5                 # the `idle_closing` backends' keep-alive timeout


@dataclass
class Fakes:
    prefill: list[FakeBackend]
    decode: FakeBackend
    refused: list[int]
    no_answer: list[NoAnswer]      # X, Y (FIN), R, S (RST)
    idle: list[FakeBackend]        # I (prefill), J (decode): close idle connections quickly

    @property
    def all(self) -> list[FakeBackend]:
        return [*self.prefill, self.decode, *self.idle]


@pytest.fixture(scope="session")
def fakes():
    started: list[FakeBackend] = []
    sockets = []
    no_answer: list[NoAnswer] = []
    try:
        for role in ("prefill", "prefill", "prefill", "decode"):
            started.append(FakeBackend(role).start())
        for role in ("prefill", "decode"):
            started.append(FakeBackend(role, keep_alive_s=IDLE_CLOSE_S).start())
        for _ in range(2):
            sockets.append(refused_port())
        for reset in (False, False, True, True):
            no_answer.append(NoAnswer(reset=reset))
        yield Fakes(started[:3], started[3], [port for _, port in sockets], no_answer,
                    started[4:])
    finally:
        for server in no_answer:
            server.stop()
        for fake in started:
            fake.stop()
        for s, _ in sockets:
            s.close()


@pytest.fixture(scope="session")
def proxies(fakes, tmp_path_factory):
    a, b, c = (f.port for f in fakes.prefill)
    d = fakes.decode.port
    dead1, dead2 = fakes.refused
    x, y, r, s = (server.port for server in fakes.no_answer)
    i, j = (fake.port for fake in fakes.idle)
    no_probe = ["--health-interval", "0"]
    topologies = {
        "main": ([LOCAL], [a, b, c], [LOCAL], [d],
                 ["--health-interval", "0.2", "--routing", "round_robin"], {}),
        "skipping": ([LOCAL], [dead1, a], [LOCAL], [dead2, d], no_probe, {}),
        "no_prefill": ([LOCAL, LOCAL], [dead1, dead2], [LOCAL], [d], no_probe, {}),
        "no_decode": ([LOCAL], [a], [LOCAL], [dead1], no_probe, {}),
        "keyed": ([LOCAL], [a, b, c], [LOCAL], [d], ["--api-key", PROXY_KEY],
                  {"OPENAI_API_KEY": BACKEND_KEY}),
        "open_with_backend_key": ([LOCAL], [a], [LOCAL], [d], no_probe,
                                  {"OPENAI_API_KEY": BACKEND_KEY}),
        "crashing_prefills": ([LOCAL], [x, y], [LOCAL], [d], no_probe, {}),
        "resetting_prefills": ([LOCAL], [r, s], [LOCAL], [d], no_probe, {}),
        "crashing_decodes": ([LOCAL], [a], [LOCAL], [x, y], no_probe, {}),
        "idle_closing": ([LOCAL], [i], [LOCAL], [j], no_probe, {}),
        "refused_first": ([LOCAL], [dead1, b], [LOCAL], [dead2, d], no_probe, {}),
    }
    logs = tmp_path_factory.mktemp("proxy")
    running: dict[str, ProxyProcess] = {}
    try:
        for name, (ph, pp, dh, dp, extra, env) in topologies.items():
            running[name] = ProxyProcess(proxy_args(free_port(), ph, pp, dh, dp) + extra,
                                         logs / f"{name}.log", env=env)
        for proc in running.values():
            proc.wait_ready()
        yield running
    finally:
        for proc in running.values():
            proc.stop()


@pytest.fixture(autouse=True)
def _fresh_fakes(request):
    """Each end-to-end test starts with default scripts and empty records."""
    if "fakes" in request.fixturenames:
        fakes = request.getfixturevalue("fakes")
        for fake in fakes.all:
            fake.reset()
        for server in fakes.no_answer:
            server.received.clear()
    yield
