"""treeflash-serve under hostile clients, through real server processes over the tiny pair: every number a
request carries is bounded (a 400 in OpenAI's shape, streams in flight unharmed), malformed text is a 400 on a
connection that stays usable, bodies are JSON only and bounded before they are read, a client leaving the
queue frees its place at once, stop strings are bounded, and the speculative counters add up to the rounds
that ran (vLLM's names too), under the self-tuning tree and under a fixed one. The fixed server also has a
request timeout and a short shutdown timeout; the last test stops it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import socket
import threading
import time

import pytest
from conftest import PROMPTS
from openai_helpers import HEADERS, KEY, NEW, QUEUE, SLOTS, Server, make_reference

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")),
    reason="needs the serve and dev extras (pip install 'treeflash-export[serve,dev]')")

FIXED_TIMEOUT = 4.0  # the fixed server's --request-timeout


def _start(server):
    try:
        server.wait_ready()
    except BaseException:
        server.proc.kill()
        raise
    return server


def _stop(server):
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory):
    """The self-tuning tree (mode auto, N <= 16), 4 slots, a queue of 4."""
    s = _start(Server(pair_dirs["qwen3"], tmp_path_factory.mktemp("hostile-auto")))
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def fixed(pair_dirs, tmp_path_factory):
    """A fixed TreeFlash tree of 16 nodes, one slot, a queue of 2, a cache as long as the tiny model's positions
    (streams that outlast both timeouts on a machine several times faster than CI's), a request timeout and a
    one-second shutdown timeout."""
    s = _start(Server(pair_dirs["qwen3"], tmp_path_factory.mktemp("hostile-fixed"), "--mode", "treeflash",
                      "--max-batch", "1", "--max-queue", "2", "--max-seq-len", "4096", "--request-timeout",
                      str(FIXED_TIMEOUT), "--shutdown-timeout", "1"))
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def reference(pair_dirs):
    return make_reference(pair_dirs)


def _post(url, path, body, headers=HEADERS, client=None):
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (client or httpx).post(url + path, content=content, headers=headers, timeout=60)


def _is_openai_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param and (code is None or error["code"] == code), error
    return error


# ---------------------------------------------------------------- every number bounded, one request fails alone


C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
OUT_OF_RANGE = [
    # (what, path, raw body (bytes) or fields added to a one-token request, param)
    ("max_tokens 0", C, {"max_tokens": 0}, "max_tokens"),
    ("max_tokens -1", C, {"max_tokens": -1}, "max_tokens"),
    ("max_tokens 2**31", C, {"max_tokens": 2**31}, "max_tokens"),
    ("max_tokens 2**64", C, {"max_tokens": 2**64}, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("max_completion_tokens 2**63", CHAT, {"max_completion_tokens": 2**63}, "max_completion_tokens"),
    ("temperature -0.1", C, {"temperature": -0.1}, "temperature"),
    ("temperature 2.5", C, {"temperature": 2.5}, "temperature"),
    ("temperature 1e309 (inf)", C, b'{"prompt": "x", "max_tokens": 1, "temperature": 1e309}', "temperature"),
    ("temperature NaN", C, b'{"prompt": "x", "max_tokens": 1, "temperature": NaN}', None),
    ("top_p 0", C, {"top_p": 0}, "top_p"),
    ("top_p -1", C, {"top_p": -1}, "top_p"),
    ("top_p 1.5", C, {"top_p": 1.5}, "top_p"),
    ("top_p Infinity", C, b'{"prompt": "x", "max_tokens": 1, "top_p": Infinity}', None),
    ("seed 2**63", C, {"seed": 2**63}, "seed"),
    ("seed -2**63 - 1", C, {"seed": -(2**63) - 1}, "seed"),
    ("seed 10**30", CHAT, {"seed": 10**30}, "seed"),
    ("seed of 5000 digits", C, b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", None),
    ("n 0", C, {"n": 0}, "n"),
    ("n 2**64", C, {"n": 2**64}, "n"),
    ("logprobs 2**63", C, {"logprobs": 2**63}, "logprobs"),
    ("top_logprobs 5", CHAT, {"top_logprobs": 5}, "top_logprobs"),
    ("best_of 2", C, {"best_of": 2}, "best_of"),
    ("frequency_penalty 1e308", C, {"frequency_penalty": 1e308}, "frequency_penalty"),
    ("presence_penalty -2", CHAT, {"presence_penalty": -2}, "presence_penalty"),
    ("repetition_penalty 1.1", C, {"repetition_penalty": 1.1}, "repetition_penalty"),
    ("min_tokens 2**63", C, {"min_tokens": 2**63}, "min_tokens"),
    ("a token id -1", C, {"prompt": [1, -1]}, "prompt"),
    ("a token id 2**63", C, {"prompt": [1, 2**63]}, "prompt"),
    ("a token id 2**70", C, {"prompt": [[2**70]]}, "prompt"),
]
# The edges that are allowed: each must be served (before the bounds, a seed of 2**63 - 1 passed and one of
# 2**63 reached the engine's int64 tensor and failed every request in flight).
EDGES = [{"seed": 2**63 - 1, "temperature": 0.7}, {"seed": -(2**63), "temperature": 2.0, "top_p": 1e-300},
         {"seed": 0, "top_p": 1.0, "temperature": 0}]


def _request(path, fields):
    if isinstance(fields, bytes):
        return fields
    base = {"messages": MSG} if path == CHAT else {"prompt": "x"}
    return {**base, "max_tokens": 1, **fields} if "max_completion_tokens" not in fields else {**base, **fields}


def test_every_numeric_field_out_of_range_is_a_400_and_streams_in_flight_are_unharmed(server, reference):
    import httpx

    prompts = PROMPTS[:3]

    async def scenario():
        async with server.client(asynchronous=True) as client, httpx.AsyncClient(timeout=60) as http:
            streams = [await client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                                       stream=True) for p in prompts]
            firsts = [await s.__anext__() for s in streams]  # every stream runs

            async def rest(first, stream):
                return first.choices[0].text + "".join([c.choices[0].text async for c in stream])

            texts = asyncio.gather(*(rest(f, s) for f, s in zip(firsts, streams)))
            bad = [await http.post(server.url + path, headers=HEADERS, content=body if isinstance(body, bytes)
                                   else json.dumps(body).encode())
                   for _, path, body in ((w, p, _request(p, f)) for w, p, f, _ in OUT_OF_RANGE)]
            edges = await asyncio.gather(*(client.completions.create(model="tiny", prompt="x", max_tokens=2, **e)
                                           for e in EDGES))
            return bad, edges, await texts

    bad, edges, texts = asyncio.run(scenario())
    for (what, _, _, param), r in zip(OUT_OF_RANGE, bad):
        assert r.status_code == 400, (what, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (what, error)
    assert all(e.choices[0].finish_reason in ("stop", "length") for e in edges)
    for prompt, text in zip(prompts, texts):
        assert text == reference(prompt, 40)[0], prompt
    assert server.metrics().get("treeflash_requests_total{finish_reason=error}", 0) == 0


def test_a_request_that_fails_in_the_engine_fails_alone(pair_dirs):
    """In process (no request can reach this through the server any more): a request whose seed the
    runner's int64 tensor cannot hold is put straight in the queue, bypassing the checks, among three
    others. It fails with the runner's error; the others equal their solo generations."""
    from conftest import one_thread

    from treeflash_export.config import SamplingConfig, TreeConfig
    from treeflash_runtime import generate
    from treeflash_runtime.options import load_session
    from treeflash_runtime.engine import Engine
    from treeflash_runtime.scheduler import FAILED, FINISHED, Request

    d = pair_dirs["qwen3"]
    sess = load_session(model=str(d / "verifier"), drafter=str(d / "drafter"), artifacts=None, verify_checksums=True,
                        mode="treeflash", tree_size=8, top_m=4, top_k=4, drafter_temperature=None, max_seq_len=128,
                        device="cpu", dtype="auto", cuda_graphs=False, fast_kernels="auto", max_batch=4)
    tok = sess.tokenizer
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    with one_thread():
        solo = [generate(sess.runner, i, TreeConfig(mode="treeflash", tree_size=8, top_m=4, top_k=4),
                         SamplingConfig(max_new_tokens=10)).token_ids for i in ids]
        engine = Engine(sess.runner)
        good = [Request(i, SamplingConfig(max_new_tokens=10)) for i in ids]
        poisoned = Request(ids[0], SamplingConfig(max_new_tokens=10, seed=2**64))
        for r in good[:2]:
            engine.submit(r)
        engine.scheduler.submit(poisoned)  # past Engine.check, which refuses it now
        engine.submit(good[2])
        engine.drain(good + [poisoned])
    assert poisoned.state == FAILED and "overflow" in poisoned.error.lower()
    assert [r.state for r in good] == [FINISHED] * 3
    assert [r.tokens for r in good] == solo
    with pytest.raises(Exception, match="int64"):
        engine.submit(Request(ids[0], SamplingConfig(max_new_tokens=10, seed=2**64)))


# ---------------------------------------------------------------- malformed text, content types, sizes


def test_a_lone_surrogate_is_a_400_on_a_connection_that_stays_usable(server, reference):
    import httpx

    with httpx.Client(headers=HEADERS, timeout=60) as client:
        r = _post(server.url, C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', client=client)
        _is_openai_error(r, 400, "prompt", "invalid_unicode")
        assert r.headers.get("connection") != "close"
        port = _local_port(r)
        r = _post(server.url, CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', client=client)
        _is_openai_error(r, 400, "messages", "invalid_unicode")
        # a valid pair of surrogates is a character like any other
        r = _post(server.url, C, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2, "temperature": 0}', client=client)
        assert r.status_code == 200, r.text
        r = _post(server.url, C, {"prompt": PROMPTS[2], "max_tokens": NEW, "temperature": 0}, client=client)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(PROMPTS[2])[0]
        assert _local_port(r) == port  # one connection all along


def _local_port(response) -> int:
    """The client's end of the connection that carried the response."""
    return response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def test_an_internal_error_is_a_500_on_a_connection_that_stays_usable(pair_dirs, monkeypatch):
    """In process (a bug has to be planted): a request whose handling raises unexpectedly gets a 500 in
    OpenAI's shape, and the same kept-alive connection serves the next request."""
    import httpx
    import uvicorn

    import treeflash_runtime.serving.text as text
    from treeflash_runtime.options import load_session
    from treeflash_runtime.serving.local_server import free_port
    from treeflash_runtime.serving.openai_server import create_app

    d = pair_dirs["qwen3"]

    def load():
        return load_session(model=str(d / "verifier"), drafter=str(d / "drafter"), artifacts=None,
                            verify_checksums=True, mode="treeflash", tree_size=8, top_m=4, top_k=4,
                            drafter_temperature=None, max_seq_len=128, device="cpu", dtype="auto", cuda_graphs=False,
                            fast_kernels="auto", max_batch=1)

    encode = text.encode_prompt

    def planted(tok, prompt):
        if prompt == "boom":
            raise RuntimeError("a planted bug")
        return encode(tok, prompt)

    monkeypatch.setattr(text, "encode_prompt", planted)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(load, "tiny", api_key=KEY), host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with httpx.Client(headers=HEADERS, timeout=60) as client:
            r = _post(url, C, {"prompt": "boom", "max_tokens": 2}, client=client)
            error = _is_openai_error(r, 500)
            assert error["type"] == "server_error" and "a planted bug" in error["message"]
            first = _local_port(r)
            r = _post(url, C, {"prompt": PROMPTS[0], "max_tokens": 2}, client=client)
            assert r.status_code == 200 and _local_port(r) == first
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    (None, 415), ("application/json; charset=utf-8", 200), ("Application/JSON", 200)])
def test_only_json_bodies_are_served(server, content_type, status):
    """A page in any browser can POST text/plain, forms and multipart to a local server without a CORS
    preflight (and without reading the answer): such requests never run."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    before = server.metrics()["treeflash_prompt_tokens_total"]
    r = _post(server.url, C, {"prompt": "x", "max_tokens": 1}, headers=headers)
    if status == 415:
        _is_openai_error(r, 415, None, "unsupported_media_type")
        assert server.metrics()["treeflash_prompt_tokens_total"] == before  # nothing ran
    else:
        assert r.status_code == 200, r.text


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _send_raw(port: int, head: bytes, body_parts) -> tuple[str, float]:
    """Sends a request's head, then its body parts from another thread; returns the status line of the
    answer and the seconds from the head to it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)

    def send_body():
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed: the rest of the body is not wanted
            pass

    t0 = time.monotonic()
    sock.sendall(head)
    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    try:
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data.split(b"\r\n", 1)[0].decode(), time.monotonic() - t0
    finally:
        sock.close()
        sender.join(30)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's memory from /proc")
def test_a_20_mb_body_is_refused_before_it_is_read(server):
    size = 20 * 2**20
    body = b'{"prompt": "' + b"a" * (size - 15) + b'"}'
    piece = 2**20
    parts = [body[i:i + piece] for i in range(0, len(body), piece)]
    rss = _rss_mb(server.proc.pid)
    auth = f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
    # with its length announced
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode() + auth + b"\r\n")
    status, seconds = _send_raw(server.port, head, parts)
    assert status.split()[1] == "413" and seconds < 1.0, (status, seconds)
    # chunked, no length: counted while it arrives
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n" + auth + b"\r\n"
    chunked = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]
    status, seconds = _send_raw(server.port, head, chunked)
    assert status.split()[1] == "413" and seconds < 1.0, (status, seconds)
    assert _rss_mb(server.proc.pid) < rss + 100
    r = _post(server.url, C, {"prompt": "x", "max_tokens": 1})  # and it serves on
    assert r.status_code == 200


def test_long_prompts_are_refused_without_tokenizing_them(server):
    """Under the byte limit but longer than a slot: text longer than capacity x the longest token's
    characters is refused before the tokenizer sees it, and token ids by their count before any is looked at."""
    error = _is_openai_error(_post(server.url, C, {"prompt": "word " * 200_000}), 400, "prompt",
                             "context_length_exceeded")
    assert "characters" in error["message"] and "256" in error["message"]
    error = _is_openai_error(_post(server.url, CHAT, {"messages": [{"role": "user", "content": "x" * 1_000_000}]}),
                             400, "messages", "context_length_exceeded")
    assert "characters" in error["message"]
    # ids outside the vocabulary too: the count is what is checked first
    error = _is_openai_error(_post(server.url, C, {"prompt": [10**6] * 100_000}), 400, "prompt",
                             "context_length_exceeded")
    assert "100000 tokens" in error["message"]


# ---------------------------------------------------------------- the queue


def test_a_client_that_leaves_the_queue_frees_its_place_at_once(server):
    """Four long streams hold the slots and four more wait; the waiting clients go. Their places are free
    at once: the waiting gauge drops to 0 and four new clients are queued (no 429) while the long streams
    still run."""
    server.wait_metric("treeflash_requests_running", 0)
    before = server.metrics()

    async def scenario():
        async with server.client(asynchronous=True) as client:
            ask = dict(model="tiny", temperature=0, stream=True, extra_body={"ignore_eos": True})
            longs = []
            for p in PROMPTS + ["Once upon a time"]:
                stream = await client.completions.create(prompt=p, max_tokens=200, **ask)
                await stream.__anext__()
                longs.append(stream)
            queued = [await client.completions.create(prompt=p, max_tokens=4, **ask) for p in PROMPTS + ["a"]]
            await _until(server, "treeflash_requests_waiting", QUEUE)
            for stream in queued:
                await stream.close()
            await _until(server, "treeflash_requests_waiting", 0)
            again = [await client.completions.create(prompt=p, max_tokens=4, **ask) for p in PROMPTS + ["b"]]
            now = await asyncio.to_thread(server.metrics)
            assert now["treeflash_requests_running"] == SLOTS and now["treeflash_requests_waiting"] == QUEUE
            for stream in longs:
                await stream.close()
            return [[c async for c in s] for s in again]

    again = asyncio.run(scenario())
    assert all(chunks[-1].choices[0].finish_reason == "length" for chunks in again)
    server.wait_metric("treeflash_requests_running", 0)
    after = server.metrics()
    cancelled = "treeflash_requests_total{finish_reason=cancelled}"
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == SLOTS + QUEUE


async def _until(server, name, value, timeout=60.0):
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(server.metrics))[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- stop strings


def test_stop_strings_are_bounded(server):
    from treeflash_runtime.serving.openai_protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    error = _is_openai_error(_post(server.url, C, {"prompt": "x", "stop": many}), 400, "stop")
    assert str(MAX_STOP_STRINGS) in error["message"]
    error = _is_openai_error(_post(server.url, CHAT, {"messages": MSG, "stop": "x" * (MAX_STOP_CHARS + 1)}), 400,
                             "stop")
    assert str(MAX_STOP_CHARS) in error["message"]


def test_the_most_stop_strings_that_never_complete_leave_the_text_whole(server, reference):
    """The most and longest stop strings allowed, each a piece of the greedy text followed by a character it
    never holds: they keep matching partly (the held-back tail grows and shrinks) but never complete."""
    from treeflash_runtime.serving.openai_protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    text = reference(PROMPTS[0], 24)[0]
    stops = [(text[i:i + 1 + i % 6] + "\x01" * MAX_STOP_CHARS)[:MAX_STOP_CHARS] for i in range(MAX_STOP_STRINGS)]
    client = server.client()
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24,
                                                                    temperature=0, stop=stops, stream=True)]
    assert "".join(pieces) == text


def test_the_held_back_tail_is_found_incrementally():
    """StopText's open tail (the longest end of the text that begins a stop string), fed a few characters at
    a time, equals the definition checked against every end of the whole text."""
    from treeflash_runtime.serving.text import StopText

    def by_definition(text, stops):
        return max((k for w in stops for k in range(1, min(len(w) - 1, len(text)) + 1) if text.endswith(w[:k])),
                   default=0)

    rng = random.Random(0)
    for _ in range(2000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 4)))
        st = StopText(None, stops)
        text = ""
        for _ in range(rng.randint(1, 8)):
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 5)))
            assert st._open_tail(text) == by_definition(text, stops), (stops, text)


# ---------------------------------------------------------------- counters that tell the truth


def _grew(before, after, name):
    return after.get(name, 0) - before.get(name, 0)


def _check_spec(spec):
    """One request's speculative figures agree with each other."""
    hist = {int(k): v for k, v in spec["acceptance_histogram"].items()}
    by_nodes = {int(k): v for k, v in spec["rounds_by_tree_nodes"].items()}
    assert sum(by_nodes.values()) == spec["rounds"]
    assert spec["drafted_nodes"] == sum((n - 1) * c for n, c in by_nodes.items())
    assert sum(hist.values()) == spec["num_drafts"] == sum(c for n, c in by_nodes.items() if n > 1)
    assert sum(k * v for k, v in hist.items()) == spec["accepted_tokens"] <= spec["drafted_nodes"]
    if spec["num_drafts"]:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["num_drafts"])
        assert spec["draft_acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["drafted_nodes"])
    else:
        assert spec["mean_acceptance_length"] is None and spec["draft_acceptance_rate"] is None


class _ScriptedPolicy:
    """A stand-in for the self-tuning tree that plans each round's tree from a fixed script (plain decoding,
    trees of several sizes and modes, the chain), so what each round verified is known exactly."""

    def __init__(self, script, block_size):
        self.script, self.rounds, self.block_size = script, 0, block_size
        self.max_tree_size = max(t.resolved(block_size).tree_size for t in script)

    def plan(self, bucket, requests=None):
        from treeflash_runtime.plan import RoundPlan

        tree = self.script[self.rounds % len(self.script)].resolved(self.block_size)
        self.rounds += 1
        return RoundPlan(tree=tree, keep_context=True)  # plain steps keep the drafter's context, as auto's do

    def learn(self, report, running=None): ...
    def start(self): ...
    def close(self): ...
    def admitted(self, key, alone): ...
    def retired(self, key): ...


def test_drafted_counts_the_nodes_each_round_verified(pair_dirs):
    """In process, the engine with a scripted tree choice: each request's ``drafted`` holds, round by round,
    N - 1 for a tree of N nodes (B - 1 for the chain of the block B = 8) and 0 for plain decoding, and the
    greedy tokens equal their solo generations (one request alone, then two sharing their rounds)."""
    from conftest import one_thread

    from treeflash_export.config import SamplingConfig, TreeConfig
    from treeflash_runtime import generate
    from treeflash_runtime.options import load_session
    from treeflash_runtime.engine import Engine
    from treeflash_runtime.scheduler import Request
    from treeflash_runtime.serving.async_engine import spec_stats

    d = pair_dirs["qwen3"]
    sess = load_session(model=str(d / "verifier"), drafter=str(d / "drafter"), artifacts=None, verify_checksums=True,
                        mode="treeflash", tree_size=16, top_m=4, top_k=4, drafter_temperature=None,
                        max_seq_len=128, device="cpu", dtype="auto", cuda_graphs=False, fast_kernels="auto",
                        max_batch=2)
    script = [TreeConfig(mode="ar"), TreeConfig(mode="treeflash", tree_size=16, top_m=4, top_k=4),
              TreeConfig(mode="chain"), TreeConfig(mode="marginal", tree_size=4, top_k=4),
              TreeConfig(mode="treeflash", tree_size=8, top_m=2, top_k=4), TreeConfig(mode="ar")]
    want = [0, 15, 7, 3, 7, 0]
    ids = [sess.tokenizer(p)["input_ids"][:8] for p in PROMPTS[:2]]  # one length: prefilled together, same rounds
    with one_thread():
        solo = [generate(sess.runner, i, script[1], SamplingConfig(max_new_tokens=20)).token_ids for i in ids]
        for batch in ([ids[0]], ids):
            policy = _ScriptedPolicy(script, sess.runner.block_size)
            requests = [Request(i, SamplingConfig(max_new_tokens=20)) for i in batch]
            Engine(sess.runner, policy=policy).run(requests)
            for r, tokens in zip(requests, solo):
                assert r.tokens == tokens
                assert r.drafted == [want[k % len(want)] for k in range(len(r.accept_lengths))], r.drafted
                spec = spec_stats(r.accept_lengths, r.drafted)
                _check_spec(spec)
                assert spec["num_drafts"] == sum(1 for n in r.drafted if n)


@pytest.mark.parametrize("which", ["auto", "fixed"])
def test_usage_adds_up_to_the_counters(which, server, fixed, reference):
    s = server if which == "auto" else fixed
    s.wait_metric("treeflash_requests_running", 0)
    before = s.metrics()
    client = s.client()
    usages, texts = [], []
    for p in PROMPTS[:2]:
        got = client.completions.create(model="tiny", prompt=p, max_tokens=NEW, temperature=0)
        usages.append(got.usage)
        texts.append(got.choices[0].text)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=9, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)  # the streamed usage chunk carries the same figures
    assert texts == [reference(p)[0] for p in PROMPTS[:2]]
    after = s.metrics()
    specs = [u.model_extra["treeflash"] for u in usages]
    for spec in specs:
        _check_spec(spec)
    if which == "fixed":  # every round verified the 15 drafted nodes of the tree
        assert all(sp["drafted_nodes"] == 15 * sp["rounds"] and sp["num_drafts"] == sp["rounds"] for sp in specs)
    m = "{model_name=tiny}"

    def total(key):
        return sum(sp[key] for sp in specs)

    for ours, theirs, key in (("treeflash_spec_drafted_nodes_total", f"vllm:spec_decode_num_draft_tokens_total{m}",
                               "drafted_nodes"),
                              ("treeflash_spec_accepted_tokens_total",
                               f"vllm:spec_decode_num_accepted_tokens_total{m}", "accepted_tokens"),
                              ("treeflash_spec_rounds_total", None, "rounds"),
                              (None, f"vllm:spec_decode_num_drafts_total{m}", "num_drafts")):
        for name in filter(None, (ours, theirs)):
            assert _grew(before, after, name) == total(key), name
    for pos in range(15):
        reached = sum(v for sp in specs for k, v in sp["acceptance_histogram"].items() if int(k) > pos)
        assert _grew(before, after, f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name=tiny,"
                                    f"position={pos}}}") == reached
    for nodes in {n for sp in specs for n in sp["rounds_by_tree_nodes"]}:
        assert _grew(before, after, f"treeflash_spec_rounds_by_tree_nodes_total{{tree_nodes={nodes}}}") == sum(
            sp["rounds_by_tree_nodes"].get(nodes, 0) for sp in specs)
    assert _grew(before, after, "treeflash_spec_tokens_per_round_count") == total("rounds")
    completions = [u.completion_tokens for u in usages]
    assert _grew(before, after, f"vllm:generation_tokens_total{m}") == sum(completions)
    assert _grew(before, after, f"vllm:prompt_tokens_total{m}") == sum(u.prompt_tokens for u in usages)
    assert _grew(before, after, f"vllm:inter_token_latency_seconds_count{m}") == sum(c - 1 for c in completions)
    for h in ("time_to_first_token", "e2e_request_latency"):
        assert _grew(before, after, f"vllm:{h}_seconds_count{m}") == 3
    assert after[f"vllm:num_requests_running{m}"] == 0 and after[f"vllm:num_requests_waiting{m}"] == 0


@pytest.mark.parametrize("flags,words", [
    (["--request-timeout", "0"], "--request-timeout must be > 0"),
    (["--max-request-bytes", "100"], "--max-request-bytes must be at least 1024"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
])
def test_server_limits_out_of_range_are_one_line_errors(flags, words):
    from click.testing import CliRunner

    from treeflash_runtime.serving.openai_server import main

    r = CliRunner().invoke(main, flags)
    assert r.exit_code == 2 and r.output.startswith("error: ") and words in r.output
    assert len(r.output.strip().splitlines()) == 1


# ---------------------------------------------------------------- timeouts and shutdown (the fixed server)


def _sse(response) -> list:
    """A server-sent event stream's data fields, JSON decoded ("[DONE]" as is)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _long(stream: bool) -> dict:
    # 4000 tokens take about 22 s on a 2-core machine like CI's: far past either timeout (900 tokens took about
    # 4 s there, and once ended before the 4 s request timeout on CI).
    return {"prompt": PROMPTS[1], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": stream}


def test_a_request_past_the_request_timeout_ends_with_an_error(fixed):
    """One slot: a stream runs and a plain request waits; both pass --request-timeout (counted from their
    arrival) and end with a clear error: an error event then [DONE], and a 408."""
    import httpx

    def plain():
        return _post(fixed.url, C, _long(False))

    with httpx.Client(timeout=120) as http:
        with http.stream("POST", fixed.url + C, headers=HEADERS, json=_long(True)) as r:
            assert r.status_code == 200
            waiter = threading.Thread(target=lambda: results.append(plain()))
            results = []
            waiter.start()
            events = _sse(r)
        waiter.join(120)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout", events[-3:]
    assert "--request-timeout" in events[-2]["error"]["message"] and len(events) > 3  # it had streamed text
    _is_openai_error(results[0], 408, None, "request_timeout")
    fixed.wait_metric("treeflash_requests_running", 0)
    assert fixed.metrics()["treeflash_requests_total{finish_reason=timeout}"] == 2


def test_shutdown_past_the_shutdown_timeout_ends_every_request_with_an_error(fixed):
    """Last (it stops the fixed server): SIGTERM with a stream running and a stream and a plain request
    waiting for the one slot. After --shutdown-timeout (1 s) each ends with a clear error (the streams with
    an error event and [DONE], the plain request with a 503), the process exits 0 and logs no traceback."""
    import httpx

    results: dict = {}

    def stream(name):
        with httpx.stream("POST", fixed.url + C, headers=HEADERS, json=_long(True),
                          timeout=60) as r:
            results[name] = (r.status_code, _sse(r))

    def plain():
        results["plain"] = _post(fixed.url, C, _long(False))

    threads = [threading.Thread(target=stream, args=("running",))]
    threads[0].start()
    fixed.wait_metric("treeflash_requests_running", 1)
    threads += [threading.Thread(target=stream, args=("queued",)), threading.Thread(target=plain)]
    for t in threads[1:]:
        t.start()
    fixed.wait_metric("treeflash_requests_waiting", 2)
    fixed.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert fixed.proc.wait(timeout=60) == 0
    for name in ("running", "queued"):
        status, events = results[name]
        assert status == 200 and events[-1] == "[DONE]", (name, events[-3:])
        assert events[-2]["error"]["code"] == "shutting_down", (name, events[-2])
    _is_openai_error(results["plain"], 503, None, "shutting_down")
    log = fixed.log.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
