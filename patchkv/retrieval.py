"""Retrieval rows: what a model reads when a fact in its context is asked for thousands of tokens later.

Effect weights measured on the summed next-token loss of plain text (`patchkv.fisher`) say what continuation reads,
mostly recent tokens through a few heads. A fact asked for 2,000 tokens after it was read is read by other heads: on
SmolLM2 one layer holds 75% of the keys' effect on retrieval rows and 10% on prose. A bit pool told only about
continuation starves those heads, and needles in real text are lost at 16x (README, "Effect weights told what
retrieval reads"). These rows tell it:

- `retrieval_row`: a piece of the calibration text with a 7-digit number on a line of its own at a depth drawn in
  [10%, 90%], in one of `WORDINGS`, the question after the text, then the answer. `FisherCapture.step(...,
  scored=...)` measures the Fisher of the answer's loss alone on it.
- `measure`: those rows stepped through an active `FisherCapture`.
- `mix_effect`: the prose and the retrieval effect weights, each scaled to the same total effect (sum over
  components of variance x weight, keys and values together), added: equal say, in the prose weights' nats;
  `with_retrieval_weights` applies it to an artifact's components.

`calibrate(..., retrieval_rows=n)` and `patchkv calibrate --retrieval-rows n` use both. The wordings are this
module's own; the evaluation's `needle_text` (evals/tasks.py) asks in other wordings, on text no calibration reads.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .artifact import Components
from .fisher import FisherCapture, effect_weights

#: (the sentence hidden in the text, the question that asks for it, ending where the answer starts)
WORDINGS = (
    ("The code word for the vault is {n}.", "What is the code word for the vault? The code word for the vault is"),
    ("Please note that the locker combination is {n}.", "What is the locker combination? The locker combination is"),
    ("The ticket number of the lost suitcase was {n}.",
     "What was the ticket number of the lost suitcase? The ticket number was"),
    ("Remember this: the captain's lucky number is {n}.",
     "What is the captain's lucky number? The captain's lucky number is"),
)
#: what precedes the text: the instruction of RULER's needle tasks
INTRO = ("Some important information is hidden inside the following text. Make sure to memorize it. I will quiz "
         "you about it afterwards.\n\n")
#: characters of text read per token of a row: enough for any tokenizer of natural text (about 4 for English)
CHARS_PER_TOKEN = 8


def hide(tokenizer: Any, text: str, sentence: str, room: int, rng: random.Random) -> tuple[str, float]:
    """`text` cut to its first `room` tokens with `sentence` on a line of its own at a depth drawn from `rng` in
    [10%, 90%] and moved to the next line break -> (that text, the depth as a fraction of the cut text, 3 places)."""
    body = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    text = text[: body["offset_mapping"][min(room, len(body["input_ids"])) - 1][1]]
    at = text.find("\n", int(len(text) * rng.uniform(0.1, 0.9)))
    at = len(text) if at < 0 else at
    return text[:at] + "\n" + sentence + text[at:], round(at / len(text), 3)


def source_text(texts: str | list[str], seq: int) -> str:
    """The text retrieval rows of `seq` tokens are cut from: `texts` joined by blank lines. Raises ValueError where it
    is shorter than one row's piece (`CHARS_PER_TOKEN * seq` characters)."""
    text = texts if isinstance(texts, str) else "\n\n".join(texts)
    if len(text) < CHARS_PER_TOKEN * seq:
        raise ValueError(f"a retrieval row of {seq} tokens reads {CHARS_PER_TOKEN * seq:,} characters of the "
                         f"calibration text, which has {len(text):,}; pass more text or a smaller retrieval_seq.")
    return text


def retrieval_row(tokenizer: Any, text: str, seq: int, seed: int) -> tuple[torch.Tensor, int]:
    """One seeded retrieval row of at most `seq` tokens from `text` -> (ids `[1, n]`, where the answer starts).

    `INTRO`, a piece of `text` from a start drawn in its first `len(text) - CHARS_PER_TOKEN * seq` characters with a
    needle of `WORDINGS` (wording `seed % 4`) hidden by `hide`, the question, the answer (" 1234567."). Raises
    ValueError where `text` is shorter than one piece or `seq` leaves no room for the text."""
    source_text(text, seq)  # refuses text shorter than one piece
    piece = CHARS_PER_TOKEN * seq
    rng = random.Random(seed)
    start = rng.randrange(0, len(text) - piece + 1)
    needle, question = WORDINGS[seed % len(WORDINGS)]
    number = str(rng.randrange(1_000_000, 10_000_000))
    question_ids = tokenizer("\n\n" + question, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(" " + number + ".", add_special_tokens=False)["input_ids"]
    intro = tokenizer(INTRO, add_special_tokens=False)["input_ids"]
    room = seq - len(question_ids) - len(answer_ids) - len(intro) - 30  # 30: the needle's own tokens
    if room < 64:
        raise ValueError(f"retrieval_seq {seq} leaves {room} tokens for the text around the needle; pass at least "
                         f"{seq - room + 64}.")
    hidden, _ = hide(tokenizer, text[start:start + piece], needle.format(n=number), room, rng)
    context = tokenizer(INTRO + hidden, add_special_tokens=False)["input_ids"]
    return torch.tensor([context + question_ids + answer_ids]), len(context) + len(question_ids)


def mix_effect(prose: dict[str, list[torch.Tensor]], retrieval: dict[str, list[torch.Tensor]],
               eigenvalues: dict[str, torch.Tensor], share: float = 0.5) -> dict[str, list[torch.Tensor]]:
    """Effect weights of both sources at `share` of the say for retrieval -> the mixed weights, float64.

    prose, retrieval: kind ("keys", "values") -> that kind's weights, the per-head `[layers, kv_heads, d]` first
    (then any others of the same kind, e.g. per-layer `[layers, D]`, mixed with the same factors); eigenvalues: kind ->
    `[layers, kv_heads, d]`, the per-head bases' variances. Each source is scaled so that its total effect (sum of
    variance x per-head weight over both kinds) is the prose's, then they are averaged with weights 1 - share and
    share: the result's total effect is the prose weights', in their unit."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1] (the retrieval source's say), got {share!r}.")

    def total(weights: dict[str, list[torch.Tensor]]) -> float:
        return sum(float((w[0].double() * eigenvalues[k].double().clamp_min(0)).sum()) for k, w in weights.items())

    own, theirs = total(prose), total(retrieval)
    if not theirs > 0:
        raise ValueError("the retrieval rows' effect weights are all zero: the answers' loss reached no coded token "
                         "(rows shorter than the sinks and window?); pass a longer retrieval_seq.")
    scale = own / theirs
    return {kind: [(1 - share) * p.double() + share * scale * r.double() for p, r in zip(prose[kind], retrieval[kind])]
            for kind in prose}


def measure(fisher: FisherCapture, tokenizer: Any, text: str, seeds: Iterable[int], seq: int,
            device: torch.device) -> list[float]:
    """Step the active capture `fisher` over the retrieval rows of `text` with these `seeds` (`retrieval_row`): the
    answer's loss alone, the gradients of the context tokens that are coded (after the capture's sinks, before the
    window that reads the answer) -> each row's answer loss in nats per token."""
    losses = []
    for seed in seeds:
        ids, answer = retrieval_row(tokenizer, text, seq, seed)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        counted = (positions >= fisher.sink_tokens) & (positions < answer - fisher.window)
        loss = fisher.step(ids, torch.ones_like(ids), positions, counted, device, scored=positions >= answer)
        losses.append(loss / (ids.shape[1] - answer))
    return losses


def with_retrieval_weights(parts: Mapping[str, Components], fisher: Mapping[str, Any],
                           share: float = 0.5) -> dict[str, Components]:
    """`parts` (kind -> components with effect weights) with each kind's weights, per head and per layer basis where
    it has one, mixed by `mix_effect` at `share` with those of the retrieval rows' Fisher sums `fisher`
    (`FisherCapture.sums()`); each keeps its dtype, every other field is the same object."""
    def own(c: Components) -> list[torch.Tensor]:
        return [c.weights] + ([c.layer_weights] if c.layer_weights is not None else [])

    def measured(kind: str, c: Components) -> list[torch.Tensor]:
        count = max(fisher["count"], 1)
        head = effect_weights(fisher[kind] / count, c.eigenvectors)
        if c.layer_weights is None:
            return [head]
        return [head, effect_weights(fisher[f"layer_{kind}"] / count, c.layer_eigenvectors)]

    mixed = mix_effect({k: own(c) for k, c in parts.items()}, {k: measured(k, c) for k, c in parts.items()},
                       {k: c.eigenvalues for k, c in parts.items()}, share)
    return {k: dataclasses.replace(c, weights=mixed[k][0].to(c.weights.dtype),
                                   layer_weights=None if c.layer_weights is None else
                                   mixed[k][1].to(c.layer_weights.dtype))
            for k, c in parts.items()}
