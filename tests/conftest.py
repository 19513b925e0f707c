from __future__ import annotations

import logging

import pytest

# transformers warns about the tiny configs' YaRN context ratio; it is irrelevant here
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    yield
