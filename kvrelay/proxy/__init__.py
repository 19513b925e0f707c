"""`kvrelay proxy`: the disaggregated prefill/decode proxy (vLLM toy_proxy_server.py's role).

`kvrelay.proxy.main.main(argv)` runs it; `kvrelay.proxy.app.build_app` is the FastAPI app;
`kvrelay.proxy.routing` holds the pairing, selection and body-rewriting rules.
See docs/proxy.md.
"""
from __future__ import annotations
