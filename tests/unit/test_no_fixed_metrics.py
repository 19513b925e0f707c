"""/metrics exports no series that can only ever read 0 (issue 13: ignored inputs)."""
from __future__ import annotations

from msgspec.structs import fields
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.engine.messages import EngineStats
from kvrelay.server.metrics import ServerMetrics


def test_every_engine_series_reads_the_stats():
    """With every engine counter non-zero, every per-engine sample is non-zero: a series
    fed by nothing (as `kvrelay:bucket_padding_tokens` was) would read 0 here."""
    values = {f.name: (1, 2) if f.name == "spec_decode_accepted_per_pos" else i + 1
              for i, f in enumerate(fields(EngineStats))}
    stats = EngineStats(**values)
    text = ServerMetrics(lambda: stats, "m").render().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.labels.get("engine") == "0" and not s.name.endswith("_created")]
    assert {s.name for s in samples} >= {"kvrelay:engine_steps_total",
                                         "vllm:num_requests_running"}
    assert [s.name for s in samples if s.value == 0] == []
