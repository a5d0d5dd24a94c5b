"""Triton kernels for TreeFlash (installed as ``treeflash_kernels``).

The MLP-expansion kernels and their plain-PyTorch references are added by the
kernels-and-plugins work; until then the PyTorch head in
``treeflash_export.models.head`` is the only implementation.
"""
