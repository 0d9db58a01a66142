"""Reading a process's Prometheus endpoint in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, list]:
    """Family name (counters without `_total`) -> its samples."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def sample_values(found: dict[str, list], family: str, suffix: str = "") -> dict:
    """(label values, in label order) -> value, of the family's samples named `family` +
    `suffix` (`_total`, `_count`, `_sum`; "" for a gauge)."""
    return {
        tuple(s.labels.values()): s.value
        for s in found.get(family, [])
        if s.name == family + suffix or (not suffix and s.name == family)
    }
