"""What `inferplane bench serve` sends: conversations of one or more chat turns, built for one run.

A conversation is the unit that arrives (by the Poisson schedule or as a concurrency slot frees up);
its later turns are sent as soon as the previous reply is in, carrying every earlier turn and the
reply the server actually gave (so the server sees a history it can find in its prefix cache).

Workloads:
- `random`: one user message of `input_len` words drawn at random (synthetic shapes, as vLLM's
  random dataset; words of the existing bench texts, most one token in a BPE vocabulary, so the
  prompt is about `input_len` tokens plus the chat template; the bench reports the server's own count);
- `shared-prefix`: a system prompt of `prefix_len` words every request of the run shares, then a
  distinct user message of `input_len` words (bench scenarios' agent shape);
- `multi-turn`: conversations of `turns` user messages of `input_len` words behind a shared system
  prompt of `prefix_len` words (bench scenarios' multi-turn shape);
- `spec-code`, `spec-rag`, `spec-agent`, `spec-chat`: bench spec's datasets (bench/spec_workloads.py).

Each run of a sweep gets its own texts (`variant`): a later run must not find its prompts in the
server's prefix cache because an earlier run sent them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from inferplane.bench import spec_workloads

SYNTHETIC = ("random", "shared-prefix", "multi-turn")
DATASETS = tuple(f"spec-{name}" for name in spec_workloads.WORKLOADS)
WORKLOADS = SYNTHETIC + DATASETS

# Words of the texts the other benches send: a vocabulary that is real English, not invented here.
_TEXTS = [*spec_workloads.DOCUMENTS, *spec_workloads.TOPICS, *spec_workloads.TICKET_TITLES]
WORDS = tuple(sorted({w.lower() for text in _TEXTS for w in re.findall(r"[A-Za-z]{3,}", text)}))


@dataclass(frozen=True)
class Conversation:
    """`turns[i]`: the messages turn i adds to the history (turn 0 may open with a system message)."""

    turns: tuple[tuple[dict, ...], ...]
    output_len: int


@dataclass(frozen=True)
class Shape:
    """The workload's settings, as given on the command line."""

    workload: str
    num_prompts: int
    input_len: int = 128
    output_len: int = 64
    prefix_len: int = 256
    turns: int = 3


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def check(shape: Shape) -> None:
    """Raises ValueError naming the setting that cannot make a workload (argparse prints it)."""
    if shape.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {shape.workload!r}")
    for name in ("num_prompts", "input_len", "output_len", "turns"):
        if getattr(shape, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(shape, name)}")
    if shape.prefix_len < 0:
        raise ValueError(f"--prefix-len must be at least 0, got {shape.prefix_len}")
    if shape.workload == "multi-turn" and shape.num_prompts % shape.turns:
        raise ValueError(f"--num-prompts ({shape.num_prompts}) must be a multiple of --turns ({shape.turns}) "
                         "for multi-turn: each conversation sends --turns requests")


def build(shape: Shape, seed: int, variant: int) -> list[Conversation]:
    """The conversations of one run: `num_prompts` requests in all; `variant` picks other texts."""
    rng = random.Random(f"{seed}:{variant}")
    n, out = shape.num_prompts, shape.output_len
    if shape.workload == "random":
        return [Conversation(((_user(words(rng, shape.input_len)),),), out) for _ in range(n)]
    if shape.workload == "shared-prefix":
        system = {"role": "system", "content": words(rng, shape.prefix_len)}
        return [Conversation(((system, _user(words(rng, shape.input_len))),), out) for _ in range(n)]
    if shape.workload == "multi-turn":
        system = ({"role": "system", "content": words(rng, shape.prefix_len)},) if shape.prefix_len else ()
        return [Conversation(tuple((*(system if t == 0 else ()), _user(words(rng, shape.input_len)))
                                   for t in range(shape.turns)), out)
                for _ in range(n // shape.turns)]
    dataset = shape.workload.removeprefix("spec-")
    return [Conversation((tuple(messages),), out)
            for messages in spec_workloads.requests(dataset, n, offset=variant * n)]


def transcript(messages: list[dict]) -> str:
    """A chat as one prompt for /v1/completions (no chat template there): what bench spec sends a
    model without a template."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


def _user(text: str) -> dict:
    return {"role": "user", "content": text}
