"""The bench: plain and speculative greedy in one run; answers end at the end of turn unless a fixed length
is asked for; its figures come from the run (identity, token counts, load average)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import DEVICE
from provision.engine import TINY_DIR
from provision.engine.bench import run_bench, transformers_peer
from provision.engine.corpus import held_out_prompts
from provision.engine.loading import load_engine


@pytest.fixture(scope="module")
def tiny():
    e = load_engine(device=DEVICE, dtype="float32", max_seq_len=256)
    e.stop_ids = {e.tokenizer.encode(" ")[-1]}                  # a token the tiny pair writes often: answers end early
    return e


def test_answers_stop_at_the_end_of_turn(tiny):
    prompts = held_out_prompts(2)
    r = run_bench(tiny, prompts, max_new_tokens=40)
    assert r["stop_at_eos"] and r["greedy_identical"]
    assert all(out[-1] in tiny.stop_ids and len(out) < 40 for out in r["plain_outputs"])
    assert r["tokens"] == sum(map(len, r["plain_outputs"]))
    fixed = run_bench(tiny, prompts, max_new_tokens=40, stop_at_eos=False)
    assert fixed["tokens"] == 80 and fixed["greedy_identical"]
    assert set(r["load_average_1min"]) == {"start", "end"}


@pytest.mark.skipif(DEVICE != "cpu", reason="the CLI bench runs on CPU here")
def test_cli_bench_bfloat16_json():
    p = subprocess.run([sys.executable, "-m", "provision.cli", "engine", "bench", "--prompts", "2",
                        "--max-new-tokens", "24", "--dtype", "bfloat16", "--fixed-length", "--json"],
                       capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert (r["dtype"], r["shared_rows"], r["stop_at_eos"], r["tokens"]) == ("bfloat16", True, False, 48)
    assert r["greedy_identical"] and r["accept_length"] > 1.0


def test_transformers_peer_runs_each_prompt_with_the_engine():
    pytest.importorskip("transformers")
    e = load_engine(device=DEVICE, dtype="float32", max_seq_len=256)
    r = run_bench(e, held_out_prompts(2), max_new_tokens=16, peer=transformers_peer(TINY_DIR, e))
    assert r["transformers_same_tokens"] and r["greedy_identical"]      # float32: the same tokens as transformers
    assert r["transformers_tok_s"] > 0 and r["plain_vs_transformers"] > 0
