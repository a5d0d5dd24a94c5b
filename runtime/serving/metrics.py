"""Prometheus metrics of a serving engine (``GET /metrics`` of treeflash-serve), in a registry of their
own so that several servers in one process (tests) never share counters.

Every finished request adds its own figures, the same ones its response reports (usage and its
``treeflash`` field), so the counters add up to what the clients were told. The gauges are read at
scrape time from the requests in flight.

Two sets of names: the project's own (``treeflash_*``) and vLLM's (``vllm:*``, labelled by
``model_name``), which existing dashboards and load generators read. A round that verified drafted
nodes is one of vLLM's drafts; a plain-decoding round drafts nothing.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; a CPU round of the default pair is about 0.1 s, a GPU round a few ms.
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_E2E = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_GAINED = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 24, 32)  # tokens a round gains: at most the block size

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int], model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        Gauge("treeflash_requests_running", "Requests holding a slot (prefilling or generating).",
              registry=r).set_function(running)
        Gauge("treeflash_requests_waiting", "Requests waiting for a slot.", registry=r).set_function(waiting)
        self.requests = Counter("treeflash_requests", "Requests ended, by finish reason (stop, length, "
                                "cancelled, error, timeout).", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("treeflash_prompt_tokens", "Prompt tokens of ended requests.", registry=r)
        self.generation_tokens = Counter("treeflash_generation_tokens", "Tokens returned to clients.", registry=r)
        self.ttft = Histogram("treeflash_time_to_first_token_seconds", "Submission to the first token.",
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("treeflash_inter_token_latency_seconds", "Per request: (last token - first token) / "
                             "(tokens after the first).", buckets=_ITL, registry=r)
        self.e2e = Histogram("treeflash_e2e_request_latency_seconds", "Submission to the last token.",
                             buckets=_E2E, registry=r)
        self.rounds = Counter("treeflash_spec_rounds", "Rounds (verifier passes after the prefill), plain "
                              "decoding included.", registry=r)
        self.drafted = Counter("treeflash_spec_drafted_nodes", "Drafted tree nodes verified (root excluded; "
                               "0 for a plain-decoding round).", registry=r)
        self.accepted = Counter("treeflash_spec_accepted_tokens", "Drafted tokens the verifier accepted; "
                                "(accepted + rounds) / rounds is the mean tokens per round.", registry=r)
        self.gained = Histogram("treeflash_spec_tokens_per_round", "Tokens a request gained in one round "
                                "(accepted drafts + the verifier's own token).", buckets=_GAINED, registry=r)
        self.by_nodes = Counter("treeflash_spec_rounds_by_tree_nodes", "Request rounds by the nodes their "
                                "tree verified, root included (1: plain decoding).", ["tree_nodes"], registry=r)

        # vLLM's names, for the dashboards and tools that read them
        m = ["model_name"]
        Gauge("vllm:num_requests_running", "Requests holding a slot.", m, registry=r).labels(
            model_name).set_function(running)
        Gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", m, registry=r).labels(
            model_name).set_function(waiting)
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of ended requests.", m, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Tokens returned to clients.", m, registry=r)
        self.v_drafts = Counter("vllm:spec_decode_num_drafts", "Rounds that verified drafted tokens.", m,
                                registry=r)
        self.v_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens (tree nodes) "
                                      "verified.", m, registry=r)
        self.v_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", m,
                                  registry=r)
        self.v_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts whose accepted path "
                                 "reached this depth (0: the first drafted token).", ["model_name", "position"],
                                 registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Submission to the first token.", m,
                                buckets=_TTFT, registry=r)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "One observation per returned token after "
                               "the first: a round's wait shared by the tokens it brought.", m, buckets=_ITL,
                               registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Submission to the last token.", m,
                               buckets=_E2E, registry=r)

    def positions(self, n: int) -> None:
        """Shows the per-position counter for depths 0..n-1 (a block of n + 1) before any draft reaches them."""
        for pos in range(n):
            self.v_per_pos.labels(self.model_name, str(pos))

    def record(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, spec: dict,
               ttft_s: float | None, itl_s: list[float], e2e_s: float | None, accept_lengths: list[int] = ()) -> None:
        """One ended request: its usage figures (``spec`` is its ``treeflash`` field), latencies (``itl_s``:
        one per returned token after the first) and the tokens each of its rounds gained."""
        name = self.model_name
        self.requests.labels(finish_reason).inc()
        for total, value in ((self.prompt_tokens, prompt_tokens), (self.generation_tokens, completion_tokens)):
            total.inc(value)
        self.v_prompt.labels(name).inc(prompt_tokens)
        self.v_generation.labels(name).inc(completion_tokens)
        self.rounds.inc(spec["rounds"])
        self.drafted.inc(spec["drafted_nodes"])
        self.accepted.inc(spec["accepted_tokens"])
        self.v_drafts.labels(name).inc(spec["num_drafts"])
        self.v_draft_tokens.labels(name).inc(spec["drafted_nodes"])
        self.v_accepted.labels(name).inc(spec["accepted_tokens"])
        for accepted, rounds in spec["acceptance_histogram"].items():
            for pos in range(int(accepted)):
                self.v_per_pos.labels(name, str(pos)).inc(rounds)
        for nodes, rounds in spec["rounds_by_tree_nodes"].items():
            self.by_nodes.labels(nodes).inc(rounds)
        for gained in accept_lengths:
            self.gained.observe(gained)
        if itl_s:
            self.itl.observe(sum(itl_s) / len(itl_s))
        for gap in itl_s:
            self.v_itl.labels(name).observe(gap)
        for ours, theirs, value in ((self.ttft, self.v_ttft, ttft_s), (self.e2e, self.v_e2e, e2e_s)):
            if value is not None:
                ours.observe(value)
                theirs.labels(name).observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
