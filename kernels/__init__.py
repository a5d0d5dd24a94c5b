"""Triton kernels for TreeFlash (installed as ``treeflash_kernels``).

- ``mlp_expand``: the MLP expansion (head + final norm over every (position, parent)
  pair) as four Triton kernels, with ``mlp_expand_reference`` beside them.
- ``ops``: ``torch.ops.treeflash.mlp_expand``, the custom op the PyTorch backend and
  the ``plugin`` graph variant use.
- ``bench``: ``treeflash-kernel-bench``, kernels vs eager vs the weight-reading floor.
"""
