"""evals/research_step_loss.py: the full and restricted losses it compares, read from the same logits."""

import torch
from conftest import calibration_ids, fed_in_chunks
from test_global_pool import model  # noqa: F401 (the tiny Llama)

from evals.research_step_loss import losses


def test_losses_are_the_full_and_the_restricted_cross_entropy(model):
    ids = calibration_ids(2, 40, seed=3)
    everything, some = torch.arange(96), torch.unique(torch.cat([ids.flatten(), torch.arange(3, 20)]))
    got = losses(model, ids, {96: everything, 5: some}, chunk=16)
    with torch.no_grad():
        logits = fed_in_chunks(model, ids, 16)[:, :-1].float()
    full = -logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().item()
    at = torch.searchsorted(some, ids[:, 1:].contiguous())
    restricted = -logits[..., some].log_softmax(-1).gather(-1, at[..., None]).mean().item()
    assert abs(got["full"] - full) < 1e-5 and abs(got["96"] - full) < 1e-5
    assert abs(got["5"] - restricted) < 1e-5 and got["5"] < got["full"]
