"""The model forms over a batch of slots (the ground of in-flight batching): one pass for the
trees of M slots, each slot attending to its own cache range up to its own length, equals each
slot run alone. fp32 on CPU; with and without the layer kernels (their references here)."""

from __future__ import annotations

import pytest
import torch

from treeflash_export.models import TreeVerifier

LENGTHS = [5, 0, 17]  # committed tokens per slot: a short one, an empty one, a longer one
S = 40  # cache slots per slot
N = 6  # tree nodes per slot


def random_tree(n: int, gen: torch.Generator):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask, mask.sum(1) - 1  # ancestor-or-self mask, depths


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "layer-kernels"])
def test_verifier_over_slots_equals_each_slot_alone(load, fast_kernels):
    pair = load("qwen3")
    verifier = TreeVerifier(pair.verifier, pair.drafter.cfg.target_layer_ids)
    verifier.use_layer_kernels(fast_kernels)
    gen = torch.Generator().manual_seed(0)
    V = verifier.vocab_size
    singles, trees = [], []
    with torch.inference_mode():
        for P in LENGTHS:
            cache = verifier.new_cache(S)
            if P:
                prompt = torch.randint(0, V, (P,), generator=gen)
                causal = torch.ones(P, P, dtype=torch.bool).tril()
                verifier.forward_cached(prompt, torch.arange(P), causal, cache, torch.tensor(0))
            singles.append(cache)
            mask, depths = random_tree(N, gen)
            trees.append((torch.randint(0, V, (N,), generator=gen), P + depths, mask))
        batch_cache = torch.cat(singles, dim=3)  # slot m's range at m * S on the sequence axis
        past = torch.tensor(LENGTHS)
        logits, taps = verifier.forward_cached(torch.stack([t[0] for t in trees]), torch.stack([t[1] for t in trees]),
                                               torch.stack([t[2] for t in trees]), batch_cache, past)
        assert logits.shape == (3, N, V) and taps.shape[:2] == (3, N)
        for m, (P, cache, (tokens, positions, mask)) in enumerate(zip(LENGTHS, singles, trees)):
            want_logits, want_taps = verifier.forward_cached(tokens, positions, mask, cache, torch.tensor(P))
            assert (logits[m] - want_logits).abs().max() < 1e-5, m
            assert (taps[m] - want_taps).abs().max() < 1e-5, m
            assert (batch_cache[:, :, :, m * S : (m + 1) * S] - cache).abs().max() < 1e-5, m  # the new K/V in place
        # Only some rows' logits (a prefill chunk's last real row per slot).
        rows = torch.tensor([[N - 1], [0], [2]])
        picked, _ = verifier.forward_cached(torch.stack([t[0] for t in trees]), torch.stack([t[1] for t in trees]),
                                            torch.stack([t[2] for t in trees]), batch_cache, past, logit_rows=rows)
        assert picked.shape == (3, 1, V)
        assert all((picked[m, 0] - logits[m, int(rows[m, 0])]).abs().max() < 1e-5 for m in range(3))


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "layer-kernels"])
def test_drafter_over_slots_equals_each_slot_alone(load, fast_kernels):
    """Slots at different context lengths, each with its own count of pending context rows (the rest
    padding), and a block each: one batched pass gives every slot's z and cache as alone."""
    pair = load("qwen3")
    backbone = pair.drafter.model
    backbone.use_layer_kernels(fast_kernels)
    try:
        gen = torch.Generator().manual_seed(1)
        F = backbone.fc.weight.shape[1]
        H, B, C = backbone.cfg.hidden_size, backbone.cfg.block_size, 3
        counts = [2, 3, 1]
        singles, steps = [], []
        with torch.inference_mode():
            for P, count in zip(LENGTHS, counts):
                cache = backbone.new_cache(S)
                if P:  # the prompt's context, ingested
                    backbone.forward_cached(torch.randn(P, F, generator=gen), torch.tensor(0), torch.tensor(P), None,
                                            cache)
                singles.append(cache)
                steps.append((torch.randn(C, F, generator=gen), torch.tensor(P), torch.tensor(count),
                              torch.randn(B, H, generator=gen)))
            batch_cache = torch.cat(singles, dim=3)
            z = backbone.forward_cached(*(torch.stack([s[j] for s in steps]) for j in range(4)), batch_cache)
            assert z.shape == (3, B, H)
            for m, (cache, step) in enumerate(zip(singles, steps)):
                want = backbone.forward_cached(*step, cache)
                assert (z[m] - want).abs().max() < 1e-5, m
                live = LENGTHS[m] + counts[m] + B  # context and block K/V written; the padding rows' land after
                assert (batch_cache[:, :, :, m * S : m * S + live] - cache[:, :, :, :live]).abs().max() < 1e-5, m
    finally:
        backbone.use_layer_kernels(False)
