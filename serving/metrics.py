"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Per-variant series carry a ``model`` label (the request's model id; the base is its own id);
``bitdelta_http_responses_total`` counts every response by route pattern and status code (no
model label: a 404's model name is the client's, not a bounded set).
Updated from the event loop, the IO threads and the device thread (prometheus_client is
thread-safe).
"""

from __future__ import annotations

from prometheus_client import (
  CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for app.py)
  CollectorRegistry,
  Counter,
  Gauge,
  Histogram,
  disable_created_metrics,
  generate_latest,
)

# No ``*_created`` series: they double every counter/histogram family in the exposition and
# scrapers that do not understand them show them as duplicates (process-wide setting).
disable_created_metrics()

TIERS = ("device", "host", "disk")
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LOAD = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class Metrics:
  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.requests = Counter("bitdelta_requests", "Completed HTTP generation requests",
                            ["model", "endpoint", "status"], registry=r)
    self.responses = Counter("bitdelta_http_responses", "HTTP responses by route and status code "
                             "(every route; 4xx and 5xx included)", ["route", "status"],
                             registry=r)
    self.prompt_tokens = Counter("bitdelta_prompt_tokens", "Prompt tokens", ["model"], registry=r)
    self.generated_tokens = Counter("bitdelta_generated_tokens", "Generated tokens", ["model"],
                                    registry=r)
    self.ttft = Histogram("bitdelta_time_to_first_token_seconds",
                          "Request arrival to first token", ["model"], buckets=_LATENCY, registry=r)
    self.itl = Histogram("bitdelta_inter_token_latency_seconds", "Time between streamed tokens",
                         ["model"], buckets=_LATENCY, registry=r)
    self.cache_hits = Counter("bitdelta_cache_hits", "Delta cache hits per tier",
                              ["model", "tier"], registry=r)
    self.cache_misses = Counter("bitdelta_cache_misses", "Delta cache misses per tier",
                                ["model", "tier"], registry=r)
    self.load_seconds = Histogram("bitdelta_variant_load_seconds",
                                  "Variant load time into a device slot, by source tier",
                                  ["model", "source"], buckets=_LOAD, registry=r)
    self.loads = Counter("bitdelta_variant_loads", "Variant loads by outcome",
                         ["model", "outcome"], registry=r)
    self.evictions = Counter("bitdelta_evictions", "Variants evicted from a tier",
                             ["model", "tier"], registry=r)
    self.tier = Gauge("bitdelta_variant_tier", "1 for the variant's current (highest) tier",
                      ["model", "tier"], registry=r)
    self.host_bytes = Gauge("bitdelta_host_cache_bytes", "Bytes of deltas held in host memory",
                            registry=r)
    self.host_budget = Gauge("bitdelta_host_cache_budget_bytes", "Host cache byte budget",
                             registry=r)
    self.slots_used = Gauge("bitdelta_device_slots_used", "Device slots holding a variant",
                            registry=r)
    self.slots_total = Gauge("bitdelta_device_slots", "Device variant slots", registry=r)
    self.batch_rows = Gauge("bitdelta_batch_rows_active", "Decode rows in use", registry=r)
    self.batch_occupancy = Gauge("bitdelta_batch_occupancy", "Fraction of decode rows in use",
                                 registry=r)
    self.queue_depth = Gauge("bitdelta_queue_depth",
                             "Requests admitted but not yet decoding (engine queue)", registry=r)
    self.waiting = Gauge("bitdelta_requests_waiting_for_load",
                         "Requests waiting for their variant to reach a device slot", registry=r)
    self.in_flight = Gauge("bitdelta_requests_in_flight", "Requests in flight", ["model"],
                           registry=r)
    self.rejected = Counter("bitdelta_requests_rejected", "Generation requests refused at "
                            "admission (429 queue_full: past --max-batch + --max-queued-requests)",
                            ["reason"], registry=r)
    self.stalled = Counter("bitdelta_stalled_sequences", "Choices failed by the stall watchdog "
                           "(no progress for stall_timeout_s: a server fault)", registry=r)
    self.step_failures = Counter("bitdelta_step_failures", "Engine steps that raised (their "
                                 "requests failed; the engine rebuilt its KV pools)", registry=r)

  def set_tier(self, model: str, tier: str | None) -> None:
    for t in TIERS:
      self.tier.labels(model, t).set(1.0 if t == tier else 0.0)

  def forget(self, model: str) -> None:
    """Drops a variant's tier series (after DELETE)."""
    for t in TIERS:
      try:
        self.tier.remove(model, t)
      except KeyError:
        pass

  def render(self) -> bytes:
    return generate_latest(self.registry)
