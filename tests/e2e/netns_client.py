"""HTTP calls read as JSON from stdin, answers written as JSON to stdout (run inside a
network namespace by tests/e2e/netns.py). A call whose "json" holds the key
"$prefill_params" gets the kv_transfer_params of the previous answer substituted."""
from __future__ import annotations

import json
import sys

import httpx


def main() -> None:
    calls = json.load(sys.stdin)
    answers = []
    with httpx.Client(timeout=120, trust_env=False) as client:
        for call in calls:
            body = call.get("json")
            if isinstance(body, dict) and body.pop("$prefill_params", False):
                body["kv_transfer_params"] = answers[-1]["body"]["kv_transfer_params"]
            r = client.request(call["method"], call["url"], json=body)
            try:
                payload = r.json()
            except ValueError:
                payload = r.text
            answers.append({"status": r.status_code, "body": payload})
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
