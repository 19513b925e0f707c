from __future__ import annotations

import pytest

from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.processes import Server


@pytest.fixture(scope="package")
def server(tiny, tmp_path_factory):  # noqa: F811
    """`kvrelay serve` on the tiny checkpoint (float32), two served names, trusting
    127.0.0.1's X-Forwarded-For (test_admission_e2e checks that). One for the package
    (test_admission_e2e, test_fuzz, test_heavy_requests_e2e, test_native_metrics and
    test_openai_api use it), since a start costs more than most of their tests: none needs
    a fresh server (each asserts on its own requests, or on an idle server)."""
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
                              "--served-model-name", "tiny", "openai/gpt-oss-120b",
                              "--max-logprobs", "5", "--forwarded-allow-ips", "127.0.0.1"],
               tmp_path_factory.mktemp("server") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
