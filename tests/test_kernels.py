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
for batch, heads, groups, seq, rank in [(1, 2, 1, 5, 3), (2, 2, 3, 70, 16), (1, 4, 2, 130, 20)]:
    q = torch.randn(batch, heads * groups, rank)
    lat = torch.randn(batch, heads, seq, rank)
    ref = reference.latent_scores(q, lat, groups)
    out = triton_kernels.latent_scores(q, lat, groups)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
for batch, heads, groups, seq, rank, chunk in [(1, 2, 1, 5, 3, 16), (2, 2, 3, 70, 16, 16), (1, 4, 2, 130, 20, 32)]:
    chunks = -(-seq // chunk)
    q, bias = torch.randn(batch, heads * groups, chunks, rank), torch.randn(batch, heads * groups, chunks)
    lat = torch.randn(batch, heads, seq, rank)
    ref = reference.chunked_latent_scores(q, bias, lat, groups, chunk)
    out = triton_kernels.chunked_latent_scores(q, bias, lat, groups, chunk)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
for batch, heads, n, rank, dim in [(1, 1, 3, 2, 32), (2, 2, 40, 16, 64), (1, 3, 33, 24, 32)]:
    coeffs = torch.randn(batch, heads, n, rank)
    basis = torch.linalg.qr(torch.randn(heads, dim, dim))[0][:, :, :rank]
    mean = torch.randn(heads, dim)
    angle = torch.rand(batch, heads, n, dim // 2) * 6.3
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    ref = reference.reconstruct_rope(coeffs, basis, mean, cos, sin)
    out = triton_kernels.reconstruct_rope(coeffs, basis, mean, cos, sin)
    assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
print("kernels ok")
"""


def test_triton_kernels_match_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported: a fresh process
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernels ok" in result.stdout


def test_reference_reconstruct_rope_matches_transformers_rotation():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from patchkv.kernels import reference
    coeffs, basis, mean = torch.randn(1, 2, 7, 4), torch.randn(2, 16, 4), torch.randn(2, 16)
    angle = torch.rand(1, 7, 8)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    keys = coeffs @ basis.transpose(1, 2) + mean.unsqueeze(1)
    _, expected = apply_rotary_pos_emb(keys, keys, cos, sin)
    out = reference.reconstruct_rope(coeffs, basis, mean, cos.unsqueeze(1), sin.unsqueeze(1))
    assert torch.allclose(out, expected, atol=1e-6)
