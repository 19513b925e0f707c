"""KVRELAY_CPU_ISA=generic end to end, in a process of its own (the kernels read the cap once,
at load): every family lists its generic build only, the plan's log line names the forced
ISA and the real one, and greedy decoding on the tiny model gives transformers' float32
tokens (near-tie rule) through the generic MoE, attention, prefill and argmax kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvrelay import envs
from kvrelay.model import kernels
from kvrelay.model.kernels import isa
from tests.factories import greedy_mismatch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from kvrelay import LLM, SamplingParams
    from kvrelay.model import kernels
    from kvrelay.model.kernels import isa
    status = kernels.status()
    lists = {f.name: list(getattr(torch.ops.kvrelay_kernels, f.list_op)())
             for f in isa.FAMILIES.values()}
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(json.loads(sys.argv[2]), params)
    print(json.dumps({"isa": status.isa, "lists": lists, "plan": llm.engine.model.plan.describe(),
                      "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
""")


def test_generic_kernels_give_the_reference_tokens(tiny):
    if not kernels.status().available:
        pytest.skip(f"the native kernels cannot be built here: {kernels.status().reason}")
    path, hf = tiny
    g = torch.Generator().manual_seed(28)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (3, 12, 21)]
    env = dict(os.environ, **{envs.CPU_ISA.name: "generic"})
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), json.dumps(prompts)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == "generic"
    for family, built in got["lists"].items():
        assert built == (["generic"] if "generic" in isa.FAMILIES[family].variants else []), family
    real = isa.top(isa.hardware_features())
    assert f"ISA generic (forced by KVRELAY_CPU_ISA; this CPU: {real})" in got["plan"]
    for prompt, tokens in zip(prompts, got["tokens"]):
        assert len(tokens) == 8
        problem = greedy_mismatch(hf, prompt, tokens)
        assert problem is None, problem
