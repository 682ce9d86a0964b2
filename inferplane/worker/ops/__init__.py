"""The ops wing, the worker's ground floor: one module per op, each choosing its backend once.

A model calls `norm.py` (RMSNorm, with the residual add), `rope.py` (the rotation with the KV write),
`activation.py` (the gated MLP's act(gate) * up), `attention.py` (over the paged cache), `router.py`
(a MoE router's top-k), `head.py` (the output head's kernel) and, for cpu-int8 decode steps,
`fused_decode.py` (every layer in one C call). Each picks C (`native/`), Triton (`gpu_kernels.py`,
`gpu_attention.py`) or plain torch once, where it first meets a device and dtype, so `model/` stays
plain PyTorch and a new kernel touches only this folder. `kv_cache.py` is the KV tensor store the
attention reads and writes; `structure.py` the version that tells the C plans' pointers are stale.
"""
