"""`inferplane bench engine --structured`: what a JSON-schema constraint costs the engine.

The same chat prompts, SmolLM2-135M (fp32) on the CPU by default, run constrained (a 6-property
schema, llguidance masks every step) and unconstrained (free text, EOS ignored, each request
generating exactly as many tokens as its constrained twin did, so both runs do the same work),
interleaved round by round, best of the rounds; at batch 1 and batch 64. Throughput is generated
tokens over wall time. Goal (issue 17): the constraint costs under 10% at batch 64.
"""

from __future__ import annotations

import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "email": {"type": "string", "maxLength": 32},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "city", "email", "tags", "active"], "additionalProperties": False}
PROMPT = "Describe a fictional customer of a bakery as a JSON object."


def _run(llm, prompts: list[str], params) -> tuple[list[int], float]:
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return [len(o.token_ids) for o in outputs], time.perf_counter() - started


def run(model: str, *, device: str, batches: tuple[int, ...] = (1, 64), new_tokens: int = 96,
        rounds: int = 2) -> list[dict]:
    from inferplane import LLM, SamplingParams
    from inferplane.worker.structured import Constraint

    llm = LLM(model, device=device, dtype="float32", max_num_seqs=max(batches))
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    constraint = Constraint("json_schema", SCHEMA)
    rows = []
    for batch in batches:
        prompts = [chat] * batch
        best: dict[str, float] = {}
        constrained = SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=1, constraint=constraint)
        for _ in range(rounds):
            lengths, elapsed = _run(llm, prompts, constrained)
            best["constrained"] = max(best.get("constrained", 0.0), sum(lengths) / elapsed)
            free = [SamplingParams(max_tokens=max(1, n), temperature=0.8, seed=1, ignore_eos=True) for n in lengths]
            done, elapsed = _run(llm, prompts, free)
            best["free"] = max(best.get("free", 0.0), sum(done) / elapsed)
        rows.append({"batch": batch, **best, "cost": 1 - best["constrained"] / best["free"]})
        print(f"batch {batch:>3}: free {best['free']:8.1f} tokens/s, json_schema {best['constrained']:8.1f} tokens/s, "
              f"constraint costs {rows[-1]['cost'] * 100:5.1f}%", flush=True)
    return rows
