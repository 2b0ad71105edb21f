"""The ckpt metric names that the deployment files (deploy/) query.

`metric_names_used()` is what the dashboard and the alert rules reference, as the names a
scrape exposes: a histogram's `_bucket`, `_sum` and `_count` series count as the histogram,
a counter keeps its `_total`. tests/system/test_deploy.py checks these against the documented list;
a live-scrape test checks that the running code exports them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ckpt-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "ckpt-alerts.yml"

_NAME = re.compile(r"(?<![A-Za-z0-9_:])ckpt_[A-Za-z0-9_:]+")
_HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def strings(value: Any) -> Iterator[str]:
    """Every string in a parsed JSON or YAML document, keys included (not its comments)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from strings(key)
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def metric_names(text: str) -> set[str]:
    """Every ckpt_* name in `text`, with the histogram series suffixes stripped."""
    return {_HISTOGRAM_SERIES.sub("", name) for name in _NAME.findall(text)}


def metric_names_used() -> set[str]:
    """Every ckpt_* metric name that the dashboard JSON and the alert rules reference: in
    queries, legends, descriptions and annotations, but not in YAML comments."""
    docs = [json.loads(DASHBOARD.read_text()), yaml.safe_load(ALERTS.read_text())]
    return {name for doc in docs for text in strings(doc) for name in metric_names(text)}
