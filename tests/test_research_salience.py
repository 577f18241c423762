"""evals/research_salience.py's oracle: it keeps exactly the needle's span, however the middle arrives."""

from types import SimpleNamespace

import torch

from evals.research_salience import NeedleOracle, needle_span


def test_the_oracle_scores_the_span_across_chunks_and_layers():
    oracle = NeedleOracle(span=(5, 9))
    keys = torch.zeros(1, 2, 6, 4)
    first = [oracle.score(SimpleNamespace(layer_idx=i), keys, keys, None) for i in (0, 1)]
    later = oracle.score(SimpleNamespace(layer_idx=0), keys, keys, None)  # middle indices 6..11
    assert first[0].tolist() == first[1].tolist() == [[[0, 0, 0, 0, 0, 1]] * 2]
    assert later.tolist() == [[[1, 1, 1, 0, 0, 0]] * 2]
    assert oracle.spec() == "needle_oracle:span=5-9"


def test_needle_span_finds_the_number_in_the_middle():
    class Digits:  # one token per character
        def decode(self, ids):
            return "".join(map(chr, ids))

    text = "x" * 40 + " is: 4719574." + "y" * 20
    sample = {"context_ids": [ord(c) for c in text], "outputs": ["4719574"]}
    first, last = needle_span(Digits(), sample, sinks=4)
    at = text.index("4719574")
    assert at - 2 <= first + 4 + 16 <= at and last - first == 28
