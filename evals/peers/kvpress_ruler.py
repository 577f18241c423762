"""kvpress's presses on the suite's RULER samples: the same token ids and SmolLM2 weights patchkv reads.

    .venv-peers/bin/python evals/peers/kvpress_ruler.py --samples .cache/ruler/samples_4096.jsonl \
        --out .cache/ruler/kvpress.jsonl [--presses all] [--ratios 0.75,0.875] [--limit N] [--threads 1]
    .venv-peers/bin/python evals/peers/kvpress_ruler.py --selftest

Runs in its own environment (.venv-peers, scripts/setup_peers.sh: kvpress 0.5.5 needs transformers<5.3) and never
imports patchkv or lm_eval. evals/peers/README.md says what the protocol and the byte counts mean.

Each samples line (written by the main suite) is one RULER prompt split at its question:
`{"task", "context_length", "index", "context_ids", "question_ids", "max_new_tokens", ...}`. For every press and
compression ratio, each sample goes through kvpress's own pipeline (KVPressTextGenerationPipeline._forward and
generate_answer, kvpress/pipeline.py, mirrored step by step here minus its chat template and tokenisation, since the
ids are given): the context ids are prefilled through `model.model` with the press active (`with press(model)`),
then the question ids are fed uncompressed at positions that continue the original context, and the answer is
decoded greedily until EOS or `max_new_tokens`. One prediction line per sample is appended to --out (flushed at
once; lines already there, by (method, task, context_length, index), are skipped, so a run resumes).

Unless --no-reference-stop, decoding also stops once every reference answer (the sample's "outputs", when it has
them) is in the lower-cased text, as the main suite's greedy decoder does: RULER's string_match metrics only look
for the references, so the score is the same and CPU time is saved.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / ".models" / "SmolLM2-135M-Instruct"
PROTOCOL = "context compressed, question exact"
#: a continuation sample's (scorer "nll"), as the suite's `Continuation` task words it; {n}: its tokens
CONTINUATION_PROTOCOL = "context compressed after its prefill; its last {n} tokens read it in one forward, scored"

# The presses run by default, by name (also accepted: these aliases, or any kvpress class taking compression_ratio).
# KVzipPress is the full KVzip (context reconstruction, about 3x a prefill): FastKVzipPress downloads its trained
# gates from the Hub at run time and cannot run offline.
DEFAULT_PRESSES = ("ExpectedAttentionPress", "KVzipPress", "SnapKVPress", "KnormPress", "StreamingLLMPress",
                   "TOVAPress", "AdaKVPress(ExpectedAttentionPress)")
ALIASES = {"expected_attention": "ExpectedAttentionPress", "kvzip": "KVzipPress", "snapkv": "SnapKVPress",
           "knorm": "KnormPress", "streaming_llm": "StreamingLLMPress", "tova": "TOVAPress",
           "adakv_expected_attention": "AdaKVPress(ExpectedAttentionPress)",
           "adakv": "AdaKVPress(ExpectedAttentionPress)"}


def make_press(name: str, ratio: float):
    """The kvpress press called `name` at `ratio` (the fraction of context KV pairs removed): a class name, or
    `AdaKVPress(Inner)` for AdaKV's head-wise budgets over the scorer press `Inner`."""
    import kvpress

    name = ALIASES.get(name, name)
    if name.startswith("AdaKVPress(") and name.endswith(")"):
        return kvpress.AdaKVPress(make_press(name[len("AdaKVPress("):-1], ratio))
    if name == "KVzipPress":
        return raw_ids_kvzip()(compression_ratio=ratio)
    cls = getattr(kvpress, name, None)
    if cls is None or not isinstance(cls, type):
        raise SystemExit(f"unknown press {name!r}: a kvpress class name, AdaKVPress(<scorer press>), or one of "
                         f"{sorted(ALIASES)}")
    return cls(compression_ratio=ratio)


def raw_ids_kvzip():
    """KVzipPress for context ids that carry no chat template. KVzip takes the first `prefix_length` context tokens
    to be the chat template's prefix (24 tokens for SmolLM2's template: its system prompt and the user header) and
    leaves them unscored (so evicted first, bar its 4 sinks); the suite's RULER contexts are lm-eval's raw prompt
    with no template, so the prefix is 0 here and every context token is scored. Everything else is KVzip's own
    (its reconstruction prompt, the template's assistant header as its suffix, chunking and head-wise scores)."""
    from kvpress import KVzipPress

    class RawIdsKVzipPress(KVzipPress):
        def _perform_kvzip_compression(self, model, tokenizer):
            self.prefix_length = 0
            return super()._perform_kvzip_compression(model, tokenizer)

    return RawIdsKVzipPress


def press_name(name: str) -> str:
    return ALIASES.get(name, name)


def kv_bytes_per_token(config, ratio: float, n_context: int, n_question: int) -> float:
    """The KV bytes a token costs after the press, counted alike for every method: an evicting press at `ratio`
    keeps (1 - ratio) of the context tokens' keys and values at bf16 (2 bytes) in every layer and KV head, the
    question's tokens stay whole; averaged over context + question tokens."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 2
    return full * ((1 - ratio) * n_context + n_question) / (n_context + n_question)


def load_model(path: Path, dtype: str, attn: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype], attn_implementation=attn)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer


def answer_sample(model, tokenizer, press, context_ids: list[int], question_ids: list[int], max_new_tokens: int,
                  references: list[str] | None) -> tuple[str, int, int]:
    """kvpress's pipeline on one sample (KVPressTextGenerationPipeline._forward then generate_answer, one question):
    returns the decoded answer, the number of new tokens and the cache's sequence length after the prefill."""
    import torch
    from transformers import DynamicCache
    from kvpress.presses.decoding_press import DecodingPress
    from kvpress.presses.dms_press import DMSPress
    from kvpress.presses.finch_press import FinchPress
    from kvpress.presses.key_rerotation_press import KeyRerotationPress
    from kvpress.presses.prefill_decoding_press import PrefillDecodingPress
    from kvpress.presses.restorekv_press import RestoreKVPress

    device = model.device
    context = torch.tensor([context_ids], device=device)
    question = torch.tensor([question_ids], device=device)
    context_length = context.shape[1]
    cache = DynamicCache()
    # prefill with the press active, through the model without its LM head (pipeline._forward)
    prefill = press is not None and not isinstance(press, DecodingPress)
    with press(model) if prefill else contextlib.nullcontext():
        model.model(input_ids=context, past_key_values=cache)
    kept = cache.get_seq_length()
    if isinstance(press, RestoreKVPress):
        context_length = cache.get_seq_length()
    decoding = press is not None and isinstance(press, (DecodingPress, PrefillDecodingPress))
    if isinstance(press, DMSPress):
        decoding = press.decoding
    with press(model) if decoding else contextlib.nullcontext():
        if isinstance(press, KeyRerotationPress) or (isinstance(press, FinchPress) and press.rerotate_keys):
            context_length = cache.get_seq_length()
        # generate_answer: the question at the positions after the original context, then greedy decoding
        position_ids = torch.arange(context_length, context_length + question.shape[1], device=device).unsqueeze(0)
        outputs = model(input_ids=question, past_key_values=cache, position_ids=position_ids, logits_to_keep=1)
        position_ids = position_ids[:, -1:] + 1
        generated = [outputs.logits[0, -1].argmax()]
        stop = model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop])
        wanted = [r.lower() for r in references] if references else None
        for i in range(max_new_tokens - 1):
            # kvpress's loop checks EOS on each token it appends after the first; an EOS first token ends it here too
            if int(generated[-1]) in stop:
                break
            if wanted is not None:
                text = tokenizer.decode(torch.stack(generated), skip_special_tokens=True).lower()
                if all(r in text for r in wanted):
                    break
            outputs = model(input_ids=generated[-1].view(1, 1), past_key_values=cache, position_ids=position_ids + i)
            generated.append(outputs.logits[0, -1].argmax())
    answer = str(tokenizer.decode(torch.stack(generated), skip_special_tokens=True))
    return answer, len(generated), kept


def continuation_nll(model, press, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, int]:
    """A continuation sample (scorer "nll"): the context prefilled with the press active, as `answer_sample` does it
    (kvpress's pipeline), through the whole model so that the prefill's last logits score the continuation's first
    token; then the continuation in one forward at the positions after the original context, its other tokens scored
    by their predecessors' logits. Returns (the NLL sum in nats, the cache's sequence length after the prefill)."""
    import torch
    from transformers import DynamicCache

    device = model.device
    context = torch.tensor([context_ids], device=device)
    continuation = torch.tensor([continuation_ids], device=device)
    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        first = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits
    kept = cache.get_seq_length()
    position_ids = torch.arange(context.shape[1], context.shape[1] + continuation.shape[1], device=device)[None]
    later = model(input_ids=continuation, past_key_values=cache, position_ids=position_ids).logits[:, :-1]
    logprobs = torch.cat([first, later], dim=1).float().log_softmax(-1)
    return -logprobs.gather(-1, continuation.unsqueeze(-1)).sum().item(), kept


def read_samples(patterns: list[str], limit: int | None) -> list[dict]:
    """Samples from the JSONL files (globs allowed), sorted by (task, context_length, index); with `limit`, the
    first `limit` indices of each (task, context_length)."""
    paths = sorted({p for pattern in patterns for p in (glob.glob(pattern) or [pattern])})
    samples = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    samples.sort(key=lambda s: (s["task"], s["context_length"], s["index"]))
    if limit is None:
        return samples
    count: dict[tuple, int] = {}
    kept = []
    for s in samples:
        key = (s["task"], s["context_length"])
        if count.get(key, 0) < limit:
            count[key] = count.get(key, 0) + 1
            kept.append(s)
    return kept


def done_keys(out: Path) -> set[tuple]:
    if not out.is_file():
        return set()
    keys = set()
    for line in out.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            keys.add((r["method"], r["task"], r["context_length"], r["index"]))
    return keys


def method_name(name: str, ratio: float) -> str:
    return f"kvpress {press_name(name)} r={ratio:g}"


def run(args) -> int:
    """Every (press, ratio, sample) not yet in args.out: returns how many lines were written."""
    import torch

    torch.set_num_threads(args.threads)
    samples = read_samples(args.samples, args.limit)
    if not samples:
        raise SystemExit(f"no samples in {args.samples}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)
    todo = [(name, ratio) for name in args.presses for ratio in args.ratios
            if any((method_name(name, ratio), s["task"], s["context_length"], s["index"]) not in done
                   for s in samples)]
    if not todo:
        print(f"{out}: all {len(samples)} samples x {len(args.presses) * len(args.ratios)} methods already there")
        return 0
    model, tokenizer = load_model(Path(args.model), args.dtype, args.attn)
    written = 0
    with out.open("a") as f, torch.no_grad():
        for name, ratio in todo:
            method = method_name(name, ratio)
            for s in samples:
                if (method, s["task"], s["context_length"], s["index"]) in done:
                    continue
                press = make_press(name, ratio)
                began = time.perf_counter()
                n_ctx, n_q = len(s["context_ids"]), len(s["question_ids"])
                if s.get("scorer") == "nll":  # a continuation: bytes after the prefill, per context token
                    nll, kept = continuation_nll(model, press, s["context_ids"], s["question_ids"])
                    scored = {"nll": nll, "count": n_q, "prediction": "", "protocol": CONTINUATION_PROTOCOL.format(n=n_q),
                              "kv_bytes_per_token": kv_bytes_per_token(model.config, ratio, n_ctx, 0)}
                else:
                    answer, n_new, kept = answer_sample(
                        model, tokenizer, press, s["context_ids"], s["question_ids"], int(s["max_new_tokens"]),
                        None if args.no_reference_stop else s.get("outputs"))
                    scored = {"prediction": answer, "protocol": PROTOCOL, "n_generated": n_new,
                              "kv_bytes_per_token": kv_bytes_per_token(model.config, ratio, n_ctx, n_q)}
                seconds = time.perf_counter() - began
                record = {"task": s["task"], "context_length": s["context_length"], "index": s["index"],
                          "method": method, "press": press_name(name), "compression_ratio": ratio, **scored,
                          "seconds": round(seconds, 3), "n_context": n_ctx, "n_question": n_q,
                          "cache_tokens_after_prefill": kept, "dtype": args.dtype}
                if "outputs" in s:
                    record["outputs"] = s["outputs"]
                f.write(json.dumps(record) + "\n")
                f.flush()
                written += 1
                print(f"{method} {s['task']}@{s['context_length']} #{s['index']}: {seconds:.1f} s "
                      f"({n_ctx}+{n_q} tokens) {record.get('nll', record['prediction'][:60])!r}", flush=True)
    return written


def selftest(args) -> None:
    """2 presses (one evicting per token, one with head-wise budgets) on 2 generated 300-token samples of random
    ids and one continuation sample: every line written with the fields the suite reads, and a second run resumes
    without writing any."""
    import math

    vocab = 49152
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "samples.jsonl"
        with samples.open("w") as f:
            for index in range(3):
                ids = [rng.randrange(3, vocab) for _ in range(300)]
                sample = {"task": "selftest", "context_length": 300, "index": index, "context_ids": ids[:280],
                          "question_ids": ids[280:], "max_new_tokens": 6}
                f.write(json.dumps({**sample, "scorer": "nll"} if index == 2 else sample) + "\n")
        args.samples, args.out = [str(samples)], str(Path(tmp) / "out.jsonl")
        args.presses, args.ratios, args.limit = ["SnapKVPress", "AdaKVPress(ExpectedAttentionPress)"], [0.75], None
        assert run(args) == 6, "expected 6 prediction lines"
        lines = [json.loads(line) for line in Path(args.out).read_text().splitlines()]
        assert len(lines) == 6
        for r in lines:
            for key in ("task", "context_length", "index", "method", "press", "compression_ratio",
                        "kv_bytes_per_token", "prediction", "protocol", "seconds"):
                assert key in r, f"missing {key}: {r}"
            assert r["method"] == f"kvpress {r['press']} r=0.75"
            # 30 layers x 3 KV heads x 64 dims x (K, V) x bf16 = 23040 bytes a whole token
            if r["index"] == 2:  # the continuation: its NLL over 20 tokens, bytes per context token after the prefill
                assert r["count"] == 20 and math.isfinite(r["nll"]) and r["nll"] > 0, r
                assert abs(r["kv_bytes_per_token"] - 23040 * 0.25) < 1e-6, r
            else:
                assert isinstance(r["prediction"], str) and 1 <= r["n_generated"] <= 6, r
                assert abs(r["kv_bytes_per_token"] - 23040 * (0.25 * 280 + 20) / 300) < 1e-6, r
        snap = [r for r in lines if r["press"] == "SnapKVPress"]
        assert all(r["cache_tokens_after_prefill"] == 70 for r in snap), snap  # 280 * (1 - 0.75) kept
        assert run(args) == 0, "a second run should resume with nothing to do"
    print("selftest: ok (SnapKVPress and AdaKVPress(ExpectedAttentionPress) at r=0.75, 2 answers and 1 continuation "
          "each)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", action="append", default=[], help="samples JSONL (globs allowed; repeatable)")
    ap.add_argument("--out", help="predictions JSONL, appended to (resumable)")
    ap.add_argument("--presses", default="all", help=f"comma-separated; 'all' = {','.join(DEFAULT_PRESSES)}")
    ap.add_argument("--ratios", default="0.75,0.875", help="compression ratios (fraction of context KV removed)")
    ap.add_argument("--limit", type=int, default=None, help="the first N samples of each (task, context_length)")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--float32", dest="dtype", action="store_const", const="float32", help="same as --dtype float32")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (AdaKV and KVzip refuse eager)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--no-reference-stop", action="store_true",
                    help="decode until EOS or max_new_tokens even once every reference answer is in the text")
    ap.add_argument("--selftest", action="store_true", help="2 presses on 2 random 300-token samples, then exit")
    args = ap.parse_args(argv)
    if args.selftest:
        selftest(args)
        return
    if not args.samples or not args.out:
        ap.error("--samples and --out are required (or --selftest)")
    args.presses = list(DEFAULT_PRESSES) if args.presses == "all" else [p.strip() for p in args.presses.split(",")]
    args.ratios = [float(r) for r in args.ratios.split(",")]
    written = run(args)
    print(f"{args.out}: {written} lines written", file=sys.stderr)


if __name__ == "__main__":
    main()
