"""KV cache managers: which blocks a sequence owns, and (radix) which it can reuse (manager.py: the interface)."""
