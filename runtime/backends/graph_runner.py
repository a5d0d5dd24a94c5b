"""The runner contract (one slot) on top of the three exported graphs (verify, draft, expand).

Subclasses only say how to run one graph (ONNX Runtime sessions, TensorRT engines);
the orchestration is written once here: prefill in chunks of the verify graph's
largest token count, context ingestion in chunks of B rows through the draft
graph, the caches as torch tensors, new K/V written and accepted K/V compacted
by the runtime (the graphs never scatter into the caches).
"""

from __future__ import annotations

import torch

from treeflash_export.export.artifact import Artifact
from treeflash_export.config import TreeConfig
from treeflash_export.tree import Tree, chain_tree

from .base import StagedRunner, allocate_caches

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int64": torch.int64, "bool": torch.bool}


class GraphRunner(StagedRunner):
    def __init__(self, artifact: Artifact, device: torch.device):
        self.artifact = artifact
        self.device = device
        sh = artifact.shapes
        self.shapes = sh
        self.specs = {g: artifact.spec(g) for g in ("verify", "draft", "expand")}
        self.vocab_size = sh.vocab
        self.block_size = sh.block
        self.capacity = sh.capacity
        self.mask_token_id = sh.mask_token_id
        self.has_head = artifact.tree.mode == "treeflash"
        self.built_tree = artifact.tree
        self.deployment = {1: artifact.tree.resolved(sh.block)}
        self.max_tree_size = max(self.deployment[1].tree_size, 1)
        self.occupied = 0
        self.kv = self.draft_kv = None

    def run_graph(self, name: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _input_dtype(self, graph: str, name: str) -> torch.dtype:
        return TORCH_DTYPES[next(s.dtype for s in self.specs[graph].inputs if s.name == name)]

    def reset(self) -> None:
        """The caches are made by the first generation and kept by the next ones: their stale slots
        are never read (the graphs mask every slot at or past the committed length, where a round's
        rejected nodes leave stale K/V too, and the runner writes a slot before it is read)."""
        if self.kv is not None:
            return
        shapes = {"verifier cache": next(s.shape for s in self.specs["verify"].inputs if s.name == "kv_cache"),
                  "drafter cache": next(s.shape for s in self.specs["draft"].inputs if s.name == "draft_kv")}
        caches = allocate_caches(shapes, self._input_dtype("verify", "kv_cache"), self.device, self.capacity)
        self.kv, self.draft_kv = caches["verifier cache"], caches["drafter cache"]

    def _verify(self, tree: Tree, past_len: int):
        out = self.run_graph("verify", {
            "tokens": tree.tokens, "positions": past_len + tree.depths, "tree_mask": tree.mask,
            "past_len": torch.tensor([past_len], device=self.device), "kv_cache": self.kv,
        })
        n = tree.size
        self.kv[:, :, :, past_len : past_len + n] = out["new_kv"]
        return out["logits"], out["features"]

    def encode(self, tokens, past_len):
        chunk = self.shapes.max_tokens
        feats, logits = [], None
        for start in range(0, tokens.shape[0], chunk):
            logits, f = self._verify(chain_tree(tokens[start : start + chunk]), past_len + start)
            feats.append(f)
        return logits[-1], torch.cat(feats)

    def verify(self, tree: Tree, past_len: int):
        return self._verify(tree, past_len)

    def propose(self, root: int, ctx_features, ctx_start: int, past_len: int, tree: TreeConfig) -> Tree:
        if (tree.mode, tree.tree_size, tree.top_m, tree.top_k) != (
                self.built_tree.mode, self.built_tree.tree_size, self.built_tree.top_m, self.built_tree.top_k):
            raise ValueError(f"the graphs were built for {self.built_tree}, not {tree}")
        B, dev = self.block_size, self.device
        root_t = torch.tensor([root], device=dev)
        feat_dtype = self._input_dtype("draft", "ctx_features")
        z = None
        # Context rows go through the draft graph B at a time; only the last call's block output is used.
        for start in range(0, ctx_features.shape[0], B):
            rows = ctx_features[start : start + B].to(feat_dtype)
            count = rows.shape[0]
            if count < B:
                rows = torch.cat([rows, rows.new_zeros(B - count, rows.shape[1])])
            out = self.run_graph("draft", {
                "root": root_t, "ctx_features": rows, "ctx_start": torch.tensor([ctx_start + start], device=dev),
                "ctx_count": torch.tensor([count], device=dev), "draft_kv": self.draft_kv,
            })
            s = ctx_start + start
            self.draft_kv[:, :, :, s : s + count] = out["new_draft_kv"][:, :, :, :count]
            z = out["z"]
        out = self.run_graph("expand", {"z": z, "root": root_t})
        return Tree(out["tree_tokens"], out["tree_parents"], out["tree_depths"], out["tree_mask"], out["tree_valid"])
