"""The exported graphs: flat tensors in and out, one I/O spec each.

verify  one verifier pass over n tokens (n is the only dynamic axis: prefill chunks,
        tree verification and plain decoding share one engine and one copy of the weights)
draft   the drafter backbone over [root, MASK x (B-1)] plus up to B new context rows
expand  marginal logits, the TreeFlash head over all (position, parent) pairs, the LM
        head, top-K, and the fixed-shape beam tree builder -> the tree itself

The I/O specs are the single source for ONNX input/output names, TensorRT
optimisation profiles, runtime input checks and Triton's config.pbtxt.
Scalars travel as shape-[1] int64 tensors (TensorRT and Triton handle those best).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..config import TreeConfig
from ..models.expand import marginal_tables, treeflash_tables
from ..tree import build_tree

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.int64: "int64", torch.bool: "bool"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # float32 | float16 | bfloat16 | int64 | bool
    shape: tuple  # ints, or a symbol name (str) for a dynamic axis


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic: dict  # symbol -> [min, opt, max]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GraphSpec":
        def ts(x):
            return TensorSpec(x["name"], x["dtype"], tuple(x["shape"]))

        return cls(d["name"], tuple(map(ts, d["inputs"])), tuple(map(ts, d["outputs"])), dict(d["dynamic"]))

    def check_inputs(self, feeds: dict) -> None:
        """Runtime check of names, dtypes and static dims; dynamic dims within their range."""
        names = [s.name for s in self.inputs]
        if sorted(feeds) != sorted(names):
            raise ValueError(f"{self.name}: expected inputs {names}, got {sorted(feeds)}")
        for s in self.inputs:
            arr = feeds[s.name]
            shape = tuple(arr.shape)
            if len(shape) != len(s.shape):
                raise ValueError(f"{self.name}.{s.name}: rank {len(shape)}, expected {len(s.shape)}")
            for got, want in zip(shape, s.shape):
                if isinstance(want, str):
                    lo, _, hi = self.dynamic[want]
                    if not lo <= got <= hi:
                        raise ValueError(f"{self.name}.{s.name}: {want}={got} outside {lo}..{hi}")
                elif got != want:
                    raise ValueError(f"{self.name}.{s.name}: shape {shape}, expected {s.shape}")
            dt = str(arr.dtype).replace("torch.", "")
            if dt != s.dtype and not (s.dtype == "bfloat16" and dt == "uint16"):
                raise ValueError(f"{self.name}.{s.name}: dtype {dt}, expected {s.dtype}")


@dataclass(frozen=True)
class Shapes:
    """Every static dimension of an artifact, from the pair and the settings."""

    vocab: int  # V
    hidden: int  # H
    features: int  # F = T * H
    layers: int  # verifier layers L
    kv_heads: int
    head_dim: int
    draft_layers: int
    draft_kv_heads: int
    draft_head_dim: int
    block: int  # B
    tree: int  # N
    top_m: int  # M
    top_k: int  # K
    capacity: int  # S
    max_tokens: int  # largest n of the verify graph (prefill chunk size)
    mask_token_id: int


def graph_specs(sh: Shapes, dtype: str) -> dict[str, GraphSpec]:
    T = TensorSpec
    verify = GraphSpec(
        "verify",
        inputs=(
            T("tokens", "int64", ("num_tokens",)),
            T("positions", "int64", ("num_tokens",)),
            T("tree_mask", "bool", ("num_tokens", "num_tokens")),
            T("past_len", "int64", (1,)),
            T("kv_cache", dtype, (sh.layers, 2, sh.kv_heads, sh.capacity, sh.head_dim)),
        ),
        outputs=(
            T("logits", "float32", ("num_tokens", sh.vocab)),
            T("features", dtype, ("num_tokens", sh.features)),
            T("new_kv", dtype, (sh.layers, 2, sh.kv_heads, "num_tokens", sh.head_dim)),
        ),
        dynamic={"num_tokens": [1, sh.tree, sh.max_tokens]},
    )
    draft = GraphSpec(
        "draft",
        inputs=(
            T("root", "int64", (1,)),
            T("ctx_features", dtype, (sh.block, sh.features)),
            T("ctx_start", "int64", (1,)),
            T("ctx_count", "int64", (1,)),
            T("draft_kv", dtype, (sh.draft_layers, 2, sh.draft_kv_heads, sh.capacity, sh.draft_head_dim)),
        ),
        outputs=(
            T("z", dtype, (sh.block, sh.hidden)),
            T("new_draft_kv", dtype, (sh.draft_layers, 2, sh.draft_kv_heads, sh.block, sh.draft_head_dim)),
        ),
        dynamic={},
    )
    expand = GraphSpec(
        "expand",
        inputs=(T("z", dtype, (sh.block, sh.hidden)), T("root", "int64", (1,))),
        outputs=(
            T("tree_tokens", "int64", (sh.tree,)),
            T("tree_parents", "int64", (sh.tree,)),
            T("tree_depths", "int64", (sh.tree,)),
            T("tree_mask", "bool", (sh.tree, sh.tree)),
            T("tree_valid", "bool", (sh.tree,)),
        ),
        dynamic={},
    )
    return {g.name: g for g in (verify, draft, expand)}


class VerifyGraph(nn.Module):
    def __init__(self, verifier):
        super().__init__()
        self.verifier = verifier

    def forward(self, tokens, positions, tree_mask, past_len, kv_cache):
        logits, features, new_kv = self.verifier(tokens, positions, tree_mask, kv_cache, past_len[0])
        return logits.float(), features, new_kv


class DraftGraph(nn.Module):
    def __init__(self, backbone, embed_tokens, block_size: int, mask_token_id: int):
        super().__init__()
        self.backbone = backbone
        self.embed_tokens = embed_tokens
        self.block_size = block_size
        self.mask_token_id = mask_token_id

    def forward(self, root, ctx_features, ctx_start, ctx_count, draft_kv):
        B = self.block_size
        steps = torch.arange(B, device=root.device)
        block = torch.where(steps == 0, root, torch.full_like(steps, self.mask_token_id))
        past = ctx_start + ctx_count  # P: the block sits right after the context
        z, new_kv = self.backbone(ctx_features, ctx_start + steps, self.embed_tokens(block), past + steps,
                                  draft_kv, ctx_start[0], ctx_count[0])
        return z, new_kv


class ExpandGraph(nn.Module):
    """fused: the head as one custom op (the ``plugin`` variant) instead of standard ops (``reference``)."""

    def __init__(self, norm, lm_head, embed_tokens, head, tree: TreeConfig, fused: bool = False):
        super().__init__()
        self.norm, self.lm_head, self.embed_tokens, self.head = norm, lm_head, embed_tokens, head
        self.tree = tree
        self.fused = fused

    def forward(self, z, root):
        t = self.tree
        logits = self.lm_head(self.norm(z))
        if t.mode == "treeflash":
            tables = treeflash_tables(z, logits, root, head=self.head, norm=self.norm,
                                      embed_tokens=self.embed_tokens, lm_head=self.lm_head, top_m=t.top_m,
                                      top_k=t.top_k, temperature=t.drafter_temperature, fused=self.fused)
        else:
            tables = marginal_tables(logits, t.top_k, t.drafter_temperature)
        tree = build_tree(tables, root, t.tree_size)
        return tree.tokens, tree.parents, tree.depths, tree.mask, tree.valid
