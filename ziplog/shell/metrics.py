"""Prometheus metrics for every server process.

A process that is given ``--metrics-port`` serves ``/metrics`` over HTTP from
prometheus_client's own thread, with a registry of its own holding one collector. The
collector calls the process's ``read`` function at scrape time: it turns counters the
driver and its core already keep (plain ints and dicts, read under the GIL, no lock)
into metric families, so nothing is added to a request's path. The cores never import
this module (nor prometheus_client): only drivers and process mains do.

A driver builds its families with :func:`counter`, :func:`gauge` and :func:`one_of`; a
process ``main`` adds the flags with :func:`add_metrics_arguments` and starts the
server with :func:`serve_metrics`, whose result it closes on the way out.

prometheus_client is imported when a family is first built or the endpoint starts, not
with this module: it pulls in ``http.server``, ``email`` and ``ssl``, the larger part of a
server process's start-up CPU, and most processes (every one a test starts) never serve
metrics.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["AUTO_PORT", "Durations", "MetricsServer", "Read", "add_metrics_arguments", "counter",
           "counters", "directory_bytes", "gauge", "histograms", "one_of", "serve_metrics"]

log = logging.getLogger("ziplog.metrics")

#: what a process hands the collector: every family, built fresh at each scrape
Read = Callable[[], Iterable["Metric"]]

#: ``--metrics-port auto``: any free port, written to the process's log
AUTO_PORT = -1


def _port(text: str) -> int:
    if text == "auto":
        return AUTO_PORT
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range")
    return port


def add_metrics_arguments(ap: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-bind``: where the process serves Prometheus
    metrics (off unless a port is given)."""
    ap.add_argument("--metrics-port", type=_port, default=0,
                    help="serve Prometheus metrics at http://BIND:PORT/metrics (0: off, the default; auto: any free "
                         "port, written to the log)")
    ap.add_argument("--metrics-bind", default="127.0.0.1",
                    help="the address the metrics endpoint listens on (IPv4 or IPv6; 0.0.0.0 or :: for every "
                         "interface)")


# -- building families ------------------------------------------------------------------------------
def counter(name: str, doc: str, value: float, labels: Mapping[str, str] | None = None) -> CounterMetricFamily:
    """A counter (exposed as ``name_total``); ``labels``: the process's constant labels."""
    labels = labels or {}
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def counters(name: str, doc: str, label: str, values: Mapping[str, float],
             labels: Mapping[str, str] | None = None) -> CounterMetricFamily:
    """One counter per ``label`` value."""
    labels = labels or {}
    from prometheus_client.core import CounterMetricFamily

    fam = CounterMetricFamily(name, doc, labels=[*labels, label])
    for key, value in sorted(values.items()):
        fam.add_metric([*labels.values(), key], value)
    return fam


def gauge(name: str, doc: str, value: float, labels: Mapping[str, str] | None = None) -> GaugeMetricFamily:
    labels = labels or {}
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def one_of(name: str, doc: str, label: str, choices: Iterable[str], current: str | None,
           labels: Mapping[str, str] | None = None) -> GaugeMetricFamily:
    """A state as a gauge per possible value: 1 for ``current``, 0 for the others."""
    labels = labels or {}
    from prometheus_client.core import GaugeMetricFamily

    fam = GaugeMetricFamily(name, doc, labels=[*labels, label])
    for choice in choices:
        fam.add_metric([*labels.values(), choice], 1.0 if choice == current else 0.0)
    return fam


class Durations:
    """A histogram kept as plain ints by the process's thread (no lock): :meth:`observe`
    is a short loop and two additions; a scrape reads the counts and sums them up."""

    BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        bounds = self.bounds
        while i < len(bounds) and seconds > bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += seconds

    def add_to(self, fam: HistogramMetricFamily, label_values: list[str]) -> None:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], counts):
            cumulative += n
            buckets.append((bound, float(cumulative)))
        fam.add_metric(label_values, buckets, total)


def histogram(name: str, doc: str, values: Durations, labels: Mapping[str, str] | None = None) -> HistogramMetricFamily:
    labels = labels or {}
    from prometheus_client.core import HistogramMetricFamily

    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    values.add_to(fam, list(labels.values()))
    return fam


def histograms(name: str, doc: str, label: str, values: Mapping[str, Durations],
               labels: Mapping[str, str] | None = None) -> HistogramMetricFamily:
    """One histogram per ``label`` value."""
    labels = labels or {}
    from prometheus_client.core import HistogramMetricFamily

    fam = HistogramMetricFamily(name, doc, labels=[*labels, label])
    for key, durations in sorted(values.items()):
        durations.add_to(fam, [*labels.values(), key])
    return fam


def directory_bytes(path: Path) -> int:
    """Bytes the regular files directly in ``path`` hold (0 when it is gone)."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # deleted while we looked (a trimmed segment)
    except FileNotFoundError:
        return 0
    return total


# -- serving ----------------------------------------------------------------------------------------
class _ReadCollector:
    """A prometheus_client collector (it needs only ``collect``)."""

    def __init__(self, read: Read) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        # The process's thread changes what is read meanwhile; a dict that changed size
        # under an iteration is simply read again.
        for attempt in range(3):
            try:
                families = list(self.read())
            except RuntimeError:
                if attempt == 2:
                    raise
                continue
            yield from families
            return


class MetricsServer:
    """The HTTP endpoint: prometheus_client's server on its own thread, with this
    process's registry."""

    def __init__(self, read: Read, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ReadCollector(read))
        try:
            self.server, self.thread = start_http_server(0 if port == AUTO_PORT else port, host,
                                                         registry=self.registry)
        except OSError as exc:
            raise SystemExit(f"cannot serve metrics on {host} port {port}: {exc}") from None
        self.port: int = self.server.server_port
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics served on http://%s:%d/metrics (pid %d)", shown, self.port, os.getpid())
        self._closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class _Off:
    port = 0

    def close(self) -> None:
        pass


def serve_metrics(args: argparse.Namespace, read: Read) -> MetricsServer | _Off:
    """Start the endpoint :func:`add_metrics_arguments` configured (nothing when
    ``--metrics-port`` is 0); close the result when the process stops."""
    if not args.metrics_port:
        return _Off()
    return MetricsServer(read, args.metrics_port, args.metrics_bind)

