"""The engine wing: what runs each step.

`engine.py` is the loop: it takes requests in (`intake.py` checks them and makes their sequences),
steps (the scheduler plans, the model runner runs, `outputs.py` appends the sampled tokens) and
reports (`stats.py`). `pool_sizing.py` decides how many KV blocks the memory budget buys;
`scheduler.py` (with `fair_share.py`, `step_budget.py` and, for the radix runtime,
`radix_scheduler.py`) picks each step's work, `decode_bursts.py` how many decode steps it runs in
one call; `model_runner.py` turns it into one forward pass and samples (`sampling.py`);
`decode_graphs.py` captures CUDA graphs for decode; `runtimes.py` maps a runtime name (`paged`,
`radix`, `cpu-int8`) to its KV manager, scheduler and kernels. `kv/` keeps the KV blocks'
accounting behind one interface (`kv/manager.py`). It calls down into `model/`, `quant/`, `lora/`,
`structured/` and `ops/`, never up into `serve/`.
"""
