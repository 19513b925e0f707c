"""Imports point down: the TP executor knows no engine module; config resolution no torch."""
from __future__ import annotations

import subprocess
import sys


def test_the_tp_executor_imports_no_engine_module():
    code = ("import sys, kvrelay.distributed.tp_workers; "
            "print(sorted(m for m in sys.modules if m.startswith('kvrelay.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_resolution_imports_no_torch():
    """`kvrelay.config` is read by the API process and `kvrelay deploy`."""
    code = "import sys, kvrelay.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

