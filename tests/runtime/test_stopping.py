"""Stopping and the cache limit, in process: the default EOS set (tokenizer, generation config and the
chat template's end-of-turn token), a real stop where the verifier itself writes EOS or end-of-turn,
--stop-token-id, --ignore-eos, and a generation at exactly the cache's capacity."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy, write_turn_pair

from treeflash_export.checkpoints import eos_token_ids, load_pair
from treeflash_runtime.cli import main as run_main

PROMPT = PROMPTS[0]
NEW = 24
EOS, IM_END = 0, 2  # <|endoftext|>, <|im_end|> in the tiny tokenizer


def run(*args):
    r = CliRunner().invoke(run_main, [str(a) for a in args], catch_exceptions=False)
    return r


def run_json(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def pair_args(d):
    return ["--model", d / "verifier", "--drafter", d / "drafter"]


@pytest.fixture(scope="module")
def greedy(load):
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPT)["input_ids"]
    ref = hf_greedy(pair.verifier, ids, NEW)
    assert EOS not in ref and IM_END not in ref  # the plain pair never stops by itself within NEW
    return pair, ids, ref


@pytest.fixture(scope="module")
def turn_pair(pair_dirs, greedy, tmp_path_factory):
    """The qwen3 pair with the verifier's LM-head rows of <|im_end|> and of the token T that its greedy
    continuation first writes at index J >= 4 swapped: the verifier itself ends its turn there (every
    earlier argmax is unchanged, since T's logit was below each of them)."""
    _, _, ref = greedy
    j = next(i for i in range(4, NEW) if ref[i] not in ref[:i])
    root = write_turn_pair(pair_dirs["qwen3"], tmp_path_factory.mktemp("turn") / "pair", ref[j])
    return root, j


def test_the_default_stop_set(greedy, pair_dirs, tmp_path):
    """EOS of the tokenizer and of the generation config (a list there too), and the end-of-turn token the
    chat template writes; without a chat template only the EOS ids."""
    pair, _, _ = greedy
    assert eos_token_ids(pair.tokenizer, pair.verifier) == [EOS, IM_END]
    d = tmp_path / "v"
    shutil.copytree(pair_dirs["qwen3"] / "verifier", d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[EOS, 77, 78])))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in d.glob("chat_template.*"):
        extra.unlink()
    other = load_pair(str(d), None)
    assert not getattr(other.tokenizer, "chat_template", None)
    assert eos_token_ids(other.tokenizer, other.verifier) == [EOS, 77, 78]


@pytest.mark.parametrize("mode", ["treeflash", "ar"])
def test_generation_ends_where_the_verifier_ends_its_turn(turn_pair, greedy, mode):
    root, j = turn_pair
    pair, _, ref = greedy
    args = [*pair_args(root), "--prompt", PROMPT, "--mode", mode, "--tree-size", 16, "--max-new-tokens", NEW]
    out = run_json(*args)
    assert out["token_ids"] == ref[:j] + [IM_END] and out["stop_reason"] == "stop_token"
    assert out["new_tokens"] == j + 1 and out["text"] == pair.tokenizer.decode(ref[:j])
    streamed = run(*args)  # the streamed text is the same, the end-of-turn token not shown
    assert streamed.exit_code == 0 and streamed.stdout == out["text"] + "\n"
    assert "(stop_token)" in streamed.stderr

    # --ignore-eos: to the budget, through the end-of-turn token (the verifier's own greedy output)
    full = run_json(*args, "--ignore-eos")
    turned = load_pair(str(root / "verifier"), None).verifier
    assert full["token_ids"] == hf_greedy(turned, pair.tokenizer(PROMPT)["input_ids"], NEW)
    assert full["token_ids"][: j + 1] == ref[:j] + [IM_END] and full["stop_reason"] == "max_new_tokens"
    # an explicit stop token still ends it under --ignore-eos
    out = run_json(*args, "--ignore-eos", "--stop-token-id", IM_END)
    assert out["token_ids"] == ref[:j] + [IM_END] and out["stop_reason"] == "stop_token"


def test_stop_token_ids_end_generation_at_their_first_occurrence(pair_dirs, greedy):
    pair, _, ref = greedy
    args = [*pair_args(pair_dirs["qwen3"]), "--prompt", PROMPT, "--tree-size", 16, "--max-new-tokens", NEW]
    for stop in (ref[0], ref[1], ref[NEW - 1]):
        out = run_json(*args, "--stop-token-id", stop)
        first = ref.index(stop)
        assert out["token_ids"] == ref[: first + 1] and out["stop_reason"] == "stop_token", stop
        assert out["text"] == pair.tokenizer.decode(ref[: first + 1])
    out = run_json(*args, "--stop-token-id", ref[0])  # the prefill's token: no round runs
    assert out["rounds"] == 0 and out["new_tokens"] == 1
    later = next(i for i in range(4, NEW) if ref[i] not in ref[:i])
    out = run_json(*args, "--stop-token-id", ref[later], "--stop-token-id", 500)  # several: the first that comes
    assert out["token_ids"] == ref[: later + 1]


def test_the_generation_configs_eos_list_is_a_real_stop(pair_dirs, greedy, tmp_path):
    """A second EOS id in generation_config.json (as Llama 3 and Qwen3 list theirs) ends generation where the
    verifier writes it; --ignore-eos does not stop there."""
    pair, _, ref = greedy
    k = next(i for i in range(3, NEW) if ref[i] not in ref[:i])
    root = tmp_path / "pair"
    shutil.copytree(pair_dirs["qwen3"], root)
    gen_path = root / "verifier" / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen_path.write_text(json.dumps(dict(gen, eos_token_id=[EOS, ref[k]])))
    args = [*pair_args(root), "--prompt", PROMPT, "--tree-size", 16, "--max-new-tokens", NEW]
    out = run_json(*args)
    assert out["token_ids"] == ref[: k + 1] and out["stop_reason"] == "stop_token"
    out = run_json(*args, "--ignore-eos")
    assert out["token_ids"] == ref and out["stop_reason"] == "max_new_tokens"


# ---------------------------------------------------------------- the cache limit


@pytest.mark.parametrize("mode,tree", [("treeflash", 16), ("chain", 8), ("ar", 1)])
def test_a_generation_exactly_at_the_cache_capacity(pair_dirs, greedy, mode, tree):
    """prompt + (budget - 1) + tree = S: the cache the last round needs (the last token never enters the
    cache) fits exactly and the generation reaches its budget with the verifier's own tokens; one token
    more is refused with the exit status 2 and one line naming both numbers. (chain: the tree is the
    drafter's block of 8; ar: one node.)"""
    pair, ids, _ = greedy
    S = 64
    budget = S - len(ids) + 1 - tree
    args = [*pair_args(pair_dirs["qwen3"]), "--prompt", PROMPT, "--mode", mode, "--tree-size", 16, "--max-seq-len",
            S, "--ignore-eos"]
    out = run_json(*args, "--max-new-tokens", budget)
    assert out["new_tokens"] == budget and out["stop_reason"] == "max_new_tokens"
    assert out["token_ids"] == hf_greedy(pair.verifier, ids, budget)
    r = run(*args, "--max-new-tokens", budget + 1)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: prompt ({len(ids)}) + max new tokens ({budget + 1}) + tree ({tree}) needs {S + 1} cache slots "
        f"but the cache holds {S}: lower --max-new-tokens or raise --max-seq-len")


def test_torch_runner_fills_the_cache_to_its_last_needed_slot(greedy):
    """The same limit on the runner itself, for a drafter-heavy setting (N = 16 nodes, a block of 8)."""
    from treeflash_export.config import SamplingConfig, TreeConfig
    from treeflash_export.errors import ConfigError
    from treeflash_runtime import generate
    from treeflash_runtime.backends.pytorch import TorchRunner

    pair, ids, _ = greedy
    S = len(ids) + 20 - 1 + 16
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=S)
    res = generate(runner, ids, TreeConfig(tree_size=16, top_m=4, top_k=4), SamplingConfig(max_new_tokens=20))
    assert res.token_ids == hf_greedy(pair.verifier, ids, 20)
    with pytest.raises(ConfigError, match=f"needs {S + 1} cache slots but the cache holds {S}"):
        generate(runner, ids, TreeConfig(tree_size=16, top_m=4, top_k=4), SamplingConfig(max_new_tokens=21))
    assert torch.equal(torch.tensor(generate(runner, ids, TreeConfig(tree_size=16, top_m=4, top_k=4),
                                             SamplingConfig(max_new_tokens=20)).token_ids), torch.tensor(res.token_ids))


def test_an_artifact_and_its_service_stop_at_the_end_of_turn(turn_pair, greedy, tmp_path):
    """The build records the default stop set in the manifest; ONNX Runtime through treeflash-run and the
    serving module (a request without end_id) end where the verifier writes <|im_end|>; end_id -1 does not."""
    import numpy as np

    from treeflash_export.export.artifact import load_artifact
    from treeflash_export.export.build import BuildConfig, build
    from treeflash_runtime.serving.service import Service

    root, j = turn_pair
    pair, _, ref = greedy
    out = build(str(root / "verifier"), str(root / "drafter"), tmp_path / "art",
                BuildConfig(mode="treeflash", tree_size=16, top_m=4, top_k=4, max_seq_len=96, prefill_chunk=16),
                validate=False, log=lambda m: None)
    assert load_artifact(out).manifest["stop_token_ids"] == [EOS, IM_END]
    res = run_json("--artifacts", out, "--backend", "onnxruntime", "--prompt", PROMPT, "--max-new-tokens", NEW)
    assert res["token_ids"] == ref[:j] + [IM_END] and res["stop_reason"] == "stop_token"
    service = Service.from_artifact(out, "onnxruntime")

    def request(**extra):
        inputs = {"text_input": np.array([[PROMPT.encode()]], dtype=object),
                  "max_tokens": np.array([[NEW]], dtype=np.int32), **extra}
        replies = []
        service.handle(inputs, replies.append)
        return replies

    (whole,) = request()
    assert (whole.token_ids, whole.text, whole.stop_reason) == (ref[:j] + [IM_END], pair.tokenizer.decode(ref[:j]),
                                                               "stop_token")
    streamed = request(stream=np.array([[True]]))
    assert sum((r.token_ids for r in streamed), []) == ref[:j] + [IM_END]
    assert "".join(r.text for r in streamed) == whole.text and streamed[-1].stop_reason == "stop_token"
    (full,) = request(end_id=np.array([[-1]], dtype=np.int32))
    assert full.new_tokens == NEW and full.token_ids[: j + 1] == ref[:j] + [IM_END]
