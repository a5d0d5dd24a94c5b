"""`treeflash-bench --server`: the same generations in process and through a Triton server, side by
side in one run.

Rows: in process (one request at a time, the loop called directly), through the server one
request at a time (gRPC streaming), and through the server with C concurrent streams. Per
request, time to first token (TTFT: request sent -> first tokens received) and inter-token
latency (ITL: time from the first to the last response over the tokens that came after the
first response); per row, mean/p50/p90 over requests, requests per second and tokens per
second over the row's wall time. At temperature 0 every row must produce the in-process tokens.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import TreeFlashError


def distinct_prompts(prompts: list[str], n: int) -> list[str]:
    """n different prompts: the given ones, then numbered variants of them."""
    return [prompts[i % len(prompts)] + ("" if i < len(prompts) else f" ({i})") for i in range(n)]


def _timing(arrivals: list[tuple[float, int]]) -> dict:
    """arrivals: (seconds since the request, tokens) per response that carried tokens."""
    arrivals = [a for a in arrivals if a[1] > 0]
    first, last = arrivals[0][0], arrivals[-1][0]
    later = sum(n for _, n in arrivals) - arrivals[0][1]
    return {"ttft_s": first, "itl_s": (last - first) / later if later else 0.0, "e2e_s": last}


def _summary(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def _row(where: str, concurrency: int, per_request: list[dict], wall_s: float) -> dict:
    tokens = sum(r["tokens"] for r in per_request)
    return {"where": where, "concurrency": concurrency, "requests": len(per_request),
            "ttft_s": _summary([r["ttft_s"] for r in per_request]), "itl_s": _summary([r["itl_s"] for r in per_request]),
            "requests_per_s": len(per_request) / wall_s, "tokens_per_s": tokens / wall_s, "tokens": tokens}


def _in_process(sess, prompts: list[str], max_new_tokens: int) -> tuple[list[dict], float]:
    from ..loop import generate

    sampling = SamplingConfig(max_new_tokens=max_new_tokens, stop_token_ids=sess.stop_token_ids)
    out, wall = [], 0.0
    for p in prompts:
        ids = sess.tokenizer(p, add_special_tokens=True)["input_ids"]
        arrivals = []
        t0 = time.perf_counter()
        res = generate(sess.runner, ids, sess.tree, sampling,
                       on_tokens=lambda new: arrivals.append((time.perf_counter() - t0, len(new))))
        wall += time.perf_counter() - t0
        out.append(dict(_timing(arrivals), tokens=res.stats.new_tokens, token_ids=res.token_ids))
    return out, wall


def _through_server(server: str, prompts: list[str], max_new_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    from ..serving.client import request_inputs, stream_grpc

    results: list[dict | None] = [None] * len(prompts)
    errors: list[str] = []
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or errors:
                return
            try:
                r = stream_grpc(server, request_inputs(prompts[i], max_new_tokens, stream=True))
            except TreeFlashError as exc:
                errors.append(str(exc))
                return
            results[i] = dict(_timing(r.arrivals), tokens=r.new_tokens, token_ids=r.token_ids)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise TreeFlashError(f"the server failed a request: {errors[0]}")
    return results, wall


def run_serving_bench(artifacts: str, server: str, prompts: list[str], max_new_tokens: int, concurrency: int,
                      requests: int) -> dict:
    """requests: prompts per row (distinct); every row runs the same ones."""
    from ..factory import session_from_artifacts

    if concurrency < 1 or requests < 1:
        raise TreeFlashError("--concurrency and --requests must be >= 1")
    sess = session_from_artifacts(artifacts, {}, backend="onnxruntime")
    batch = distinct_prompts(prompts, max(requests, concurrency))
    _in_process(sess, batch[:1], max_new_tokens)  # warm-up (the server warmed up when it loaded)
    _through_server(server, batch[:1], max_new_tokens, 1)
    local, local_wall = _in_process(sess, batch, max_new_tokens)
    serial, serial_wall = _through_server(server, batch, max_new_tokens, 1)
    loaded, loaded_wall = _through_server(server, batch, max_new_tokens, concurrency)
    rows = [_row("in process", 1, local, local_wall), _row("server (gRPC)", 1, serial, serial_wall),
            _row("server (gRPC)", concurrency, loaded, loaded_wall)]
    mismatched = [i for i in range(len(batch))
                  if not local[i]["token_ids"] == serial[i]["token_ids"] == loaded[i]["token_ids"]]
    return {"rows": rows, "identical_outputs": not mismatched, "mismatched_prompts": mismatched,
            "prompts": len(batch), "max_new_tokens": max_new_tokens, "artifacts": artifacts, "server": server,
            "backend": "onnxruntime"}


def format_serving_report(report: dict) -> str:
    head = (f"{'where':<15} {'conc':>4} {'reqs':>4} {'TTFT mean/p50/p90 ms':>22} {'ITL mean/p50/p90 ms':>21} "
            f"{'req/s':>7} {'tok/s':>8}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        t, i = r["ttft_s"], r["itl_s"]
        ttft = f"{t['mean'] * 1e3:.1f}/{t['p50'] * 1e3:.1f}/{t['p90'] * 1e3:.1f}"
        itl = f"{i['mean'] * 1e3:.2f}/{i['p50'] * 1e3:.2f}/{i['p90'] * 1e3:.2f}"
        lines.append(f"{r['where']:<15} {r['concurrency']:>4} {r['requests']:>4} {ttft:>22} {itl:>21} "
                     f"{r['requests_per_s']:>7.2f} {r['tokens_per_s']:>8.1f}")
    lines.append(f"greedy outputs identical in process and through the server: {report['identical_outputs']} "
                 f"({report['prompts']} prompts, {report['max_new_tokens']} new tokens, in-process backend "
                 f"{report['backend']})")
    return "\n".join(lines)
