"""Train a shipped reference model: a small Llama (or Mistral/Qwen3) on Shakespeare, byte-level BPE, on CPU.

    python -m evals train-reference --out artifacts/reference-llama --minutes 20
    python -m evals train-reference --arch qwen3 --out artifacts/reference-qwen3 --minutes 6

Writes an HF-format folder (config.json, model.safetensors, tokenizer files) that
`AutoModelForCausalLM.from_pretrained` loads offline, plus training.json with the held-out perplexity.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, PreTrainedModel

from patchkv.corpus import HELD_OUT, shakespeare_held_out, shakespeare_train

from .suite import ROOT
from .verbs import parse, parser

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>"]


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>", model_max_length=1024)


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def perplexity(model: PreTrainedModel, ids: torch.Tensor, seq_len: int, max_windows: int = 200) -> float:
    model.eval()
    n = min(ids.numel() // seq_len, max_windows)
    windows = ids[: n * seq_len].view(n, seq_len)
    nll = sum(model(w, labels=w).loss.item() * w.shape[0] * (seq_len - 1) for w in windows.split(8))
    model.train()
    return math.exp(nll / (n * (seq_len - 1)))


def main(argv: list[str] | None = None) -> None:
    p = parser("train-reference", __doc__, out=ROOT / "artifacts" / "reference-llama", threads=None)
    p.add_argument("--arch", choices=["llama", "mistral", "qwen3"], default="llama")
    p.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = parse(p, argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    train_texts, held_texts = shakespeare_train(), shakespeare_held_out()
    tokenizer = train_tokenizer(train_texts, args.vocab)
    train_ids, held_ids = encode(tokenizer, train_texts), encode(tokenizer, held_texts)
    config = AutoConfig.for_model(
        args.arch, vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"sliding_window": 128} if args.arch == "mistral" else {}),
    )
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f}M parameters, {train_ids.numel()} train tokens, {held_ids.numel()} held-out tokens")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget, start, step, warmup = args.minutes * 60, time.time(), 0, 50
    model.train()
    while (elapsed := time.time() - start) < budget:
        progress = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - args.seq_len, (args.batch,))
        batch = torch.stack([train_ids[s: s + args.seq_len] for s in starts])
        loss = model(batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            print(f"step {step} {elapsed / 60:.1f} min loss {loss.item():.3f} lr {lr:.2e}", flush=True)
        step += 1

    held_ppl = perplexity(model, held_ids, args.seq_len)
    out = Path(args.out)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {"parameters": params, "steps": step, "tokens_seen": step * args.batch * args.seq_len,
              "minutes": round((time.time() - start) / 60, 1), "held_out_works": list(HELD_OUT),
              "held_out_token_perplexity": round(held_ppl, 3), "seq_len": args.seq_len, "args": vars(args)}
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
