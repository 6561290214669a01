"""Prometheus metrics: one registry per app (no process globals), every name from DESIGN.md.

Attributes carry the metric name without the `gateway_` prefix (`folds`, `store_errors`, …); each
counter is also reachable by its exposed name (`folds_total`, `store_errors_total`, …).
Labels: `provider` is the upstream's configured name, `model` the configured model name the
request's model falls under (`Settings.model_label`, "other" otherwise): both bounded by the
config. Never a tenant or a conversation id.
Who counts what: `app.py` counts `requests`, `overhead`, `upstream` and `usage_tokens` for every
proxied request;
the memory path counts tokens and cost through `observe_tokens` (once, when it plans a request);
fold workers count `folds`, `fold_seconds` and `summarizer_tokens`; the store's callers count
`store_errors`; the memory path's retry queue (backlog.py) counts `unrecorded` and sets
`unrecorded_pending`; `gc_pauses` times the process's garbage collections while an app runs.
`gateway serve`'s /metrics adds the offload process's samples to its own (`SiblingSamples`).
"""

from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Iterator
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from gateway.model import Usage

# Gateway overhead is sub-millisecond when healthy: fine buckets at the low end.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
UPSTREAM_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class GCPauses:
    """`gateway_gc_pause_seconds{generation}`: how long each of this process's cyclic GC collections
    held it, and so the event loop (the overhead's tail: docs/architecture.md, Limits).

    Counted in plain lists and exported by a collector at scrape time: the GC callback runs inside
    whatever code allocated, and a Histogram's observe takes a lock that code may be holding."""

    def __init__(self) -> None:
        self.counts = [[0] * (len(GC_BUCKETS) + 1) for _ in range(3)]  # per generation; the last: +Inf
        self.sums = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:  # watching began between this collection's start and stop
            return
        seconds, generation = now - self._started, min(int(info.get("generation", 2)), 2)
        self.counts[generation][bisect.bisect_left(GC_BUCKETS, seconds)] += 1
        self.sums[generation] += seconds

    def watch(self) -> Callable[[], None]:
        """Start timing collections; returns what stops it."""
        gc.callbacks.append(self._on_gc)

        def stop() -> None:
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
        return stop

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("gateway_gc_pause_seconds",
                                       "Pauses of this process's cyclic garbage collector (each stalls the event loop)",
                                       labels=("generation",))
        # Copied first, together: a collection an allocation below sets off counts into the originals.
        all_counts, sums = [list(c) for c in self.counts], list(self.sums)
        for generation in range(3):
            counts, total, buckets = all_counts[generation], 0, []
            for bound, n in zip((*GC_BUCKETS, float("inf")), counts, strict=True):
                total += n
                buckets.append((floatToGoString(bound), total))
            family.add_metric([str(generation)], buckets, sums[generation])
        yield family


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gateway_requests", "Requests handled",
                                ("route", "context", "status", "provider", "model"), registry=r)
        self.tokens_original = Counter("gateway_tokens_original", "Estimated tokens of the client's requests",
                                       ("provider", "model"), registry=r)
        self.tokens_forwarded = Counter("gateway_tokens_forwarded", "Estimated tokens forwarded upstream",
                                        ("provider", "model"), registry=r)
        self.tokens_saved = Counter("gateway_tokens_saved", "Estimated tokens not sent upstream",
                                    ("provider", "model"), registry=r)
        self.usage_tokens = Counter("gateway_usage_tokens", "Tokens the upstream reported using (streams too)",
                                    ("provider", "model", "kind"), registry=r)
        self.summarizer_tokens = Counter("gateway_summarizer_tokens", "Tokens spent by the summarizer",
                                         ("kind",), registry=r)
        self.overhead = Histogram("gateway_overhead_seconds", "Time in the gateway, not waiting on upstream",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.upstream = Histogram("gateway_upstream_seconds", "Time waiting on the upstream", ("provider",),
                                  buckets=UPSTREAM_BUCKETS, registry=r)
        self.folds = Counter("gateway_folds", "Folds attempted, by result", ("result",), registry=r)
        self.fold_seconds = Histogram("gateway_fold_seconds", "Duration of a fold", buckets=FOLD_BUCKETS,
                                      registry=r)
        self.store_errors = Counter("gateway_store_errors", "Store operations that failed", registry=r)
        self.unrecorded = Counter("gateway_unrecorded", "Requests whose turn the store did not take when "
                                  "answered, by what became of it (queued, recorded, dropped, failed)",
                                  ("result",), registry=r)
        self.unrecorded_pending = Gauge("gateway_unrecorded_pending", "Unrecorded requests queued for a retry",
                                        registry=r)
        self.cost_saved_usd = Counter("gateway_cost_saved_usd", "Estimated input cost saved (USD)",
                                      ("provider", "model"), registry=r)
        self.gc_pauses = GCPauses()
        r.register(self.gc_pauses)  # type: ignore[arg-type]  # a collector by protocol
        for name in ("requests", "tokens_original", "tokens_forwarded", "tokens_saved", "summarizer_tokens",
                     "folds", "store_errors", "cost_saved_usd", "usage_tokens", "unrecorded"):
            setattr(self, f"{name}_total", getattr(self, name))

    def observe_tokens(self, original: int, forwarded: int, usd_saved: float = 0.0, *,
                       model: str = "other", provider: str = "other") -> None:
        """One planned request: its estimated tokens before and after the rewrite, and the input cost saved.

        `model` must come from a bounded set (`Settings.model_label`): a client-chosen string as a
        label value would grow the registry without bound."""
        self.tokens_original.labels(provider, model).inc(max(original, 0))
        self.tokens_forwarded.labels(provider, model).inc(max(forwarded, 0))
        if original > forwarded:
            self.tokens_saved.labels(provider, model).inc(original - forwarded)
        if usd_saved > 0:
            self.cost_saved_usd.labels(provider, model).inc(usd_saved)

    def observe_usage(self, provider: str, model: str, usage: Usage) -> None:
        """What the upstream reported (JSON answers and streams alike)."""
        for kind, n in (("input", usage.input_tokens), ("output", usage.output_tokens),
                        ("cache_read", usage.cache_read_tokens), ("cache_write", usage.cache_write_tokens)):
            if n:
                self.usage_tokens.labels(provider, model, kind).inc(n)

    def render(self, sibling: SiblingSamples | None = None) -> tuple[bytes, str]:
        """The exposition text and its content type, with another process's samples added (the
        offload process, gateway/offload.py)."""
        if sibling is None or not sibling.families:
            return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
        return generate_latest(_Merged(self.registry, sibling)), CONTENT_TYPE_PLAIN_0_0_4


_Key = tuple[str, str, tuple[tuple[str, str], ...]]  # family, sample name, labels


class SiblingSamples:
    """Another process's samples, as this process adds them to its own: counters and histograms
    keep what each earlier incarnation of it had counted (a restart must not make a counter go
    down), gauges are its latest value; its `gc_pause` histogram is left out (it times this
    process's loop) and so are `_created` samples (the text format gives them families of their own)."""

    LEFT_OUT = ("gateway_gc_pause_seconds",)

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, str]] = {}  # name -> (type, help, unit)
        self._pid: int | None = None
        self._last: dict[_Key, float] = {}
        self._before: dict[_Key, float] = {}  # what its earlier incarnations counted

    def update(self, pid: int, text: str) -> None:
        values: dict[_Key, float] = {}
        try:
            for f in text_string_to_metric_families(text):
                if f.name.endswith("_created") or f.name in self.LEFT_OUT:
                    continue
                self.families[f.name] = (f.type, f.documentation, f.unit)
                for sample in f.samples:
                    if not sample.name.endswith("_created"):
                        values[(f.name, sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        except ValueError:
            return  # an exposition that does not parse changes nothing
        if self._pid is not None and pid != self._pid:
            for key, value in self._last.items():
                if self.families[key[0]][0] != "gauge":
                    self._before[key] = self._before.get(key, 0.0) + value
        self._pid, self._last = pid, values

    def values(self) -> dict[_Key, float]:
        out = dict(self._before)
        for key, value in self._last.items():
            out[key] = out.get(key, 0.0) + value
        return out


class _Merged:
    """A registry's families with another process's samples added, by name and labels."""

    def __init__(self, registry: CollectorRegistry, sibling: SiblingSamples) -> None:
        self.registry = registry
        self.sibling = sibling

    def collect(self) -> Iterator[Metric]:
        theirs: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for (family_name, name, labels), value in self.sibling.values().items():
            theirs.setdefault(family_name, {})[(name, labels)] = value
        for family in self.registry.collect():
            extra = theirs.pop(family.name, None)
            if extra is None or self.sibling.families[family.name][0] != family.type:
                yield family
                continue
            values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                values[key] = values.get(key, 0.0) + sample.value
            for key, value in extra.items():
                values[key] = values.get(key, 0.0) + value
            yield _family(family.name, family.documentation, family.type, family.unit, values)
        for name, extra in theirs.items():
            typ, doc, unit = self.sibling.families[name]
            yield _family(name, doc, typ, unit, extra)


def _family(name: str, doc: str, typ: str, unit: str,
            values: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> Metric:
    family = Metric(name, doc, typ, unit)
    for (sample, labels), value in values.items():
        family.add_sample(sample, dict(labels), value)
    return family
