from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

# One intra-op thread per process: tests run a test process and server/engine processes
# side by side on 2 cores, and oversubscribed OpenMP barriers make small ops ~100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# transformers warns about the tiny configs' YaRN context ratio; it is irrelevant here
logging.getLogger("transformers").setLevel(logging.ERROR)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")     # read when a test first imports it


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """Quiet transformers for the tests that use it, without importing it for the rest."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    yield


@pytest.fixture(scope="session", autouse=True)
def _paged_decode_kernel():
    """Build the native kernels (MoE, paged decode attention) once, before any test starts
    a server: they are cached on disk, and a cold build (a minute quiet, minutes on a
    loaded machine) inside an engine's warm-up would eat the server fixtures' start-up
    timeout."""
    from kvrelay.model import kernels
    kernels.status()
