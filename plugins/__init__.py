"""TensorRT plugin definitions wrapping the Triton kernels (installed as ``treeflash_plugins``).

Not implemented yet: the plugin graph variant and ``load_plugins()`` arrive with
the kernels-and-plugins work. Nothing here imports TensorRT.
"""
