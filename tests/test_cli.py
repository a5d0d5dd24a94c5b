"""`treeflash-run`, `treeflash-export tiny-pair` and `random-pair`: JSON output, streaming, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import hf_greedy
from treeflash_runtime.cli import main as run_main

from treeflash_export.cli import main as export_main
from treeflash_export.tiny import write_tiny_pair

JSON_KEYS = {"text", "token_ids", "mode", "backend", "rounds", "accept_lengths", "mean_accepted", "new_tokens",
             "elapsed_s", "tokens_per_s"}


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(run_main, [str(a) for a in args], input=input, env=env, catch_exceptions=False)


def pair_args(d: Path):
    return ["--model", d / "verifier", "--drafter", d / "drafter"]


@pytest.mark.parametrize("mode,draft_vocab", [("treeflash", "auto"), ("marginal", "auto"), ("chain", "auto"),
                                              ("ar", "auto"), ("treeflash", 40)])
def test_json_output_is_one_object_and_exact(pair_dirs, load, mode, draft_vocab):
    r = invoke(*pair_args(pair_dirs["qwen3"]), "--prompt", "def main():", "--mode", mode, "--max-new-tokens", 24,
               "--tree-size", 16, "--ignore-eos", "--json", "--draft-vocab", draft_vocab)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert JSON_KEYS <= set(out)
    assert out["mode"] == mode and out["backend"] == "torch" and out["new_tokens"] == 24
    assert sum(out["accept_lengths"]) + 1 >= out["new_tokens"] and out["rounds"] == len(out["accept_lengths"])
    pair = load("qwen3")
    ids = pair.tokenizer("def main():")["input_ids"]
    assert out["token_ids"] == hf_greedy(pair.verifier, ids, 24)
    assert out["text"] == pair.tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_streams_text_and_reads_stdin_with_chat(pair_dirs):
    r = invoke(*pair_args(pair_dirs["llama"]), "--chat", "--max-new-tokens", 12, "--ignore-eos", input="hello there")
    assert r.exit_code == 0, r.stderr
    assert "tokens/round" in r.stderr and len(r.stdout.strip("\n")) > 0


def test_console_script_json(pair_dirs):
    """The installed entry point, as a user runs it."""
    exe = Path(sys.executable).with_name("treeflash-run")
    cmd = [str(exe), *map(str, pair_args(pair_dirs["qwen3-dflash"])), "--mode", "chain", "--prompt", "x = 1",
           "--max-new-tokens", 8, "--json"]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["mode"] == "chain" and 1 <= out["new_tokens"] <= 8


def _edited_drafter(tmp_path, src: Path, **changes) -> Path:
    dst = tmp_path / "drafter"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key in ("target_layer_ids", "mask_token_id"):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def assert_one_line_error(r, *words):
    """One error line, last, and before it only the loading progress lines (no traceback); exit status 2
    (the README's promise for bad input)."""
    assert r.exit_code == 2, (r.exit_code, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), r.stderr
    assert all(line.startswith("loaded ") for line in lines[:-1]), r.stderr
    for w in words:
        assert w in lines[-1], lines[-1]


def test_wrong_paths(pair_dirs, tmp_path):
    d = pair_dirs["qwen3"]
    assert_one_line_error(invoke("--model", tmp_path / "nope", "--drafter", d / "drafter", "--prompt", "x"),
                          "verifier", "nope")
    assert_one_line_error(invoke("--model", d / "verifier", "--drafter", tmp_path, "--prompt", "x"),
                          "drafter", "config.json")


def test_uncached_hub_id_offline_names_the_download(pair_dirs, tmp_path):
    d = pair_dirs["qwen3"]
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = invoke("--model", "Qwen/Qwen3-8B", "--drafter", d / "drafter", "--prompt", "x", env=env)
    assert_one_line_error(r, "Qwen/Qwen3-8B", "huggingface-cli download Qwen/Qwen3-8B")


def test_mismatched_pairs(pair_dirs, tmp_path):
    d = pair_dirs["qwen3"]
    small = write_tiny_pair(tmp_path / "small", hidden=32)
    assert_one_line_error(invoke("--model", d / "verifier", "--drafter", small / "drafter", "--prompt", "x"),
                          "hidden size mismatch", "32", "64")
    for change, words in [
        (dict(vocab_size=1000), ("vocabulary size mismatch", "1000", "512")),
        (dict(target_layer_ids=[1, 9]), ("target_layer_ids", "0..3")),
        (dict(mask_token_id=600), ("mask_token_id 600", "512")),
        (dict(num_target_layers=36), ("36", "4")),
    ]:
        sub = tmp_path / next(iter(change))
        sub.mkdir()
        edited = _edited_drafter(sub, d / "drafter", **change)
        assert_one_line_error(invoke("--model", d / "verifier", "--drafter", edited, "--prompt", "x"), *words)


def test_head_required_for_treeflash_mode(pair_dirs):
    r = invoke(*pair_args(pair_dirs["qwen3-dflash"]), "--prompt", "x", "--mode", "treeflash")
    assert_one_line_error(r, "head", "--mode marginal")


def test_unknown_layout_and_missing_keys(pair_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = pair_dirs["qwen3"]
    state = load_file(str(d / "drafter" / "model.safetensors"))
    renamed = tmp_path / "renamed"
    shutil.copytree(d / "drafter", renamed)
    save_file({f"backbone.{k}": v for k, v in state.items()}, str(renamed / "model.safetensors"))
    assert_one_line_error(invoke("--model", d / "verifier", "--drafter", renamed, "--prompt", "x"),
                          "unknown drafter layout")
    partial = tmp_path / "partial"
    shutil.copytree(d / "drafter", partial)
    save_file({k: v for k, v in state.items() if "layers.1." not in k}, str(partial / "model.safetensors"))
    assert_one_line_error(invoke("--model", d / "verifier", "--drafter", partial, "--prompt", "x"), "missing")


@pytest.mark.parametrize("flags,words", [
    (["--tree-size", 1], ["--tree-size 1"]),
    (["--tree-size", 5000], ["--tree-size 5000"]),
    (["--top-k", 0], ["--top-k 0"]),
    (["--top-k", 600], ["--top-k 600", "512"]),
    (["--top-m", 0], ["--top-m 0"]),
    (["--temperature", -1], ["--temperature"]),
    (["--top-p", 0], ["--top-p"]),
    (["--max-new-tokens", 0], ["--max-new-tokens"]),
    (["--draft-vocab", -3], ["--draft-vocab -3", "between 1 and the vocabulary size"]),
    (["--mode", "marginal", "--tree-size", 8, "--top-k", 8, "--draft-vocab", 4], ["--top-k 8", "vocabulary 4"]),
])
def test_tree_and_sampling_settings_out_of_range(pair_dirs, flags, words):
    assert_one_line_error(invoke(*pair_args(pair_dirs["qwen3"]), "--prompt", "x", *flags), *words)


def test_prompt_longer_than_cache(pair_dirs):
    long_prompt = "def f(x): return x\n" * 40
    r = invoke(*pair_args(pair_dirs["qwen3"]), "--prompt", long_prompt, "--max-seq-len", 64)
    assert_one_line_error(r, "prompt is", "cache holds 64", "--max-seq-len")
    r = invoke(*pair_args(pair_dirs["qwen3"]), "--prompt", "x", "--max-seq-len", 64, "--max-new-tokens", 60)
    assert_one_line_error(r, "needs", "--max-new-tokens")


def test_cache_larger_than_memory(pair_dirs):
    r = invoke(*pair_args(pair_dirs["qwen3"]), "--prompt", "x", "--max-seq-len", 10**9)
    assert_one_line_error(r, "caches for --max-seq-len 1000000000 need", "GiB is free on cpu", "lower --max-seq-len")


def test_missing_drafter_and_empty_prompt(pair_dirs):
    d = pair_dirs["qwen3"]
    assert_one_line_error(invoke("--model", d / "verifier", "--prompt", "x"), "--drafter is required")
    assert_one_line_error(invoke(*pair_args(d), "--prompt", ""), "empty")


def test_export_tiny_pair_command(tmp_path):
    r = CliRunner().invoke(export_main, ["tiny-pair", "--out", str(tmp_path / "p"), "--family", "llama"])
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "p" / "verifier" / "config.json").is_file()
    assert (tmp_path / "p" / "drafter" / "model.safetensors").is_file()
    r = CliRunner().invoke(export_main, ["tiny-pair", "--out", str(tmp_path / "p")])
    assert r.exit_code == 2 and "already exists" in r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_export_random_pair_command_runs_exactly(tmp_path):
    """A random pair at a preset's shapes written as checkpoints, for timing start-up on a GPU:
    it loads, runs TreeFlash exactly, and the JSON reports the start-up split."""
    import torch

    from treeflash_export.checkpoints import load_pair

    out = tmp_path / "rp"
    r = CliRunner().invoke(export_main, ["random-pair", "--preset", "tiny", "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.stderr
    assert "building a random tiny pair on cpu (float32)" in r.stderr
    r = invoke(*pair_args(out), "--prompt", "def f(x):", "--max-new-tokens", 12, "--tree-size", 16, "--ignore-eos",
               "--json")
    assert r.exit_code == 0, r.stderr
    res = json.loads(r.stdout)
    pair = load_pair(str(out / "verifier"), str(out / "drafter"), dtype=torch.float32)
    assert res["token_ids"] == hf_greedy(pair.verifier, pair.tokenizer("def f(x):")["input_ids"], 12)
    assert res["load_s"] > 0 and res["first_token_s"] == pytest.approx(res["load_s"] + res["prefill_s"])
    stages = res["load_stages_s"]  # where loading went, each step within the whole
    assert set(stages) == {"tokenizer", "verifier", "drafter", "runner"} and min(stages.values()) >= 0
    assert sum(stages.values()) <= res["load_s"]
    loaded = [line for line in r.stderr.splitlines() if line.startswith("loaded ")]
    assert len(loaded) == 2 and "verifier:" in loaded[0] and "drafter (treeflash layout):" in loaded[1], r.stderr
    assert all("float32 on cpu" in line for line in loaded), r.stderr
    r = CliRunner().invoke(export_main, ["random-pair", "--preset", "tiny", "--out", str(out)])
    assert r.exit_code == 2 and "already exists" in r.stderr
    if not torch.cuda.is_available():  # a device that is not there: one line, nothing written
        r = CliRunner().invoke(export_main, ["random-pair", "--preset", "tiny", "--out", str(tmp_path / "x"),
                                             "--device", "cuda"])
        assert r.exit_code == 2 and "sees no CUDA GPU" in r.stderr and not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_bench_reports_side_by_side_ratios(pair_dirs):
    from treeflash_runtime.bench.cli import main as bench_main

    d = pair_dirs["qwen3"]
    r = CliRunner().invoke(bench_main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"),
                                        "--modes", "treeflash,chain", "--tree-sizes", "16", "--top-m", "4",
                                        "--top-k", "4", "--max-new-tokens", "12", "--prompt", "def f(x):",
                                        "--prompt", "Hello", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["stops_at_eos"] is False
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"treeflash", "chain", "ar"}
    assert report["identical_outputs"] is True
    assert rows["ar"]["speedup_vs_ar"] == 1.0 and rows["ar"]["mean_accepted"] == 1.0
    for row in rows.values():
        assert row["new_tokens"] == 2 * 12 and row["tokens_per_s"] > 0


def test_a_drafter_without_model_pairs_with_the_default_verifier(pair_dirs, monkeypatch, tmp_path):
    """--drafter alone keeps that drafter with the default verifier (it used to be replaced by the
    demo drafter without a word)."""
    from treeflash_runtime import factory

    d = pair_dirs["qwen3"]
    monkeypatch.setattr(factory, "default_pair", lambda log=None: (str(d / "verifier"), str(tmp_path / "no-demo")))
    r = CliRunner().invoke(run_main, ["--drafter", str(d / "drafter"), "--prompt", "def f(x):", "--max-new-tokens",
                                      "4", "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(run_main, ["--prompt", "def f(x):", "--max-new-tokens", "4"])
    assert r.exit_code == 2 and "no-demo" in r.output  # without --drafter the demo drafter is the one loaded


def test_the_default_verifier_is_converted_again_under_another_transformers(monkeypatch, tmp_path):
    """The cached SmolLM2 copy is reused only when the transformers release that converted it is the
    running one: an older copy (or one with no record, from before the record existed) is made again
    in place, and a half-failed conversion leaves the old copy untouched."""
    from treeflash_export import smollm

    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm, "gguf_path", lambda: tmp_path / "x.gguf")
    calls = []

    def convert(src, out):
        calls.append(src)
        (out / "model.safetensors").write_text(f"conversion {len(calls)}")

    monkeypatch.setattr(smollm, "convert_gguf", convert)
    out = smollm.default_verifier()
    assert len(calls) == 1 and (out / "model.safetensors").read_text() == "conversion 1"
    assert json.loads((out / smollm.CONVERTED_BY).read_text()) == smollm._converter()
    assert smollm.default_verifier() == out and len(calls) == 1  # same release: reused

    record = json.loads((out / smollm.CONVERTED_BY).read_text())
    # a release that is never the running one (pyproject.toml asks for transformers 5)
    (out / smollm.CONVERTED_BY).write_text(json.dumps(dict(record, transformers="4.57.0")))
    lines = []
    assert smollm.default_verifier(log=lines.append) == out and len(calls) == 2
    assert "converted by transformers 4.57.0" in lines[0]
    assert (out / "model.safetensors").read_text() == "conversion 2"

    (out / smollm.CONVERTED_BY).unlink()  # a copy made before the record existed

    def failing(src, out):
        (out / "model.safetensors").write_text("half")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(smollm, "convert_gguf", failing)
    with pytest.raises(RuntimeError):
        smollm.default_verifier()
    assert (out / "model.safetensors").read_text() == "conversion 2"
    monkeypatch.setattr(smollm, "convert_gguf", convert)
    smollm.default_verifier()
    assert len(calls) == 3 and smollm.default_verifier() == out and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no partial folders


def test_chat_with_a_tokenizer_without_a_chat_template(pair_dirs, tmp_path):
    """--chat needs the tokenizer's chat template: one line, exit status 2, nothing on stdout."""
    d = tmp_path / "pair"
    shutil.copytree(pair_dirs["qwen3"], d)
    cfg_path = d / "verifier" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in (d / "verifier").glob("chat_template.*"):
        extra.unlink()
    r = invoke(*pair_args(d), "--prompt", "hello", "--chat", "--max-new-tokens", 4)
    assert_one_line_error(r)
    assert r.stderr.strip().splitlines()[-1] == "error: --chat: this tokenizer has no chat template"
    assert r.stdout == ""
    r = invoke(*pair_args(d), "--prompt", "hello", "--max-new-tokens", 4, "--ignore-eos", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["new_tokens"] == 4  # without --chat it runs
