"""The engine wing: what runs each step.

`engine.py` is the loop (intake, one step, outputs); `scheduler.py` (with `fair_share.py` and
`step_budget.py`) picks the step's work; `model_runner.py` turns it into one forward pass and samples
(`sampling.py`); `decode_graphs.py` captures CUDA graphs for decode; `runtimes.py` maps a runtime name
(`paged`, `radix`, `cpu-int8`) to its KV manager, scheduler and kernels. `kv/` keeps the KV blocks'
accounting. It calls down into `model/`, `quant/`, `lora/`, `structured/` and `ops/`, never up into
`serve/`.
"""
