"""The native CPU kernels' status and the half-precision matmul path on /metrics: decided
in the engine core at start-up, sent once with its "ready" info, never silent."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.model import kernels
from kvrelay.model.layers.linear import half_matmul_choice
from tests.processes import Server

WARNING = "native CPU kernels unavailable"


def labelled(server: Server, name: str) -> dict[tuple[str, ...], float]:
    """{(label values other than model_name/engine): value} of gauge `name`."""
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = tuple(v for k, v in sorted(sample.labels.items())
                            if k not in ("model_name", "engine"))
                out[key] = sample.value
    return out


def expected_half_path() -> dict[tuple[str, ...], float]:
    chosen = "native" if half_matmul_choice().native else "fp32"      # same CPU, same env
    return {("native",): float(chosen == "native"), ("fp32",): float(chosen == "fp32")}


@pytest.fixture(scope="module")
def broken_kernels_server(tiny, tmp_path_factory):
    """`kvrelay serve` where the native kernels cannot be built: no compiler, and an empty
    kernels cache (so no earlier build is loaded)."""
    tmp = tmp_path_factory.mktemp("broken-kernels")
    env = {"CXX": "no-such-compiler-kvrelay", "KVRELAY_KERNELS_DIR": str(tmp / "kernels")}
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
                              "--served-model-name", "tiny"], tmp / "serve.log", env)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_working_kernels_are_exported_with_their_isa(server):
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    isa = kernels.status().isa
    assert kernels.status().available and isa
    assert labelled(server, "kvrelay:native_kernels_available") == {
        (isa, "moe"): 1.0, (isa, "paged_decode"): 1.0,    # labels sorted: isa, kernel
        (kernels.status().dense_isa, "dense"): 1.0}
    assert labelled(server, "kvrelay:half_matmul_path") == expected_half_path()
    assert labelled(server, "kvrelay:native_kernels_ready") == {(): 1.0}


def test_failed_build_is_a_zero_gauge_and_one_warning(broken_kernels_server):
    s = broken_kernels_server
    r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 3})
    assert r.status_code == 200, r.text                 # the reference paths serve
    assert labelled(s, "kvrelay:native_kernels_available") == {
        ("none", "moe"): 0.0, ("none", "paged_decode"): 0.0, ("none", "dense"): 0.0}
    assert labelled(s, "kvrelay:half_matmul_path") == expected_half_path()
    assert labelled(s, "kvrelay:native_kernels_ready") == {(): 0.0}
    assert labelled(s, "kvrelay:native_kernels_building") == {(): 0.0}     # failed, not pending
    warnings = [line for line in s.log().splitlines() if WARNING in line]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0], warnings
