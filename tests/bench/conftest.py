from tests.engine.conftest import tiny  # noqa: F401  (the tiny checkpoint fixture)
