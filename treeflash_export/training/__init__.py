"""Drafter training (`treeflash-export train`). Imports run one way, from the bottom up:

config (TrainConfig, the source names and the mix parser) -> distributed, files, sources (where
prompts come from) -> data (the verifier's continuations) -> chat (instructions the verifier
writes) -> dataset (the splits of the mix, cached) -> loop (the loss and the training loop).
"""
