"""How the suite runs its tasks, one sample at a time: `TASKS` holds a runner for every task of the one registry
(`patchkv.tasks.TASKS`) that is not an lm-eval one (those are `patchkv eval`'s), built from its record.

A runner turns a sample into a `patchkv.records.Result` (the record `patchkv eval` and `patchkv report` write too)
through the configuration's cache:
- `Perplexity` (kind `perplexity`: `ppl_prose`, `ppl_shakespeare`, `ppl_milton`): token perplexity of one held-out
  document, fed 64 tokens per forward through the cache (`patchkv.perplexity.token_nll`, the function `patchkv report`
  uses).
- `Ruler` (kind `ruler`: `ruler_niah_single_1`, ...): lm-eval's own RULER task. Its prompt is split where the question starts;
  the context goes through the model in one forward and is stored as the cache stores it (compressed by a
  patchkv config, quantized by QuantizedCache, evicted by a kvpress press in evals/peers), then the question is
  fed and the answer decoded greedily, every token reading the cache. The answer is scored by the task's own
  `process_results`. Decoding stops at EOS, at the task's `max_gen_toks`, or once every reference answer is in the
  text: RULER's metrics (`string_match_all` / `_part`) only look for the references, so that stop is exact.
- `NeedleText` (kind `needle`: `needle_text`): a number hidden in held-out prose, run as `Ruler` runs RULER.
- `Continuation` (kind `continuation`: `ppl_after_prose`, ...): a held-out document cut where its last 512 tokens
  start; the context goes through the model in one forward and is stored as the cache stores it (as RULER's), then
  the 512 tokens are read in one forward and scored (the first from the prefill's last logits). It is the perplexity
  a kvpress press can be scored by (`evals/peers`: a press compresses once, after the prefill), so patchkv, the
  presses and QuantizedCache meet on one measure; bytes are those the cache holds after the prefill, per context
  token, since the continuation is held exact by the presses.

RULER's prompts are built once per (task, context) by lm-eval (seeded: some haystacks draw from the global
generators) and kept in `.cache/ruler/<task>@<context>.jsonl` as token ids: the same ids every runner reads,
kvpress's included.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from patchkv.nbytes import cache_nbytes
from patchkv.perplexity import token_nll
from patchkv.records import Result
from patchkv.retrieval import INTRO, hide
from patchkv.tasks import TASKS as REGISTRY
from patchkv.tasks import Task, documents

from .suite import text_ids

ROOT = Path(__file__).resolve().parents[1]
RULER_CACHE = ROOT / ".cache" / "ruler"


@dataclass(frozen=True)
class Perplexity(Task):
    """Token perplexity of the held-out documents of the data file `source` (never in any calibration mix), `chunk`
    tokens per forward."""

    chunk: int = 64

    def documents(self) -> list[str]:
        return documents(self.source)

    def available(self, context: int) -> int:
        return len(self.documents())

    def run(self, model: nn.Module, tokenizer: Any, index: int, context: int, cache: Any, config: str = "") -> Result:
        """Document `index`'s first `context` tokens through `cache` (None: the model's own) under `config` (its
        name): the NLL sum over the tokens scored."""
        ids = text_ids(tokenizer, self.documents()[index], context)
        began = time.perf_counter()
        scored = token_nll(model, ids, self.chunk, cache)
        return Result(config=config, task=self.name, context=context, index=index, score=scored.nll,
                      count=scored.count, kv_bytes_per_token=cache_nbytes(scored.cache) / ids.shape[1],
                      seconds=time.perf_counter() - began)


@dataclass(frozen=True)
class Ruler(Task):
    """lm-eval's RULER subtask `source` (offline ones only: the essay haystacks and QA sets need the Hub)."""

    def samples_path(self, context: int) -> Path:
        return RULER_CACHE / f"{self.source}@{context}.jsonl"

    def samples(self, context: int, count: int, tokenizer_path: Path) -> list[dict]:
        """The first `count` prompts at `context` tokens: built by lm-eval once, then read from the cache file."""
        path = self.samples_path(context)
        have = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        if len(have) < count:
            have = self.build(context, count, tokenizer_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in have))
        return have[:count]

    def build(self, context: int, count: int, tokenizer_path: Path) -> list[dict]:
        return build_ruler_samples(self.source, context, count, tokenizer_path)

    def available(self, context: int) -> int:
        path = self.samples_path(context)
        return len(path.read_text().splitlines()) if path.is_file() else 0

    @torch.no_grad()
    def run(self, model: nn.Module, tokenizer: Any, sample: dict, cache: Any, config: str = "") -> Result:
        """One prompt through `cache` (None: the model's own) under `config` (its name): its score in [0, 1]."""
        began = time.perf_counter()
        _, cache, context, question = prefill(model, sample, cache)
        logits = model(input_ids=question, cache=cache, use_cache=True).logits[:, -1]
        held = cache_nbytes(cache) / (context.shape[1] + question.shape[1])
        answer = greedy_answer(model, tokenizer, logits, cache, sample["max_new_tokens"], sample["outputs"])
        return Result(config=config, task=self.name, context=sample["context_length"], index=sample["index"],
                      score=ruler_score(sample, answer), kv_bytes_per_token=held, seconds=time.perf_counter() - began,
                      prediction=answer)


def prefill(model: nn.Module, sample: dict, cache: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """A sample's context through `cache` (None: the model's own) in one forward, stored as the cache stores it:
    (the forward's output, its last logits only, the cache, the context's and the question's ids `[1, n]`)."""
    device = next(model.parameters()).device
    context = torch.tensor([sample["context_ids"]], device=device)
    question = torch.tensor([sample["question_ids"]], device=device)
    out = model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    return out, out.cache if cache is None else cache, context, question


@torch.no_grad()
def greedy_answer(model: nn.Module, tokenizer: Any, logits: torch.Tensor, cache: Any, limit: int,
                  references: list[str]) -> str:
    """Greedy-decode from next-token `logits` `[1, vocab]` through `cache` until EOS, `limit` tokens, or every
    reference is in the text (lower-cased, as RULER matches)."""
    tokens: list[int] = []
    wanted = [r.lower() for r in references]
    for _ in range(limit):
        token = int(logits.argmax(-1))
        if token == tokenizer.eos_token_id:
            break
        tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if all(r in text.lower() for r in wanted):
            break
        logits = model(input_ids=torch.tensor([[token]], device=logits.device), cache=cache, use_cache=True).logits[:, -1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def ruler_score(sample: dict, answer: str) -> float:
    """The task's own metric (lm-eval's `common_utils.process_results[_part]`) on one answer, in [0, 1]; for the
    suite's own needle task (`NeedleText`, scorer "contains_all"), whether every reference is in the answer, as
    RULER's string_match_all counts one sample."""
    if sample["scorer"] == "contains_all":
        return float(all(r.lower() in answer.lower() for r in sample["outputs"]))
    from lm_eval.tasks.ruler import common_utils

    scorer = getattr(common_utils, sample["scorer"])
    return float(scorer({"max_length": sample["context_length"], "outputs": sample["outputs"]}, [answer])
                 [str(sample["context_length"])])


def build_ruler_samples(subtask: str, context: int, count: int, tokenizer_path: Path) -> list[dict]:
    """`count` RULER prompts of `subtask` at `context` tokens as lm-eval builds them (its haystacks, its prompt and
    answer prefix, tokenised as its HF model does: no special tokens), each split at its question into
    `context_ids` and `question_ids`. Seeded: the same prompts on every run."""
    import numpy as np
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    random.seed(0)
    np.random.seed(0)
    tasks = TaskManager(metadata={"max_seq_lengths": [context], "tokenizer": str(tokenizer_path)}).load([subtask])
    task = next(iter(tasks.values())) if isinstance(tasks, dict) else tasks
    while isinstance(task, dict):  # groups nest
        task = next(iter(task.values()))
    task.build_all_requests(limit=count, rank=0, world_size=1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    out = []
    for index, instance in enumerate(task.instances[:count]):
        prompt, gen_kwargs = instance.arguments
        doc = instance.doc
        split = doc["input"].rfind("\n") + 1  # the question is the prompt's last line, then the answer prefix
        if not 0 < split <= len(prompt) or not prompt.startswith(doc["input"][:split]):
            raise ValueError(f"{subtask}: cannot find where the question starts in sample {index}")
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        cut = next(i for i, (begin, _) in enumerate(enc["offset_mapping"]) if begin >= split)
        ids = enc["input_ids"]
        out.append({"task": subtask, "context_length": context, "index": index, "context_ids": ids[:cut],
                    "question_ids": ids[cut:], "max_new_tokens": int(gen_kwargs.get("max_gen_toks", 128)),
                    "outputs": list(doc["outputs"]), "scorer": task.config.process_results.__name__})
    return out


@dataclass(frozen=True)
class Continuation(Ruler):
    """The last `tokens` of each held-out document of the data file `source`, scored after the rest was prefilled and
    compressed (module doc). A sample: `context_ids` (BOS and the document's first `context - tokens` tokens),
    `question_ids` (its next `tokens`), scorer "nll"."""

    tokens: int = 512

    def samples_path(self, context: int) -> Path:
        return RULER_CACHE / f"{self.name}@{context}.jsonl"

    def available(self, context: int) -> int:
        return len(documents(self.source))

    def build(self, context: int, count: int, tokenizer_path: Path) -> list[dict]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        out = []
        for index, text in enumerate(documents(self.source)[:count]):
            ids = text_ids(tokenizer, text, context)[0].tolist()
            if len(ids) < context:
                raise ValueError(f"{self.name}: document {index} has {len(ids)} tokens, fewer than the {context} "
                                 "asked for; use a shorter --context.")
            out.append({"task": self.name, "context_length": context, "index": index,
                        "context_ids": ids[:-self.tokens], "question_ids": ids[-self.tokens:], "scorer": "nll"})
        return out

    @torch.no_grad()
    def run(self, model: nn.Module, tokenizer: Any, sample: dict, cache: Any, config: str = "") -> Result:
        """One document through `cache` (None: the model's own) under `config` (its name): the NLL sum of its last
        `tokens`, with the bytes the cache held after the prefill, per context token."""
        began = time.perf_counter()
        out, cache, context, continuation = prefill(model, sample, cache)
        held = cache_nbytes(cache) / context.shape[1]
        later = model(input_ids=continuation, cache=cache, use_cache=True).logits[:, :-1]
        logprobs = torch.cat([out.logits[:, -1:], later], dim=1).float().log_softmax(-1)
        nll = -logprobs.gather(-1, continuation.unsqueeze(-1)).sum().item()
        return Result(config=config, task=self.name, context=sample["context_length"], index=sample["index"],
                      score=nll, count=continuation.shape[1], kv_bytes_per_token=held,
                      seconds=time.perf_counter() - began)


#: (the sentence hidden in the text, the question that asks for it); {n} is the number. None of them is one of the
#: wordings calibration's retrieval rows use (`patchkv.retrieval.WORDINGS`)
NEEDLES = (
    ("The pass key is {n}. Remember it. {n} is the pass key.", "What is the pass key? The pass key is"),
    ("Note for the reader: the access code for the archive is {n}.",
     "What is the access code for the archive? The access code for the archive is"),
    ("(The serial number of the old printer in room four is {n}.)",
     "What is the serial number of the old printer in room four? The serial number is"),
    ("My grandmother's favourite number was {n}, and she wrote it on every letter.",
     "What was the grandmother's favourite number? Her favourite number was"),
)


@dataclass(frozen=True)
class NeedleText(Ruler):
    """A needle in real held-out text (`needle_text`): a 7-digit number in one of four wordings (`NEEDLES`), at a
    depth drawn in [10%, 90%] and moved to the next line break, inside a held-out 4k document of the data file
    `source` (`needle_text`'s: the Python documentation prose of `ppl_prose`, never in any calibration mix, each used
    again with other needles and depths),
    asked for after the text; scored 1 if the answer holds the number. Seeded by the sample index; run by RULER's protocol (`Ruler.run`), so a method cannot pass by coding a
    repetitive haystack well."""

    def samples_path(self, context: int) -> Path:
        return RULER_CACHE / f"{self.name}@{context}.jsonl"

    def build(self, context: int, count: int, tokenizer_path: Path) -> list[dict]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        haystacks = documents(self.source)
        out = []
        for index in range(count):
            rng = random.Random(index)
            text = haystacks[index % len(haystacks)]
            number = str(rng.randrange(1_000_000, 10_000_000))
            needle, question = NEEDLES[rng.randrange(len(NEEDLES))]
            question_ids = tokenizer("\n\n" + question, add_special_tokens=False)["input_ids"]
            intro = tokenizer(INTRO, add_special_tokens=False)["input_ids"]
            room = context - len(question_ids) - len(intro) - 40  # the needle's own tokens
            hidden, depth = hide(tokenizer, text, needle.format(n=number), room, rng)
            ids = tokenizer(INTRO + hidden, add_special_tokens=False)["input_ids"]
            out.append({"task": self.name, "context_length": context, "index": index, "depth": depth,
                        "context_ids": ids[:context - len(question_ids)], "question_ids": question_ids,
                        "max_new_tokens": 16, "outputs": [number], "scorer": "contains_all"})
        return out


def wilson_half_width(mean: float, n: int) -> float:
    """Half the width of the 95% Wilson interval of a mean of `n` scores in [0, 1] (never 0 when n is small)."""
    if n == 0:
        return math.nan
    z = 1.959964
    centre_spread = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
    return centre_spread / (1 + z * z / n)


#: the runner of each kind of task the suite runs
RUNNERS: dict[str, type[Task]] = {"perplexity": Perplexity, "ruler": Ruler, "needle": NeedleText,
                                   "continuation": Continuation}
TASKS: dict[str, Perplexity | Ruler] = {name: RUNNERS[task.kind](**asdict(task)) for name, task in REGISTRY.items()
                                        if task.kind in RUNNERS}
