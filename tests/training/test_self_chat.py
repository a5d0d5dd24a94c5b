"""The chat-self source (`train --source chat-self`): user turns the verifier writes from its chat
template alone. The cleaning rules on strings; on the tiny pair: seeded determinism, the held-out
split kept out of training, the candidate cache (growth and an interrupted run), batches that stop
once every turn has ended, the mix through the CLI and the benchmark's held-out domain."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from treeflash_export.checkpoints import checkpoint_fingerprint, load_tokenizer, load_verifier
from treeflash_export.errors import ConfigError
from treeflash_export.training import data as train_data
from treeflash_export.training import self_chat
from treeflash_export.training.chat import stop_ids
from treeflash_export.training.config import TrainConfig
from treeflash_export.training.self_chat import check_turn, finish_turn, normalise, self_chat_prompts

CFG = TrainConfig(num_taps=2, prompt_tokens=40, continuation_tokens=6, gen_batch=8, instruction_tokens=10,
                  instruction_temperature=1.0)


@pytest.fixture(scope="module")
def writer(pair_dirs, tmp_path_factory):
    """The tiny verifier, made to end a user turn often: its <|im_end|> row of the LM head points
    along the mean of its final hidden states over user-turn prefixes (random weights alone almost
    never end a turn)."""
    src = pair_dirs["qwen3"] / "verifier"
    out = tmp_path_factory.mktemp("writer") / "verifier"
    v = load_verifier(src, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(src)
    asks = [self_chat.user_prefix(tok, o) for o in ("", *self_chat.OPENERS[:7])]
    with torch.no_grad():
        u = torch.cat([v.model(torch.tensor([ids])).last_hidden_state[0] for ids in asks]).mean(0)
        v.lm_head.weight[tok.convert_tokens_to_ids("<|im_end|>")] = 1.1 * u / u.norm()
    v.save_pretrained(out)
    tok.save_pretrained(out)
    return out, load_verifier(out, dtype=torch.float32, device="cpu"), tok


@pytest.fixture
def lenient(monkeypatch):
    """Random weights write no English: only empty turns are rejected here (the rules are tested
    on strings below)."""
    monkeypatch.setattr(self_chat, "check_turn", lambda text: "" if text.strip() else "empty")


# ---------------------------------------------------------------- the rules, on strings


@pytest.mark.parametrize("text, reason", [
    ("How do I keep basil alive on a windowsill?", ""),
    ("Write a Python function that checks whether a string is a palindrome.", ""),
    ("I'm planning a trip to Japan. Can you suggest a 5-day itinerary?", ""),
    ("", "empty"),
    ("Explain recursion.", "too short"),
    ("Tell me " + "about the history of bread and how it spread " * 12, "too long"),
    ("Comment puis-je améliorer ma prononciation en français très rapidement ?", "not English"),
    ("Как научиться программировать на Python быстро?", "not English"),
    ("1 + 2 = 3; 4 * 5 = 20; 7 - 1 = 6 ??", "not English"),  # letters under half of the text
    ("Sure, here is a list of five healthy breakfasts.", "answer-like"),
    ("Hello! I'm an AI assistant, how can I help you today?", "answer-like"),
    ("Hi there, how can I help you with your garden today?", "answer-like"),
    ("1. What is the capital of France?\n2. What is the capital of Spain?", "malformed"),
    ("- buy milk and eggs and bread for the week", "malformed"),
    ("What is a good name for a cat?\nA: Whiskers is a good name.", "malformed"),
    ("Q: how do plants make food from light?", "malformed"),
    ("Summarize the following article in three sentences:", "malformed"),
    ("Can you explain <|im_start|> tokens in chat templates?", "malformed"),
    ("Write a poem poem poem poem poem poem poem poem poem poem poem poem", "malformed"),
])
def test_user_turns_are_checked_by_rule(text, reason):
    assert check_turn(text) == reason


def test_normalised_text_is_the_key_of_deduplication():
    assert normalise("How do I boil an egg?") == normalise("  how do i BOIL an egg") == "how do i boil an egg"
    assert normalise("How do I boil an egg?") != normalise("How do I boil two eggs?")


@pytest.mark.parametrize("generated, start, expected", [
    (" keep basil alive?<|im_end|>junk after the turn", "How do I", ("How do I keep basil alive?", "")),
    ("Why is the sky blue? And the sea", "", ("Why is the sky blue?", "")),  # no end of turn: the last sentence
    ("a list of 3 things without an end", "Give me", (None, "unfinished")),
    ('"Tell me a joke about cats."<|im_end|>', "", ("Tell me a joke about cats.", "")),
])
def test_a_turn_is_its_opening_plus_the_text_up_to_the_end_of_turn(pair_dirs, generated, start, expected):
    tok = load_tokenizer(pair_dirs["qwen3"] / "verifier")
    ids = tok(generated, add_special_tokens=False)["input_ids"]
    assert finish_turn(ids, tok, stop_ids(tok), start) == expected


def test_the_prefix_is_the_chat_template_up_to_the_user_text(pair_dirs):
    tok = load_tokenizer(pair_dirs["qwen3"] / "verifier")
    assert tok.decode(self_chat.user_prefix(tok)) == "<|im_start|>user\n"
    assert tok.decode(self_chat.user_prefix(tok, "How do I")) == "<|im_start|>user\nHow do I"


def test_openers_are_seeded_per_candidate_and_a_third_are_empty():
    first = [self_chat.opener("train", 0, i) for i in range(600)]
    assert first == [self_chat.opener("train", 0, i) for i in range(600)]
    assert first != [self_chat.opener("heldout", 0, i) for i in range(600)]
    assert first != [self_chat.opener("train", 1, i) for i in range(600)]
    assert 150 < first.count("") < 250 and set(first) - {""} <= set(self_chat.OPENERS)
    assert len(set(first)) > 20  # the openers are all in use


# ---------------------------------------------------------------- generation on the tiny pair


def test_a_batch_stops_once_every_row_has_ended_its_turn_and_keeps_each_rows_text(writer):
    _, v, tok = writer
    stops = stop_ids(tok)
    asks = [self_chat.user_prefix(tok, o) for o in ("", "How do I", "What is", "List")]
    width = max(map(len, asks))
    kw = dict(width=width, pad_id=0, temperature=1.0, seeds=[11, 12, 13, 14])
    full = train_data.generate_data(v, asks, [], 40, 4, **kw)["tokens"][:, width:]
    short = train_data.generate_data(v, asks, [], 40, 4, stops=stops, **kw)["tokens"][:, width:]
    assert short.shape == full.shape
    ends = [next(i for i, t in enumerate(row) if t in stops) for row in full.tolist()]  # every row ends within 40
    assert max(ends) < 39  # so the batch stopped early ...
    for row, end, fast in zip(full.tolist(), ends, short.tolist()):
        assert fast[: end + 1] == row[: end + 1]  # ... with each row's text unchanged
    assert (short[:, max(ends) + 1:] == 0).all()  # and padding after the last row ended


def test_prompts_are_seeded_and_grow_from_the_cache(writer, lenient, tmp_path, monkeypatch):
    _, v, tok = writer
    calls = []
    real = train_data.generate_data
    monkeypatch.setattr(train_data, "generate_data", lambda verifier, prompts, *a, **k: calls.append(len(prompts))
                        or real(verifier, prompts, *a, **k))
    logs = []
    first = self_chat_prompts(v, tok, "v", "heldout", 5, CFG, tmp_path / "w", logs.append)
    assert len(first.ids) == 5 and calls and max(calls) <= CFG.gen_batch  # generated in batches of --gen-batch
    assert any(m.startswith("chat-self heldout: ") and "candidate user turns cached" in m for m in logs)
    n = len(calls)
    again = self_chat_prompts(v, tok, "v", "heldout", 5, CFG, tmp_path / "w", lambda m: None)
    assert len(calls) == n and again.ids == first.ids and again.texts == first.texts  # all from the cache
    more = self_chat_prompts(v, tok, "v", "heldout", 14, CFG, tmp_path / "w", lambda m: None)
    assert more.ids[:5] == first.ids and len(more.ids) == 14 and len(calls) > n
    fresh = self_chat_prompts(v, tok, "v", "heldout", 14, CFG, tmp_path / "fresh", lambda m: None)
    assert fresh.ids == more.ids  # independent of how the candidates were batched
    other = self_chat_prompts(v, tok, "v", "heldout", 5, dataclasses.replace(CFG, seed=1), tmp_path / "w",
                              lambda m: None)
    assert other.texts != first.texts
    assert len({normalise(t) for t in more.texts}) == len(more.texts)  # no duplicates
    for ids, text in zip(more.ids, more.texts):
        assert len(ids) <= CFG.prompt_tokens
        assert ids == tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)


def test_an_interrupted_run_keeps_its_finished_batches(writer, lenient, tmp_path, monkeypatch):
    _, v, tok = writer
    straight = self_chat_prompts(v, tok, "v", "heldout", 12, CFG, tmp_path / "straight", lambda m: None)
    real, calls = train_data.generate_data, []

    def dies_after_two(verifier, prompts, *a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(len(prompts))
        return real(verifier, prompts, *a, **k)

    monkeypatch.setattr(train_data, "generate_data", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        self_chat_prompts(v, tok, "v", "heldout", 12, CFG, tmp_path / "cut", lambda m: None)
    (cache,) = (tmp_path / "cut").glob("turns-chat-self-heldout-*.pt")
    assert len(torch.load(cache)) == 2 * CFG.gen_batch  # both finished batches were saved
    monkeypatch.setattr(train_data, "generate_data", lambda verifier, prompts, *a, **k: calls.append(len(prompts))
                        or real(verifier, prompts, *a, **k))
    resumed = self_chat_prompts(v, tok, "v", "heldout", 12, CFG, tmp_path / "cut", lambda m: None)
    assert resumed.ids == straight.ids


def test_training_turns_never_repeat_a_held_out_turn(writer, lenient, tmp_path, monkeypatch):
    """With the two splits' streams made identical, every training candidate among the first held-out
    ones is rejected as held-out: none of the held-out pool reaches training."""
    _, v, tok = writer
    held = self_chat_prompts(v, tok, "v", "heldout", self_chat.HELDOUT_POOL, CFG, tmp_path / "a", lambda m: None)
    train = self_chat_prompts(v, tok, "v", "train", 8, CFG, tmp_path / "a", lambda m: None)
    assert not {normalise(t) for t in train.texts} & {normalise(t) for t in held.texts}
    monkeypatch.setattr(self_chat, "opener", lambda split, seed, i: self_chat.OPENERS[i % 3])
    monkeypatch.setattr(self_chat, "turn_seed", lambda seed, split, i: i)
    held = self_chat_prompts(v, tok, "v", "heldout", self_chat.HELDOUT_POOL, CFG, tmp_path / "b", lambda m: None)
    train = self_chat_prompts(v, tok, "v", "train", 8, CFG, tmp_path / "b", lambda m: None)
    assert not {normalise(t) for t in train.texts} & {normalise(t) for t in held.texts}
    # each turn of the pool, met again (the same candidates in the same order), was rejected
    assert train.rejected["held-out"] >= self_chat.HELDOUT_POOL


def test_greedy_user_turns_are_refused(writer, tmp_path):
    _, v, tok = writer
    with pytest.raises(ConfigError, match="--instruction-temperature must be > 0"):
        self_chat_prompts(v, tok, "v", "train", 2, dataclasses.replace(CFG, instruction_temperature=0.0), tmp_path)


def test_cache_keys_separate_the_splits_and_settings():
    cfg = TrainConfig()
    keys = {self_chat.turns_key("/v", split, c) for split in ("train", "heldout")
            for c in (cfg, dataclasses.replace(cfg, seed=1), dataclasses.replace(cfg, instruction_temperature=0.9))}
    assert len(keys) == 6
    assert self_chat.turns_key("/v", "train", dataclasses.replace(cfg, prompt_tokens=9)) \
        == self_chat.turns_key("/v", "train", cfg)  # the prompt length only chooses among the candidates
    fields = {cfg.data_key("/v", "train", chat=self_chat.self_fields(cfg)),
              cfg.data_key("/v", "train", chat=self_chat.self_fields(dataclasses.replace(cfg, instruction_tokens=9)))}
    from treeflash_export.training.chat import chat_fields

    fields |= {cfg.data_key("/v", "train", chat=chat_fields(s, cfg)) for s in ("chat-stdlib", "chat-prose")}
    assert len(fields) == 4


# ---------------------------------------------------------------- through the CLI and the benchmark


def test_a_mix_with_chat_self_through_the_cli(writer, lenient, tmp_path):
    from click.testing import CliRunner

    from treeflash_export.cli import main

    vdir, v, tok = writer
    vkey = checkpoint_fingerprint(vdir)
    opts = ["--steps", "2", "--batch-size", "2", "--block-size", "4", "--intermediate-size", "96", "--num-taps", "2",
            "--prompt-tokens", "40", "--continuation-tokens", "6", "--gen-batch", "8", "--eval-every", "2",
            "--save-every", "2", "--anchors", "2", "--train-prompts", "6", "--heldout-prompts", "3",
            "--instruction-tokens", "10", "--instruction-temperature", "1"]
    r = CliRunner().invoke(main, ["train", "--model", str(vdir), "--out", str(tmp_path / "d"), "--mix",
                                  "code:1,chat-self:2", *opts])
    assert r.exit_code == 0, r.output
    work = tmp_path / "d.work"
    cfg = dataclasses.replace(CFG, mix="code:1,chat-self:2")
    key = cfg.data_key(vkey, "train", chat=self_chat.self_fields(cfg))
    rows = torch.load(work / f"chat-self-train-{key}-4.pt")
    want = self_chat_prompts(v, tok, vkey, "train", 4, cfg, work, lambda m: None).ids
    for row, pad, ids in zip(rows["tokens"], rows["pad"].tolist(), want):
        assert row[pad:40].tolist() == ids and pad == 40 - len(ids) > 0
    info = json.loads((tmp_path / "d" / "training.json").read_text())
    assert set(info["data"]["corpus"]) == {"code", "chat-self"} and info["data"]["mix"] == {"code": 1, "chat-self": 2}
    assert "chat-self train: 4 user turns from" in r.output or "chat-self train" in r.output


def test_bench_held_out_chat_self_prompts_are_the_held_out_split(writer, lenient, pair_dirs, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from treeflash_runtime.bench.cli import _prompt_ids
    from treeflash_runtime.bench.cli import main as bench_main

    vdir, v, tok = writer
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path / "cache"))
    ids = _prompt_ids(("heldout", 3, 48, "chat-self"), tok, vdir)
    cfg = TrainConfig(prompt_tokens=160)  # the demo recipe's, with the instruction defaults
    want = self_chat_prompts(v, tok, checkpoint_fingerprint(vdir), "heldout", 3, cfg, tmp_path / "w", lambda m: None)
    assert ids == want.ids
    assert list((tmp_path / "cache" / "heldout-chat-self").glob("turns-chat-self-heldout-*.pt"))  # cached
    r = CliRunner().invoke(bench_main, ["--model", str(vdir), "--drafter", str(pair_dirs["qwen3"] / "drafter"),
                                        "--modes", "marginal", "--tree-sizes", "8", "--max-new-tokens", "4",
                                        "--heldout-prompts", "2", "--heldout-domain", "chat-self", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["prompts"] == 2 and report["identical_outputs"] is True


def test_a_run_with_another_seed_avoids_the_benchmarks_held_out_turns_too(writer, lenient, tmp_path, monkeypatch):
    """A training run with the benchmark's instruction settings but another --seed: its own held-out
    stream is not the benchmark's, so the benchmark's held-out pool (seed 0) is rejected as well; with
    the streams made identical whatever the seed, every turn of that pool met again is rejected."""
    _, v, tok = writer
    monkeypatch.setattr(self_chat, "BENCH_SETTINGS", {f.name: getattr(CFG, f.name) for f in dataclasses.fields(CFG)})
    bench = TrainConfig(**self_chat.BENCH_SETTINGS)
    other = dataclasses.replace(bench, seed=7)
    monkeypatch.setattr(self_chat, "opener", lambda split, seed, i: self_chat.OPENERS[i % 3] if seed == 0 or
                        split == "train" else "")
    monkeypatch.setattr(self_chat, "turn_seed", lambda seed, split, i: i if seed == 0 or split == "train" else 10**6 + i)
    held = self_chat_prompts(v, tok, "v", "heldout", self_chat.HELDOUT_POOL, bench, tmp_path, lambda m: None)
    train = self_chat_prompts(v, tok, "v", "train", 8, other, tmp_path, lambda m: None)
    assert not {normalise(t) for t in train.texts} & {normalise(t) for t in held.texts}
    assert train.rejected["held-out"] >= self_chat.HELDOUT_POOL
