from __future__ import annotations

import pytest

from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
from tests.processes import Server


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):  # noqa: F811
    """`kvrelay serve` on the tiny checkpoint (float32), two served names."""
    s = Server(str(tiny[0]), ["--dtype", "float32", "--max-model-len", "96", "--block-size", "4",
                              "--served-model-name", "tiny", "openai/gpt-oss-120b",
                              "--max-logprobs", "5"],
               tmp_path_factory.mktemp("server") / "serve.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()
