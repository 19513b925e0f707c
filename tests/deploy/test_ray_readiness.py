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


def test_await_ready_says_each_step_once_and_passes_back_the_step_it_saw(monkeypatch):
    def at(step: str) -> dict[str, Any]:
        return state("decode-0", step == "ready") | {"step": step, "started": 0.0}
    seen: list[Any] = []

    class Steps(Method):
        def remote(self, *args: Any) -> Ref:
            seen.append(args[1])                 # the step the caller last saw
            return super().remote(*args)
    h = Handle("decode-0", [])
    h.wait_ready = Steps([at("loading the weights"), at("loading the weights"),
                          at("warming up"), at("ready")])
    said: list[str] = []
    ray_backend.await_ready(FakeRay(), [h], 60, said.append)
    assert [line.split(" (")[0] for line in said] == [
        "decode-0: loading the weights", "decode-0: warming up", "decode-0: ready"]
    assert seen == ["starting", "loading the weights", "loading the weights", "warming up"]


def test_the_proxy_is_placed_once_a_server_has_loaded_its_weights_and_comes_last():
    def at(name: str, step: str) -> dict[str, Any]:
        return state(name, step == "ready") | {"step": step, "started": 0.0}
    a = Handle("prefill-0", [at("prefill-0", "loading the weights"),
                             at("prefill-0", "allocating the KV cache"), at("prefill-0", "ready")])
    b = Handle("decode-0", [at("decode-0", "starting up"), at("decode-0", "ready")])
    placed: list[str] = []

    def place() -> Handle:
        placed.append("proxy")
        return Handle("proxy", [at("proxy", "ready")])
    said: list[str] = []
    states = ray_backend.await_ready(FakeRay(), [a, b], 60, said.append,
                                     then=(ray_backend.PROXY_AFTER, place))
    assert [s["name"] for s in states] == ["prefill-0", "decode-0", "proxy"]
    assert placed == ["proxy"]
    # placed right after prefill-0 said it was allocating its KV cache, not before
    said = [line.split(" (")[0] for line in said]
    first = said.index("prefill-0: allocating the KV cache")
    assert not any(line.startswith("proxy") for line in said[:first])
    assert "proxy: ready" in said[first:]


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


class Running:
    pid = 1

    def poll(self) -> None:
        return None


def watching_actor(tmp_path, monkeypatch, answers: list[int]) -> tuple[Any, list[str]]:
    """A ServerActor (no Ray, no process) whose server writes `tmp_path/s.log` and answers
    /health with `answers`, one per ask; the asks are recorded."""
    actor = ray_actors.ServerActor.__new__(ray_actors.ServerActor)
    actor.ready, actor.changed = threading.Event(), threading.Condition()
    actor.step, actor.stopping, actor.draining = ray_actors.STARTING, False, False
    actor.name, actor.role, actor.node, actor.ip, actor.port = "p", "prefill", "n", "127.0.0.1", 1
    actor.started = 0.0
    actor.log_path = str(tmp_path / "s.log")
    (tmp_path / "s.log").write_text("an earlier run's lines: Application startup complete\n")
    actor.log_offset = (tmp_path / "s.log").stat().st_size
    actor.proc = Running()          # type: ignore[assignment]
    asked: list[str] = []

    def http(url: str, timeout: float = 2.0) -> tuple[int, str]:
        asked.append(url)
        return (answers.pop(0) if answers else 200), ""
    monkeypatch.setattr(ray_actors, "http_json", http)
    monkeypatch.setattr(ray_actors, "WATCH_S", 0.01)
    return actor, asked


def test_the_actor_follows_the_log_and_asks_the_server_only_once_it_says_ready(
        tmp_path, monkeypatch):
    actor, asked = watching_actor(tmp_path, monkeypatch, [503, 200])
    watcher = threading.Thread(target=actor._watch)
    watcher.start()
    try:
        st = actor.wait_ready(0.3, ray_actors.STARTING)
        assert not st["ready"] and st["step"] == "starting" and asked == []  # this run: nothing
        with open(actor.log_path, "a") as f:
            f.write("INFO:     Waiting for application startup.\nLoading weights: 3/32\n")
        st = actor.wait_ready(5.0, "starting")          # returns on the news, not the timeout
        assert st["step"] == "loading the weights" and not st["ready"] and asked == []
        with open(actor.log_path, "a") as f:
            f.write("INFO:     Application startup complete.\n")
        st = actor.wait_ready(5.0)
        assert st["ready"] and st["step"] == "ready"
    finally:
        actor.stopping = True
        watcher.join(5)
    # /health: 503 then 200 (the watch), then once for the status the last call returned
    assert len(asked) == 3 and all(u.endswith("/health") for u in asked)
