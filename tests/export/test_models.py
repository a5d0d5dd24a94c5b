"""Model definitions against transformers and against a straightforward re-implementation."""

from __future__ import annotations

import math

import pytest
import torch

from treeflash_export.checkpoints import normalise_drafter_keys, read_drafter_state
from treeflash_export.models import TreeVerifier
from treeflash_export.models.expand import marginal_tables, treeflash_tables
from treeflash_export.tree import chain_tree

# ---------------------------------------------------------------- an independent drafter, written plainly


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    # x: [n, heads, d]; Hugging Face rotate-half convention.
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].float()
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_drafter_z(sd, cfg, ctx_feats, ctx_pos, block_emb, blk_pos):
    """DESIGN section 2, line by line: fused context, non-causal block attention, SwiGLU MLP."""
    eps, nh, nkv, hd = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    theta = cfg.rope_parameters["rope_theta"]
    ctx = _rms(ctx_feats @ sd["model.fc.weight"].T, sd["model.hidden_norm.weight"], eps)
    x = block_emb
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rms((h @ sd[p + "self_attn.q_proj.weight"].T).view(-1, nh, hd), sd[p + "self_attn.q_norm.weight"], eps)
        kin = torch.cat([ctx, h])
        pos = torch.cat([ctx_pos, blk_pos])
        k = _rms((kin @ sd[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), sd[p + "self_attn.k_norm.weight"], eps)
        v = (kin @ sd[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rope(q, blk_pos, theta), _rope(k, pos, theta)
        outs = []
        for head in range(nh):
            kv = head // (nh // nkv)
            att = torch.softmax(q[:, head] @ k[:, kv].T / math.sqrt(hd), dim=-1)  # no mask: non-causal
            outs.append(att @ v[:, kv])
        x = x + torch.cat(outs, -1) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return x


def reference_head_logits(sd, cfg, z, parent_emb, lm_head_w):
    """Conditional logits lm_head(norm(z + d(silu(g) * u))) with [u, g] = ug([RMSNorm_e(E[t]) ; norm(z)])."""
    eps = cfg.rms_norm_eps
    h = _rms(z, sd["model.norm.weight"], eps)
    inp = torch.cat([_rms(parent_emb, sd["ar_approximation.norm.weight"], 1e-6), h], -1)
    ug = inp @ sd["ar_approximation.ug.weight"].T + sd["ar_approximation.ug.bias"]
    u, g = ug.chunk(2, -1)
    delta = (torch.nn.functional.silu(g) * u) @ sd["ar_approximation.d.weight"].T
    return _rms(z + delta, sd["model.norm.weight"], eps) @ lm_head_w.T


def released_treeflash_keys(num_layers: int) -> set[str]:
    """The released TreeFlash key names, spelled out independently of the project's modules."""
    keys = {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight",
            "ar_approximation.ug.weight", "ar_approximation.ug.bias", "ar_approximation.d.weight",
            "ar_approximation.norm.weight"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        keys |= {p + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
    return keys


# ---------------------------------------------------------------- tests


def test_treeflash_checkpoint_has_exactly_the_released_keys(pair_dirs, load):
    pair = load("qwen3")
    state = read_drafter_state(pair_dirs["qwen3"] / "drafter")
    assert set(state) == released_treeflash_keys(pair.drafter_cfg.num_layers)
    # ... and the project's module tree has exactly those names too (strict load, nothing left over).
    assert set(pair.drafter.state_dict()) == set(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_loads_the_checkpoint_tensors_without_initialising(pair_dirs, monkeypatch, dtype):
    """load_drafter builds the module on the meta device: the parameters are the checkpoint's
    tensors in the run's dtype (no random initialisation runs at all), and RoPE's frequencies,
    which no checkpoint holds, are made afresh in float32."""
    from treeflash_export.checkpoints import load_drafter
    from treeflash_export.models import TreeFlashDrafter

    folder = pair_dirs["qwen3"] / "drafter"
    def no_init(tensor, *args, **kwargs):  # on the meta device an initialisation costs nothing
        assert tensor.is_meta, "a random initialisation ran on real memory"
        return tensor

    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        monkeypatch.setattr(torch.nn.init, name, no_init)
    model, cfg, layout = load_drafter(folder, dtype=dtype, device="cpu")
    monkeypatch.undo()
    state = read_drafter_state(folder)
    got = model.state_dict()
    assert layout == "treeflash" and set(got) == set(state)
    assert all(torch.equal(got[k], v.to(dtype)) for k, v in state.items())
    assert not any(p.requires_grad or p.is_meta for p in model.parameters())
    fresh = TreeFlashDrafter(cfg).model.rotary_emb
    for name, buf in model.model.rotary_emb.named_buffers():
        assert buf.dtype == torch.float32 and torch.equal(buf, getattr(fresh, name))


def test_dflash_layout_maps_onto_the_backbone(pair_dirs, load):
    raw = read_drafter_state(pair_dirs["qwen3-dflash"] / "drafter")
    assert all(k.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for k in raw)
    mapped, layout = normalise_drafter_keys(raw)
    assert layout == "dflash"
    pair = load("qwen3-dflash")
    assert pair.drafter.ar_approximation is None and pair.drafter_layout == "dflash"
    assert set(mapped) == set(pair.drafter.state_dict())


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_verifier_wrapper_matches_transformers(load, name):
    pair = load(name)
    hf = pair.verifier
    ids = torch.tensor(pair.tokenizer("def f(x):\n    return x * 2\n")["input_ids"])
    out = hf(ids[None], output_hidden_states=True)
    wrapper = TreeVerifier(hf, pair.drafter_cfg.target_layer_ids)
    cache = wrapper.new_cache(64)
    tree = chain_tree(ids)
    logits, feats, new_kv = wrapper(ids, tree.depths, tree.mask, cache, 0)
    assert (logits - out.logits[0]).abs().max() < 1e-4
    taps = torch.cat([out.hidden_states[i + 1][0] for i in pair.drafter_cfg.target_layer_ids], -1)
    assert (feats - taps).abs().max() < 1e-4
    # Incremental: the last 4 tokens as a second call over the cached prefix give the same rows.
    cache2 = wrapper.new_cache(64)
    n = ids.shape[0]
    _, _, kv = wrapper(ids[:-4], tree.depths[:-4], tree.mask[:-4, :-4], cache2, 0)
    cache2[:, :, :, : n - 4] = kv
    tail = chain_tree(ids[-4:])
    logits2, _, _ = wrapper(ids[-4:], n - 4 + tail.depths, tail.mask, cache2, n - 4)
    assert (logits2 - out.logits[0, -4:]).abs().max() < 1e-4
    # Traced form: P as a tensor, the whole cache visible to the graph and slots >= P masked.
    logits3, _, _ = wrapper(ids[-4:], n - 4 + tail.depths, tail.mask, cache2, torch.tensor(n - 4))
    assert (logits3 - out.logits[0, -4:]).abs().max() < 1e-4


def test_drafter_matches_reference_implementation(load):
    pair = load("qwen3")
    d, cfg = pair.drafter, pair.drafter_cfg
    sd = {k: v.float() for k, v in d.state_dict().items()}
    H, B, T = cfg.hidden_size, cfg.block_size, len(cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(11, T * H, generator=g)
    block = torch.randn(B, H, generator=g)
    cache = d.model.new_cache(32)
    # Two rounds through the cache: 7 context tokens, then 4 more; the block sits after them.
    with torch.no_grad():
        _, kv = d.model(feats[:7], torch.arange(7), block, torch.arange(7, 7 + B), cache, 0)
        cache[:, :, :, :7] = kv
        z, _ = d.model(feats[7:], torch.arange(7, 11), block, torch.arange(11, 11 + B), cache, 7)
        # Traced form: context padded to B rows with a valid count, the whole cache masked past 7.
        padded = torch.cat([feats[7:], torch.randn(B - 4, T * H, generator=g)])
        z_static, _ = d.model(padded, torch.arange(7, 7 + B), block, torch.arange(11, 11 + B), cache,
                              torch.tensor(7), torch.tensor(4))
    ref = reference_drafter_z(sd, cfg.hf_config, feats, torch.arange(11), block, torch.arange(11, 11 + B))
    assert (z - ref).abs().max() < 1e-4
    assert (z_static - ref).abs().max() < 1e-4

    # Head: conditional logits for every (position, parent) pair, against the plain formula.
    emb_w, lm_w = pair.verifier.model.embed_tokens.weight, pair.verifier.lm_head.weight
    with torch.no_grad():
        logits = pair.verifier.lm_head(d.model.norm(z))
        tables, fused_tables = (
            treeflash_tables(z, logits, torch.tensor([5]), head=d.ar_approximation, norm=d.model.norm,
                             embed_tokens=pair.verifier.model.embed_tokens, lm_head=pair.verifier.lm_head,
                             top_m=3, top_k=4, temperature=1.0, fused=fused)
            for fused in (False, True))
    # The custom op (the plugin graphs' node; the PyTorch reference on CPU) gives the same tables.
    assert torch.equal(fused_tables.tokens, tables.tokens) and torch.equal(fused_tables.next_row, tables.next_row)
    assert (fused_tables.logprobs - tables.logprobs).abs().max() < 1e-5
    cands = logits[:-1].topk(3, -1).indices
    for pos in range(1, B):
        for m in range(3):
            parent = 5 if pos == 1 else int(cands[pos - 1, m])
            ref_logits = reference_head_logits(sd, cfg.hf_config, z[pos], emb_w[parent], lm_w)
            ref_lp = torch.log_softmax(ref_logits, -1).topk(4)
            assert tables.tokens[pos - 1, m].tolist() == ref_lp.indices.tolist()
            assert (tables.logprobs[pos - 1, m] - ref_lp.values).abs().max() < 1e-4
            for k in range(4):  # the child's own row: its index among position pos's candidates
                tok = int(tables.tokens[pos - 1, m, k])
                row = cands[pos].tolist().index(tok) if pos < B - 1 and tok in cands[pos].tolist() else -1
                assert int(tables.next_row[pos - 1, m, k]) == row


def test_untrained_head_reproduces_marginal_drafter(load):
    """With d = 0 the head adds nothing: every parent row equals the marginal row."""
    pair = load("qwen3")
    d = pair.drafter
    z = torch.randn(pair.drafter_cfg.block_size, pair.drafter_cfg.hidden_size)
    head = type(d.ar_approximation)(pair.drafter_cfg.hidden_size, pair.drafter_cfg.intermediate_size)
    with torch.no_grad():
        logits = pair.verifier.lm_head(d.model.norm(z))
        tf = treeflash_tables(z, logits, torch.tensor([0]), head=head, norm=d.model.norm,
                              embed_tokens=pair.verifier.model.embed_tokens, lm_head=pair.verifier.lm_head,
                              top_m=2, top_k=3, temperature=1.0)
        mg = marginal_tables(logits, 3, 1.0)
    assert torch.equal(tf.tokens, mg.tokens.expand(-1, 2, -1))
    assert torch.allclose(tf.logprobs, mg.logprobs.expand(-1, 2, -1), atol=1e-5)


def test_drafter_rope_stays_float32_when_the_weights_are_cast(load):
    """``.to(bfloat16)`` casts the drafter's weights but not RoPE's inverse frequencies (the verifier
    from from_pretrained keeps them float32 too): bfloat16 ones would turn the angles between
    distant tokens by radians. The cast drafter's cos/sin are the float32 drafter's, rounded once."""
    import copy

    pair = load("qwen3")
    fp32 = pair.drafter.model
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    assert {b.dtype for b in bf16.rotary_emb.buffers()} == {torch.float32}
    assert torch.equal(bf16.rotary_emb.inv_freq, pair.verifier.model.rotary_emb.inv_freq)
    positions = torch.arange(7990, 8010)
    x = torch.zeros(1, dtype=torch.bfloat16)
    cos, sin = bf16._rope(x, positions)
    want_cos, want_sin = fp32._rope(x.float(), positions)
    assert torch.equal(cos, want_cos.to(torch.bfloat16)) and torch.equal(sin, want_sin.to(torch.bfloat16))
    back = copy.deepcopy(bf16).float()  # and back: still the same frequencies
    assert torch.equal(back.rotary_emb.inv_freq, fp32.rotary_emb.inv_freq)
