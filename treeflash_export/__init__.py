"""TreeFlash export: checkpoints, traceable model definitions and the tree algebra.

Heavy optional packages (onnx, onnxruntime, tensorrt, triton) are imported
lazily inside the functions that need them, never at package import.
"""

__version__ = "0.1.0"
