"""`treeflash-bench --openai URL --concurrency 1,8`: the same distinct prompts through an OpenAI-compatible
server (treeflash-serve, or any other) at each concurrency, C clients each sending its next request when
its last one ends; the rows of treeflash-bench --server.

Every request is a streamed, greedy /v1/completions with usage. Per request: time to first token (TTFT:
request sent -> first chunk with text) and inter-token latency (ITL: (last chunk - first chunk) /
(completion tokens - 1), the definition load generators use). Per row: tokens per second over the row's
wall time, and whether every text equals its text at the first concurrency. The client is the standard
library (a thread per client), so the benchmark needs no extra package.
"""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

from treeflash_export.errors import TreeFlashError

from .server import closed_loop, distinct_prompts, serving_row, serving_table


class _Client:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http":
            raise TreeFlashError(f"--openai takes an http:// address, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _open(self, method: str, path: str, body: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        try:
            conn.request(method, self.base + path, json.dumps(body) if body is not None else None, self.headers)
            response = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise TreeFlashError(f"cannot reach the server at {self.host}:{self.port}: {exc}") from None
        if response.status != 200:
            text = response.read().decode("utf-8", "replace")
            conn.close()
            raise TreeFlashError(f"{method} {self.base + path}: HTTP {response.status}: {text[:300]}")
        return conn, response

    def model(self) -> str:
        conn, response = self._open("GET", "/models")
        try:
            return json.loads(response.read())["data"][0]["id"]
        finally:
            conn.close()

    def stream(self, body: dict) -> dict:
        """One streamed completion: its text, completion tokens and chunk arrival times."""
        t0 = time.perf_counter()
        conn, response = self._open("POST", "/completions", dict(body, stream=True,
                                                                 stream_options={"include_usage": True}))
        pieces, times, usage = [], [], None
        try:
            for raw in response:  # server-sent events, one "data: ..." line each
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise TreeFlashError(f"the server failed a request: {chunk['error'].get('message')}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        times.append(time.perf_counter() - t0)
        finally:
            conn.close()
        if usage is None or not times:
            raise TreeFlashError("the server's stream ended without text or usage")
        tokens = usage["completion_tokens"]
        return {"ttft_s": times[0], "itl_s": (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else 0.0,
                "tokens": tokens, "output": "".join(pieces)}


def _level(client: _Client, bodies: list[dict], concurrency: int) -> tuple[list[dict], float]:
    return closed_loop(bodies, client.stream, concurrency)


def run_openai_bench(url: str, prompts: list[str], max_new_tokens: int, concurrency: list[int], requests: int,
                     api_key: str | None = None, ignore_eos: bool = False) -> dict:
    if not concurrency or min(concurrency) < 1 or requests < 1:
        raise TreeFlashError("--concurrency and --requests must be >= 1")
    client = _Client(url, api_key)
    model = client.model()
    extra = {"ignore_eos": True} if ignore_eos else {}
    bodies = [dict(model=model, prompt=p, max_tokens=max_new_tokens, temperature=0, **extra)
              for p in distinct_prompts(prompts, max(requests, max(concurrency)))]
    _level(client, bodies[:1], 1)  # warm-up
    rows, reference = [], None
    for c in sorted(set(concurrency)):
        results, wall = _level(client, bodies, c)
        rows.append(serving_row("openai", c, results, wall, reference))
        reference = reference or results
    for r in rows:
        r["ratio_to_first"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return {"rows": rows, "identical_outputs": all(r["identical_outputs"] for r in rows), "prompts": len(bodies),
            "max_new_tokens": max_new_tokens, "url": url, "model": model, "stops_at_eos": not ignore_eos}


def format_openai_report(report: dict) -> str:
    lines = serving_table(report["rows"])
    lines.append(f"{report['url']} model {report['model']}: {report['prompts']} prompts of up to "
                 f"{report['max_new_tokens']} new tokens{', ending at end of turn' if report['stops_at_eos'] else ''}"
                 f"; greedy outputs identical to concurrency {report['rows'][0]['concurrency']}: "
                 f"{report['identical_outputs']}")
    return "\n".join(lines)
