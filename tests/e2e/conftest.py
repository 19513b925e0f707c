from tests.engine.conftest import tiny  # noqa: F401
