"""`treeflash-bench` (cli): model rows over checkpoints or artifacts, random-weight rows at real
shapes against the weight-reading floor (random_weights), and rows through a running Triton
server (server)."""
