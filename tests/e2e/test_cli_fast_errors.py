"""A wrong model path or a bad config is one line within a second (issue 30): `kvrelay
serve` checks them before importing torch, the server or the model (it took 7–10 s when
torch came first). Run as a user runs it, in a fresh interpreter; the bound is generous for
a loaded 2-core machine (~0.5 s quiet), and `-X importtime` shows torch was never imported."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _serve(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvrelay.cli", "serve", *argv],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, check=False)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("argv, message", [
    (["/no/such/dir"], "kvrelay serve: error: model '/no/such/dir' is not a local directory"),
    (["--kv-transfer-config", '{"kv_role": "bogus"}'],
     "kvrelay serve: error: --kv-transfer-config: kv_role must be one of kv_producer, "
     "kv_consumer, kv_both, got 'bogus'"),
    (["--additional-config", '{"neuron_config": {"colour": 1}}'],
     "kvrelay serve: error: --additional-config: unknown neuron_config key 'colour'"),
])
def test_bad_paths_and_configs_fail_fast_without_torch(argv, message):
    out, seconds = _serve(*argv)
    lines = out.stderr.splitlines()
    errors = [line for line in lines if not line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines
                if line.startswith("import time:")}
    assert out.returncode == 1 and out.stdout == ""
    assert len(errors) == 1 and errors[0].startswith(message), out.stderr[-2000:]
    assert "kvrelay.cli_flags" in imported                  # -X importtime did report
    assert "torch" not in imported and "kvrelay.server.launch" not in imported
    assert seconds < 5, f"{seconds:.1f}s"
