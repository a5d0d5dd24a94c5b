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


def serving_row(where: str, concurrency: int, per_request: list[dict], wall_s: float, reference=None) -> dict:
    """The fields of treeflash-bench --concurrency's rows (bench.batching), plus requests per second.
    per_request: ttft_s, itl_s, tokens and ``output`` (what must equal the reference's)."""
    from .batching import summary_ms

    tokens = sum(r["tokens"] for r in per_request)
    same = reference is None or all(r["output"] == ref["output"] for r, ref in zip(per_request, reference))
    return {"where": where, "concurrency": concurrency, "requests": len(per_request),
            "ttft_ms": summary_ms([r["ttft_s"] for r in per_request]),
            "itl_ms": summary_ms([r["itl_s"] for r in per_request]), "requests_per_s": len(per_request) / wall_s,
            "tokens_per_s": tokens / wall_s, "tokens": tokens, "identical_outputs": same}


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
        out.append(dict(_timing(arrivals), tokens=res.stats.new_tokens, output=res.token_ids))
    return out, wall


def closed_loop(items: list, call, concurrency: int) -> tuple[list, float]:
    """call(item) for every item from ``concurrency`` client threads, each taking the next item when
    its last call returns -> (results in item order, wall seconds). The first TreeFlashError stops
    the clients and is raised."""
    results: list = [None] * len(items)
    errors: list[str] = []
    order = iter(range(len(items)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(order, None)
            if i is None or errors:
                return
            try:
                results[i] = call(items[i])
            except TreeFlashError as exc:
                errors.append(str(exc))
                return

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise TreeFlashError(errors[0])
    return results, wall


def _through_server(server: str, prompts: list[str], max_new_tokens: int, concurrency: int,
                    model: str = "treeflash") -> tuple[list[dict], float]:
    from ..serving.client import request_inputs, stream_grpc

    def call(prompt):
        r = stream_grpc(server, request_inputs(prompt, max_new_tokens, stream=True), model=model)
        return dict(_timing(r.arrivals), tokens=r.new_tokens, output=r.token_ids)

    try:
        return closed_loop(prompts, call, concurrency)
    except TreeFlashError as exc:
        raise TreeFlashError(f"the server failed a request: {exc}") from None


def run_serving_bench(artifacts: str, server: str, prompts: list[str], max_new_tokens: int, concurrency: list[int],
                      requests: int, model: str = "treeflash") -> dict:
    """requests: prompts per row (distinct); every row runs the same ones: in process (ONNX Runtime,
    one at a time), then through the server's ``model`` at each concurrency."""
    from ..factory import session_from_artifacts

    if not concurrency or min(concurrency) < 1 or requests < 1:
        raise TreeFlashError("--concurrency and --requests must be >= 1")
    sess = session_from_artifacts(artifacts, {}, backend="onnxruntime")
    batch = distinct_prompts(prompts, max(requests, max(concurrency)))
    _in_process(sess, batch[:1], max_new_tokens)  # warm-up (the server warmed up when it loaded)
    _through_server(server, batch[:1], max_new_tokens, 1, model)
    local, local_wall = _in_process(sess, batch, max_new_tokens)
    rows = [serving_row("in_process", 1, local, local_wall)]
    for c in sorted(set(concurrency)):
        results, wall = _through_server(server, batch, max_new_tokens, c, model)
        rows.append(serving_row("server", c, results, wall, local))
    served = [r for r in rows if r["where"] == "server"]
    for r in served:
        r["ratio_to_first"] = r["tokens_per_s"] / served[0]["tokens_per_s"]
    return {"rows": rows, "identical_outputs": all(r["identical_outputs"] for r in rows), "prompts": len(batch),
            "max_new_tokens": max_new_tokens, "artifacts": artifacts, "server": server, "model": model,
            "backend": "onnxruntime"}


def serving_table(rows: list[dict]) -> list[str]:
    """The rows of a serving report (in process, Triton, OpenAI), one line each under a header."""
    from .batching import latency_cells

    head = (f"{'where':<11} {'conc':>4} {'reqs':>4} {'TTFT mean/p50/p90 ms':>22} {'ITL mean/p50/p90 ms':>21} "
            f"{'req/s':>7} {'tok/s':>8} {'x first':>7} {'same':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ttft, itl = latency_cells(r)
        ratio = f"{r['ratio_to_first']:.2f}" if "ratio_to_first" in r else "-"
        lines.append(f"{r['where']:<11} {r['concurrency']:>4} {r['requests']:>4} {ttft:>22} {itl:>21} "
                     f"{r['requests_per_s']:>7.2f} {r['tokens_per_s']:>8.1f} {ratio:>7} "
                     f"{str(r['identical_outputs']):>5}")
    return lines


def format_serving_report(report: dict) -> str:
    lines = serving_table(report["rows"])
    lines.append(f"model {report['model']}: greedy outputs identical in process and through the server: "
                 f"{report['identical_outputs']} "
                 f"({report['prompts']} prompts, {report['max_new_tokens']} new tokens, in-process backend "
                 f"{report['backend']})")
    return "\n".join(lines)
