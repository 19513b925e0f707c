from __future__ import annotations

import logging
import os

import pytest
import torch

# One intra-op thread per process: tests run a test process and server/engine processes
# side by side on 2 cores, and oversubscribed OpenMP barriers make small ops ~100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

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
