"""The C++ CPU kernels (`kernels/latent_cpu.cpp`) against their PyTorch references (`kernels/reference.py`).

Codes of every width (a head with no component, a codec with none at all), packed float latents in three dtypes,
head dims that are and are not a multiple of the vector width, full and half RoPE tables, partial rotary dims,
batches, blocks of tokens that do not divide the length. `setup.sh` builds the kernels; with
`PATCHKV_CPU_KERNELS=0` they are off and these tests are skipped (anywhere else a failed build fails them)."""

import itertools

import pytest
import torch

from patchkv.kernels import cpu, ops, reference
from patchkv.latent import LatentBasis, LayerBasis, PackedCodec
from patchkv.methods.quantized import LayerQuantizedCodec, QuantizedCodec

pytestmark = pytest.mark.skipif(not cpu.enabled(), reason="PATCHKV_CPU_KERNELS=0")


@pytest.fixture(scope="module")
def ext():
    module = cpu.extension()
    assert module is not None, "the C++ CPU kernels did not build (see the warning above)"
    return module


def quantized_codec(bits: torch.Tensor, dim: int, seed: int) -> QuantizedCodec:
    g = torch.Generator().manual_seed(seed)
    heads, rank = bits.shape
    eigenvectors = torch.linalg.qr(torch.randn(heads, dim, dim, generator=g))[0]
    ranks = [int((row > 0).nonzero().max()) + 1 if row.any() else 1 for row in bits]
    basis = LatentBasis(torch.randn(heads, dim, generator=g), eigenvectors, ranks, 2, torch.float32)
    eigenvalues = torch.rand(heads, dim, generator=g) * 4 + 0.1
    return QuantizedCodec(basis, torch.nn.functional.pad(bits, (0, dim - rank)), eigenvalues)


def layer_codec(heads: int, bits: list[int], dim: int, seed: int) -> LayerQuantizedCodec:
    """Codes on one basis for the layer's heads: every head reads the same components from the same bits (the
    kernels unpack a token's codes once for all heads)."""
    g = torch.Generator().manual_seed(seed)
    width = heads * dim
    eigenvectors = torch.linalg.qr(torch.randn(width, width, generator=g))[0]
    basis = LayerBasis(torch.randn(width, generator=g), eigenvectors, len(bits), heads, 2, torch.float32)
    per_component = torch.nn.functional.pad(torch.tensor(bits), (0, width - len(bits)))
    return LayerQuantizedCodec(basis, per_component, torch.rand(width, generator=g) * 4 + 0.1)


def packed_codec(ranks: list[int], dim: int, seed: int, dtype: torch.dtype) -> PackedCodec:
    g = torch.Generator().manual_seed(seed)
    eigenvectors = torch.linalg.qr(torch.randn(len(ranks), dim, dim, generator=g))[0]
    return PackedCodec(LatentBasis(torch.randn(len(ranks), dim, generator=g), eigenvectors, ranks, 2, dtype))


CODECS = {
    "codes, every width": lambda d: quantized_codec(torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1], [1, 2, 3, 0, 0, 8, 1, 1]]),
                                                    d, 0),
    "codes, random": lambda d: quantized_codec(torch.randint(0, 9, (3, 20), generator=torch.Generator().manual_seed(1)),
                                               d, 1),
    "codes, a head with none": lambda d: quantized_codec(torch.tensor([[3, 3, 2, 1], [0, 0, 0, 0]]), d, 2),
    "codes, none at all": lambda d: quantized_codec(torch.zeros(2, 3, dtype=torch.long), d, 3),
    "codes, a layer basis": lambda d: layer_codec(3, [8, 6, 5, 4, 4, 3, 2, 2, 1, 1, 3, 7, 2, 1, 1, 1, 2, 5], d, 7),
    "floats": lambda d: packed_codec([5, 9, 2], d, 4, torch.float32),
    "bfloat16": lambda d: packed_codec([7, 7], d, 5, torch.bfloat16),
    "float16": lambda d: packed_codec([3, 1], d, 6, torch.float16),
}


def stored(codec, batch: int, tokens: int, seed: int) -> torch.Tensor:
    x = torch.randn(batch, codec.basis.heads, tokens, codec.basis.head_dim,
                    generator=torch.Generator().manual_seed(seed)) * 3
    return codec.encode(x.to(codec.basis.basis.dtype)).squeeze(1).contiguous()


def tables(tokens: int, rot: int, seed: int, half: bool):
    angle = torch.rand(tokens + 7, rot // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    scale = 1.3  # tables that carry an attention scaling (yarn, longrope) are read as they are
    if half:
        return (angle.cos() * scale).contiguous(), (angle.sin() * scale).contiguous()
    other = angle + 0.5  # halves that differ: the general rotation
    return torch.cat([angle.cos(), other.cos()], -1) * scale, torch.cat([angle.sin(), other.sin()], -1) * scale


@pytest.mark.parametrize("dim", [64, 80, 24, 128])
@pytest.mark.parametrize("name", list(CODECS))
def test_kernels_equal_their_references(ext, name, dim):
    codec = CODECS[name](dim)
    batch, tokens = 2, 150  # blocks of 64 tokens: two full, one partial
    latents = stored(codec, batch, tokens, seed=dim)
    table, rows, mean = codec.table, codec.rows, codec.kernel_mean
    args = table.kernel_args()
    # codes: value * step + offset, one rounding (fused) or two: equal to float32 rounding
    assert torch.allclose(ext.unpack(latents, *args), reference.unpack(latents, table), rtol=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(7)
    positions = torch.randint(0, tokens + 7, (batch, tokens), generator=g).int()
    empty = torch.empty(0)
    for rot, half in ((dim, True), (dim, False), (dim // 2, True), (None, None)):
        if rot is None:  # no rotation (values, post-RoPE keys)
            rope, cos, sin = (empty, empty, empty.int(), 0), None, None
        else:
            cos, sin = tables(tokens, rot, seed=rot, half=half)
            rope = (cos, sin, positions, rot)
        scale = max(1.0, float(reference.reconstruct(latents, table, rows, mean, cos, sin, None if rot is None else
                                                     positions, rope[3], torch.float32).abs().max()))
        want = reference.reconstruct(latents, table, rows, mean, cos, sin, None if rot is None else positions, rope[3],
                                     torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            for products in (False, True):  # float32 products, or bfloat16 (for half-precision models)
                got = ext.reconstruct(latents, *args, rows, mean, *rope, dtype, products)
                assert got.dtype == dtype and got.shape == want.shape
                tol = 1e-5 * scale if dtype == torch.float32 and not products else 2e-2 * scale
                assert (got.float() - want).abs().max() <= tol, (rot, half, dtype, products)


def test_ops_dispatch_to_the_kernels_on_cpu_and_back_to_the_reference_when_off(ext, monkeypatch):
    codec = CODECS["codes, random"](64)
    latents = stored(codec, 1, 70, seed=1)
    calls = []
    monkeypatch.setattr(cpu, "extension", lambda: calls.append(1) or ext)
    fast = ops.unpack(latents, codec.table)
    assert calls and torch.allclose(fast, reference.unpack(latents, codec.table), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(cpu, "extension", lambda: None)  # not built, or PATCHKV_CPU_KERNELS=0
    assert torch.allclose(ops.unpack(latents, codec.table), fast, rtol=1e-6, atol=1e-6)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    """No compiler (or any build error): one RuntimeWarning naming the fix, then None (the reference path)."""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'patchkv_cpu': g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    cpu.extension.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built.*compiler"):
            assert cpu.extension() is None
    finally:
        cpu.extension.cache_clear()


@pytest.mark.parametrize("name", [n for n in CODECS if n.startswith("codes")])
def test_encode_equals_its_reference(ext, name):
    """Codes written by the kernel are the reference's, bit for bit, out-of-range coefficients clamped."""
    codec = CODECS[name](64)
    q = codec.quantizer
    coeffs = torch.randn(2, codec.basis.heads, 150, codec.basis.max_rank, generator=torch.Generator().manual_seed(3)) * 4
    want = reference.encode(coeffs, q.table, q.components, q.bytes_per_token)
    got = ext.encode(coeffs, *q.table.kernel_args(), q.components.int(), q.bytes_per_token)
    assert got.dtype == torch.uint8 and got.shape == (2, 150, q.bytes_per_token) and torch.equal(got, want)


@pytest.mark.parametrize("name", list(CODECS))
def test_leading_scores_are_those_of_the_first_coefficients(ext, name, monkeypatch):
    """`Codec.leading_scores` (top-k's candidate scores, read from the codes) equals one query per chunk against the
    first r of the full decode, on the kernel and on the reference."""
    codec = CODECS[name](64)
    latents = stored(codec, 2, 70, seed=4).unsqueeze(1)
    full = codec.decode(latents).float()
    g = torch.Generator().manual_seed(5)
    heads = codec.basis.heads * codec.basis.query_groups
    for rank, chunk in itertools.product({1, min(3, codec.basis.max_rank), codec.basis.max_rank}, (16, 70)):
        chunks = -(-70 // chunk)
        q, bias = torch.randn(2, heads, chunks, rank, generator=g), torch.randn(2, heads, chunks, generator=g)
        want = reference.chunked_latent_scores(q, bias, full[..., :rank], codec.basis.query_groups, chunk)
        got = codec.leading_scores(latents, rank, q, bias, chunk)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-4)
        with monkeypatch.context() as off:
            off.setattr(cpu, "extension", lambda: None)
            assert torch.allclose(codec.leading_scores(latents, rank, q, bias, chunk), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["codes, random", "codes, a head with none", "floats"])
@pytest.mark.parametrize("latent_space", [False, True])
def test_attend_equals_its_reference(ext, name, latent_space):
    """One pass over the codes (scores, online softmax, value sums, partial states of the threads merged) against
    scores, softmax and sums taken apart; a bias that masks some tokens included."""
    keys, values = CODECS[name](64), CODECS[name](64)
    batch, tokens, groups = 2, 150, 3
    k_lat, v_lat = stored(keys, batch, tokens, seed=1), stored(values, batch, tokens, seed=2)
    g = torch.Generator().manual_seed(9)
    positions = torch.randint(0, tokens + 7, (batch, tokens), generator=g).int()
    cos, sin = tables(tokens, 64, seed=3, half=True)
    heads = keys.table.heads
    width = keys.table.widest if latent_space else 64
    q = torch.randn(batch, heads, groups, width, generator=g)
    q_bias = torch.randn(batch, heads, groups, generator=g) if latent_space else None
    bias = torch.zeros(batch, tokens)
    bias[1, :20] = torch.finfo(torch.float32).min  # masked (left padding)
    rope = None if latent_space else (cos, sin, positions, 64)
    want = reference.attend(k_lat, keys.table, keys.rows, keys.kernel_mean, None if rope is None else cos,
                            None if rope is None else sin, None if rope is None else positions, 64, q, q_bias, bias,
                            0.125, v_lat, values.table, latent_space)
    per_head = bias[:, None].repeat(1, heads, 1)
    per_head[0, -1, 100:] = torch.finfo(torch.float32).min  # one KV head masks more
    want_per_head = reference.attend(k_lat, keys.table, keys.rows, keys.kernel_mean, None if rope is None else cos,
                                     None if rope is None else sin, None if rope is None else positions, 64, q, q_bias,
                                     per_head, 0.125, v_lat, values.table, latent_space)
    got = ops.attend(k_lat, keys.table, keys.rows, keys.kernel_mean, rope, q, q_bias, per_head, 0.125, v_lat,
                     values.table, latent_space, False)
    assert torch.allclose(got[2] / got[1].unsqueeze(-1), want_per_head[2] / want_per_head[1].unsqueeze(-1),
                          rtol=1e-4, atol=1e-4)
    for products in (False, True):
        got = ops.attend(k_lat, keys.table, keys.rows, keys.kernel_mean, rope, q, q_bias, bias, 0.125, v_lat,
                         values.table, latent_space, products)
        tol = 3e-2 if products and not latent_space else 1e-4
        for a, b in zip(got, want):
            assert a.shape == b.shape
        # compare the normalised results (m is a shift shared by l and sums)
        norm = [x * torch.exp(m - want[0]).unsqueeze(-1) for m, x in ((got[0], got[2]),)][0] / \
            (got[1] * torch.exp(got[0] - want[0])).unsqueeze(-1)
        assert torch.allclose(norm, want[2] / want[1].unsqueeze(-1), rtol=tol, atol=tol)
        assert torch.allclose(got[0], want[0], rtol=tol, atol=tol * 10)
