"""From checkpoints to an artifact folder: the traced graphs and their I/O specs (graphs), ONNX
export and its parity check (build), engine builds (engines), the folder's manifest (artifact)
and the Triton Inference Server model repository written from it (triton_repo)."""
