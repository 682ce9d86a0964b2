"""`inferplane bench fairness`'s LoRA cases (issue 53, classes 1 and 2): a flooding tenant's
hostile adapters beside an interactive tenant that uses an adapter of its own and the base.

Class 1 (`adapter-poison`): adapters whose values are not finite (a NaN lora_B, one NaN element,
an +inf lora_A, a -inf element, lora_alpha Infinity, an alpha_pattern value NaN) once registered
as verified, and after one had been in a slot, other rows of the same step came back empty or as
500s. Class 2 (`adapter-patterns`): adapter_config.json's `alpha_pattern` / `rank_pattern` keys are
regular expressions matched against module names; under a backtracking matcher one with nested
quantifiers held the interpreter lock for seconds, at registration (the gateway) and at first use
(the worker), so every other tenant's stream stalled with it.

In each case the flooding tenant keeps `copies` chats running on its own valid adapter and, one at
a time in a loop, tries to register hostile adapters through the admin API: first with its own
tenant admin key (a tenant admin may register aliases only, so a folder is expected to be refused
with a 403), then through the platform path, with the bootstrap key, named `flood-...` (the
adapter would be public: the admin API records a platform admin's adapters as the platform's, so
the flooding tenant is the author only by name). An adapter that is accepted is used by the flood's
chats from then on. Meanwhile the interactive tenant sends greedy streamed chats one at a time,
alternating its adapter and the base; besides the TTFT and `/healthz` figures, every answer is
held to the one the same request got alone (the isolation figure: a poisoned slot used to turn
other rows' answers into nothing).

Only the standard library runs in the flood's process (adapters are written from templates the
main process made), so its own work stays small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from inferplane.api.lora_manifest import ATTENTION_MODULES, CONFIG_FILE, WEIGHTS_FILE
from inferplane.bench.fairness_harness import CHAT, FloodProcess, Health, Probe, Tenants, poll_health, row

ADAPTER_CASES = ("adapter-poison", "adapter-patterns")  # the cases this module runs

RANK = 8
MAX_LORAS = 4  # slots: the two tenants' own adapters and what the flood gets registered
TARGETS = list(ATTENTION_MODULES)
ANSWER_TOKENS = 12  # the interactive tenant's greedy answers: long enough to differ where a row is hit
FLOOD_MAX_TOKENS = 32
OWN = {"interactive": "interactive-bot", "flood": "flood-bot"}  # each tenant's private adapter
TENANT_ADMIN, PLATFORM = "tenant admin", "platform"

# Class 1: what each poisoned adapter holds (see `write_poisoned_adapter`).
POISONS = ("nan-lora_B", "one-nan-lora_B", "inf-lora_A", "neg-inf-lora_B", "alpha-Infinity",
           "alpha_pattern-NaN")

# Class 2. Under Python's backtracking `re` (the matcher before issue 53), `NESTED` failing against
# the tiny model's module names ("model.layers.0.self_attn.q_proj") took ~0.3 s per name here, 2.7 s
# for the adapter's 8 modules, with the lock held; each character fewer before the group doubles it
# (without the prefix: 2^31 steps per name, minutes). Kept this size so the bench stays bounded
# even where a backtracking matcher still runs it.
NESTED = r"model\.lay(?:[a-z_.0-9]+)+!"
NESTED_ALTERNATION = r"model\.laye(?:[a-z_.0-9]|[a-z_.0-9])+!"


def pattern_variants() -> dict[str, list[str]]:
    """Variant -> the keys its adapter_config.json gives both `alpha_pattern` and `rank_pattern`."""
    return {
        "nested-plus": ["(a+)+$"],
        "nested-classes": [NESTED],
        "nested-alternation": [NESTED_ALTERNATION],
        "huge-alternation": ["(?:" + "|".join(f"module_{i}" for i in range(20_000)) + ")"],
        "long-pattern": ["a" * 100_000],
        "many-patterns": [f"p{i}_proj" for i in range(5_000)],
        "counted-repetition": ["((a{100}){100}){100}"],
        "backreference": [r"(\w+)\1+!"],
    }


def _config(alpha: float = 2 * RANK, **extra) -> dict:
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": alpha, "target_modules": TARGETS, "bias": "none", **extra}


def write_valid_adapter(folder: Path, config, seed: int) -> Path:
    """A random rank-8 adapter on the attention projections, strong enough (B's entries ~0.5) to
    change the tiny model's greedy answers."""
    from inferplane.bench.lora import write_random_adapter

    return write_random_adapter(folder, config, RANK, TARGETS, seed=seed, b_scale=0.5)


def write_poisoned_adapter(folder: Path, config, poison: str, seed: int = 7) -> Path:
    """A valid adapter with one poison of `POISONS`: a whole lora_B NaN, one NaN element of a
    lora_B, a whole lora_A +inf, one -inf element of a lora_B, lora_alpha Infinity (JSON's
    `Infinity`, which Python's json reads), or an alpha_pattern value NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    if poison not in POISONS:
        raise ValueError(f"unknown poison {poison!r}; known: {', '.join(POISONS)}")
    write_valid_adapter(folder, config, seed)
    if poison.startswith("alpha"):
        settings = _config(alpha=float("inf")) if poison == "alpha-Infinity" else \
            _config(alpha_pattern={"q_proj": float("nan")})
        (folder / CONFIG_FILE).write_text(json.dumps(settings))  # allow_nan: writes Infinity / NaN
        return folder
    tensors = load_file(str(folder / WEIGHTS_FILE))
    prefix = "base_model.model.model.layers.{}.self_attn.{}"
    if poison == "nan-lora_B":
        tensors[prefix.format(0, "q_proj") + ".lora_B.weight"].fill_(float("nan"))
    elif poison == "one-nan-lora_B":
        tensors[prefix.format(config.num_layers - 1, "v_proj") + ".lora_B.weight"][1, 2] = float("nan")
    elif poison == "inf-lora_A":
        tensors[prefix.format(0, "o_proj") + ".lora_A.weight"].fill_(float("inf"))
    else:  # neg-inf-lora_B
        tensors[prefix.format(0, "k_proj") + ".lora_B.weight"][0, 0] = float("-inf")
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / WEIGHTS_FILE))
    assert not all(bool(torch.isfinite(t).all()) for t in tensors.values())
    return folder


def write_pattern_adapter(folder: Path, template: Path, keys: list[str], nonce: str) -> Path:
    """The template's weights with a config whose alpha_pattern and rank_pattern have `keys` (the
    values change nothing: the template's alpha and rank); `nonce` (PEFT's `revision`) makes each
    copy's digest its own, so a worker reads and matches each anew, as at a first use."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template / WEIGHTS_FILE, folder / WEIGHTS_FILE)
    settings = _config(alpha_pattern={k: float(2 * RANK) for k in keys}, rank_pattern={k: RANK for k in keys},
                       revision=nonce)
    (folder / CONFIG_FILE).write_text(json.dumps(settings))
    return folder


@dataclass
class AdapterSetup:
    """The files and keys the adapter cases need; `root` is the gateway's model root."""

    root: Path
    model_dir: str
    own: dict[str, Path] = field(default_factory=dict)  # tenant -> its adapter's folder
    poisoned: dict[str, Path] = field(default_factory=dict)  # poison -> folder
    template: Path | None = None  # the weights the pattern adapters copy
    admin_keys: dict[str, str] = field(default_factory=dict)  # tenant -> its tenant admin's key
    platform_key: str = ""

    @classmethod
    def prepare(cls, root: Path, model_dir: str) -> AdapterSetup:
        from inferplane.api.model_config import read_model_config

        config = read_model_config(model_dir)
        root.mkdir(parents=True, exist_ok=True)
        setup = cls(root=root.resolve(), model_dir=model_dir)
        setup.own = {tenant: write_valid_adapter(setup.root / name, config, seed)
                     for seed, (tenant, name) in enumerate(OWN.items(), start=1)}
        setup.poisoned = {p: write_poisoned_adapter(setup.root / "poisoned" / p, config, p) for p in POISONS}
        setup.template = write_valid_adapter(setup.root / "pattern-template", config, seed=9)
        return setup

    @staticmethod
    def worker_args() -> tuple[str, ...]:
        return ("--max-loras", str(MAX_LORAS), "--max-lora-rank", str(RANK))

    def gateway_args(self) -> tuple[str, ...]:
        own = [arg for tenant, folder in self.own.items() for arg in ("--adapter", f"{tenant}={OWN[tenant]}={folder}")]
        return ("--bootstrap-admin", "--tenant-admin", "flood", "--model-root", str(self.root),
                "--register-base", self.model_dir, *own)

    def with_keys(self, gateway) -> AdapterSetup:
        self.admin_keys, self.platform_key = dict(gateway.admin_keys), gateway.admin_key
        return self


# -- the flood (a process of its own) ---------------------------------------------------------------


@dataclass(frozen=True)
class AdapterFlood:
    """What the flooding tenant does in one case (picklable: it crosses to the flood's process)."""

    case: str
    base: str
    copies: int
    tenant_admin_key: str
    platform_key: str
    attempts: tuple[tuple[str, str], ...] = ()  # adapter-poison: (poison, folder), registered in turn
    template: str = ""  # adapter-patterns: weights copied into a new folder per attempt
    pattern_root: str = ""


@dataclass
class FloodReport:
    registrations: dict[str, dict[str, Counter]] = field(default_factory=dict)  # label -> credential -> status
    registration_ms: dict[str, list[float]] = field(default_factory=dict)  # label -> the platform's times
    chats: dict[str, Counter] = field(default_factory=dict)  # model -> status
    accepted: list[str] = field(default_factory=list)  # names registered (then used by the chats)


def _flood_attempts(flood: AdapterFlood):
    """Endless (label, folder) pairs: the poisoned folders in turn, or a new pattern adapter each."""
    variants = list(pattern_variants().items())
    n = 0
    while True:
        if flood.attempts:
            yield flood.attempts[n % len(flood.attempts)]
        else:
            label, keys = variants[n % len(variants)]
            folder = Path(flood.pattern_root) / f"{label}-{n}"
            yield label, str(write_pattern_adapter(folder, Path(flood.template), keys, f"flood-{n}"))
        n += 1


async def _adapter_flood(t: Tenants, flood: AdapterFlood, stop, report: FloodReport) -> None:
    models = [OWN["flood"]]
    limits = httpx.Limits(max_connections=flood.copies + 4, max_keepalive_connections=flood.copies + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def register() -> None:
            for label, folder in _flood_attempts(flood):
                if stop.is_set():
                    return
                seen = report.registrations.setdefault(label, {TENANT_ADMIN: Counter(), PLATFORM: Counter()})
                name = f"flood-{label}".replace("_", "-").lower()
                body = {"source": folder, "base": flood.base, "name": name}
                for who, key in ((TENANT_ADMIN, flood.tenant_admin_key), (PLATFORM, flood.platform_key)):
                    started = time.perf_counter()
                    try:
                        response = await client.post(f"{t.base_url}/admin/v1/adapters", json=body,
                                                     headers={"Authorization": f"Bearer {key}"})
                        status: int | str = response.status_code
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    seen[who][status] += 1
                    if who == PLATFORM:
                        report.registration_ms.setdefault(label, []).append((time.perf_counter() - started) * 1000)
                    if status == 201 and name not in models:
                        models.append(name)
                        report.accepted.append(name)

        async def chat(i: int) -> None:
            n = i
            while not stop.is_set():
                model = models[n % len(models)]
                n += 1
                body = {"model": model, "messages": CHAT, "max_tokens": FLOOD_MAX_TOKENS, "temperature": 0}
                try:
                    response = await client.post(f"{t.base_url}/v1/chat/completions", json=body,
                                                 headers=t.headers("flood"))
                    status: int | str = response.status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                    await asyncio.sleep(0.05)
                report.chats.setdefault(model, Counter())[status] += 1

        tasks = [asyncio.create_task(register())] + [asyncio.create_task(chat(i)) for i in range(flood.copies)]
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()  # a cancelled request disconnects
        await asyncio.gather(*tasks, return_exceptions=True)


def _adapter_flood_process(t: Tenants, flood: AdapterFlood, stop, results) -> None:
    report = FloodReport()
    asyncio.run(_adapter_flood(t, flood, stop, report))
    results.put(report)


# -- the interactive tenant -------------------------------------------------------------------------


@dataclass
class Answers:
    """The interactive tenant's chats: TTFT over all, and each model's answers in order."""

    probe: Probe = field(default_factory=Probe)
    texts: dict[str, list[str]] = field(default_factory=dict)

    def mismatches(self, reference: dict[str, str]) -> dict[str, int]:
        return {model: sum(text != reference.get(model) for text in texts) for model, texts in self.texts.items()}

    def first_differing(self, reference: dict[str, str]) -> dict[str, str]:
        """Per model, the first answer that differs from its reference ("<error>": the request failed)."""
        return {model: next(t for t in texts if t != reference.get(model))
                for model, texts in self.texts.items() if any(t != reference.get(model) for t in texts)}


async def _answer(client: httpx.AsyncClient, t: Tenants, model: str) -> tuple[float, str]:
    """(ms to the first content chunk, the whole greedy answer) of one streamed chat."""
    body = {"model": model, "messages": CHAT, "max_tokens": ANSWER_TOKENS, "stream": True, "temperature": 0}
    start, first, parts = time.perf_counter(), None, []
    async with client.stream("POST", f"{t.base_url}/v1/chat/completions", json=body,
                             headers=t.headers("interactive")) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"probe: HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"probe: error in the stream: {chunk['error']}")
            text = "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
            if text and first is None:
                first = (time.perf_counter() - start) * 1000
            parts.append(text)
    if first is None:
        raise RuntimeError("probe: the stream had no content")
    return first, "".join(parts)


async def probe_answers(t: Tenants, models: list[str], samples: int) -> Answers:
    """`samples` chats per model, one at a time, the models alternating."""
    result = Answers(texts={m: [] for m in models})
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(samples * len(models)):
            model = models[i % len(models)]
            try:
                ttft, text = await _answer(client, t, model)
            except Exception:  # noqa: BLE001 - counted and shown, never hidden
                result.probe.errors += 1
                result.texts[model].append("<error>")
                continue
            result.probe.ttft_ms.append(ttft)
            result.texts[model].append(text)
    return result


async def _measure(t: Tenants, models: list[str], samples: int, flood: AdapterFlood | None,
                   warmup_s: float) -> tuple[Answers, Health, FloodReport | None]:
    stop, health = asyncio.Event(), Health()
    poller = asyncio.create_task(poll_health(t.base_url, stop, health))
    flooding = FloodProcess(t, flood, _adapter_flood_process) if flood is not None else None
    if flooding is not None:
        await asyncio.sleep(warmup_s)
    answers = await probe_answers(t, models, samples)
    stop.set()
    report = await flooding.stop() if flooding is not None else None
    await poller
    return answers, health, report


def case_flood(case: str, setup: AdapterSetup, copies: int, base: str) -> AdapterFlood:
    common = dict(case=case, base=base, copies=copies, tenant_admin_key=setup.admin_keys.get("flood", ""),
                  platform_key=setup.platform_key)
    if case == "adapter-poison":
        return AdapterFlood(**common, attempts=tuple((p, str(f)) for p, f in setup.poisoned.items()))
    if case == "adapter-patterns":
        assert setup.template is not None
        return AdapterFlood(**common, template=str(setup.template), pattern_root=str(setup.root / "patterns"))
    raise ValueError(f"unknown adapter case {case!r}; known: {', '.join(ADAPTER_CASES)}")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report_lines(report: FloodReport) -> list[str]:
    def counts(c: Counter) -> str:
        return " ".join(f"{status}x{n}" for status, n in sorted(c.items(), key=str)) or "-"

    lines = ["      registrations (tenant admin | platform, platform ms p50/max):"]
    for label, by in report.registrations.items():
        ms = report.registration_ms.get(label, [])
        lines.append(f"        {label:<20} {counts(by[TENANT_ADMIN]):<10} | {counts(by[PLATFORM]):<12} "
                     f"{_pct(ms, 0.5):7.1f}/{max(ms, default=float('nan')):7.1f} ms")
    lines.append("      flood chats: " + "; ".join(f"{m} {counts(c)}" for m, c in report.chats.items()))
    if report.accepted:
        lines.append("      registered (and used by the flood): " + ", ".join(report.accepted))
    return lines


async def run_cases(args: argparse.Namespace, t: Tenants, setup: AdapterSetup, cases: list[str],
                    results: dict) -> None:
    """The adapter cases: prints a row per case (as fairness.run does) plus the registration answers,
    the flood's chats and the interactive answers that differ from alone; adds the figures to
    `results` (fairness.run's: "adapters_alone", and each case under "cases")."""
    models = [t.model, OWN["interactive"]]
    await probe_answers(t, models, 2)  # warm-up: the interactive adapter read into a slot
    alone, health, _ = await _measure(t, models, args.samples, None, 0)
    reference = {m: Counter(texts).most_common(1)[0][0] for m, texts in alone.texts.items()}
    print(f"\nadapters: the interactive tenant alternates the base and its adapter ({OWN['interactive']}), "
          f"greedy, max_tokens {ANSWER_TOKENS}; {MAX_LORAS} slots, rank {RANK}", flush=True)
    print(row("adapters alone", alone.probe, health, alone.probe.pct(0.99)), flush=True)
    print("      answers alone: " + ", ".join(f"{m} {text!r}" for m, text in reference.items()), flush=True)
    unsteady = {m: len(set(texts)) for m, texts in alone.texts.items() if len(set(texts)) > 1}
    if unsteady:
        print(f"      note: alone, these gave more than one answer: {unsteady}", flush=True)
    if len(set(reference.values())) < len(reference):
        print("      note: the adapter answers as the base does: mismatches would not show its rows", flush=True)
    results["adapters_alone"] = {"p50": alone.probe.pct(0.5), "p99": alone.probe.pct(0.99),
                                 "healthz_p99": health.pct(0.99), "errors": alone.probe.errors, "answers": reference}
    for case in cases:
        flood = case_flood(case, setup, args.max_num_seqs, t.model)
        answers, h, report = await _measure(t, models, args.samples, flood, args.warmup)
        assert report is not None
        ratio = answers.probe.pct(0.99) / alone.probe.pct(0.99)
        print(row(case, answers.probe, h, alone.probe.pct(0.99)), flush=True)
        for line in _report_lines(report):
            print(line, flush=True)
        mismatches = answers.mismatches(reference)
        print("      interactive answers differing from alone: "
              + ", ".join(f"{m} {n} of {len(answers.texts[m])}" for m, n in mismatches.items()), flush=True)
        differing = answers.first_differing(reference)
        if differing:
            print("      e.g. " + ", ".join(f"{m} {text!r}" for m, text in differing.items()), flush=True)
        results.setdefault("cases", {})[case] = {
            "p50": answers.probe.pct(0.5), "p99": answers.probe.pct(0.99), "healthz_p99": h.pct(0.99),
            "ratio": ratio, "errors": answers.probe.errors, "alone_p99": alone.probe.pct(0.99),
            "mismatches": mismatches, "first_differing": differing,
            "registrations": {label: {who: {str(k): v for k, v in c.items()} for who, c in by.items()}
                              for label, by in report.registrations.items()},
            "registration_ms_max": {label: max(ms) for label, ms in report.registration_ms.items() if ms},
            "flood_chats": {m: {str(k): v for k, v in c.items()} for m, c in report.chats.items()},
            "accepted": report.accepted}
