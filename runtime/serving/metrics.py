"""Prometheus metrics of a serving engine (``GET /metrics`` of treeflash-serve), in a registry of their
own so that several servers in one process (tests) never share counters.

Every finished request adds its own figures, the same ones its response reports (usage and its
``treeflash`` field), so the counters add up to what the clients were told. The gauges are read at
scrape time from the requests in flight.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; a CPU round of the default pair is about 0.1 s, a GPU round a few ms.
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        Gauge("treeflash_requests_running", "Requests holding a slot (prefilling or generating).",
              registry=r).set_function(running)
        Gauge("treeflash_requests_waiting", "Requests waiting for a slot.", registry=r).set_function(waiting)
        self.requests = Counter("treeflash_requests", "Requests ended, by finish reason (stop, length, "
                                "cancelled, error).", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("treeflash_prompt_tokens", "Prompt tokens of ended requests.", registry=r)
        self.generation_tokens = Counter("treeflash_generation_tokens", "Tokens returned to clients.", registry=r)
        self.ttft = Histogram("treeflash_time_to_first_token_seconds", "Submission to the first token.",
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("treeflash_inter_token_latency_seconds", "Per request: (last token - first token) / "
                             "(tokens after the first).", buckets=_ITL, registry=r)
        self.e2e = Histogram("treeflash_e2e_request_latency_seconds", "Submission to the last token.",
                             buckets=_E2E, registry=r)
        self.rounds = Counter("treeflash_spec_rounds", "Speculative rounds (verifier passes after the prefill).",
                              registry=r)
        self.drafted = Counter("treeflash_spec_drafted_nodes", "Drafted tree nodes verified (root excluded).",
                               registry=r)
        self.accepted = Counter("treeflash_spec_accepted_tokens", "Drafted tokens the verifier accepted; "
                                "(accepted + rounds) / rounds is the mean tokens per round.", registry=r)

    def record(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, spec: dict,
               ttft_s: float | None, itl_s: float | None, e2e_s: float | None) -> None:
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.rounds.inc(spec["rounds"])
        self.drafted.inc(spec["drafted_nodes"])
        self.accepted.inc(spec["accepted_tokens"])
        for histogram, value in ((self.ttft, ttft_s), (self.itl, itl_s), (self.e2e, e2e_s)):
            if value is not None:
                histogram.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
