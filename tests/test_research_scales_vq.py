"""The simulation behind evals/research_scales_vq.py: its scalar quantizer reconstructs exactly what the real codes
decode to, a per-token scale follows the token's size, and its VQ path codes with the codebook it is given."""

import torch

from evals.research_scales_vq import Quantizer, kmeans, midrise, token_factor
from patchkv.quantize import GAUSSIAN_STEP, CoefficientQuantizer


def setup(seed=0, heads=3, rank=16):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 5, (heads, rank), generator=gen)
    std = torch.rand(heads, rank, generator=gen, dtype=torch.float64) + 0.1
    c = torch.randn(2, heads, 40, rank, generator=gen) * std.float().unsqueeze(1) * 1.5
    return bits, std, c


def test_simulated_uniform_is_what_the_real_codes_decode_to():
    bits, std, c = setup()
    real = CoefficientQuantizer(bits, std)
    step = torch.tensor(GAUSSIAN_STEP, dtype=torch.float64)[bits] * std
    torch.testing.assert_close(midrise(c, bits, step.float()), real.decode(real.encode(c)), atol=1e-5, rtol=0)


def test_token_factor_follows_a_token_scaled_by_a_power_of_two():
    bits, std, c = setup(1)
    c = c / 3  # inside the stored factors' range (2^-2 .. 2^1.875 per head)
    c[:, :, 5] *= 2.0
    for per in ("head", "layer"):
        f = token_factor(c, bits, std.float(), per)
        assert f.shape == ((2, 3, 40, 1) if per == "head" else (2, 1, 40, 1))
        unscaled = token_factor(c / torch.where(torch.arange(40) == 5, 2.0, 1.0).view(1, 1, 40, 1), bits,
                                std.float(), per)
        torch.testing.assert_close(f[:, :, 5], 2 * unscaled[:, :, 5])
        assert not torch.equal(f[:, :, 5], f[:, :, 4])


def test_vq_with_the_scalar_grid_as_codebook_is_the_scalar_quantizer():
    bits, std, c = setup(2)
    q = Quantizer("VQ d=1", bits, std, None, codebooks={})
    for b in q.groups[1]:
        levels = torch.arange(2 ** b, dtype=torch.float32)
        q.codebooks[(1, b)] = ((levels + 0.5 - 2 ** b / 2) * GAUSSIAN_STEP[b]).unsqueeze(1)
    torch.testing.assert_close(q(c), midrise(c, bits, q.step), atol=1e-5, rtol=0)


def test_kmeans_finds_separated_clusters():
    gen = torch.Generator().manual_seed(3)
    centers = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    x = (centers.repeat_interleave(200, 0) + 0.1 * torch.randn(800, 2, generator=gen))
    found = kmeans(x, 4)
    assert torch.cdist(centers, found).min(1).values.max() < 0.2
