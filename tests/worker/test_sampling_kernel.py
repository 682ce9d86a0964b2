"""Sampling without sorting the vocabulary (native/csrc/sample.c) and its torch twin: the tokens
drawn follow the filtered distribution (a chi-square test with fixed draws, not a timing), never
leave its support, and each draw depends only on the request's key and the token's position.
Every ISA build this CPU runs is tested, and the torch path that GPUs and CPUs without the kernels use."""

from __future__ import annotations

import pytest
import torch

from inferplane.worker.engine.sampling import (
    SamplingParams,
    _draw_rows,
    _filter_rows,
    sample,
    uniform_draw,
)
from inferplane.worker.ops import native
from tests.worker.test_native import ISAS

DRAWS = 20_000
CASES = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.8, 0, 0.95),
    (0.7, 12, 1.0),
    (1.3, 20, 0.8),
]


def logits_of(vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2


def expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The distribution sampling.py defines: temperature, then top-k and min-p, then top-p over what is left."""
    scaled = _filter_rows((logits / temperature)[None], torch.tensor([top_k]), torch.tensor([top_p]),
                          torch.tensor([min_p]))
    return scaled.softmax(dim=-1)[0].double()


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at p = 0.999 (z: the normal's) by Wilson and Hilferty's approximation,
    within a percent for the degrees of freedom here."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Every token in the support, and the counts a chi-square test at p = 0.001 accepts."""
    support = probs > 0
    assert bool(support[tokens].all()), "a token outside the filtered distribution was drawn"
    counts = torch.bincount(tokens, minlength=len(probs)).double()[support]
    wanted = probs[support] * len(tokens)
    statistic = float(((counts - wanted) ** 2 / wanted).sum())
    assert statistic < chi2_critical(int(support.sum()) - 1), statistic


def uniforms(count: int, key: int = 7) -> torch.Tensor:
    return torch.tensor([uniform_draw(key, position) for position in range(count)], dtype=torch.float64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_the_kernel_draws_from_the_filtered_distribution(isa: str, temperature: float, top_k: int,
                                                         top_p: float) -> None:
    kernels = native.kernels_for(isa)
    logits = logits_of(64, seed=top_k + 1)
    rows = logits[None].expand(DRAWS, -1).contiguous()
    tokens = kernels.sample_rows(rows, torch.full((DRAWS,), temperature), torch.full((DRAWS,), top_k),
                                 torch.full((DRAWS,), top_p), torch.zeros(DRAWS), uniforms(DRAWS))
    assert_follows(tokens, expected(logits, temperature, top_k, top_p))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), CASES)
def test_the_torch_path_draws_from_the_same_distribution(temperature: float, top_k: int, top_p: float) -> None:
    logits = logits_of(64, seed=top_k + 1)
    rows = logits[None].expand(DRAWS, -1) / temperature
    tokens = _draw_rows(rows, torch.full((DRAWS,), top_k), torch.full((DRAWS,), top_p), uniforms(DRAWS))
    assert_follows(tokens, expected(logits, temperature, top_k, top_p))


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_and_torch_path_pick_the_same_token_for_the_same_draw(isa: str) -> None:
    """Inverse CDF at the same uniform: the same token, but where float rounding puts the draw on
    the other side of a boundary between two tokens (rare)."""
    kernels = native.kernels_for(isa)
    logits = logits_of(49_152, seed=3)[None].expand(256, -1).contiguous()
    draws = uniforms(256, key=11)
    for top_k, top_p in ((0, 1.0), (40, 1.0), (0, 0.9)):
        ours = kernels.sample_rows(logits, torch.full((256,), 0.8), torch.full((256,), top_k),
                                   torch.full((256,), top_p), torch.zeros(256), draws)
        theirs = _draw_rows(logits / 0.8, torch.full((256,), top_k), torch.full((256,), top_p), draws)
        assert int((ours == theirs).sum()) >= 250, (top_k, top_p)


@pytest.mark.parametrize("isa", ISAS)
def test_a_flat_distributions_nucleus_is_found_without_sorting_it(isa: str) -> None:
    """Most of a flat 262k vocabulary is above the top-p bound: the threshold is found by bisection,
    and every token drawn is inside the exact nucleus but for ties at its edge."""
    kernels = native.kernels_for(isa)
    logits = logits_of(262_144, seed=5) * 0.05
    probs = expected(logits, 1.0, 0, 0.5)
    rows = logits[None].expand(64, -1).contiguous()
    tokens = kernels.sample_rows(rows, torch.ones(64), torch.zeros(64, dtype=torch.int64), torch.full((64,), 0.5),
                                 torch.zeros(64), uniforms(64))
    edge = probs[probs > 0].min()
    assert bool(((probs[tokens] > 0) | (logits[tokens].double().exp() >= edge * 0.999)).all())


@pytest.mark.parametrize("isa", ISAS)
def test_masked_tokens_are_never_drawn_and_min_p_cuts(isa: str) -> None:
    kernels = native.kernels_for(isa)
    logits = torch.zeros(1000)
    logits[:500] = float("-inf")  # a grammar's mask
    logits[600] = 5.0
    rows = logits[None].expand(2000, -1).contiguous()
    tokens = kernels.sample_rows(rows, torch.ones(2000), torch.zeros(2000, dtype=torch.int64), torch.ones(2000),
                                 torch.zeros(2000), uniforms(2000))
    assert int(tokens.min()) >= 500
    # min_p 0.5: only tokens with at least half the top token's probability: token 600 alone.
    tokens = kernels.sample_rows(rows, torch.ones(2000), torch.zeros(2000, dtype=torch.int64), torch.ones(2000),
                                 torch.full((2000,), 0.5), uniforms(2000))
    assert set(tokens.tolist()) == {600}


def test_a_draw_depends_on_the_key_and_the_position_alone() -> None:
    assert uniform_draw(3, 10) == uniform_draw(3, 10)
    draws = [uniform_draw(3, p) for p in range(1000)]
    assert len(set(draws)) == 1000 and all(0.0 < u <= 1.0 for u in draws)
    assert uniform_draw(4, 10) != uniform_draw(3, 10)
    # The sampler's answer for a row does not depend on the other rows of its batch.
    logits = logits_of(300, seed=9)[None].expand(3, -1).contiguous()
    params = [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, top_p=0.9)]
    alone = sample(logits[:1].clone(), params[:1], [uniform_draw(5, 0)], False).tokens[0]
    batched = sample(logits.clone(), params, [uniform_draw(5, 0), 0.0, uniform_draw(6, 0)], False).tokens
    assert batched[0] == alone and batched[1] == int(logits[0].argmax())


MIN_P_CASES = [  # (temperature, top_k, top_p, min_p): min-p alone, and with top-k and top-p
    (1.0, 0, 1.0, 0.05),
    (0.8, 0, 0.95, 0.1),
    (1.3, 20, 0.8, 0.1),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), MIN_P_CASES)
def test_min_p_draws_from_the_filtered_distribution(isa: str, temperature: float, top_k: int, top_p: float,
                                                    min_p: float) -> None:
    """The kernel and the torch path, each against the distribution _filter_rows defines: what min-p
    leaves (a real cut here: the expected support is smaller than top-k and top-p alone leave)."""
    logits = logits_of(64, seed=31)
    probs = expected(logits, temperature, top_k, top_p, min_p)
    assert int((probs > 0).sum()) < int((expected(logits, temperature, top_k, top_p) > 0).sum())
    rows = logits[None].expand(DRAWS, -1).contiguous()
    tokens = native.kernels_for(isa).sample_rows(rows, torch.full((DRAWS,), temperature), torch.full((DRAWS,), top_k),
                                                 torch.full((DRAWS,), top_p), torch.full((DRAWS,), min_p),
                                                 uniforms(DRAWS))
    assert_follows(tokens, probs)
    torch_tokens = _draw_rows(rows / temperature, torch.full((DRAWS,), top_k), torch.full((DRAWS,), top_p),
                              uniforms(DRAWS), torch.full((DRAWS,), min_p))
    assert_follows(torch_tokens, probs)


def test_min_p_reaches_the_sampler_and_is_checked() -> None:
    """SamplingParams.min_p is what sample() filters by (C path here), and out of range is refused
    naming the field."""
    logits = torch.zeros(1, 1000)
    logits[0, 600] = 5.0
    drawn = {sample(logits.clone(), [SamplingParams(temperature=1.0, min_p=0.5)], [uniform_draw(1, p)], False).tokens[0]
             for p in range(200)}
    assert drawn == {600}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5).validate(4, 64)
