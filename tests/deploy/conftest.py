from __future__ import annotations

import json
import shutil

import pytest

from tests.engine.conftest import tiny  # noqa: F401


@pytest.fixture(scope="session")
def tiny_no_eos(tiny, tmp_path_factory):  # noqa: F811
    """The tiny checkpoint without an EOS token: sampled outputs always run to max_tokens, so
    validate's "non-empty text" checks cannot be failed by a first-token EOS."""
    path = tmp_path_factory.mktemp("tiny-no-eos") / "tiny"
    shutil.copytree(tiny[0], path)
    (path / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    return path
