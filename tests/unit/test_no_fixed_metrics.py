"""/metrics exports no series that can only ever read 0 (issue 13: ignored inputs)."""
from __future__ import annotations

from kvrelay.server.metrics import ServerMetrics


def test_no_bucket_padding_counter():
    stats = {"num_requests_running": 1, "num_steps": 3, "padded_tokens": 0}
    text = ServerMetrics(lambda: stats, "m").render().decode()
    assert "kvrelay:engine_steps" in text            # the engine's own series are there
    assert "bucket_padding" not in text              # eager steps are never padded
