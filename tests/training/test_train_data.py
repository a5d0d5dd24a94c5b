"""Training data from the user's files (`train --data`): formats, malformed records, padded and
sampled generation, the cache key."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from treeflash_export.checkpoints import load_tokenizer
from treeflash_export.errors import ConfigError
from treeflash_export.training.config import TrainConfig
from treeflash_export.training.loop import block_loss
from treeflash_export.training.data import generate_data, next_tokens, prompt_seed
from treeflash_export.training.files import Prompt, load_prompts, render, split_heldout

SYSTEM, USER, ANSWER = "You write Python.", "Sort a list.", "ANSWER_NOT_USED"


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tok(pair_dirs):
    return load_tokenizer(pair_dirs["qwen3"] / "verifier")


def chat_ids(tok, turns):
    return tok.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


@pytest.mark.parametrize("record", [
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                  {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "more"}]},
    {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [{"type": "text", "text": USER}]},
                  {"role": "assistant", "content": ANSWER}]},
    {"conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": USER},
                       {"from": "gpt", "value": ANSWER}]},
], ids=["openai", "openai-content-parts", "sharegpt"])
def test_conversations_render_their_turns_before_the_first_answer_with_the_chat_template(tok, tmp_path, record):
    path = write_jsonl(tmp_path / "chat.jsonl", [record])
    (prompt,) = load_prompts([path], log=pytest.fail)
    assert prompt.messages == (("system", SYSTEM), ("user", USER)) and prompt.where == f"{path}:1"
    ids = render(prompt, tok)
    assert ids == list(chat_ids(tok, [("system", SYSTEM), ("user", USER)]))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n") and ANSWER not in tok.decode(ids)


@pytest.mark.parametrize("field", ["prompt", "text"])
def test_plain_prompts_are_raw_text_tokenised_as_the_runtime_does(tok, tmp_path, field):
    path = write_jsonl(tmp_path / "p.jsonl", [{field: "def f(x):\n    return"}])
    (prompt,) = load_prompts([path], log=pytest.fail)
    assert render(prompt, tok) == tok("def f(x):\n    return", add_special_tokens=True)["input_ids"]


def test_parquet_records_read_like_json_lines(tok, tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["import os", None, "class A:"]}), tmp_path / "d.parquet")
    logs = []
    prompts = load_prompts([tmp_path / "d.parquet"], log=logs.append)
    assert [p.text for p in prompts] == ["import os", "class A:"]
    assert logs == [f"{tmp_path / 'd.parquet'}:row 2: skipped: no 'prompt', 'text', 'messages' or 'conversations' "
                    "field", "skipped 1 malformed record(s) of 3"]


def test_malformed_records_are_reported_with_file_and_line_and_skipped(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "good one"},
        "{not json",
        {"question": "no known field"},
        {"prompt": 42},
        {"messages": []},
        {"messages": [{"role": "assistant", "content": "answer first"}]},
        {"conversations": [{"from": "alien", "value": "hi"}]},
        ["a", "list"],
        {"text": "   "},
        {"conversations": [{"from": "user", "value": "good two"}]},
    ])
    logs = []
    prompts = load_prompts([path], log=logs.append)
    assert [p.where for p in prompts] == [f"{path}:1", f"{path}:10"]
    assert [line.split(": skipped: ")[0] for line in logs[:-1]] == [f"{path}:{n}" for n in range(2, 10)]
    # The reason, not the record's value (the path may hold any digits: pytest-42).
    reasons = [line.split(": skipped: ")[1] for line in logs[:-1]]
    assert "bad JSON" in reasons[0] and "42" not in reasons[2] and "not a string" in reasons[2]
    assert "non-empty list" in logs[3] and "no user turn" in logs[4] and "'alien'" in logs[5]
    assert logs[-1] == "skipped 8 malformed record(s) of 10"


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", "", "holds no records"),
    ("blank.jsonl", "\n\n", "holds no records"),
    ("data.csv", "prompt\nhello\n", "unsupported file type"),
    ("missing.jsonl", None, "no such file"),
    ("latin1.jsonl", b'{"prompt": "caf\xe9"}\n', "cannot read"),
    ("broken.parquet", b"PAR1 not really parquet", "cannot read"),
    ("all-bad.jsonl", '{"nothing": 1}\n', "no usable record"),
])
def test_unusable_files_are_one_line_errors_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_prompts([path], log=lambda m: None)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_every_tenth_record_is_held_out():
    prompts = [Prompt(f"f:{i}", text=str(i)) for i in range(25)]
    train, held = split_heldout(prompts)
    assert [p.text for p in held] == ["0", "10", "20"] and len(train) == 22
    assert not {p.text for p in train} & {p.text for p in held}


@torch.no_grad()
def test_padded_batch_generation_equals_each_prompt_alone(load):
    """Prompts of different lengths in one left-padded batch get exactly the tokens, and the
    taps up to fp16 rounding, that each gets when generated alone without padding."""
    pair = load("qwen3")
    taps = pair.drafter_cfg.target_layer_ids
    prompts = [[5, 9, 3, 77, 12, 40], [8, 100, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 301]]
    width = 10
    batched = generate_data(pair.verifier, prompts, taps, new_tokens=8, batch=4, width=width, pad_id=7)
    assert batched["pad"].tolist() == [width - len(p) for p in prompts]
    for i, p in enumerate(prompts):
        alone = generate_data(pair.verifier, [p], taps, new_tokens=8, batch=1)
        pad = width - len(p)
        assert torch.equal(batched["tokens"][i, pad:], alone["tokens"][0])
        assert torch.allclose(batched["features"][i, pad:].float(), alone["features"][0].float(), atol=2e-3)
        assert (batched["tokens"][i, :pad] == 7).all() and (batched["features"][i, :pad] == 0).all()


def test_generation_keeps_no_autograd_graph(load):
    """Data generation runs in inference mode by itself: called with grad enabled on a verifier
    whose weights require grad, it records no graph (the caches and taps of every step would be
    kept alive for a backward pass that never comes)."""
    pair = load("qwen3")
    taps = pair.drafter_cfg.target_layer_ids
    weights = list(pair.verifier.parameters())
    flags = [w.requires_grad for w in weights]
    try:
        pair.verifier.requires_grad_(True)
        with torch.enable_grad():
            data = generate_data(pair.verifier, [[5, 9, 3, 77]], taps, new_tokens=4, batch=1)
    finally:
        for w, f in zip(weights, flags):
            w.requires_grad_(f)
    assert not data["features"].requires_grad and data["features"].grad_fn is None
    assert all(torch.is_inference(v) for v in data.values())


@torch.no_grad()
def test_sampled_generation_is_seeded_per_prompt_not_per_batch(load):
    pair = load("qwen3")
    taps = pair.drafter_cfg.target_layer_ids
    prompts = [[5, 9, 3, 77], [8, 100, 2, 6], [1, 2, 3, 4]]
    seeds = [prompt_seed(0, "train", i) for i in range(3)]
    kw = dict(new_tokens=12, temperature=1.0, seeds=seeds)
    together = generate_data(pair.verifier, prompts, taps, batch=3, **kw)["tokens"]
    one_by_one = generate_data(pair.verifier, prompts, taps, batch=1, **kw)["tokens"]
    greedy = generate_data(pair.verifier, prompts, taps, new_tokens=12, batch=3)["tokens"]
    reseeded = generate_data(pair.verifier, prompts, taps, batch=3, **{**kw, "seeds": [s + 1 for s in seeds]})
    assert torch.equal(together, one_by_one)
    assert not torch.equal(together, greedy) and not torch.equal(together, reseeded["tokens"])


def test_sampling_draws_from_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(4000, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    drawn = next_tokens(logits, 0.5, gens)[:, 0]
    freq = torch.bincount(drawn, minlength=4).double() / 4000
    assert (freq - torch.softmax(logits[0].double() / 0.5, -1)).abs().max() < 0.02  # 4 sigma is about 0.027
    assert torch.equal(next_tokens(logits[:2], 0.0), torch.zeros(2, 1, dtype=torch.long))


@torch.no_grad()
def test_loss_on_left_padded_rows_equals_the_unpadded_rows(load):
    """Padding columns (garbage here) are hidden from every block, each row by its own count, and
    RoPE only sees relative positions: the loss is that of the unpadded rows."""
    pair = load("qwen3")
    d, cfg = pair.drafter, pair.drafter_cfg
    g = torch.Generator().manual_seed(11)
    F = len(cfg.target_layer_ids) * cfg.hidden_size
    tokens, feats = torch.randint(0, 500, (2, 20), generator=g), torch.randn(2, 20, F, generator=g)
    pads, width = [5, 2], 25  # row 1 also has 3 trailing columns, past every block
    padded_tokens = torch.randint(0, 500, (2, width), generator=g)
    padded_feats = torch.randn(2, width, F, generator=g) * 9
    for r, k in enumerate(pads):
        padded_tokens[r, k : k + 20], padded_feats[r, k : k + 20] = tokens[r], feats[r]
    args = (pair.verifier.model.embed_tokens, pair.verifier.lm_head, cfg.block_size, 4.0, cfg.mask_token_id)
    anchors = [12, 14]  # columns: original positions 7, 9 of row 0 and 10, 12 of row 1
    got = block_loss(d, args[0], args[1], padded_tokens, padded_feats, anchors, *args[2:], pad=torch.tensor(pads))
    refs = [block_loss(d, args[0], args[1], tokens[r : r + 1], feats[r : r + 1], [a - k for a in anchors], *args[2:])
            for r, k in enumerate(pads)]
    for i in (0, 1):
        assert abs(float(got[i]) - (float(refs[0][i]) + float(refs[1][i])) / 2) < 1e-5
    unmasked = block_loss(d, args[0], args[1], padded_tokens, padded_feats, anchors, *args[2:])
    assert abs(float(unmasked[0]) - float(got[0])) > 1e-3  # without the mask the garbage would matter


def test_data_keys_name_files_and_temperature_but_keep_the_corpus_key():
    cfg = TrainConfig()
    # The key of the default greedy corpus data, as computed before --data existed (caches stay valid).
    assert cfg.data_key("/v", "train") == "1a90191fb67b8716"
    keys = {cfg.data_key("/v", "train"), cfg.data_key("/v", "train", "abc"), cfg.data_key("/v", "train", "abd"),
            dataclasses.replace(cfg, gen_temperature=0.7).data_key("/v", "train"),
            dataclasses.replace(cfg, gen_temperature=0.8).data_key("/v", "train", "abc")}
    assert len(keys) == 5


def test_train_from_files_through_the_cli(pair_dirs, tok, tmp_path):
    """`train --data`: malformed and too-long records are reported and skipped, conversations are
    templated, prompts are stored left-padded to --prompt-tokens, and the cache is named by the
    files' content."""
    from click.testing import CliRunner

    from treeflash_export.checkpoints import checkpoint_fingerprint
    from treeflash_export.cli import main
    from treeflash_export.training.files import content_hash

    records = []
    for i in range(22):
        records.append({"messages": [{"role": "user", "content": f"Write function number {i}."},
                                     {"role": "assistant", "content": ANSWER}]} if i % 2 else {"prompt": f"x = {i}"})
    records[3] = "{broken"
    records[5] = {"prompt": "word " * 200}  # longer than --prompt-tokens: skipped, not cut
    data = write_jsonl(tmp_path / "mixed.jsonl", records)
    vdir = pair_dirs["qwen3"] / "verifier"
    opts = ["--steps", "2", "--batch-size", "2", "--block-size", "4", "--intermediate-size", "96", "--num-taps", "2",
            "--prompt-tokens", "40", "--continuation-tokens", "8", "--gen-batch", "8", "--eval-every", "2",
            "--save-every", "2", "--anchors", "2"]
    r = CliRunner().invoke(main, ["train", "--model", str(vdir), "--out", str(tmp_path / "d"), "--data", str(data),
                                  *opts])
    assert r.exit_code == 0, r.output
    assert f"{data}:4: skipped: bad JSON" in r.output and "skipped 1 malformed record(s) of 22" in r.output
    assert "train: skipped 1 prompt(s) longer than --prompt-tokens 40" in r.output

    usable = [rec for i, rec in enumerate(records) if i != 3]  # the split counts usable records
    held_records = [rec for i, rec in enumerate(usable) if i % 10 == 0]
    train_records = [rec for i, rec in enumerate(usable) if i % 10 and rec is not records[5]]

    def ids(rec):
        if "prompt" in rec:
            return tok(rec["prompt"], add_special_tokens=True)["input_ids"]
        return list(chat_ids(tok, [("user", rec["messages"][0]["content"])]))

    cfg = TrainConfig(num_taps=2, prompt_tokens=40, continuation_tokens=8)
    for split, recs in (("train", train_records), ("heldout", held_records)):
        key = cfg.data_key(checkpoint_fingerprint(vdir), split, content_hash([data]))
        path = tmp_path / "d.work" / f"{split}-{key}-{len(recs)}.pt"
        cached = torch.load(path)
        assert cached["tokens"].shape == (len(recs), 40 + 8)
        for row, rec, pad in zip(cached["tokens"], recs, cached["pad"].tolist()):
            assert row[pad:40].tolist() == ids(rec) and pad == 40 - len(ids(rec))
    info = json.loads((tmp_path / "d" / "training.json").read_text())
    assert info["data"]["corpus"] == {"files": [str(data)], "sha256": content_hash([data]),
                                      "heldout": "every tenth usable record"}
    assert torch.isfinite(torch.tensor(info["history"][-1]["marginal_loss"]))


def test_no_prompt_fitting_in_prompt_tokens_is_a_config_error(pair_dirs, tmp_path):
    from treeflash_export.training.loop import train

    data = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 100}] * 3)
    with pytest.raises(ConfigError, match="no train prompt fits in --prompt-tokens 12; raise it"):
        train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "d", TrainConfig(prompt_tokens=12), log=lambda m: None,
              data_files=[data])
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()


@pytest.mark.parametrize("name, message", [("missing.jsonl", "no such file"), ("notes.txt", "unsupported file type")])
def test_train_refuses_an_unusable_data_file_in_one_line(pair_dirs, tmp_path, name, message):
    from click.testing import CliRunner

    from treeflash_export.cli import main

    if name.endswith(".txt"):
        (tmp_path / name).write_text("hello\n")
    r = CliRunner().invoke(main, ["train", "--model", str(pair_dirs["qwen3"] / "verifier"), "--out",
                                  str(tmp_path / "d"), "--data", str(tmp_path / name)])
    last = r.output.strip().splitlines()[-1]
    assert r.exit_code == 2 and last.startswith("error: ") and message in last, r.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()
