import itertools

import pytest
import torch

from conftest import expected_distortion

from patchkv.allocation import allocate_bits_global, allocate_bits_grouped, allocate_to_bytes, marginal_gains
from patchkv.quantize import GAUSSIAN_MSE, allocate_bits


def brute_force(lam: torch.Tensor, budget: int, max_bits: int) -> float:
    best = float("inf")
    for bits in itertools.product(range(max_bits + 1), repeat=len(lam)):
        if sum(bits) <= budget:
            best = min(best, float(expected_distortion(lam, torch.tensor(bits))))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_global_allocation_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    lam = torch.rand(4, generator=g) ** 3 * 10 ** torch.randint(-2, 3, (4,), generator=g)
    for budget in (0, 1, 3, 6, 9, 16):
        bits = allocate_bits_global(lam, budget, max_bits=4)
        assert int(bits.sum()) == min(budget, 16) and bits.max() <= 4 and bits.min() >= 0
        assert float(expected_distortion(lam, bits)) == pytest.approx(brute_force(lam, budget, 4), rel=1e-12)


def test_global_allocation_agrees_with_the_per_head_dp():
    lam = torch.tensor([5.0, 2.0, 1.0, 0.3, 0.01, 0.0])
    for budget in (1, 4, 10, 20):
        dp = allocate_bits(lam[None], budget)[0]
        greedy = allocate_bits_global(lam, budget)
        assert float(expected_distortion(lam, greedy)) == pytest.approx(float(expected_distortion(lam, dp)))


def test_one_pool_beats_equal_budgets_per_group():
    loud, quiet = torch.tensor([100.0, 50.0, 10.0]), torch.tensor([0.01, 0.005, 0.001])
    pooled = allocate_bits_grouped([loud, quiet], 12)
    equal = [allocate_bits_global(loud, 6), allocate_bits_global(quiet, 6)]
    cost = lambda bits: sum(float(expected_distortion(x, b)) for x, b in zip((loud, quiet), bits))  # noqa: E731
    assert int(sum(b.sum() for b in pooled)) == 12
    assert pooled[0].sum() > pooled[1].sum()  # the bits go where the effect is
    assert cost(pooled) < cost(equal)


def test_bits_are_monotone_in_variance_and_budget():
    lam = torch.tensor([0.1, 8.0, 1.0, 3.0])
    bits = allocate_bits_global(lam, 9)
    order = torch.argsort(lam, descending=True)
    assert torch.all(bits[order][:-1] >= bits[order][1:])
    prev = torch.zeros(4, dtype=torch.long)
    for budget in range(0, 33):
        now = allocate_bits_global(lam, budget, max_bits=8)
        assert torch.all(now >= prev)  # more budget never takes a bit away
        prev = now


def test_marginal_gains_are_decreasing():
    gains = marginal_gains(torch.tensor([1.0, 2.0]))
    assert gains.shape == (2, len(GAUSSIAN_MSE) - 1)
    assert torch.all(gains[:, 1:] < gains[:, :-1])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        allocate_bits_global(torch.ones(2, 2), 3)
    with pytest.raises(ValueError):
        allocate_bits_global(torch.ones(3), -1)


def test_allocation_to_bytes_fits_whole_bytes_and_uses_them():
    g = torch.Generator().manual_seed(3)
    costs = [torch.rand(n, generator=g) ** 4 * s for n, s in ((12, 5.0), (7, 0.2), (20, 1.0), (5, 1e-6))]
    for byte_budget in (0, 1, 3, 10, 17, 40):
        bits = allocate_to_bytes(costs, byte_budget, max_bits=6)
        used = [-(-int(b.sum()) // 8) for b in bits]
        assert sum(used) <= byte_budget
        for b, cost in zip(bits, costs):
            assert b.min() >= 0 and b.max() <= 6
            # a group's last byte is full unless every component is at max_bits
            assert int(b.sum()) % 8 == 0 or bool((b == 6).all())
        # nearly all of the budget is used (what is left is less than one byte per group), or every bit is spent
        assert byte_budget - sum(used) < len(costs) or all(bool((b == 6).all()) for b in bits)
    # more bytes never cost more distortion
    distortion = [sum(float(expected_distortion(c, b)) for c, b in zip(costs, allocate_to_bytes(costs, n, 6)))
                  for n in range(0, 41)]
    assert all(a >= b - 1e-12 for a, b in zip(distortion, distortion[1:]))


def test_allocation_to_bytes_refuses_a_negative_budget():
    with pytest.raises(ValueError):
        allocate_to_bytes([torch.ones(3)], -1)
