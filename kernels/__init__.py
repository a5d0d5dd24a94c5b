"""Triton kernels for TreeFlash (installed as ``treeflash_kernels``).

- ``mlp_expand``: the MLP expansion (head + final norm over every (position, parent)
  pair) as four Triton kernels, with ``mlp_expand_reference`` beside them.
- ``tree_attention``: attention over the KV cache in place plus a tree of new nodes.
- ``layer_ops``: a decoder layer's elementwise work (add + RMSNorm, q/k norm + RoPE + cache
  write, SwiGLU) in three kernels, for the PyTorch backend's fast path.
- ``topk_logprobs``: the top-k log-probabilities of rows of logits in one read of them (the
  expansion's last step); ``build_tree``: the tree build in one kernel.
- ``ops``: all of them as ``torch.ops.treeflash`` custom ops (Triton on CUDA, the references
  elsewhere); ``mlp_expand`` is also what the ``plugin`` graph variant exports.
- ``bench``: ``treeflash-kernel-bench``, kernels vs eager vs the weight-reading floor.
"""
