from __future__ import annotations

from tests.engine.conftest import tiny  # noqa: F401
