"""Scraping the Prometheus exporter over real HTTP, as Prometheus would."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, timeout: float = 30) -> Samples:
    """Every sample of ``url`` (``/metrics``): ``(sample name, labels)`` -> value."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels``; fails the test if there is none."""
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def bucket(samples: Samples, name: str, le: str, **labels: str) -> float:
    return value(samples, f"{name}_bucket", le=le, **labels)
