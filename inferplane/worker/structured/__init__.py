"""Structured outputs: constraining sampling to a JSON schema, any JSON object, a regex or a choice.

One module per step a constraint goes through:

- `constraints.py`: what a request asks (`Constraint`), normalised and checked against the bounds
  (`GrammarLimits`, `LIMITS`) when the request is parsed; a bad one is a `GrammarError`.
- `compiler.py`: `GrammarCompiler` turns a constraint into an llguidance grammar, once per model
  and constraint (an LRU cache), off the engine's thread.
- `state.py`: each sequence's `GrammarState`, a copy of the compiled matcher that accepts its tokens.
- `masks.py`: `apply_masks` sets the logits of every token a state does not allow to -inf, for a
  whole batch at once, before the sampler runs.
- `json_guard.py`: what a grammar cannot say about JSON (no repeated key, no endless number),
  tracked per JSON sequence and cleared from its mask.

Callers import from the package: the names below are its surface.
"""

from inferplane.worker.structured.compiler import JSON_OPTIONS, GrammarCompiler
from inferplane.worker.structured.constraints import LIMITS, Constraint, GrammarError, GrammarLimits
from inferplane.worker.structured.masks import apply_masks, apply_token_bitmask_, bitmask_of, fill_bitmasks, new_bitmask
from inferplane.worker.structured.state import GrammarState

__all__ = [
    "JSON_OPTIONS",
    "LIMITS",
    "Constraint",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimits",
    "GrammarState",
    "apply_masks",
    "apply_token_bitmask_",
    "bitmask_of",
    "fill_bitmasks",
    "new_bitmask",
]
