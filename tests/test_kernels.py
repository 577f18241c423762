"""Triton kernels against their PyTorch references, under the Triton CPU interpreter."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from patchkv.kernels import reference, triton_kernels
torch.manual_seed(0)
for batch, heads, groups, seq, rank, chunk in [(1, 2, 1, 5, 3, 16), (2, 2, 3, 70, 16, 16), (1, 4, 2, 130, 20, 32),
                                                  (2, 2, 3, 70, 16, 70)]:
    chunks = -(-seq // chunk)
    q, bias = torch.randn(batch, heads * groups, chunks, rank), torch.randn(batch, heads * groups, chunks)
    lat = torch.randn(batch, heads, seq, rank)
    ref = reference.chunked_latent_scores(q, bias, lat, groups, chunk)
    out = triton_kernels.chunked_latent_scores(q, bias, lat, groups, chunk)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
from patchkv.kernels.reference import ComponentTable
g = torch.Generator().manual_seed(1)
for batch, tokens, heads, bits_per in [(1, 5, 1, 3), (2, 70, 3, None), (1, 33, 2, 8)]:
    width_bits = torch.randint(0, 9, (heads, 12), generator=g) if bits_per is None else torch.full((heads, 12), bits_per)
    flat = width_bits.flatten()
    start = torch.cumsum(flat, 0) - flat
    coded = (flat > 0).nonzero().squeeze(1)
    head = torch.div(coded, 12, rounding_mode="floor")
    counts = torch.bincount(head, minlength=heads)
    head_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    table = ComponentTable(head_start.int(), (start[coded] // 8).int(), (start[coded] % 8).int(),
                           (2 ** flat[coded] - 1).int(), torch.rand(len(coded), generator=g),
                           torch.randn(len(coded), generator=g), (start[coded] % 8 + flat[coded] > 8).int(),
                           head.int(), (torch.arange(len(coded)) - head_start[head]).int(), max(1, int(counts.max())))
    width = -(-int(flat.sum()) // 8)
    codes = torch.randint(0, 256, (batch, tokens, width), generator=g, dtype=torch.uint8)
    ref = reference.unpack(codes, table)
    out = triton_kernels.unpack(codes, table)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
print("kernels ok")
"""


def test_triton_kernels_match_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported: a fresh process
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels ok" in result.stdout


def test_reference_rotation_matches_transformers():
    """The references' rotation (full tables and half tables) is transformers' own `apply_rotary_pos_emb`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from patchkv.kernels import reference
    x = torch.randn(2, 3, 7, 16)
    angle = torch.rand(40, 8) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    positions = torch.randint(0, 40, (2, 7))
    _, expected = apply_rotary_pos_emb(x, x, cos[positions], sin[positions])
    assert torch.allclose(reference._rope(x, cos, sin, positions, 16), expected, atol=1e-6)
    assert torch.allclose(reference._rope(x, cos[:, :8], sin[:, :8], positions, 16), expected, atol=1e-6)
