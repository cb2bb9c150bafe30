"""benchmarks/hybrid_engine.py at toy sizes in this process (hidden 64, 4 layers, vocabulary 128,
prompts of 32-64 tokens, a state checkpoint every block): its tables and the JSON it writes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tests.bench_machine import assert_names_machine  # noqa: E402

TOY = (
    "--hidden 64 --intermediate 128 --layers 4 --vocab 128 --heads 4 --kv-heads 2 --head-dim 16 "
    "--linear-key-heads 2 --linear-value-heads 4 --linear-head-dim 16 --state-dim 16 --seqs 4 "
    "--prompt 32 --decode-tokens 4 --ttft-prompt 64 --system 48 --shared-requests 4 --tail 8 16 "
    "--checkpoint-blocks 1 --kv-mib 8"
).split()


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_hybrid_engine_benchmark(tmp_path, capsys, family):
    from benchmarks import hybrid_engine

    out = tmp_path / "h.json"
    assert hybrid_engine.main(TOY + ["--family", family, "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert_names_machine(res, stdout)
    assert f"| hybrid {family} |" in stdout and "| dense qwen3 |" in stdout
    models = res["models"]
    for name, m in models.items():
        d, t, s = m["decode"], m["ttft"], m["shared"]
        # 4 x 32 prompt tokens fit one step: then 3 decode steps of 4 rows
        assert d["to_first_s"] > 0 and d["decode_s"] > 0 and d["tok_s"] > 0
        assert d["decode_steps"] == 3 and d["decode_tokens"] == 4 * 3
        assert t["cold_s"] > 0 and t["hit_s"] > 0 and t["hit_over_cold"] > 0
        assert t["cached"] == 48  # 64 tokens: 3 whole blocks before the last token
        # the first request fills the cache, the others reuse the 48-token system prompt
        assert s["cached_per_request"] == [0, 48, 48, 48]
        assert 0 < s["hit_rate"] < 1 and s["prompt_tokens"] >= 4 * (48 + 8)
        if name == "dense":
            assert s["saved"] == s["restored"] == 0 and m["state_bytes_per_sequence"] == 0
        else:
            assert s["saved"] > 0 and s["restored"] >= 3 and m["checkpoint_blocks"] == 1
    h, d = models["hybrid"], models["dense"]
    assert h["state_bytes_per_sequence"] > 0 and 0 < h["bytes_per_token"] < d["bytes_per_token"]
    summary = res["summary"]
    ratios = summary["memory_ratio"]
    assert set(ratios) == {"4096", "16384", "65536"} and 0 < ratios["65536"] < 1
    assert ratios["65536"] <= ratios["4096"]  # the fixed state weighs less at long contexts
    assert summary["hit_rate_vs_dense"] == 1 and summary["hit_rate_goal_met"] is True
    assert summary["decode_vs_dense"] > 0 and isinstance(summary["ttft_goal_met"], bool)
    assert res["load"][0] and res["load"][1] and res["seconds"] > 0
