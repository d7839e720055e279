"""Latency summaries (used by the demo and the benchmark harness)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def summarize(samples_ns: Sequence[int]) -> dict:
    """count, p50/p90/p99/p99.9, mean and min, in microseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    if a.size == 0:
        return {"count": 0, **{k: None for k in ("p50_us", "p90_us", "p99_us", "p999_us", "mean_us", "min_us")}}
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9])
    return {
        "count": int(a.size),
        "p50_us": float(p50),
        "p90_us": float(p90),
        "p99_us": float(p99),
        "p999_us": float(p999),
        "mean_us": float(a.mean()),
        "min_us": float(a.min()),
    }
