"""Reading a scrape in tests: samples by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    matching = [v for (n, ls), v in scraped.items() if n == name and all((k, v) in ls for k, v in labels.items())]
    assert matching, f"no sample {name} {labels}"
    return sum(matching)
