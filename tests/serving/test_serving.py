"""Serving: the Triton model repository, the serving module, and a real tritonserver on CPU.

Tests marked `tritonserver` start the tritonserver that nvidia-pytriton bundles (the `serve`
extra) on 127.0.0.1 with free ports, serving a tiny artifact, and compare every generation
with the in-process run of the same artifact, token for token (greedy, fp32).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy, write_turn_pair

from treeflash_export.export.artifact import MANIFEST, file_table, load_artifact
from treeflash_export.cli import main as export_main
from treeflash_export.export.build import BuildConfig, build
from treeflash_export.errors import TreeFlashError
from treeflash_export.export.triton_repo import SERVING_OUTPUTS, write_triton_repo
from treeflash_runtime.cli import main as run_main

CAPACITY = 256
TREE = dict(tree_size=16, top_m=4, top_k=4)
NEW = 32
HAVE_SERVER = importlib.util.find_spec("pytriton") is not None and importlib.util.find_spec("tritonclient") is not None
needs_server = pytest.mark.skipif(not HAVE_SERVER, reason="nvidia-pytriton / tritonclient are not installed "
                                  "(pip install 'treeflash-export[serve]')")
PLACEHOLDER = re.compile(r"\$\{|\{\{|\}\}|%\(|<[A-Za-z_]+>|TODO|FIXME|XXX")
# Different prompts for the load test (8 concurrent streams).
LOAD_PROMPTS = PROMPTS + ["for i in range(10):", "Once upon a time", "SELECT * FROM users WHERE",
                          "#include <stdio.h>\n", "The capital of France is"]


@pytest.fixture(scope="module")
def artifact(pair_dirs, tmp_path_factory):
    d = pair_dirs["qwen3"]
    out = build(str(d / "verifier"), str(d / "drafter"), tmp_path_factory.mktemp("serve") / "art",
                BuildConfig(mode="treeflash", max_seq_len=CAPACITY, prefill_chunk=16, **TREE), validate=False,
                log=lambda m: None)
    return load_artifact(out)


@pytest.fixture(scope="module")
def service(artifact):
    from treeflash_runtime.serving.service import Service

    return Service.from_artifact(artifact.root, "onnxruntime")


@pytest.fixture(scope="module")
def reference(artifact):
    """prompt -> treeflash-run's in-process --json output for the artifact (greedy, NEW tokens)."""
    cache = {}

    def get(prompt, new=NEW):
        if (prompt, new) not in cache:
            r = CliRunner().invoke(run_main, ["--artifacts", str(artifact.root), "--backend", "onnxruntime",
                                              "--prompt", prompt, "--max-new-tokens", str(new), "--json"])
            assert r.exit_code == 0, r.output
            cache[prompt, new] = json.loads(r.stdout)
        return cache[prompt, new]

    return get


def _parse_config(path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def _generated_text_files(repo):
    return [p for p in repo.rglob("*") if p.is_file() and "artifact" not in p.relative_to(repo).parts
            and p.suffix in (".pbtxt", ".py", ".md")]


def _inputs(prompt, max_tokens, **kw):
    from treeflash_runtime.serving.client import request_inputs

    return request_inputs(prompt, max_tokens, **kw)


# ---------------------------------------------------------------- repository generation


@needs_server
def test_repo_for_onnx_artifact_is_whole_and_parses(artifact, tmp_path):
    repo = write_triton_repo(artifact.root, tmp_path / "repo", log=lambda m: None)
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "treeflash"]  # no engine models for ONNX
    cfg = _parse_config(repo / "treeflash" / "config.pbtxt")
    assert cfg.name == "treeflash" and cfg.backend == "python" and cfg.max_batch_size == 1
    assert cfg.model_transaction_policy.decoupled
    from tritonclient.grpc import model_config_pb2 as mc

    types = {t.name: (mc.DataType.Name(t.data_type), list(t.dims), t.optional) for t in cfg.input}
    # TensorRT-LLM's tensorrt_llm_bls names and dtypes.
    assert types == {"text_input": ("TYPE_STRING", [-1], False), "max_tokens": ("TYPE_INT32", [-1], False),
                     "stream": ("TYPE_BOOL", [1], True), "temperature": ("TYPE_FP32", [1], True),
                     "top_p": ("TYPE_FP32", [1], True), "random_seed": ("TYPE_UINT64", [1], True),
                     "end_id": ("TYPE_INT32", [1], True), "stop_words": ("TYPE_STRING", [-1], True)}
    assert [o.name for o in cfg.output] == [s.name for s in SERVING_OUTPUTS]
    assert mc.DataType.Name(cfg.output[0].data_type) == "TYPE_STRING" and cfg.output[0].name == "text_output"
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "backend": "onnxruntime", "artifact": "1/artifact", "verify_checksums": "true"}
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and cfg.instance_group[0].count == 1
    copy = load_artifact(repo / "treeflash" / "1" / "artifact")  # complete, checksums verified
    assert copy.manifest["files"] == artifact.manifest["files"]
    src = (artifact.root / "onnx" / "verify.onnx").stat()
    dst = (repo / "treeflash" / "1" / "artifact" / "onnx" / "verify.onnx").stat()
    assert src.st_ino == dst.st_ino  # same filesystem: hard links, not a second copy of the weights
    from treeflash_export.export.triton_repo import MODEL_PY

    assert (repo / "treeflash" / "1" / "model.py").read_text() == MODEL_PY  # names the runtime's adapter only
    for p in _generated_text_files(repo):
        assert not PLACEHOLDER.search(p.read_text()), p
    assert not list(tmp_path.glob(".repo*"))  # no temporary folder left behind


def _fake_tensorrt_artifact(artifact, dst, variant="reference"):
    """The ONNX artifact relabelled as a TensorRT build with stand-in plan files (TensorRT cannot be
    installed here); checksums recomputed so that it loads."""
    shutil.copytree(artifact.root, dst)
    (dst / "engines").mkdir()
    m = json.loads((dst / MANIFEST).read_text())
    for g in ("verify", "draft", "expand"):
        (dst / "engines" / f"{g}.plan").write_bytes(f"plan of {g}".encode())
        m["graphs"][g]["engine"] = f"engines/{g}.plan"
    m["build"].update(target="tensorrt", variant=variant)
    m["versions"]["tensorrt"] = "10.13.3"
    m["files"] = file_table(dst)
    (dst / MANIFEST).write_text(json.dumps(m))
    return load_artifact(dst)


@needs_server
@pytest.mark.parametrize("variant", ["reference", "plugin"])
def test_repo_for_tensorrt_artifact_has_one_plan_model_per_engine(artifact, tmp_path, variant):
    from tritonclient.grpc import model_config_pb2 as mc

    art = _fake_tensorrt_artifact(artifact, tmp_path / "trt", variant)
    repo = write_triton_repo(art.root, tmp_path / "repo", instances=2, log=lambda m: None)
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "treeflash", "treeflash_draft",
                                                       "treeflash_expand", "treeflash_verify"]
    for g in ("verify", "draft", "expand"):
        folder = repo / f"treeflash_{g}"
        assert (folder / "1" / "model.plan").read_bytes() == f"plan of {g}".encode()
        cfg = _parse_config(folder / "config.pbtxt")
        spec = art.spec(g)
        assert cfg.name == folder.name and cfg.platform == "tensorrt_plan" and cfg.max_batch_size == 0
        assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU and cfg.instance_group[0].count == 2
        for tensors, specs in ((cfg.input, spec.inputs), (cfg.output, spec.outputs)):
            assert [t.name for t in tensors] == [s.name for s in specs]
            for t, s in zip(tensors, specs):
                assert list(t.dims) == [d if isinstance(d, int) else -1 for d in s.shape]
                assert mc.DataType.Name(t.data_type) == {"float32": "TYPE_FP32", "int64": "TYPE_INT64",
                                                         "bool": "TYPE_BOOL"}[s.dtype]
        warm = cfg.model_warmup[0]
        assert set(warm.inputs) == {s.name for s in spec.inputs} and all(v.zero_data for v in warm.inputs.values())
        if g == "verify":  # dynamic token axis at the profile's opt value (the tree size)
            assert list(warm.inputs["tree_mask"].dims) == [TREE["tree_size"]] * 2
    cfg = _parse_config(repo / "treeflash" / "config.pbtxt")
    assert cfg.parameters["backend"].string_value == "tensorrt"
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    readme = (repo / "README.md").read_text()
    assert "TensorRT 10.13.3" in readme
    assert ("## Plugins" in readme) == (variant == "plugin")
    for p in _generated_text_files(repo):
        assert not PLACEHOLDER.search(p.read_text()), p


def test_triton_repo_cli_errors_leave_nothing(artifact, tmp_path):
    def run(*args):
        return CliRunner().invoke(export_main, ["triton-repo", *map(str, args)])

    r = run(tmp_path / "missing", "--out", tmp_path / "repo")
    assert r.exit_code == 2 and r.stderr.startswith("error: artifact folder") and "does not exist" in r.stderr
    r = run(artifact.root, "--out", tmp_path / "repo", "--backend", "tensorrt")
    assert r.exit_code == 2 and "needs TensorRT engines" in r.stderr and "--target onnx" in r.stderr
    r = run(artifact.root, "--out", tmp_path / "repo", "--instances", "0")
    assert r.exit_code == 2 and "--instances must be >= 1" in r.stderr
    broken = tmp_path / "broken"
    shutil.copytree(artifact.root, broken)
    with open(broken / "onnx" / "draft.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01")
    r = run(broken, "--out", tmp_path / "repo")
    assert r.exit_code == 2 and "does not match its checksum" in r.stderr
    assert not (tmp_path / "repo").exists() and not list(tmp_path.glob(".repo*"))
    (tmp_path / "repo").mkdir()
    r = run(artifact.root, "--out", tmp_path / "repo")
    assert r.exit_code == 2 and "already exists; pass --force" in r.stderr
    r = run(artifact.root, "--out", tmp_path / "repo", "--force")
    assert r.exit_code == 0 and (tmp_path / "repo" / "treeflash" / "config.pbtxt").is_file()


# ---------------------------------------------------------------- serving without a server


def _collect(service, inputs):
    replies = []
    service.handle({k: np.asarray(v) for k, v in inputs.items()}, replies.append)
    return replies


def _arrays(prompt, max_tokens, **kw):
    from treeflash_runtime.serving.client import _as_array

    return {k: _as_array(k, v) for k, v in _inputs(prompt, max_tokens, **kw).items()}


def test_service_streams_what_the_cli_prints(service, reference):
    for prompt in PROMPTS:
        ref = reference(prompt)
        streamed = _collect(service, _arrays(prompt, NEW, stream=True))
        assert [r.final for r in streamed] == [False] * (len(streamed) - 1) + [True]
        assert "".join(r.text for r in streamed) == ref["text"]
        assert sum((r.token_ids for r in streamed), []) == ref["token_ids"]
        last = streamed[-1]
        assert (last.new_tokens, last.rounds, last.stop_reason) == (ref["new_tokens"], ref["rounds"], ref["stop_reason"])
        assert last.mean_accepted == pytest.approx(ref["mean_accepted"])
        assert len(streamed) == ref["rounds"] + 2  # prefill token, one reply per round, the final statistics
        (whole,) = _collect(service, _arrays(prompt, NEW, stream=False))
        assert whole.final and whole.text == ref["text"] and whole.token_ids == ref["token_ids"]
        out = whole.outputs()
        assert list(out) == [s.name for s in SERVING_OUTPUTS] and all(a.shape[0] == 1 for a in out.values())


def test_service_stop_words_and_end_id(service, reference):
    ref = reference(PROMPTS[1])
    word = ref["text"][10:13]
    (r,) = _collect(service, _arrays(PROMPTS[1], NEW, stream=False, stop_words=(word,)))
    cut = ref["text"].find(word) + len(word)
    assert r.text == ref["text"][:cut] and r.stop_reason == "stop_word" and r.new_tokens < NEW
    end = ref["token_ids"][5]
    (r,) = _collect(service, _arrays(PROMPTS[1], NEW, stream=False, end_id=end))
    assert r.token_ids == ref["token_ids"][: ref["token_ids"].index(end) + 1] and r.stop_reason == "stop_token"
    (r,) = _collect(service, _arrays(PROMPTS[1], NEW, stream=False, end_id=-1))
    assert r.token_ids == ref["token_ids"] and r.stop_reason == "max_new_tokens"


def _first_tokens_holding(tokenizer, ids, word):
    """The shortest run of ids whose text holds ``word`` (written independently of the service)."""
    return next(ids[:k] for k in range(1, len(ids) + 1) if word in tokenizer.decode(ids[:k], skip_special_tokens=True))


def _new_word(text, start):
    """Three ASCII characters, not all spaces, first written at or after ``start``."""
    return next(text[i : i + 3] for i in range(start, len(text) - 3)
                if text[i : i + 3].isascii() and text[i : i + 3].strip() and text.find(text[i : i + 3]) == i)


def _stop_word_case(service, reference):
    """(prompt, reference, a stop word that a middle token completes, the text cut after it, its tokens)"""
    tok = service.session.tokenizer
    ref = reference(PROMPTS[1])
    word = _new_word(ref["text"], 5)
    cut = ref["text"][: ref["text"].find(word) + len(word)]
    ids = _first_tokens_holding(tok, ref["token_ids"], word)
    assert 1 < len(ids) < len(ref["token_ids"]) - 2
    return PROMPTS[1], ref, word, cut, ids


def test_service_stop_word_returns_the_tokens_up_to_it(service, reference):
    """The text is cut right after the stop word, and output_ids hold the tokens up to the one that completes
    it: not the rest of the round that wrote it. Streamed and whole agree."""
    prompt, ref, word, cut, ids = _stop_word_case(service, reference)
    (whole,) = _collect(service, _arrays(prompt, NEW, stream=False, stop_words=(word,)))
    assert (whole.text, whole.token_ids, whole.new_tokens, whole.stop_reason) == (cut, ids, len(ids), "stop_word")
    streamed = _collect(service, _arrays(prompt, NEW, stream=True, stop_words=(word,)))
    assert "".join(r.text for r in streamed) == cut and sum((r.token_ids for r in streamed), []) == ids
    assert streamed[-1].final and streamed[-1].stop_reason == "stop_word" and streamed[-1].new_tokens == len(ids)
    assert [r.new_tokens for r in streamed[:-1]] == [len(sum((x.token_ids for x in streamed[: i + 1]), []))
                                                     for i in range(len(streamed) - 1)]

    class FourRoundsAtOnce:
        """The runner with four rounds' tokens gained at once (the random drafter accepts about nothing),
        so the stop word is completed in the middle of a round's tokens."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, plan):
            reports = [self.inner.step(plan) for _ in range(4)]
            return dataclasses.replace(reports[-1], gained=[sum((r.gained[i] for r in reports), [])
                                                            for i in range(len(reports[0].gained))])

    from treeflash_runtime.serving.service import Service

    grouped = Service(dataclasses.replace(service.session, runner=FourRoundsAtOnce(service.session.runner)))
    (whole,) = _collect(grouped, _arrays(prompt, NEW, stream=False, stop_words=(word,)))
    assert (whole.text, whole.token_ids, whole.new_tokens, whole.stop_reason) == (cut, ids, len(ids), "stop_word")
    streamed = _collect(grouped, _arrays(prompt, NEW, stream=True, stop_words=(word,)))
    assert "".join(r.text for r in streamed) == cut and sum((r.token_ids for r in streamed), []) == ids
    assert len(streamed) < len(ids) + 1  # rounds of several tokens did happen


def test_service_several_stop_words_cut_at_the_first_in_the_text(service, reference):
    prompt, ref, word, cut, ids = _stop_word_case(service, reference)
    later = _new_word(ref["text"], len(cut))  # first written after the cut
    for words in [(later, word), (word, later), ("never in this text \u2603", word)]:
        for stream in (False, True):
            replies = _collect(service, _arrays(prompt, NEW, stream=stream, stop_words=words))
            assert "".join(r.text for r in replies) == cut, (words, stream)
            assert sum((r.token_ids for r in replies), []) == ids and replies[-1].stop_reason == "stop_word"


def test_service_accepts_the_max_tokens_its_error_names(service):
    """'ask for at most N tokens': N is served to the last token, N + 1 is refused."""
    from treeflash_runtime.serving.service import RequestError

    with pytest.raises(RequestError) as err:
        service.handle(_arrays("hi", CAPACITY, stream=False), lambda r: None)
    n = int(re.search(r"ask for at most (\d+) tokens", str(err.value)).group(1))
    assert n == CAPACITY - len(service.session.tokenizer("hi")["input_ids"]) + 1 - TREE["tree_size"]
    (r,) = _collect(service, _arrays("hi", n, stream=False, end_id=-1))
    assert r.new_tokens == len(r.token_ids) == n and r.stop_reason == "max_new_tokens"
    with pytest.raises(RequestError, match=f"ask for at most {n} tokens"):
        service.handle(_arrays("hi", n + 1, stream=False), lambda r: None)


BAD_REQUESTS = [
    # (what, inputs as given to the model, expected message part)
    ("missing text_input", {"max_tokens": np.array([[4]], np.int32)}, "missing input 'text_input'"),
    ("missing max_tokens", {"text_input": np.array([[b"hi"]], object)}, "missing input 'max_tokens'"),
    ("max_tokens 0", {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[0]], np.int32)},
     "max_tokens must be >= 1, got 0"),
    ("max_tokens beyond the cache", {"text_input": np.array([[b"hi"]], object),
                                     "max_tokens": np.array([[CAPACITY]], np.int32)},
     f"but this model's cache holds {CAPACITY}: ask for at most"),
    ("prompt longer than the cache", {"text_input": np.array([["word " * CAPACITY]], object),
                                      "max_tokens": np.array([[4]], np.int32)},
     f"but this model's cache holds {CAPACITY} (with a tree of {TREE['tree_size']})"),
    ("wrong dtype", {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[4.0]], np.float32)},
     "input 'max_tokens' must be int32, got float32"),
    ("two prompts", {"text_input": np.array([[b"a", b"b"]], object), "max_tokens": np.array([[4]], np.int32)},
     "must hold one value"),
    ("empty prompt", {"text_input": np.array([[b""]], object), "max_tokens": np.array([[4]], np.int32)},
     "text_input is empty"),
    ("negative temperature", {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[4]], np.int32),
                              "temperature": np.array([[-1.0]], np.float32)}, "temperature must be >= 0"),
]


@pytest.mark.parametrize("what,inputs,message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_service_rejects_bad_requests(service, what, inputs, message):
    from treeflash_runtime.serving.service import RequestError

    sent = []
    with pytest.raises(RequestError) as err:
        service.handle(inputs, sent.append)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert sent == []


@needs_server
@pytest.mark.parametrize("server,protocol,message", [
    ("nohost", "grpc", "--server 'nohost' must be HOST:PORT"),
    ("127.0.0.1:{port}", "grpc", "failed to connect"),
    ("127.0.0.1:{port}", "http", "cannot reach 127.0.0.1:"),
])
def test_run_cli_server_errors_are_one_line(server, protocol, message):
    from treeflash_runtime.serving.local_server import free_port

    r = CliRunner().invoke(run_main, ["--server", server.format(port=free_port()), "--server-protocol", protocol,
                                      "--prompt", "hi"])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stdout == ""


# ---------------------------------------------------------------- a real tritonserver

TURN_MODEL = "treeflash_turn"  # the second model of the served repository: a verifier that ends its turn
BATCHED_MODEL = "treeflash_batched"  # the third: the same artifact on the torch backend, 4 requests in flight


@dataclasses.dataclass
class Turn:
    artifact: object
    tokenizer: object
    im_end: int
    j: int  # the verifier writes <|im_end|> as its (j + 1)-th new token for PROMPTS[0]
    greedy: list  # its own greedy continuation, NEW tokens, through transformers
    plain: list  # the unchanged verifier's greedy continuation


@pytest.fixture(scope="module")
def turn(pair_dirs, tmp_path_factory):
    """The qwen3 pair whose verifier writes <|im_end|> at index j >= 4 of its greedy continuation of PROMPTS[0]
    (LM-head rows swapped, see conftest.write_turn_pair), built as the served artifact is."""
    from treeflash_export.checkpoints import load_pair

    pair = load_pair(str(pair_dirs["qwen3"] / "verifier"), None)
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    im_end = pair.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ref = hf_greedy(pair.verifier, ids, NEW)
    assert im_end not in ref and pair.tokenizer.eos_token_id not in ref  # the plain pair does not stop
    j = next(i for i in range(4, NEW - 4) if ref[i] not in ref[:i])
    root = write_turn_pair(pair_dirs["qwen3"], tmp_path_factory.mktemp("turn") / "pair", ref[j])
    turned = load_pair(str(root / "verifier"), None)
    greedy = hf_greedy(turned.verifier, ids, NEW)
    assert greedy[: j + 1] == ref[:j] + [im_end]
    out = build(str(root / "verifier"), str(root / "drafter"), root.parent / "art",
                BuildConfig(mode="treeflash", max_seq_len=CAPACITY, prefill_chunk=16, **TREE), validate=False,
                log=lambda m: None)
    art = load_artifact(out)
    assert im_end in art.manifest["stop_token_ids"]  # the default stop set holds the end-of-turn token
    return Turn(art, pair.tokenizer, im_end, j, greedy, ref)


def _add_model(repo, name, artifact, work, **options):
    """``artifact``'s treeflash model as model ``name`` of the repository ``repo`` (one server serves both)."""
    other = write_triton_repo(artifact.root, work / f"{name}-repo", log=lambda m: None, **options)
    shutil.move(str(other / "treeflash"), str(repo / name))
    config = repo / name / "config.pbtxt"
    text = config.read_text()
    assert text.count('name: "treeflash"\n') == 1
    config.write_text(text.replace('name: "treeflash"\n', f'name: "{name}"\n'))


@pytest.fixture(scope="module")
def server(artifact, turn, tmp_path_factory, request):
    if not HAVE_SERVER:
        pytest.skip("nvidia-pytriton / tritonclient are not installed (pip install 'treeflash-export[serve]')")
    from treeflash_runtime.serving.local_server import start_local_server

    work = tmp_path_factory.mktemp("tritonserver")
    repo = write_triton_repo(artifact.root, work / "repo", instances=2, log=lambda m: None)
    _add_model(repo, TURN_MODEL, turn.artifact, work)
    _add_model(repo, BATCHED_MODEL, artifact, work, backend="torch", max_batch=4)
    srv = start_local_server(repo, work)
    failed = request.session.testsfailed
    yield srv
    srv.stop()
    if request.session.testsfailed > failed:
        print(f"\n----- tritonserver log ({srv.log_path}) -----\n{srv.log()[-20000:]}")


@pytest.mark.tritonserver
def test_grpc_stream_and_http_equal_in_process_output(server, reference):
    from treeflash_runtime.serving.client import generate_http, stream_grpc

    for prompt in PROMPTS[:2]:
        ref = reference(prompt)
        pieces = []
        r = stream_grpc(server.grpc, _inputs(prompt, NEW, stream=True), on_text=pieces.append)
        assert r.token_ids == ref["token_ids"] and r.text == ref["text"] == "".join(pieces)
        assert (r.rounds, r.new_tokens, r.stop_reason) == (ref["rounds"], ref["new_tokens"], ref["stop_reason"])
        assert len(r.arrivals) == ref["rounds"] + 2  # streamed: a response per round
        h = generate_http(server.http, _inputs(prompt, NEW, stream=False))
        assert h.token_ids == ref["token_ids"] and h.text == ref["text"] and h.rounds == ref["rounds"]
        one = stream_grpc(server.grpc, _inputs(prompt, NEW, stream=False))  # stream false: one response
        assert len(one.arrivals) == 1 and one.token_ids == ref["token_ids"] and one.text == ref["text"]


@pytest.mark.tritonserver
def test_eight_concurrent_streams_with_different_prompts(server, reference):
    from treeflash_runtime.serving.client import stream_grpc

    results, errors = {}, []

    def one(prompt):
        try:
            results[prompt] = stream_grpc(server.grpc, _inputs(prompt, NEW, stream=True))
        except Exception as exc:  # collected, asserted below
            errors.append(f"{prompt!r}: {exc}")

    threads = [threading.Thread(target=one, args=(p,)) for p in LOAD_PROMPTS]
    assert len(set(LOAD_PROMPTS)) == len(threads) >= 8
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for p in LOAD_PROMPTS:
        assert results[p].token_ids == reference(p)["token_ids"], p
        assert results[p].text == reference(p)["text"], p


SERVER_BAD = [
    # (what, gRPC inputs, its error, HTTP generate JSON body, its error). Missing inputs, wrong dtypes and
    # batches are refused by Triton itself, before the model; the rest by treeflash_runtime.serving.
    ("missing input", {"max_tokens": np.array([[4]], np.int32)}, "missing required input(s) ['text_input']",
     {"max_tokens": 4}, "text_input"),
    ("max_tokens 0", {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[0]], np.int32)},
     "max_tokens must be >= 1, got 0", {"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ("max_tokens beyond the cache", {"text_input": np.array([[b"hi"]], object),
                                     "max_tokens": np.array([[CAPACITY]], np.int32)},
     f"this model's cache holds {CAPACITY}: ask for at most", {"text_input": "hi", "max_tokens": CAPACITY},
     f"this model's cache holds {CAPACITY}: ask for at most"),
    ("prompt longer than the cache", {"text_input": np.array([["word " * CAPACITY]], object),
                                      "max_tokens": np.array([[4]], np.int32)}, "at most 240 prompt tokens",
     {"text_input": "word " * CAPACITY, "max_tokens": 4}, "at most 240 prompt tokens"),
    ("wrong dtype", {"text_input": np.array([[b"hi"]], object), "max_tokens": np.array([[4.0]], np.float32)},
     "input 'max_tokens' data-type is 'FP32', but model 'treeflash' expects 'INT32'",
     {"text_input": "hi", "max_tokens": "four"}, "Unable to parse 'data'"),
    ("batch of two", {"text_input": np.array([[b"a"], [b"b"]], object), "max_tokens": np.array([[4], [4]], np.int32)},
     "batch-size must be <= 1", None, None),
]


@pytest.mark.tritonserver
@pytest.mark.parametrize("what,grpc_inputs,grpc_error,http_body,http_error", SERVER_BAD,
                         ids=[b[0] for b in SERVER_BAD])
def test_bad_requests_get_an_error_and_the_server_keeps_serving(server, reference, what, grpc_inputs, grpc_error,
                                                                http_body, http_error):
    from treeflash_runtime.serving.client import ServerError, post_generate, stream_grpc

    ref = reference(PROMPTS[0], 8)
    with pytest.raises(ServerError) as err:
        stream_grpc(server.grpc, grpc_inputs, timeout=60)
    assert grpc_error in str(err.value), str(err.value)
    assert stream_grpc(server.grpc, _inputs(PROMPTS[0], 8, stream=True)).token_ids == ref["token_ids"]
    if http_body is not None:
        with pytest.raises(ServerError) as err:
            post_generate(server.http, http_body, timeout=60)
        assert http_error in str(err.value), str(err.value)
        assert post_generate(server.http, {"text_input": PROMPTS[0], "max_tokens": 8}).token_ids == ref["token_ids"]


@pytest.mark.tritonserver
def test_run_cli_against_the_server(server, reference, artifact):
    ref = reference(PROMPTS[2])
    args = ["--prompt", PROMPTS[2], "--max-new-tokens", str(NEW)]
    r = CliRunner().invoke(run_main, ["--server", server.grpc, *args])
    assert r.exit_code == 0, r.output
    assert r.stdout == ref["text"] + "\n" and "tokens/round" in r.stderr
    local = CliRunner().invoke(run_main, ["--artifacts", str(artifact.root), "--backend", "onnxruntime", *args])
    assert local.exit_code == 0 and local.stdout == r.stdout  # streamed in process: the same text
    r = CliRunner().invoke(run_main, ["--server", server.http, "--server-protocol", "http", *args, "--json"])
    out = json.loads(r.stdout)
    assert out["text"] == ref["text"] and out["token_ids"] == ref["token_ids"] and out["rounds"] == ref["rounds"]
    r = CliRunner().invoke(run_main, ["--server", server.grpc, "--prompt", "hi", "--max-new-tokens", str(CAPACITY)])
    assert r.exit_code == 2 and r.stderr.startswith("error: max_tokens") and len(r.stderr.splitlines()) == 1
    r = CliRunner().invoke(run_main, ["--server", server.grpc, "--artifacts", "x", "--prompt", "hi"])
    assert r.exit_code == 2 and "--artifacts does not apply" in r.stderr


@pytest.mark.tritonserver
def test_bench_in_process_vs_server(server, artifact):
    from treeflash_runtime.bench.cli import main as bench_main

    for model in ("treeflash", BATCHED_MODEL):  # one generation per instance, and in-flight batching
        r = CliRunner().invoke(bench_main, ["--artifacts", str(artifact.root), "--server", server.grpc,
                                            "--server-model", model, "--concurrency", "1,8", "--requests", "8",
                                            "--max-new-tokens", "16", "--json"])
        assert r.exit_code == 0, r.output
        report = json.loads(r.stdout)
        assert report["identical_outputs"] is True and report["prompts"] == 8 and report["model"] == model
        assert [(row["where"], row["concurrency"]) for row in report["rows"]] == [
            ("in_process", 1), ("server", 1), ("server", 8)]
        for row in report["rows"]:
            assert row["requests"] == 8 and row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["requests_per_s"] > 0
            assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] and row["itl_ms"]["mean"] > 0
            assert row["identical_outputs"] is True


@pytest.mark.tritonserver
def test_a_model_that_cannot_load_stops_the_server_with_its_reason(artifact, tmp_path):
    if not HAVE_SERVER:
        pytest.skip("nvidia-pytriton / tritonclient are not installed (pip install 'treeflash-export[serve]')")
    from treeflash_export.errors import TreeFlashError
    from treeflash_runtime.serving.local_server import start_local_server

    repo = write_triton_repo(artifact.root, tmp_path / "repo", log=lambda m: None)
    (repo / "treeflash" / "1" / "artifact" / MANIFEST).unlink()  # an incomplete copy
    with pytest.raises(TreeFlashError) as err:
        start_local_server(repo, tmp_path / "work", timeout=120)
    assert "did not become ready" in str(err.value) and "has no manifest.json" in str(err.value)


@pytest.mark.tritonserver
def test_stop_words_and_end_id_through_the_server(server, service, reference):
    """The same cut text and tokens as in process, streamed over gRPC, whole over gRPC and HTTP."""
    from treeflash_runtime.serving.client import generate_http, stream_grpc

    prompt, ref, word, cut, ids = _stop_word_case(service, reference)
    later = _new_word(ref["text"], len(cut))
    for stream in (True, False):
        r = stream_grpc(server.grpc, _inputs(prompt, NEW, stream=stream, stop_words=(later, word)))
        assert (r.text, r.token_ids, r.new_tokens, r.stop_reason) == (cut, ids, len(ids), "stop_word"), stream
    h = generate_http(server.http, _inputs(prompt, NEW, stream=False, stop_words=(later, word)))
    assert (h.text, h.token_ids, h.new_tokens, h.stop_reason) == (cut, ids, len(ids), "stop_word")
    end = ref["token_ids"][5]
    want = ref["token_ids"][: ref["token_ids"].index(end) + 1]
    r = stream_grpc(server.grpc, _inputs(prompt, NEW, stream=True, end_id=end))
    assert r.token_ids == want and r.stop_reason == "stop_token"
    assert r.text == service.session.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.tritonserver
def test_a_seeded_sampled_request_repeats_through_the_server(server, service):
    """temperature 1, top_p 0.9, random_seed 7: the same tokens twice, and the in-process tokens of the same
    request; another seed gives other tokens."""
    from treeflash_runtime.serving.client import generate_http, stream_grpc

    sampled = dict(temperature=1.0, top_p=0.9, end_id=-1)
    first = stream_grpc(server.grpc, _inputs(PROMPTS[0], 16, stream=True, random_seed=7, **sampled))
    again = stream_grpc(server.grpc, _inputs(PROMPTS[0], 16, stream=True, random_seed=7, **sampled))
    (local,) = _collect(service, _arrays(PROMPTS[0], 16, stream=False, random_seed=7, **sampled))
    assert first.token_ids == again.token_ids == local.token_ids and len(first.token_ids) == 16
    assert first.text == again.text == local.text
    http = generate_http(server.http, _inputs(PROMPTS[0], 16, stream=False, random_seed=7, **sampled))
    assert http.token_ids == first.token_ids
    other = stream_grpc(server.grpc, _inputs(PROMPTS[0], 16, stream=True, random_seed=8, **sampled))
    assert other.token_ids != first.token_ids


@pytest.mark.tritonserver
def test_the_server_accepts_the_max_tokens_its_error_names(server):
    from treeflash_runtime.serving.client import ServerError, stream_grpc

    with pytest.raises(ServerError) as err:
        stream_grpc(server.grpc, _inputs("hi", CAPACITY, stream=True), timeout=60)
    n = int(re.search(r"ask for at most (\d+) tokens", str(err.value)).group(1))
    r = stream_grpc(server.grpc, _inputs("hi", n, stream=True, end_id=-1))
    assert r.new_tokens == len(r.token_ids) == n and r.stop_reason == "max_new_tokens"
    with pytest.raises(ServerError, match=f"ask for at most {n} tokens"):
        stream_grpc(server.grpc, _inputs("hi", n + 1, stream=False), timeout=60)


@pytest.mark.tritonserver
def test_run_cli_stop_token_and_ignore_eos_through_the_server(server, reference):
    """--stop-token-id becomes the request's end_id, --ignore-eos sends -1: the tokens and text stated exactly,
    streamed to the terminal and as JSON."""
    ref = reference(PROMPTS[0])
    stop = ref["token_ids"][6]
    want = ref["token_ids"][: ref["token_ids"].index(stop) + 1]
    args = ["--server", server.grpc, "--prompt", PROMPTS[0], "--max-new-tokens", str(NEW)]
    r = CliRunner().invoke(run_main, [*args, "--stop-token-id", str(stop), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["token_ids"] == want and out["stop_reason"] == "stop_token" and out["new_tokens"] == len(want)
    r = CliRunner().invoke(run_main, [*args, "--stop-token-id", str(stop)])
    assert r.exit_code == 0 and r.stdout == out["text"] + "\n" and "(stop_token)" in r.stderr
    r = CliRunner().invoke(run_main, [*args, "--ignore-eos", "--json"])
    assert json.loads(r.stdout)["token_ids"] == ref["token_ids"]
    r = CliRunner().invoke(run_main, [*args, "--stop-token-id", "5", "--stop-token-id", "6"])
    assert r.exit_code == 2 and r.stderr == "error: --server takes one --stop-token-id (the request's end_id)\n"


@pytest.mark.tritonserver
def test_a_request_stops_where_the_verifier_ends_its_turn_through_the_server(server, turn):
    """A request without end_id ends at the <|im_end|> the verifier writes (the default stop set), streamed
    and not over gRPC and over HTTP: the tokens up to it, it included, and the text before it; end_id -1
    runs past it to max_tokens with the verifier's own greedy tokens."""
    from treeflash_runtime.serving.client import generate_http, stream_grpc

    want = turn.greedy[: turn.j] + [turn.im_end]
    text = turn.tokenizer.decode(turn.greedy[: turn.j], skip_special_tokens=True)
    assert text and len(want) < NEW
    for stream in (True, False):
        r = stream_grpc(server.grpc, _inputs(PROMPTS[0], NEW, stream=stream), model=TURN_MODEL)
        assert (r.token_ids, r.text, r.new_tokens, r.stop_reason) == (want, text, len(want), "stop_token"), stream
        assert len(r.arrivals) == (r.rounds + 2 if stream else 1)
    h = generate_http(server.http, _inputs(PROMPTS[0], NEW, stream=False), model=TURN_MODEL)
    assert (h.token_ids, h.text, h.stop_reason) == (want, text, "stop_token")
    for stream in (True, False):
        r = stream_grpc(server.grpc, _inputs(PROMPTS[0], NEW, stream=stream, end_id=-1), model=TURN_MODEL)
        assert (r.token_ids, r.new_tokens, r.stop_reason) == (turn.greedy, NEW, "max_new_tokens"), stream
        assert r.text == turn.tokenizer.decode(turn.greedy, skip_special_tokens=True) != text
    # the repository's first model (the plain verifier) does not stop there
    r = stream_grpc(server.grpc, _inputs(PROMPTS[0], NEW, stream=True))
    assert r.token_ids == turn.plain and r.token_ids[: turn.j] == want[:-1] and r.stop_reason == "max_new_tokens"


# ---------------------------------------------------------------- in-flight batching through the server


def test_a_torch_repository_batches_in_flight(artifact, tmp_path):
    """--backend torch: one instance, several requests at once (KIND_MODEL: the instance's GPU when the
    server has one); the graph backends keep one generation per instance."""
    from tritonclient.grpc import model_config_pb2 as mc
    from google.protobuf import text_format

    repo = write_triton_repo(artifact.root, tmp_path / "repo", backend="torch", max_batch=6,
                             tree_size_by_batch="1:8,4:4", log=lambda m: None)
    cfg = text_format.Parse((repo / "treeflash" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {
        "backend": "torch", "artifact": "1/artifact", "verify_checksums": "true", "max_batch": "6",
        "tree_size_by_batch": "1:8,4:4", "tree": "manifest"}  # an explicit table: the artifact's tree as built
    auto = write_triton_repo(artifact.root, tmp_path / "auto", backend="torch", log=lambda m: None)
    cfg = text_format.Parse((auto / "treeflash" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert cfg.parameters["tree"].string_value == "auto" and cfg.parameters["tree_size_by_batch"].string_value == ""
    assert cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_MODEL and cfg.model_transaction_policy.decoupled
    assert "batches requests in flight" in (repo / "README.md").read_text()
    with pytest.raises(TreeFlashError, match="--tree-size-by-batch"):
        write_triton_repo(artifact.root, tmp_path / "bad", backend="torch", tree_size_by_batch="8", log=lambda m: None)
    with pytest.raises(TreeFlashError, match="--tree 'best'"):
        write_triton_repo(artifact.root, tmp_path / "bad", backend="torch", tree="best", log=lambda m: None)


def test_the_batched_service_tunes_within_the_artifacts_tree(artifact, tmp_path, monkeypatch):
    """tree auto (the default of triton-repo --backend torch): the service's engine asks the self-tuning
    tree each round, within the artifact's tree size; every request equals what the artifact's own tree
    gives it (greedy: the verifier's own tokens either way)."""
    from treeflash_export.config import SamplingConfig
    from treeflash_runtime.engine import Request
    from treeflash_runtime.serving.service import BatchedService

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    tuned = BatchedService.from_artifact(artifact.root, device="cpu", max_batch=3, tune=True)
    fixed = BatchedService.from_artifact(artifact.root, device="cpu", max_batch=3)
    assert tuned.session.tuner is not None and fixed.session.tuner is None
    assert max(s.tree_size for s in tuned.session.tuner.rule.arms) <= artifact.tree.tree_size
    tok = tuned.session.tokenizer
    prompts = [tok(p)["input_ids"] for p in LOAD_PROMPTS[:5]]
    want = []
    for ids in prompts:
        r = Request(ids, SamplingConfig(max_new_tokens=NEW, stop_token_ids=()))
        fixed.engine.run([r])
        want.append(r.tokens)
    requests = [Request(ids, SamplingConfig(max_new_tokens=NEW, stop_token_ids=())) for ids in prompts]
    tuned.engine.run(requests)
    assert [r.tokens for r in requests] == want
    assert tuned.session.tuner.report()["choices"]


@pytest.mark.tritonserver
def test_the_batched_model_serves_concurrent_streams_and_refuses_a_bad_one(server, reference):
    """Eight concurrent gRPC streams on one torch instance with four request slots (so requests also
    wait for slots and take them as others finish), plus a request that cannot fit among them: each good
    stream equals its own single in-process generation, the bad one gets one error, the model keeps serving."""
    from treeflash_runtime.serving.client import stream_grpc

    results, errors = {}, {}

    def one(prompt, max_tokens):
        try:
            results[prompt] = stream_grpc(server.grpc, _inputs(prompt, max_tokens, stream=True), model=BATCHED_MODEL)
        except Exception as exc:  # collected, asserted below
            errors[prompt] = str(exc)

    jobs = [(p, NEW) for p in LOAD_PROMPTS[:8]] + [("a request that asks for too much", 10**6)]
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(errors) == ["a request that asks for too much"] and "ask for at most" in errors[jobs[-1][0]]
    for prompt, _ in jobs[:8]:
        ref = reference(prompt)
        assert results[prompt].token_ids == ref["token_ids"] and results[prompt].text == ref["text"], prompt
    again = stream_grpc(server.grpc, _inputs(LOAD_PROMPTS[0], NEW, stream=False), model=BATCHED_MODEL)
    assert again.token_ids == reference(LOAD_PROMPTS[0])["token_ids"]


def test_batched_service_streams_cancels_and_refuses_in_process(artifact, reference):
    """The Triton adapter's torch path without a server: requests handed to the engine's background
    loop stream through their own senders; one whose stream is cancelled (after its second reply) ends
    there and frees its slot for a waiting one; a request that cannot fit is refused at once; the
    others equal their single generations."""
    from treeflash_runtime.serving.service import BatchedService, RequestError

    svc = BatchedService.from_artifact(artifact.root, max_batch=2)
    svc.start()
    try:
        replies, errors = {}, []

        def sender(name):
            return lambda reply: replies.setdefault(name, []).append(reply)

        with pytest.raises(RequestError, match="ask for at most"):
            svc.submit(_np_inputs("too long", 10**6), sender("x"), errors.append)
        cancelled = svc.submit(_np_inputs(PROMPTS[0], NEW, stream=True), sender("cancelled"), errors.append,
                               cancelled=lambda: len(replies.get("cancelled", [])) >= 2)
        others = [svc.submit(_np_inputs(p, NEW, stream=True), sender(p), errors.append) for p in PROMPTS[1:3]]
        deadline = time.monotonic() + 300
        while not all(r.done for r in [cancelled, *others]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not errors and cancelled.state == "cancelled"
        final = replies["cancelled"][-1]
        assert final.final and final.stop_reason == "cancelled" and final.new_tokens < NEW
        for p in PROMPTS[1:3]:
            ref = reference(p)
            got = replies[p]
            assert [t for r in got for t in r.token_ids] == ref["token_ids"] and got[-1].stop_reason == ref["stop_reason"]
        assert svc.engine.scheduler.idle()
    finally:
        svc.stop()


def _np_inputs(prompt, max_tokens, stream=False):
    return {"text_input": np.array([[prompt.encode()]], dtype=object),
            "max_tokens": np.array([[max_tokens]], dtype=np.int32), "stream": np.array([[stream]], dtype=bool)}
