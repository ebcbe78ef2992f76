"""Prometheus families computed at scrape time, for every kvgate server: nothing on the request path, the state
read when ``/metrics`` is asked for.

A server subclasses :class:`ScrapeCollector` (``collect`` yields families built with :func:`gauge`,
:func:`counter` and :func:`labelled`), registers it in a :func:`new_registry`, and answers ``/metrics`` with
:func:`exposition`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Labels = Mapping[str, str] | None
_F = TypeVar("_F", GaugeMetricFamily, CounterMetricFamily)


class ScrapeCollector:
    """A collector with nothing to describe ahead of a scrape (its registry does not auto-describe)."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:  # pragma: no cover - subclasses say what they collect
        raise NotImplementedError


def new_registry(collector: ScrapeCollector) -> CollectorRegistry:
    """A registry of ``collector`` alone."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)  # type: ignore[arg-type]
    return registry


def gauge(name: str, doc: str, value: float, labels: Labels = None) -> GaugeMetricFamily:
    """One gauge sample, with ``labels`` (name -> value) if given."""
    return _one(GaugeMetricFamily, name, doc, value, labels)


def counter(name: str, doc: str, value: float, labels: Labels = None) -> CounterMetricFamily:
    """One counter sample, with ``labels`` (name -> value) if given."""
    return _one(CounterMetricFamily, name, doc, value, labels)


def _one(kind: type[_F], name: str, doc: str, value: float, labels: Labels) -> _F:
    if not labels:
        return kind(name, doc, value=value)
    m = kind(name, doc, labels=list(labels))
    m.add_metric(list(labels.values()), value)
    return m


def labelled(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, label: str,
    values: Mapping[str, float], keys: Sequence[str] | None = None, labels: Labels = None,
) -> Metric:
    """One family, a sample per ``label`` value: ``values[key]`` for each of ``keys`` (all of ``values`` by
    default; a key ``values`` lacks counts as 0), after the constant ``labels``."""
    const = dict(labels or {})
    m = kind(name, doc, labels=[*const, label])
    for key in keys if keys is not None else values:
        m.add_metric([*const.values(), key], values.get(key, 0))
    return m


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """``(body, content type)`` of a scrape of ``registry``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
