"""Reading a live service's /metrics in e2e tests: one scrape as {(sample name, labels): value},
and the sum of a metric's samples over the labels a test does not name. Tests compare two scrapes
taken around what they do, so that what earlier tests did on the same process does not count."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient, base_url: str) -> Samples:
    response = await client.get(f"{base_url}/metrics")
    assert response.status_code == 200, response.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (sample_name, sample_labels), value in samples.items() if sample_name == name and wanted <= sample_labels)


def is_exported(samples: Samples, name: str) -> bool:
    return any(sample_name == name for sample_name, _ in samples)


def grew(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much `name` (summed over the labels not given) rose from `before` to `after`."""
    return total(after, name, **labels) - total(before, name, **labels)
