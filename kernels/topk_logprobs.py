"""The top-k log-probabilities of each row of logits, in two Triton kernels that read the
logits once (the expansion's last step, after the LM head).

The reference (``topk_logprobs_reference``, below) is what the expansion composes
(treeflash_export.models.expand): ``log_softmax(logits.float() / T).topk(k)``.
At Qwen3-8B shapes the TreeFlash expansion has (B - 1) x M = 240 rows of 151,936 logits:
the composition casts them to float32, normalises and selects in four or more launches
that move about 0.8 GB (the bf16 logits once, then float32 passes of 146 MB each way);
these kernels read the bf16 logits once (73 MB) and write k entries per row.

- ``_chunk_kernel``: one program per (row, chunk of CHUNK logits): the chunk's max m and
  sum(exp(x - m)) for the row's log-sum-exp, and the chunk's own top k. It does not pass k
  times over the chunk: it splits the chunk into groups of G, picks the k groups with the
  largest maxima (which hold the chunk's top k: a group outside them is outranked by k
  groups, each with an entry that outranks all of its entries) and selects among their k x G
  entries only.
- ``_merge_kernel``: one program per row: the log-sum-exp from the chunks' (m, sum) pairs, and
  the top k of the chunks' candidates.

Order: by the scaled logits x / T desc, then by index asc, ties included (``torch.topk``
leaves the order of equal values unspecified). NaN logits (a broken model or overflowed
activations) rank as -inf, so every id returned is inside the vocabulary: an id past it would
reach an embedding gather and end the CUDA context with a device-side assert. Values differ from the reference only by the
order of the row's sum.
"""

from __future__ import annotations

import torch

from .mlp_expand import _pow2, runs_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; the kernels need `pip install triton`
    triton = None

CHUNK = 4096  # logits per program in the first kernel (151,936 -> 38 chunks a row)
GROUP = 32  # entries per group inside a chunk
MAX_K = 64
MAX_CANDIDATES = 8192  # the chunks' candidates of one row, in one program of the second kernel


def topk_logprobs_reference(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the top k of log_softmax(logits / T) in float32: (values, ids), best first."""
    x = logits.float() / temperature
    top = torch.log_softmax(x, dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def kernel_fits(vocab: int, k: int, chunk: int = CHUNK) -> bool:
    return (1 <= k <= min(MAX_K, vocab) and chunk == _pow2(chunk) >= GROUP and k <= chunk // GROUP
            and _pow2(-(-vocab // chunk) * k) <= MAX_CANDIDATES)


if triton is not None:
    _NONE = tl.constexpr(1 << 62)  # an index past every real one

    @triton.jit
    def _best(x, idx, live):
        """The best live entry of x (value desc, index asc): (value, index)."""
        best = tl.max(tl.max(tl.where(live, x, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(live & (x == best), idx, _NONE), axis=1), axis=0)
        return best, pick

    @triton.jit
    def _store_top(x, idx, live, out_v, out_i, shift, log_total, K: tl.constexpr):
        """Stores the K best live entries of the 2-D tile x, in order, at out_v / out_i, each value
        as (x - shift) - log_total."""
        for j in range(K):
            best, pick = _best(x, idx, live)
            tl.store(out_v + j, (best - shift) - log_total)
            tl.store(out_i + j, pick)
            live = live & (idx != pick)

    @triton.jit
    def _chunk_kernel(x_ptr, V, temperature, cand_v, cand_i, stats, n_chunks, K: tl.constexpr, KP: tl.constexpr,
                      NG: tl.constexpr, G: tl.constexpr, SCALE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        row = x_ptr + r * V
        e = tl.arange(0, G)
        g = tl.arange(0, NG)
        offs = c * NG * G + g[:, None] * G + e[None, :]  # [NG, G]
        x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            x = x / temperature
        x = tl.where(x == x, x, float("-inf"))  # NaN ranks as -inf: no comparison may leave a row without a pick
        m = tl.max(tl.max(x, axis=1), axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        slot = r * n_chunks + c
        tl.store(stats + slot * 2, m)
        tl.store(stats + slot * 2 + 1, tl.sum(tl.sum(tl.exp(x - m_safe), axis=1), axis=0))
        # The K groups with the largest maxima (ties: lower group first).
        gmax = tl.max(x, axis=1)[:, None]  # [NG, 1]
        gid = g[:, None].to(tl.int64)
        live = gid >= 0
        kk = tl.arange(0, KP)
        chosen = tl.zeros([KP], tl.int64)
        for j in range(K):
            _, pick = _best(gmax, gid, live)
            chosen = tl.where(kk == j, pick, chosen)
            live = live & (gid != pick)
        # Their K x G entries (entries past V are -inf with indices >= V: they lose every tie).
        offs = c * NG * G + chosen[:, None] * G + e[None, :]  # [KP, G]
        y = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if SCALE:
            y = y / temperature
        y = tl.where(y == y, y, float("-inf"))
        # Entries past V are never picked; a chunk with fewer than K entries leaves sentinel ids (-inf,
        # index _NONE) that lose to every real entry in the merge, where V >= K real ones exist.
        _store_top(y, offs, (kk < K)[:, None] & (offs < V), cand_v + slot * K, cand_i + slot * K, 0.0, 0.0, K)

    @triton.jit
    def _merge_kernel(cand_v, cand_i, stats, n_chunks, out_v, out_i, K: tl.constexpr, NC: tl.constexpr,
                      NCAND: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NC)
        c_ok = c < n_chunks
        m = tl.load(stats + (r * n_chunks + c) * 2, mask=c_ok, other=float("-inf"))
        s = tl.load(stats + (r * n_chunks + c) * 2 + 1, mask=c_ok, other=0.0)
        top = tl.max(m, axis=0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top_safe)), axis=0)
        j = tl.arange(0, NCAND)[None, :]
        j_ok = j < n_chunks * K
        v = tl.load(cand_v + r * n_chunks * K + j, mask=j_ok, other=float("-inf"))
        i = tl.load(cand_i + r * n_chunks * K + j, mask=j_ok, other=_NONE)
        # Ordered by the scaled logits; stored in log_softmax's form, (x - max) - log(sum(exp(x - max))).
        _store_top(v, i, j_ok, out_v + r * K, out_i + r * K, top_safe, tl.log(total), K)


def topk_logprobs_triton(logits: torch.Tensor, k: int, temperature: float,
                         chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Two launches; the reference's values (up to the sum's order) and ids (ties: lower id first)."""
    if triton is None:
        raise RuntimeError("the top-k kernels need triton: pip install triton")
    V = logits.shape[-1]
    if not kernel_fits(V, k, chunk):
        raise ValueError(f"topk_logprobs kernel: k={k} over {V} logits in chunks of {chunk} exceeds its limits "
                         f"(k <= {MAX_K} and <= chunk / {GROUP}, {MAX_CANDIDATES} candidates a row)")
    lead = logits.shape[:-1]
    x = logits.reshape(-1, V).contiguous()
    R, n_chunks = x.shape[0], -(-V // chunk)
    dev = x.device
    cand_v = torch.empty(R * n_chunks * k, device=dev, dtype=torch.float32)
    cand_i = torch.empty(R * n_chunks * k, device=dev, dtype=torch.long)
    stats = torch.empty(R * n_chunks * 2, device=dev, dtype=torch.float32)
    out_v = torch.empty(R, k, device=dev, dtype=torch.float32)
    out_i = torch.empty(R, k, device=dev, dtype=torch.long)
    if R:
        _chunk_kernel[(R, n_chunks)](x, V, float(temperature), cand_v, cand_i, stats, n_chunks, K=k, KP=_pow2(k),
                                     NG=chunk // GROUP, G=GROUP, SCALE=temperature != 1.0,
                                     num_warps=4)
        _merge_kernel[(R,)](cand_v, cand_i, stats, n_chunks, out_v, out_i, K=k, NC=_pow2(n_chunks),
                            NCAND=_pow2(n_chunks * k), num_warps=4)
    return out_v.reshape(*lead, k), out_i.reshape(*lead, k)


def topk_logprobs_fast(logits: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels on CUDA where they fit, else the reference."""
    if runs_triton(logits) and kernel_fits(logits.shape[-1], k):
        return topk_logprobs_triton(logits, k, temperature)
    return topk_logprobs_reference(logits, k, temperature)
