"""Grammar engines for structured outputs, measured on SmolLM2's tokenizer (49,152 tokens):
xgrammar against llguidance, the two engines vLLM and SGLang constrain sampling with.

For each engine: the time to build its tokenizer index (once per model), to compile a 10-property
JSON schema (nested object, arrays, an enum, numbers, strings; once per distinct schema), to start
a request's matcher from the compiled grammar, and the per-step mask cost at batch 1 and 64. One
step is what a constrained decode step costs the worker: fill one bitmask for the batch (the
engine's batched, multi-threaded call), apply it to a [B, V] float32 logits tensor, and accept the
chosen token (the engine's batched call). Sequences advance token by token through valid JSON
documents (then EOS), leaving the batch as their document ends, as in a running batch.

The bitmask format is the same for both engines (int32 words, bit j of word w = token 32w+j), so
both are applied with the same vectorised torch function (`structured.apply_token_bitmask_`); the
apply column is the same cost measured twice, and xgrammar's own C++ CPU kernel is timed on the
side. Every step is also checked (untimed): the document's token is allowed, no special token but
EOS ever is, each accept succeeds and each sequence ends complete. A probe then asks what each
engine admits inside a JSON string, plain and with maxLength: escapes (refusing one only narrows
what a model may write) and raw control characters (admitting one is invalid JSON). An engine that
fails a check is reported as failing, whatever its speed, and the choice printed last is the lowest
fill + accept cost at the largest batch among the engines that pass.

The engines take turns, one full pass each per round, and each keeps its fastest pass: on a shared
machine whose speed drifts over minutes, measuring one after the other would let the drift decide.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import time
from dataclasses import dataclass, field

SCHEMA: dict = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "history": {"type": "array", "items": {"type": "number"}},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "email", "active", "score", "role", "tags", "address", "history", "notes"],
    "additionalProperties": False,
}

_WORDS = ["alpha", "beta", "gamma", "delta", "Zürich", "naïve", "x", "Ωmega"]
# Escapes only where both engines allow them (see _ESCAPE_PROBES): not in length-limited strings.
_ESCAPED = ["quote\"d", "back\\slash", "tab\there", "line\nbreak", "ctrl\u0001"]


def documents(count: int, seed: int = 0) -> list[str]:
    """Valid instances of SCHEMA, varied (lengths, escapes, non-ASCII) so the sequences of a batch
    sit at different places in the grammar at each step."""
    rng = random.Random(seed)
    docs = []
    for i in range(count):
        doc = {
            "id": rng.randrange(10**6),
            "name": " ".join(rng.choices(_WORDS, k=rng.randint(1, 3)))[:40],
            "email": f"{rng.choice(['ann', 'bob', 'eve'])}@{rng.choice(['example', 'mail'])}.com",
            "active": rng.random() < 0.5,
            "score": round(rng.uniform(0, 100), rng.randint(0, 3)),
            "role": rng.choice(["admin", "editor", "viewer", "guest"]),
            "tags": [rng.choice(_WORDS)[:12] for _ in range(rng.randint(1, 5))],
            "address": {"street": f"{rng.randint(1, 999)} {rng.choice(_ESCAPED)} St", "city": rng.choice(_WORDS),
                        "zip": f"0{i:04d}"},
            "history": [round(rng.uniform(-1e3, 1e3), 2) for _ in range(rng.randint(0, 4))],
            "notes": None if rng.random() < 0.3 else rng.choice(_WORDS + _ESCAPED),
        }
        docs.append(json.dumps(doc, ensure_ascii=False, indent=None if i % 3 else 1))
    return docs


def smollm2_tokenizer():
    """(TextTokenizer, the model's vocab size) for SmolLM2-135M, read from its GGUF as the worker does."""
    from inferplane.api.model_config import config_from_gguf
    from inferplane.api.model_resolution import builtin_model_path
    from inferplane.worker.model.gguf_file import open_gguf
    from inferplane.worker.model.tokenizer import load_gguf_tokenizer

    reader = open_gguf(str(builtin_model_path("smollm2-135m")))
    return load_gguf_tokenizer(reader), config_from_gguf(reader).vocab_size


# --- the engines, behind one small interface -------------------------------------------------------
# Both compile JSON the way inferplane.worker.structured does: at most 24 whitespace characters
# between tokens; the bench schema forbids additional properties, so xgrammar's strict mode and
# llguidance's JSON-Schema semantics agree on it.


class _LLGuidance:
    name = "llguidance"
    module = "llguidance"

    def __init__(self, text_tokenizer, vocab_size: int, eos: list[int], threads: int) -> None:
        import llguidance  # not llguidance.torch: it runs torch.compile machinery at import

        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(text_tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        from inferplane.worker.structured import JSON_OPTIONS

        grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def new_matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self._executor.consume_token_par(list(zip(matchers, tokens, strict=True)))

    def done(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()


class _XGrammar:
    name = "xgrammar"
    module = "xgrammar"

    def __init__(self, text_tokenizer, vocab_size: int, eos: list[int], threads: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.tokenizer = xgrammar_tokenizer_info(text_tokenizer, vocab_size, eos)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        compiler = self._xgr.GrammarCompiler(self.tokenizer, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=24)

    def new_matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self._xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


def xgrammar_tokenizer_info(text_tokenizer, vocab_size: int, eos: list[int]):
    """xgrammar's TokenizerInfo from a `tokenizers.Tokenizer`, without the transformers tokenizer
    `TokenizerInfo.from_huggingface` wants (xgrammar imports transformers anyway). Special tokens get
    "", which xgrammar never allows as text: given "<|im_start|>", it allows it inside a JSON string."""
    import xgrammar

    tok = text_tokenizer.tokenizer
    encoded = [""] * vocab_size
    for text, token_id in tok.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in text_tokenizer.special_ids:
            encoded[token_id] = text
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=eos,
                                  add_prefix_space=meta["add_prefix_space"])


ENGINES = {"llguidance": _LLGuidance, "xgrammar": _XGrammar}


# --- measuring ---------------------------------------------------------------------------------------


@dataclass
class StepCost:
    """Seconds spent per phase over one pass, and the (sequence, step) pairs it covered."""

    fill: float = 0.0
    apply: float = 0.0
    accept: float = 0.0
    seq_steps: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.fill + self.apply + self.accept

    def per_seq_step_us(self, seconds: float) -> float:
        return seconds * 1e6 / max(self.seq_steps, 1)


class _Checker:
    """The untimed checks of one step: the document's token allowed, no special token but EOS."""

    def __init__(self, special_ids: set[int], eos: list[int], vocab_size: int) -> None:
        from inferplane.worker.structured import bitmask_of

        self._forbidden = bitmask_of(sorted(set(special_ids) - set(eos)), vocab_size)

    def check(self, bitmask, tokens: list[int], cost: StepCost, engine: str) -> None:
        rows = bitmask[: len(tokens)]
        if (rows & self._forbidden).any():
            cost.errors.append(f"{engine}: a special token other than EOS is allowed")
        for i, token in enumerate(tokens):
            if not (int(rows[i, token >> 5]) >> (token & 31)) & 1:
                cost.errors.append(f"{engine}: token {token} of a valid document is masked")
                return


def _one_pass(engine, compiled, streams: list[list[int]], vocab_size: int, checker: _Checker) -> StepCost:
    """Advances len(streams) sequences through their token streams, batched, timing each phase."""
    import torch

    from inferplane.worker.structured import apply_token_bitmask_, new_bitmask

    cost = StepCost()
    matchers = [engine.new_matcher(compiled) for _ in streams]
    active = list(range(len(streams)))
    bitmask = new_bitmask(len(streams), vocab_size)
    logits = torch.zeros(len(streams), vocab_size)
    step = 0
    while active:
        batch = [matchers[i] for i in active]
        tokens = [streams[i][step] for i in active]
        b = len(active)
        start = time.perf_counter()
        engine.fill(batch, bitmask[:b])
        middle = time.perf_counter()
        apply_token_bitmask_(logits[:b], bitmask[:b])
        cost.fill += middle - start
        cost.apply += time.perf_counter() - middle
        checker.check(bitmask, tokens, cost, engine.name)
        start = time.perf_counter()
        accepted = engine.accept(batch, tokens)
        cost.accept += time.perf_counter() - start
        if not all(accepted):
            cost.errors.append(f"{engine.name}: a valid token was refused")
        cost.seq_steps += b
        step += 1
        logits[:b].zero_()
        ended = [i for i in active if step == len(streams[i])]
        if any(not engine.done(matchers[i]) for i in ended):
            cost.errors.append(f"{engine.name}: a complete document did not end the grammar")
        active = [i for i in active if step < len(streams[i])]
    return cost


def _best(costs: list[StepCost]) -> StepCost:
    best = min(costs, key=lambda c: c.total)
    best.errors = sorted({e for c in costs for e in c.errors})
    return best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _xgrammar_apply_us(vocab_size: int, batch: int, repeats: int) -> float:
    """xgrammar's C++ CPU kernel on a half-allowed mask, µs per row (the side measurement)."""
    import torch
    import xgrammar

    bitmask = torch.full((batch, (vocab_size + 31) // 32), 0x55555555, dtype=torch.int32)
    logits = torch.zeros(batch, vocab_size)
    best = min(_timed(lambda: xgrammar.apply_token_bitmask_inplace(logits, bitmask)) for _ in range(repeats * 5))
    return best * 1e6 / batch


def run(batch_sizes: tuple[int, ...] = (1, 64), repeats: int = 3, threads: int | None = None,
        engines: tuple[str, ...] = ("llguidance", "xgrammar"), docs: int = 16) -> dict:
    """Measures the engines and prints the tables; returns {engine: {metric: value}} with the
    choice under "chosen"."""
    import torch

    threads = threads or len(os.sched_getaffinity(0))
    text_tokenizer, vocab_size = smollm2_tokenizer()
    eos = [text_tokenizer.eos_token_id]
    texts = documents(docs)
    streams = [text_tokenizer.tokenizer.encode(t, add_special_tokens=False).ids + eos for t in texts]
    checker = _Checker(text_tokenizer.special_ids, eos, vocab_size)
    print(f"SmolLM2 tokenizer: {vocab_size} tokens; {docs} documents of {min(map(len, streams))}-"
          f"{max(map(len, streams))} tokens; {threads} engine threads, {torch.get_num_threads()} torch threads")

    built, results = {}, {}
    for name in engines:
        cls = ENGINES[name]
        results[name] = {"import_ms": _timed(lambda m=cls.module: importlib.import_module(m)) * 1e3}
        results[name]["tokenizer_ms"] = _timed(
            lambda n=name, c=cls: built.__setitem__(n, c(text_tokenizer, vocab_size, eos, threads))) * 1e3
    _measure_compile(built, results, repeats)
    _measure_steps(built, results, streams, batch_sizes, repeats, vocab_size, checker)
    probes = _probe_strings(built, text_tokenizer)
    for name, rows in probes.items():
        for variant, row in rows.items():
            results[name]["errors"] += [f"admits {label} in a {variant} string (invalid JSON)"
                                        for label, ok in row.items() if ok and label.startswith("raw")]
    _print(results, batch_sizes)
    _print_probes(probes)
    if "xgrammar" in engines:
        for b in batch_sizes:
            print(f"side measurement: xgrammar's C++ CPU apply kernel at batch {b}: "
                  f"{_xgrammar_apply_us(vocab_size, b, repeats):.1f} µs per sequence")
    results["chosen"] = _choose(results, max(batch_sizes))
    print(f"\nchosen: {results['chosen']} (lowest fill + accept at batch {max(batch_sizes)} among engines "
          f"with no correctness failure)")
    return results


def _choose(results: dict, batch: int) -> str | None:
    ok = {n: r[batch]["fill_us"] + r[batch]["accept_us"] for n, r in results.items()
          if not r["errors"] and not r[batch]["errors"] and not any(r[b]["errors"] for b in r if isinstance(b, int))}
    return min(ok, key=ok.get) if ok else None


def _measure_compile(built: dict, results: dict, repeats: int) -> None:
    """Compile (schema → grammar ready for matchers) and start (a matcher and its first mask), best of N."""
    from inferplane.worker.structured import new_bitmask

    for _ in range(repeats):
        for name, engine in built.items():
            row = results[name]
            row.setdefault("errors", [])
            start = time.perf_counter()
            compiled = engine.compile(SCHEMA)
            row["compile_ms"] = min(row.get("compile_ms", 1e9), (time.perf_counter() - start) * 1e3)
            bitmask = new_bitmask(1, engine.tokenizer.vocab_size)
            first = _timed(lambda e=engine, c=compiled, m=bitmask: e.fill([e.new_matcher(c)], m))
            row["first_mask_ms"] = min(row.get("first_mask_ms", 1e9), first * 1e3)
            row["_compiled"] = compiled


# What a JSON string may contain, as JSON text: escapes (valid JSON; "no" only narrows what a model
# may write) and raw control characters (invalid JSON: "yes" is a correctness failure).
_STRING_PROBES = {"\\\"": 'q\\"x', "\\t": "t\\tx", "\\u0001": "c\\u0001", "\\u00ef": "na\\u00efve",
                  "raw \\x00": "a\x00", "raw \\x10": "a\x10", "raw \\t": "a\tb"}


def _probe_strings(built: dict, text_tokenizer) -> dict[str, dict[str, dict[str, bool]]]:
    """{engine: {"plain" | "maxLength": {probe: admitted}}}: the JSON strings each engine admits."""
    out: dict = {}
    for name, engine in built.items():
        for variant, prop in (("plain", {"type": "string"}), ("maxLength", {"type": "string", "maxLength": 20})):
            compiled = engine.compile({"type": "object", "properties": {"a": prop}, "required": ["a"]})
            row = out.setdefault(name, {}).setdefault(variant, {})
            for label, body in _STRING_PROBES.items():
                ids = text_tokenizer.tokenizer.encode(f'{{"a": "{body}"}}', add_special_tokens=False).ids
                matcher = engine.new_matcher(compiled)
                row[label] = all(engine.accept([matcher], [t])[0] for t in ids)
    return out


def _measure_steps(built, results, streams, batch_sizes, repeats, vocab_size, checker) -> None:
    for batch in batch_sizes:
        picked = [streams[i % len(streams)] for i in range(batch)]
        passes: dict[str, list[StepCost]] = {name: [] for name in built}
        for _ in range(repeats):
            for name, engine in built.items():
                if batch == 1:  # one pass per document, so batch 1 sees as many documents as batch 64
                    costs = [_one_pass(engine, results[name]["_compiled"], [s], vocab_size, checker)
                             for s in streams]
                    passes[name].append(_sum(costs))
                else:
                    passes[name].append(_one_pass(engine, results[name]["_compiled"], picked, vocab_size, checker))
        for name in built:
            best = _best(passes[name])
            results[name][batch] = {
                "fill_us": best.per_seq_step_us(best.fill),
                "apply_us": best.per_seq_step_us(best.apply),
                "accept_us": best.per_seq_step_us(best.accept),
                "total_us": best.per_seq_step_us(best.total),
                "errors": best.errors,
            }


def _sum(costs: list[StepCost]) -> StepCost:
    out = StepCost()
    for c in costs:
        out.fill += c.fill
        out.apply += c.apply
        out.accept += c.accept
        out.seq_steps += c.seq_steps
        out.errors += c.errors
    return out


def _print(results: dict, batch_sizes: tuple[int, ...]) -> None:
    print(f"\n{'engine':<11} {'import ms':>9} {'tokenizer ms':>12} {'compile ms':>10} {'first mask ms':>13}")
    for name, row in results.items():
        print(f"{name:<11} {row['import_ms']:>9.0f} {row['tokenizer_ms']:>12.0f} {row['compile_ms']:>10.1f} "
              f"{row['first_mask_ms']:>13.2f}")
    print(f"\nµs per step per sequence (engine = fill + accept; total adds the apply, the same code for both)\n"
          f"{'engine':<11} {'batch':>5} {'fill':>8} {'apply':>8} {'accept':>8} {'engine':>8} {'total':>8}  correct")
    for batch in batch_sizes:
        for name, row in results.items():
            r = row[batch]
            errors = r["errors"] + row["errors"]
            verdict = "yes" if not errors else "NO: " + "; ".join(errors[:3])
            print(f"{name:<11} {batch:>5} {r['fill_us']:>8.1f} {r['apply_us']:>8.1f} {r['accept_us']:>8.1f} "
                  f"{r['fill_us'] + r['accept_us']:>8.1f} {r['total_us']:>8.1f}  {verdict}")


def _print_probes(probes: dict) -> None:
    print("\nadmitted inside a JSON string (escapes: 'no' narrows the output; raw controls: 'yes' is invalid JSON)")
    print(f"{'':<22}" + "".join(f"{label:>9}" for label in _STRING_PROBES))
    for name, rows in probes.items():
        for variant, row in rows.items():
            print(f"{name + ' (' + variant + ')':<22}" + "".join(f"{'yes' if ok else 'no':>9}" for ok in row.values()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m inferplane.bench.grammar", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated (default 1,64)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each engine keeps its fastest pass")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: the CPUs we may use)")
    p.add_argument("--engines", default="llguidance,xgrammar")
    p.add_argument("--docs", type=int, default=16, help="distinct JSON documents the sequences follow")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(tuple(int(b) for b in args.batch_sizes.split(",")), args.repeats, args.threads,
        tuple(args.engines.split(",")), args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
