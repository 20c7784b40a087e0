"""Which dtype the engine is fastest in on this device: float32 and bfloat16 engines of one checkpoint, each prompt
decoded by both in turn (plain and speculative), in one run; prints tok/s per dtype and bfloat16 ÷ float32.

    python bench/dtype_bench.py                                   # the bundled tiny pair, CPU
    python bench/dtype_bench.py --model smollm2 --draft bench/smollm2-135m-instruct-eagle3 --chat --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from provision.engine.bench import encode_prompts  # noqa: E402
from provision.engine.loading import auto_dtype, load_engine  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chat", action="store_true", help="held-out chat prompts through the model's template")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    engines = {dt: load_engine(a.model, a.draft, device=a.device, dtype=dt, max_seq_len=a.max_seq_len)
               for dt in DTYPES}
    prompts = encode_prompts(engines[DTYPES[0]], a.chat, a.prompts)
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=0.0)
    for eng in engines.values():                     # warm-up: capture, each prompt's shapes, each mode
        eng.capture()
        for ids in prompts:
            for spec in (False, True):
                eng.generate(ids, max_new_tokens=4, speculative=spec, stop_at_eos=False)
    secs = {(dt, spec): 0.0 for dt in DTYPES for spec in (False, True)}
    toks, outs = dict.fromkeys(secs, 0), {k: [] for k in secs}
    load0 = os.getloadavg()[0]
    for ids in prompts:                              # interleaved: each prompt by every engine in turn
        for spec in (False, True):
            for dt, eng in engines.items():
                t0 = time.perf_counter()
                r = eng.generate(ids, speculative=spec, **kw)
                if eng.device.type == "cuda":
                    torch.cuda.synchronize()
                secs[dt, spec] += time.perf_counter() - t0
                toks[dt, spec] += len(r.tokens)
                outs[dt, spec].append(r.tokens)
    rate = {f"{dt} {'eagle3' if spec else 'plain'}": round(toks[dt, spec] / secs[dt, spec], 2) for dt, spec in secs}
    out = {"device": a.device, "model": a.model or "tiny pair", "prompts": len(prompts), "threads": a.threads,
           "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)], "tok_s": rate,
           "bfloat16_over_float32": {m: round(rate[f"bfloat16 {m}"] / rate[f"float32 {m}"], 3)
                                     for m in ("plain", "eagle3")},
           "greedy_identical": {dt: outs[dt, False] == outs[dt, True] for dt in DTYPES},
           "fastest": max(DTYPES, key=lambda dt: rate[f"{dt} eagle3"]),
           "auto": auto_dtype(a.device, engines[DTYPES[0]].target.args)}
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['model']} on {a.device}, {len(prompts)} prompts, {a.threads} threads, load {out['load_average_1min']}")
        for k, v in rate.items():
            print(f"  {k:<18} {v:>8} tok/s")
        print(f"  bfloat16 / float32: plain {out['bfloat16_over_float32']['plain']}x, "
              f"EAGLE-3 {out['bfloat16_over_float32']['eagle3']}x; fastest: {out['fastest']}")
        print(f"  greedy EAGLE-3 = plain: {out['greedy_identical']}")
        print(f"  auto picks {out['auto'][0]} ({out['auto'][1]})")
    return out


if __name__ == "__main__":
    main()
