"""The main training job (`python -m megatron_dsa.train`), by concern.

`config` (the job's YAML sections), `records` (per-step and evaluation statistics, `history.json`),
`batches` (corpus, seeded batches, micro-batch rows, CP shards), `steps` (model, optimizer, loss,
schedule, one optimizer step with its gradient reductions and clipping), `evaluation`, `resume`
(what a checkpoint holds besides the weights, and resuming from one), `plots`, `report` (log
lines) and `loop` (the launch check, process groups and the training loop). `megatron_dsa.train`
is the CLI; it re-exports the public names.
"""
