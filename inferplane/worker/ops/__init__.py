"""The ops wing, the worker's ground floor: one module per op, each choosing its backend once.

A model calls `ops.norm`, `ops.rope`, `ops.activation`, `ops.attention`, `ops.head`; each picks C
(`native/`), Triton (`gpu_kernels.py`, `gpu_attention.py`) or plain torch where it is built or first
called, so `model/` stays plain PyTorch and a new kernel touches only this folder. `kv_cache.py` is
the KV tensor store the attention reads and writes.
"""
