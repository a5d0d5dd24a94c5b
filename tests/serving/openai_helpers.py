"""What the treeflash-serve tests share: a server process over the tiny pair, its metrics, and the
greedy reference (generate() one sequence at a time, as treeflash-run does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import one_thread

from treeflash_runtime.serving.local_server import free_port

KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
SLOTS, QUEUE = 4, 4
TREE = ["--tree-size", "16", "--top-m", "4", "--top-k", "4", "--max-seq-len", "256"]
NEW = 12


class Server:
    """A treeflash-serve process over a tiny pair; ``options`` replace the defaults named the same."""

    def __init__(self, pair, tmp, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "serve.log"
        opts = dict(zip(["--max-batch", "--max-queue", "--shutdown-timeout"], map(str, [SLOTS, QUEUE, 60])))
        opts.update(zip(options[::2], options[1::2]))
        cmd = [sys.executable, "-m", "treeflash_runtime.serving.openai_server", "--model", str(pair / "verifier"),
               "--drafter", str(pair / "drafter"), *TREE, *(x for kv in opts.items() for x in kv),
               "--port", str(self.port), "--api-key", KEY, "--served-model-name", "tiny", "--log-level", "warning"]
        # One thread: the tiny pair gains nothing from two, and on a busy 2-core machine a second OpenMP
        # thread makes every matrix product wait for a core (milliseconds each instead of microseconds).
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        with open(self.log, "w") as log:
            # cwd: `-m` puts the working folder on sys.path, and the checkout's kernels/ hides a package
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def wait_ready(self, timeout=180.0):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.log.read_text()}")

    def client(self, asynchronous=False):
        import openai

        cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return cls(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=180)

    def metrics(self) -> dict:
        """name{labels} -> value, parsed with prometheus_client's parser."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_metric(self, name, value, timeout=120.0):
        deadline = time.monotonic() + timeout
        while self.metrics().get(name) != value:
            assert time.monotonic() < deadline, f"{name} never reached {value}: {self.metrics().get(name)}"
            time.sleep(0.05)


def make_reference(pair_dirs):
    """(prompt or ids, new tokens, chat) -> generate()'s greedy text and tokens on the same settings,
    one sequence at a time (what treeflash-run does)."""
    from treeflash_export.config import SamplingConfig
    from treeflash_runtime import generate
    from treeflash_runtime.options import load_session
    from treeflash_runtime.serving.text import encode_chat, encode_prompt

    d = pair_dirs["qwen3"]
    sess = load_session(model=str(d / "verifier"), drafter=str(d / "drafter"), artifacts=None, verify_checksums=True,
                        mode=None, tree_size=16, top_m=4, top_k=4, drafter_temperature=None, max_seq_len=256,
                        device="cpu", dtype="auto", cuda_graphs=False, fast_kernels="auto")
    cache = {}

    def get(prompt, new=NEW, chat=False):
        key = (str(prompt), new, chat)
        if key not in cache:
            tok = sess.tokenizer
            ids = prompt if isinstance(prompt, list) else (
                encode_chat(tok, [{"role": "user", "content": prompt}]) if chat else encode_prompt(tok, prompt))
            with one_thread():
                res = generate(sess.runner, ids, sess.tree, SamplingConfig(max_new_tokens=new,
                                                                           stop_token_ids=sess.stop_token_ids))
            finish = "stop" if res.stop_reason == "stop_token" else "length"
            cache[key] = (tok.decode(res.token_ids, skip_special_tokens=True), res.token_ids, finish, len(ids))
        return cache[key]

    get.tokenizer = sess.tokenizer
    return get
