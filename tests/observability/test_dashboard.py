"""The Grafana dashboard charts only what /metrics exports, and tells the P/D story: where time to
first token goes (queue, prefill, KV transfer), inter-token latency by decode worker, KV transfer
bandwidth and failures, recomputes, and how full each pool is."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics import WORKER_COUNTERS, WORKER_GAUGES, WORKER_HISTOGRAMS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
CHART_COPY = ROOT / "helm" / "pdserve" / "dashboards" / "pdserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_series(scrape: str) -> set[str]:
    """The sample names a live scrape shows, empty families included, plus every worker family
    (a worker of another role may add samples a colocated one has none of)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(scrape):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    names |= {name + "_total" for name in WORKER_COUNTERS} | set(WORKER_GAUGES)
    names |= {name + suffix for name in WORKER_HISTOGRAMS for suffix in SUFFIXES["histogram"]}
    return names


def queries(node: Any) -> Iterator[str]:
    """Every PromQL string in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "definition", "query") and isinstance(item, str):
                yield item
            else:
                yield from queries(item)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def metrics_named(dashboard: dict) -> set[str]:
    return {name for query in queries(dashboard) for name in re.findall(r"\b(?:vllm|pdserve):[A-Za-z0-9_:]+", query)}


def test_every_query_names_an_exported_metric(live_scrape: str) -> None:
    assert CHART_COPY.read_text() == DASHBOARD.read_text(), "the chart's copy differs: cp deploy/grafana-dashboard.json"
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series(live_scrape)
    named = metrics_named(dashboard)
    assert named and named <= exported, f"charted but not exported: {sorted(named - exported)}"


def test_the_dashboard_has_a_prefill_decode_view() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    named = metrics_named(dashboard)
    story = {
        "TTFT split": {"vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
                       "pdserve:kv_transfer_exposed_seconds_sum", "vllm:time_to_first_token_seconds_sum"},
        "ITL by decode worker": {"vllm:request_decode_time_seconds_sum", "vllm:request_generation_tokens_sum"},
        "KV transfer": {"pdserve:kv_transfer_bytes_total", "pdserve:kv_transfer_seconds_total",
                        "pdserve:kv_transfer_failures_total", "pdserve:kv_transfer_exposed_seconds_bucket"},
        "recomputes": {"pdserve:kv_recomputes_total"},
        "pool saturation": {"pdserve:max_num_seqs", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"},
    }
    for what, metrics in story.items():
        assert metrics <= named, f"{what}: not charted {sorted(metrics - named)}"
    targets = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert any("by (worker)" in e and "vllm:request_decode_time_seconds_sum" in e for e in targets)  # per decode worker


def test_every_exported_metric_is_documented(live_scrape: str) -> None:
    """docs/observability.md (which the HELP texts point to) lists every family /metrics shows."""
    documented = (ROOT / "docs" / "observability.md").read_text()
    families = {family.name for family in text_string_to_metric_families(live_scrape)
                if not family.name.endswith("_created")}  # prometheus_client's start times, one per family
    families |= set(WORKER_GAUGES) | set(WORKER_COUNTERS) | set(WORKER_HISTOGRAMS)
    missing = sorted(name for name in families if f"`{name}`" not in documented)
    assert not missing, f"not in docs/observability.md: {missing}"
