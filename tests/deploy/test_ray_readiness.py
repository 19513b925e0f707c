"""How `kvrelay deploy --backend ray` and the proxy's actor learn that servers are ready,
with a scripted stand-in for Ray: one `wait_ready` call per server at a time (answered when
the server is ready or after a while), actors restarting mid-wait, the deadline, and the
follower writing the proxy's backends file without asking again and again."""
from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from kvrelay.deploy import ray_actors, ray_backend


class Ref:
    def __init__(self, value: Any) -> None:
        self.value = value


class FakeRay:
    """`ray.wait` / `ray.get` over refs that are answered at once (a scripted answer per
    call); counts the calls made."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, refs: list[Ref], num_returns: int = 1, timeout: float | None = None):
        self.waits += 1
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref: Ref) -> Any:
        if isinstance(ref.value, Exception):
            raise ref.value
        return ref.value


class Method:
    def __init__(self, answers: list[Any]) -> None:
        self.answers, self.calls = answers, 0

    def remote(self, *args: Any) -> Ref:
        self.calls += 1
        return Ref(self.answers.pop(0) if len(self.answers) > 1 else self.answers[0])


class Handle:
    def __init__(self, name: str, answers: list[Any]) -> None:
        self.wait_ready = Method(answers)


def state(name: str, ready: bool, role: str = "prefill") -> dict[str, Any]:
    return {"name": name, "role": role, "ip": "127.0.0.1", "url": f"http://{name}",
            "ready": ready, "draining": False}


def test_await_ready_waits_on_one_call_per_server_and_rides_out_a_restart(monkeypatch):
    monkeypatch.setattr(ray_backend.time, "sleep", lambda s: None)
    a = Handle("prefill-0", [state("prefill-0", True)])
    b = Handle("decode-0", [state("decode-0", False), RuntimeError("actor restarting"),
                            state("decode-0", False), state("decode-0", True)])
    fake = FakeRay()
    said: list[str] = []
    states = ray_backend.await_ready(fake, [a, b], 60, said.append)
    assert [s["name"] for s in states] == ["prefill-0", "decode-0"]      # the handles' order
    assert a.wait_ready.calls == 1                # answered ready: never asked again
    assert b.wait_ready.calls == 4                # one call per answer, the failed one too


def test_await_ready_names_who_is_not_ready_at_the_deadline(monkeypatch):
    monkeypatch.setattr(ray_backend.time, "sleep", lambda s: None)
    clock = iter(range(0, 10_000, 7))
    monkeypatch.setattr(ray_backend.time, "monotonic", lambda: float(next(clock)))
    slow = Handle("decode-0", [state("decode-0", False)])
    with pytest.raises(TimeoutError, match=r"not ready after 30s: decode-0"):
        ray_backend.await_ready(FakeRay(), [Handle("p", [state("p", True)]), slow], 30,
                                lambda s: None)


def test_the_follower_lists_ready_servers_and_waits_on_the_others(tmp_path, monkeypatch):
    servers = {"prefill-0": state("prefill-0", True), "prefill-1": state("prefill-1", False),
               "decode-0": state("decode-0", True, "decode")}
    waited: list[str] = []

    class Server:
        def __init__(self, name: str) -> None:
            self.name = name
            self.status = Method([servers[name]])
            outer = self

            class Wait:
                def remote(self, timeout: float) -> Ref:
                    waited.append(outer.name)
                    return Ref(servers[outer.name])
            self.wait_ready = Wait()

    fake = FakeRay()
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.setattr(ray_actors, "server_names", lambda ns: sorted(servers))
    monkeypatch.setattr(ray_actors, "server_handle", lambda name, ns: Server(name))
    proxy = ray_actors.ProxyActor.__new__(ray_actors.ProxyActor)
    proxy.ns, proxy.written = "ns", None
    proxy.backends_path = str(tmp_path / "backends.json")

    assert proxy._write_backends() == ["prefill-1"]
    listed = json.loads((tmp_path / "backends.json").read_text())
    assert listed == {"prefill": [{"id": "prefill-0", "url": "http://prefill-0"}],
                      "decode": [{"id": "decode-0", "url": "http://decode-0"}]}
    proxy._await_one(["prefill-1"])
    assert waited == ["prefill-1"]                  # only the server not ready is waited on

    servers["prefill-1"] = state("prefill-1", True)
    assert proxy._write_backends() == []
    assert [b["id"] for b in json.loads((tmp_path / "backends.json").read_text())["prefill"]] \
        == ["prefill-0", "prefill-1"]


def test_wait_ready_returns_when_the_server_first_answers(monkeypatch):
    actor = ray_actors.ServerActor.__new__(ray_actors.ServerActor)
    actor.ready = threading.Event()
    answers = iter([(503, ""), (0, ""), (200, "")])
    monkeypatch.setattr(ray_actors, "http_json", lambda url, timeout=2.0: next(answers))
    monkeypatch.setattr(ray_actors.time, "sleep", lambda s: None)
    actor.stopping, actor.ip, actor.port = False, "127.0.0.1", 1

    class Running:
        def poll(self) -> None:
            return None
    actor.proc = Running()          # type: ignore[assignment]
    actor._watch()
    assert actor.ready.is_set()
