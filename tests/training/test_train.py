"""`treeflash-export train` on a tiny verifier: loss falls, the checkpoint round-trips, resume is exact."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from treeflash_export.training import loop as train_mod
from treeflash_export.training import data as train_data
from treeflash_export.checkpoints import load_drafter
from treeflash_export.config import DrafterConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models import TreeFlashDrafter
from treeflash_export.training.config import TrainConfig
from treeflash_export.training.dataset import prepare_data
from treeflash_export.training.loop import block_loss, train

CFG = TrainConfig(block_size=4, draft_layers=1, intermediate_size=96, num_taps=2, train_prompts=16,
                  heldout_prompts=8, prompt_tokens=12, continuation_tokens=12, gen_batch=16, steps=40,
                  batch_size=4, lr=3e-3, warmup=5, eval_every=10, save_every=10)


@contextlib.contextmanager
def die_after_second_checkpoint(monkeypatch):
    """Within the block, a run is interrupted right after writing its second checkpoint."""
    real_save = train_mod._atomic_save
    saves = {"n": 0}

    def save_then_die(obj, path):
        real_save(obj, path)
        if path.name == "last.pt":
            saves["n"] += 1
            if saves["n"] == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "_atomic_save", save_then_die)
    try:
        yield
    finally:
        monkeypatch.setattr(train_mod, "_atomic_save", real_save)


@pytest.fixture(scope="module")
def trained(pair_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    out = train(str(pair_dirs["qwen3"] / "verifier"), root / "drafter", CFG, work=root / "work", log=lambda m: None)
    return out, root


def test_loss_falls_and_drafter_loads_in_released_layout(trained):
    out, _ = trained
    info = json.loads((out / "training.json").read_text())
    hist = info["history"]
    assert [h["step"] for h in hist] == [0, 10, 20, 30, 40]  # step 0: the untrained drafter
    assert hist[-1]["marginal_loss"] < hist[0]["marginal_loss"] - 0.3
    assert hist[-1]["conditional_loss"] < hist[0]["conditional_loss"] - 0.3
    model, cfg, layout = load_drafter(out, dtype=torch.float32, device="cpu")
    assert layout == "treeflash" and cfg.has_head and cfg.block_size == 4 and len(cfg.target_layer_ids) == 2
    assert model.ar_approximation.d.weight.abs().sum() > 0  # the head was trained (it starts at zero)
    # Its draft vocabulary: every token of the training data (the training softmax's), most frequent
    # among the continuations first.
    data = torch.load(next((trained[1] / "work").glob("train-*.pt")), weights_only=False)
    tokens = data["tokens"].long()
    assert sorted(model.vocab_order) == torch.unique(tokens).tolist()
    counts = torch.bincount(tokens[:, CFG.prompt_tokens:].flatten(), minlength=cfg.vocab_size)
    assert [int(counts[t]) for t in model.vocab_order] == sorted((int(counts[t]) for t in model.vocab_order),
                                                              reverse=True)


def test_checkpoint_round_trips(trained):
    out, root = trained
    last = torch.load(root / "work" / "last.pt", weights_only=False)
    assert last["step"] == CFG.steps
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(last["model"])
    for k, v in last["model"].items():
        assert torch.equal(saved[k], v.to(torch.float16)), k


def test_data_caches_follow_the_verifier_content_not_its_path(trained, pair_dirs, tmp_path, monkeypatch):
    """The trained fixture's data, reused by a run on a copy of the verifier in another folder, and
    generated afresh once that copy's weights change."""
    import shutil

    from safetensors.torch import save_file

    from treeflash_export.checkpoints import checkpoint_fingerprint

    _, root = trained
    source = pair_dirs["qwen3"] / "verifier"
    moved = tmp_path / "elsewhere" / "verifier"
    shutil.copytree(source, moved)
    assert checkpoint_fingerprint(moved) == checkpoint_fingerprint(source)
    generated = []
    real_generate = train_data.generate_data
    monkeypatch.setattr(train_data, "generate_data",
                        lambda verifier, prompts, *a, **k: generated.append(len(prompts)) or
                        real_generate(verifier, prompts, *a, **k))
    short = dataclasses.replace(CFG, steps=10)

    def run(name):
        work = tmp_path / name
        shutil.copytree(root / "work", work, ignore=shutil.ignore_patterns("last.pt"))
        train(str(moved), tmp_path / f"out-{name}", short, work=work, log=lambda m: None)

    run("moved")
    assert generated == []  # both splits found under the moved verifier's name
    weights = load_file(str(moved / "model.safetensors"))
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(moved / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_fingerprint(moved) != checkpoint_fingerprint(source)
    run("retrained")
    assert generated == [CFG.train_prompts, CFG.heldout_prompts]


def test_fingerprint_samples_large_files_at_both_ends(tmp_path):
    from treeflash_export.checkpoints import checkpoint_fingerprint

    data = bytearray(torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).numpy().tobytes())
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(data)
    base = checkpoint_fingerprint(tmp_path)
    (tmp_path / ".cache").mkdir()  # a download tool's hidden folder and files are not content
    (tmp_path / ".lock").write_text("x")
    assert checkpoint_fingerprint(tmp_path) == base
    seen = {base}
    inside = (len(data) - (1 << 16)) * 5 // 15 + 100  # in the 6th of the 16 chunks of 64 KiB sampled
    for where in (0, len(data) - 1, inside):
        changed = bytearray(data)
        changed[where] ^= 1
        (tmp_path / "model.safetensors").write_bytes(changed)
        seen.add(checkpoint_fingerprint(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(data)
    (tmp_path / "config.json").write_text('{"a": 1}')
    seen.add(checkpoint_fingerprint(tmp_path))
    assert len(seen) == 5


def test_resume_continues_exactly(pair_dirs, tmp_path, monkeypatch):
    """Interrupted after the checkpoint at step 20, then resumed: the same weights as one straight run."""
    short = dataclasses.replace(CFG, steps=30)
    straight = train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "a", short, work=tmp_path / "wa",
                     log=lambda m: None)

    with die_after_second_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):  # after step 20
        train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "b", short, work=tmp_path / "wb", log=lambda m: None)
    assert not (tmp_path / "b").exists()
    with pytest.raises(Exception, match="--resume"):
        train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "b", short, work=tmp_path / "wb", log=lambda m: None)
    resumed = train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "b", short, work=tmp_path / "wb",
                    resume=True, log=lambda m: None)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_batched_training_forward_equals_runtime_forward(load):
    """Training runs the drafter with a batch dimension and no cache; the runtime runs it one
    block at a time with a cache: both must compute the same z."""
    pair = load("qwen3")
    d = pair.drafter
    cfg = pair.drafter_cfg
    g = torch.Generator().manual_seed(3)
    B, F, H = cfg.block_size, len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size
    feats = torch.randn(3, 9, F, generator=g)
    block = torch.randn(3, B, H, generator=g)
    with torch.no_grad():
        zb, _ = d.model(feats, torch.arange(9), block, torch.arange(9, 9 + B), None, 0)
        for i in range(3):
            cache = d.model.new_cache(32)
            z, _ = d.model(feats[i], torch.arange(9), block[i], torch.arange(9, 9 + B), cache, 0)
            assert (z - zb[i]).abs().max() < 1e-5


def test_block_loss_is_finite_and_uses_the_head(load):
    pair = load("qwen3")
    d = TreeFlashDrafter(DrafterConfig.from_hf(pair.drafter_cfg.hf_config))
    d.load_state_dict(pair.drafter.state_dict())
    tokens = torch.randint(0, 500, (2, 20))
    feats = torch.randn(2, 20, len(pair.drafter_cfg.target_layer_ids) * pair.drafter_cfg.hidden_size)
    lm, lc, _ = block_loss(d, pair.verifier.model.embed_tokens, pair.verifier.lm_head, tokens, feats, 8,
                             pair.drafter_cfg.block_size, 4.0, pair.drafter_cfg.mask_token_id)
    assert torch.isfinite(lm) and torch.isfinite(lc) and lm.item() != lc.item()
    (lm + lc).backward()
    assert d.ar_approximation.ug.weight.grad.abs().sum() > 0


def test_many_anchors_in_one_call_equal_one_call_per_anchor(load):
    """The block mask lets each block see only the context before its anchor and itself: the
    losses and accuracies of one call over several anchors are the means of per-anchor calls."""
    pair = load("qwen3")
    d = TreeFlashDrafter(DrafterConfig.from_hf(pair.drafter_cfg.hf_config))
    d.load_state_dict(pair.drafter.state_dict())
    with torch.no_grad():
        d.ar_approximation.d.weight.normal_(0, 0.05)  # a trained head, so the conditional differs
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 500, (3, 30), generator=g)
    feats = torch.randn(3, 30, len(pair.drafter_cfg.target_layer_ids) * pair.drafter_cfg.hidden_size, generator=g)
    args = (pair.verifier.model.embed_tokens, pair.verifier.lm_head)
    B, mask = pair.drafter_cfg.block_size, pair.drafter_cfg.mask_token_id
    anchors = [21, 4, 13, 5]  # unsorted, overlapping blocks
    with torch.no_grad():
        lm, lc, acc = block_loss(d, *args, tokens, feats, anchors, B, 4.0, mask)
        singles = [block_loss(d, *args, tokens, feats, a, B, 4.0, mask) for a in anchors]
    assert abs(float(lm) - sum(float(s[0]) for s in singles) / 4) < 1e-5
    assert abs(float(lc) - sum(float(s[1]) for s in singles) / 4) < 1e-5
    for key in ("marginal", "conditional"):
        assert torch.allclose(acc[key], sum(s[2][key] for s in singles) / 4, atol=1e-6)


def test_generated_data_equals_generate_then_one_full_pass(load):
    """Taps kept step by step during cached greedy decoding equal those of one pass over the
    finished sequences, and the tokens are transformers' greedy continuation."""
    from transformers import GenerationConfig

    from treeflash_export.training.data import generate_data

    pair = load("qwen3")
    v, taps = pair.verifier, pair.drafter_cfg.target_layer_ids
    prompts = [[5, 9, 3, 77, 12, 40], [8, 8, 100, 2, 31, 6], [1, 2, 3, 4, 5, 6]]
    data = generate_data(v, prompts, taps, new_tokens=10, batch=2)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        seq = v.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=10, eos_token_id=[], pad_token_id=0))
        full = v(seq, output_hidden_states=True).hidden_states
    ref = torch.cat([full[t + 1] for t in taps], dim=-1)
    assert torch.equal(data["tokens"], seq.to(torch.int32))
    assert data["features"].dtype == torch.float16 and data["features"].shape == ref.shape
    assert torch.allclose(data["features"].float(), ref.half().float(), atol=2e-3, rtol=2e-3)


def test_loss_over_a_vocabulary_subset_equals_masking_the_rest(load):
    """--loss-vocab data: the softmax over a subset of tokens (holding every target) equals the
    full-vocabulary loss with every other logit at -inf."""
    pair = load("qwen3")
    d = TreeFlashDrafter(DrafterConfig.from_hf(pair.drafter_cfg.hf_config))
    d.load_state_dict(pair.drafter.state_dict())
    with torch.no_grad():
        d.ar_approximation.d.weight.normal_(0, 0.05)
    g = torch.Generator().manual_seed(7)
    V = pair.verifier.lm_head.weight.shape[0]
    tokens = torch.randint(0, V // 3, (2, 24), generator=g) * 3  # multiples of 3: a third of the ids
    feats = torch.randn(2, 24, len(pair.drafter_cfg.target_layer_ids) * pair.drafter_cfg.hidden_size, generator=g)
    vocab = torch.unique(torch.cat([tokens.flatten(), torch.tensor([1, V // 2, V - 2])]))
    real = pair.verifier.lm_head

    class Masked(torch.nn.Module):
        weight = real.weight

        def forward(self, x):
            logits = real(x)
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
            keep[vocab] = True
            return logits.masked_fill(~keep, float("-inf"))

    embed, B, mask = pair.verifier.model.embed_tokens, pair.drafter_cfg.block_size, pair.drafter_cfg.mask_token_id
    with torch.no_grad():
        sub = block_loss(d, embed, real, tokens, feats, [6, 11, 15], B, 4.0, mask, vocab)
        ref = block_loss(d, embed, Masked(), tokens, feats, [6, 11, 15], B, 4.0, mask)
        full = block_loss(d, embed, real, tokens, feats, [6, 11, 15], B, 4.0, mask)
    assert abs(float(sub[0]) - float(ref[0])) < 1e-5 and abs(float(sub[1]) - float(ref[1])) < 1e-5
    assert float(sub[0]) < float(full[0])  # fewer competitors, a lower loss: the subset was really used
    for key in ("marginal", "conditional"):
        assert torch.equal(sub[2][key], ref[2][key])


@pytest.mark.parametrize("device, message", [("cuda", "no CUDA device"), ("tpu", "use cpu or cuda"),
                                             ("not a device", "use cpu or cuda")])
def test_train_refuses_an_unusable_device(pair_dirs, tmp_path, device, message):
    from click.testing import CliRunner

    from treeflash_export.cli import main

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = CliRunner().invoke(main, ["train", "--model", str(pair_dirs["qwen3"] / "verifier"), "--out",
                                  str(tmp_path / "d"), "--device", device, "--steps", "1"])
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.work").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none")
def test_training_on_cuda_learns_and_resumes_on_the_cpu(pair_dirs, tmp_path, monkeypatch):
    """Data generation and training on the GPU; the checkpoint it leaves continues on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    short = dataclasses.replace(CFG, steps=30)
    verifier = str(pair_dirs["qwen3"] / "verifier")
    with die_after_second_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        train(verifier, tmp_path / "d", short, work=tmp_path / "w", log=lambda m: None, device="cuda")
    # The data the GPU generated is the data the CPU would have generated (greedy tokens).
    from treeflash_export.checkpoints import load_tokenizer, load_verifier
    from treeflash_export.config import default_target_layer_ids

    gpu_data = torch.load(next((tmp_path / "w").glob("train-*.pt")))
    v = load_verifier(pair_dirs["qwen3"] / "verifier", dtype=torch.float32, device="cpu")
    taps = default_target_layer_ids(int(v.config.num_hidden_layers), short.num_taps)
    cpu_data = prepare_data(v, load_tokenizer(pair_dirs["qwen3"] / "verifier"), verifier, short, taps,
                                      tmp_path / "cpu", log=lambda m: None)
    assert torch.equal(gpu_data["tokens"], cpu_data["train"]["tokens"])
    out = train(verifier, tmp_path / "d", short, work=tmp_path / "w", resume=True, log=lambda m: None,
                device="cpu")
    hist = json.loads((out / "training.json").read_text())["history"]
    assert [h["step"] for h in hist] == [0, 10, 20, 30]
    assert hist[-1]["marginal_loss"] < hist[0]["marginal_loss"] - 0.3


def test_more_prompts_generate_only_the_new_sequences(pair_dirs, tmp_path, monkeypatch):
    from treeflash_export.checkpoints import load_tokenizer, load_verifier
    from treeflash_export.config import default_target_layer_ids

    vdir = pair_dirs["qwen3"] / "verifier"
    v = load_verifier(vdir, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(vdir)
    taps = default_target_layer_ids(int(v.config.num_hidden_layers), CFG.num_taps)
    generated = []
    real_generate = train_data.generate_data

    def counting_generate(verifier, prompts, *args, **kwargs):
        generated.append(len(prompts))
        return real_generate(verifier, prompts, *args, **kwargs)

    monkeypatch.setattr(train_data, "generate_data", counting_generate)

    def prepare(cfg, work):
        return prepare_data(v, tok, str(vdir), cfg, taps, tmp_path / work, log=lambda m: None)

    small, big = dataclasses.replace(CFG, train_prompts=6), dataclasses.replace(CFG, train_prompts=10)
    prepare(small, "w")
    assert generated == [6, 8]  # train, held-out
    grown = prepare(big, "w")
    assert generated == [6, 8, 4]  # only the four new training sequences; the held-out split is cached
    assert sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "w").glob("train-*.pt")) == ["10.pt"]
    shrunk = prepare(small, "w")  # a leading slice of the larger cache, nothing generated
    assert generated == [6, 8, 4]
    fresh = prepare(big, "fresh")
    # The same sequences as one run of ten prompts; the taps only up to rounding, as they were
    # computed in other batches.
    assert torch.equal(grown["train"]["tokens"], fresh["train"]["tokens"])
    assert torch.equal(shrunk["train"]["tokens"], fresh["train"]["tokens"][:6])
    assert torch.equal(grown["heldout"]["tokens"], fresh["heldout"]["tokens"])
    assert torch.allclose(grown["train"]["features"].float(), fresh["train"]["features"].float(), atol=2e-3)
    assert torch.equal(shrunk["train"]["features"], grown["train"]["features"][:6])


def test_turn_ends_finds_the_first_end_of_turn_of_each_continuation():
    tokens = torch.tensor([[7, 2, 5, 9, 2, 5],    # a stop in the prompt (column 1) does not count
                           [7, 7, 5, 5, 5, 5],    # no end: the last column
                           [2, 7, 9, 2, 9, 9]])   # the first of two stops after the prompt
    ends = train_data.turn_ends(tokens, 2, {2, 9})
    assert ends.tolist() == [3, 5, 2]
    assert train_data.turn_ends(tokens[1:2], 2, {2, 9}) is None  # no row ends early: nothing to mask
    assert train_data.turn_ends(tokens, 2, set()) is None


def test_targets_past_the_end_of_turn_weigh_nothing(load):
    """With ends, a target past its row's end changes neither the loss nor the accuracy, and the
    loss is the unmasked one with those positions' cross-entropy removed (same divisor)."""
    pair = load("qwen3")
    d = TreeFlashDrafter(DrafterConfig.from_hf(pair.drafter_cfg.hf_config))
    d.load_state_dict(pair.drafter.state_dict())
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 500, (2, 24), generator=g)
    feats = torch.randn(2, 24, len(pair.drafter_cfg.target_layer_ids) * pair.drafter_cfg.hidden_size, generator=g)
    args = (pair.verifier.model.embed_tokens, pair.verifier.lm_head)
    B, mask = pair.drafter_cfg.block_size, pair.drafter_cfg.mask_token_id
    anchors, ends = [6, 12], torch.tensor([23, 13])  # row 1 ends inside the second block
    with torch.no_grad():
        full = block_loss(d, *args, tokens, feats, anchors, B, 4.0, mask)
        masked = block_loss(d, *args, tokens, feats, anchors, B, 4.0, mask, ends=ends)
        changed = tokens.clone()
        changed[1, 14:] = torch.randint(0, 500, (10,), generator=g)  # what follows row 1's end
        again = block_loss(d, *args, changed, feats, anchors, B, 4.0, mask, ends=ends)
        same_all = block_loss(d, *args, tokens, feats, anchors, B, 4.0, mask, ends=torch.tensor([23, 23]))
    assert float(masked[0]) < float(full[0])  # some positive cross-entropy was removed
    for a, b in zip(masked[:2], again[:2]):
        assert abs(float(a) - float(b)) < 1e-6
    for key in ("marginal", "conditional"):
        assert torch.allclose(masked[2][key], again[2][key])
    assert abs(float(same_all[0]) - float(full[0])) < 1e-6  # nothing past the end: the old loss


def test_init_starts_from_a_drafter_and_refuses_another_shape(trained, pair_dirs, tmp_path):
    """--init: the run's step-0 evaluation is the given drafter's (not a fresh one's), training.json
    names it, and a drafter of other shapes is refused before any data is generated."""
    out, root = trained
    first = json.loads((out / "training.json").read_text())["history"]
    cfg = dataclasses.replace(CFG, steps=10)
    again = train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "drafter", cfg, work=root / "work2",
                  log=lambda m: None, init_from=out)
    info = json.loads((again / "training.json").read_text())
    start = info["history"][0]
    # The fp16 copy of the trained weights: the trained drafter's last losses up to rounding.
    assert abs(start["marginal_loss"] - first[-1]["marginal_loss"]) < 0.02
    assert start["marginal_loss"] < first[0]["marginal_loss"] - 0.3
    assert info["init"]["from"] == out.name and len(info["init"]["sha256"]) == 64
    wider = dataclasses.replace(CFG, intermediate_size=64)
    with pytest.raises(ConfigError, match="intermediate_size"):
        train(str(pair_dirs["qwen3"] / "verifier"), tmp_path / "other", wider, work=tmp_path / "work3",
              log=lambda m: None, init_from=out)
    assert not (tmp_path / "work3").exists()


def test_an_interrupt_while_a_checkpoint_is_written_keeps_the_previous_one(pair_dirs, tmp_path, monkeypatch):
    """Ctrl-C in the middle of writing the step-20 checkpoint: the step-10 checkpoint is still there,
    whole (it loads and says step 10), no half-written file is left beside it, and --resume continues
    from it to the end."""
    short = dataclasses.replace(CFG, steps=30)
    verifier = str(pair_dirs["qwen3"] / "verifier")
    real_save = torch.save
    writes = {"n": 0}

    def save_half_then_interrupt(obj, f, *a, **k):
        if str(f).endswith("last.pt.tmp"):
            writes["n"] += 1
            if writes["n"] == 2:
                with open(f, "wb") as out:
                    out.write(b"half a checkpoint")
                raise KeyboardInterrupt
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save_half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(verifier, tmp_path / "d", short, work=tmp_path / "w", log=lambda m: None)
    monkeypatch.setattr(torch, "save", real_save)
    assert writes["n"] == 2 and not (tmp_path / "d").exists()
    assert sorted(p.name for p in (tmp_path / "w").glob("last.pt*")) == ["last.pt"]
    state = torch.load(tmp_path / "w" / "last.pt", weights_only=False)
    assert state["step"] == 10 and [h["step"] for h in state["history"]] == [0, 10]
    lines = []
    out = train(verifier, tmp_path / "d", short, work=tmp_path / "w", resume=True, log=lines.append)
    assert "resumed at step 10" in lines
    assert [h["step"] for h in json.loads((out / "training.json").read_text())["history"]] == [0, 10, 20, 30]


def test_resume_without_a_checkpoint_is_one_line_and_writes_nothing(pair_dirs, tmp_path):
    from click.testing import CliRunner

    from treeflash_export.cli import main

    r = CliRunner().invoke(main, ["train", "--model", str(pair_dirs["qwen3"] / "verifier"), "--out",
                                  str(tmp_path / "d"), "--work", str(tmp_path / "w"), "--resume", "--steps", "1"])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [
        f"error: --resume: there is no checkpoint to continue in {tmp_path / 'w'} (no last.pt); run without "
        f"--resume to start, or pass the --work folder of the earlier run"]
    assert sorted(tmp_path.iterdir()) == []


def test_chat_sources_with_a_tokenizer_without_a_chat_template(pair_dirs, tmp_path):
    """The chat sources render turns with the verifier's chat template: without one, a single line before
    any data is generated, exit status 2, and nothing is written (neither --out nor --work)."""
    import shutil

    from click.testing import CliRunner

    from treeflash_export.cli import main

    v = tmp_path / "verifier"
    shutil.copytree(pair_dirs["qwen3"] / "verifier", v)
    cfg = json.loads((v / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (v / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in v.glob("chat_template.*"):
        extra.unlink()
    for source in ("chat-stdlib", "code:1,chat-prose:1"):
        option = "--mix" if ":" in source else "--source"
        r = CliRunner().invoke(main, ["train", "--model", str(v), "--out", str(tmp_path / "d"), "--work",
                                      str(tmp_path / "w"), option, source, "--steps", "1", "--train-prompts", "4",
                                      "--heldout-prompts", "2", "--prompt-tokens", "48"])
        assert r.exit_code == 2, r.output
        name = source if option == "--source" else "chat-prose"
        assert r.stderr.strip().splitlines() == [
            f"error: --source {name} writes chat turns with the verifier's chat template, but its tokenizer has "
            f"none: train on --source code or on --data prompts instead"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["verifier"]
