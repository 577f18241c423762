"""Gemma 3 270M as setup converts it, opt-in (`PATCHKV_SETUP_GEMMA3=1 bash scripts/setup.sh`, into .models/).

Skipped when the folder is absent. When present: it loads as a plain Hugging Face folder in bfloat16 with SDPA, has
Gemma 3's shape (sliding-window layers between full ones, one KV head of dimension 256) and continues a prompt
with words.
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GEMMA3 = ROOT / ".models" / "gemma-3-270m"
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def gemma3():
    if not all((GEMMA3 / name).is_file() for name in FILES):
        pytest.skip(f"Gemma 3 270M is not in {GEMMA3.relative_to(ROOT)} (setup skipped it with "
                    "PATCHKV_SETUP_GEMMA3=0): run `bash scripts/setup.sh`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GEMMA3)
    model = AutoModelForCausalLM.from_pretrained(GEMMA3, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    return model, tokenizer


def test_config_is_gemma3_text(gemma3):
    model, _ = gemma3
    config = model.config
    assert config.model_type == "gemma3_text" and type(model).__name__ == "Gemma3ForCausalLM"
    assert config._attn_implementation == "sdpa" and model.dtype == torch.bfloat16
    assert config.num_hidden_layers == 18 and len(config.layer_types) == 18
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.layer_types[5] == "full_attention" and config.sliding_window == 512
    assert config.num_key_value_heads == 1 and config.head_dim == 256
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features == attn.v_proj.out_features == 256  # 1 KV head x 256
    assert config.vocab_size == 262144 and config.tie_word_embeddings


def test_greedy_continuation_has_words(gemma3):
    model, tokenizer = gemma3
    ids = tokenizer("The capital of France is", return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert len(new) == 8 and len(set(new.tolist())) > 1, text
    assert re.search(r"[A-Za-z]{2}", text), text
