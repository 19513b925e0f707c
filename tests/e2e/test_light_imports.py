"""The light layers load neither torch nor a KV transport (issue 13): the API process,
the proxy and the scheduler's bookkeeping start without the model stack.

The modules are imported in a fresh interpreter and what they pulled in is read from
`sys.modules` (in this process other tests have loaded torch already)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "nixl", "kvrelay.disagg.transport", "kvrelay.disagg.tcp",
         "kvrelay.disagg.nixl", "kvrelay.disagg.side_channel", "kvrelay.disagg.connector",
         "kvrelay.engine.core", "kvrelay.model.gpt_oss")
LIGHT = ("kvrelay.engine.scheduler", "kvrelay.kv_cache.manager", "kvrelay.proxy.app",
         "kvrelay.proxy.main", "kvrelay.server.api", "kvrelay.engine.messages",
         "kvrelay.framing", "kvrelay.disagg.params")


def heavy_loaded_by(modules: tuple[str, ...]) -> list[str]:
    code = (f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_light_modules_load_no_torch_and_no_transport():
    if heavy_loaded_by(LIGHT):                # one interpreter for all; on failure, who
        assert {m: heavy_loaded_by((m,)) for m in LIGHT} == {m: [] for m in LIGHT}
