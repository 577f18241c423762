"""`python -m evals generation-bytes` (evals/bench_generation_bytes.py) on a tiny model: the bytes per token are the
cache's own count over the tokens held, and with `Evict` the counterfactual of keeping every decode token adds back
exactly the codes of the tokens dropped after the prompt (the bitmap holds their bits either way)."""

from conftest import calibration_ids, make_model

import patchkv
from evals.bench_generation_bytes import FIELDS, dropped_while_decoding, generate_rows, main, table
from evals.suite import write_csv
from patchkv.nbytes import cache_nbytes


def test_rows_count_the_cache_and_what_ranking_decode_tokens_saved():
    model = make_model("llama")
    art = patchkv.calibrate(model, calibration_ids(), mode="pre_rope", rank=8, progress=False)
    ids = calibration_ids(1, 30, seed=11)
    methods = [patchkv.SinksWindow(2, 3), patchkv.Quantized(24), patchkv.Evict(0.3, block=8)]
    with patchkv.patched(model, art, methods):
        cache = patchkv.LatentCache(model)
        rows = generate_rows(model, ids, cache, new=20, every=5, name="tiny", unpatched=1000.0)
    assert [r["generated"] for r in rows] == [5, 10, 15, 20]
    last = rows[-1]
    held = 30 + 20
    assert last["kv_bytes_per_token"] == cache_nbytes(cache) / held
    # after the prefill's 24, 21 tokens left one step at a time (the prompt's last and 20 generated): twice 8 ranked,
    # 2 dropped each
    assert all(layer.passed == 24 + 21 and layer.pending == 5 for layer in cache.layers)
    codes = sum(layer.patch.keys.bytes_per_token() + layer.patch.values.bytes_per_token() for layer in cache.layers)
    assert dropped_while_decoding(cache, [24] * len(cache.layers)) == 4 * codes
    assert last["all_kept_bytes_per_token"] == (cache_nbytes(cache) + 4 * codes) / held > last["kv_bytes_per_token"]
    with patchkv.patched(model, art, methods[:2]):
        plain = generate_rows(model, ids, patchkv.LatentCache(model), new=5, every=5, name="plain", unpatched=1000.0)
    assert plain[0]["all_kept_bytes_per_token"] == ""
    assert "| tiny | 20 |" in table(rows) and "| plain | 5 |" in table(plain)


def test_table_reads_the_csv(tmp_path, capsys):
    rows = [{"config": "16x-evict", "prompt": 4096, "generated": 128, "kv_bytes_per_token": 1431.5,
             "compression_vs_bf16": 16.1, "all_kept_bytes_per_token": 1450.25}]
    write_csv(rows, tmp_path / "gb.csv", FIELDS)
    main(["--table", "--out", str(tmp_path), "--name", "gb"])
    assert "| 16x-evict | 128 | 1,432 | 16.10x | 1,450 |" in capsys.readouterr().out
