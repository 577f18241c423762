import pytest
import torch

from patchkv.pca import CovarianceAccumulator, select_ranks


def low_rank_signal(heads=2, n=4000, dim=16, rank=3, noise=1e-3, seed=0):
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(heads, dim, rank, generator=g, dtype=torch.float64))[0]
    scales = torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64)[:rank]
    z = torch.randn(heads, n, rank, generator=g, dtype=torch.float64) * scales
    mean = torch.randn(heads, 1, dim, generator=g, dtype=torch.float64)
    x = z @ basis.transpose(1, 2) + mean + noise * torch.randn(heads, n, dim, generator=g, dtype=torch.float64)
    return x, basis, mean.squeeze(1)


def test_pca_recovers_low_rank_subspace_and_mean():
    x, basis, mean = low_rank_signal()
    acc = CovarianceAccumulator(2, 16)
    for chunk in x.split(700, dim=1):  # streaming in uneven chunks
        acc.add(chunk.float())
    pca = acc.pca()
    assert acc.count == 4000
    assert torch.allclose(pca.mean, mean, atol=0.2)
    top = pca.eigenvectors[:, :, :3]
    # the principal angles between recovered and true subspaces are ~0: projection matrices agree
    assert torch.allclose(top @ top.transpose(1, 2), basis @ basis.transpose(1, 2), atol=1e-3)
    assert (pca.eigenvalues[:, 3:] < 1e-5).all() and (pca.eigenvalues[:, :3] > 0.5).all()
    assert torch.all(pca.eigenvalues[:, :-1] >= pca.eigenvalues[:, 1:])


def test_reconstruction_error_falls_with_rank():
    x, _, _ = low_rank_signal(rank=3, noise=0.05)
    acc = CovarianceAccumulator(2, 16)
    acc.add(x)
    pca = acc.pca()
    centred = x - pca.mean.unsqueeze(1)
    errors = []
    for r in range(1, 17):
        u = pca.eigenvectors[:, :, :r]
        errors.append(((centred - centred @ u @ u.transpose(1, 2)) ** 2).mean().item())
    assert all(a > b for a, b in zip(errors, errors[1:4]))  # strictly better up to the true rank
    assert all(a >= b - 1e-12 for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-20  # full rank reconstructs exactly


def test_select_ranks_by_rank_and_energy():
    eig = torch.tensor([[4.0, 3.0, 2.0, 1.0], [10.0, 0.0, 0.0, 0.0]])
    assert select_ranks(eig, rank=2).tolist() == [2, 2]
    assert select_ranks(eig, energy=0.7).tolist() == [2, 1]  # (4 + 3) / 10 reaches 0.7 exactly
    assert select_ranks(eig, energy=0.75).tolist() == [3, 1]
    assert select_ranks(eig, energy=1.0).tolist() == [4, 1]
    with pytest.raises(ValueError, match="head_dim=4"):
        select_ranks(eig, rank=5)
    with pytest.raises(ValueError, match="exactly one"):
        select_ranks(eig)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        select_ranks(eig, energy=1.5)
