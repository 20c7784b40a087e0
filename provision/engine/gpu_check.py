"""The tiny-pair bench on cuda and on cpu in one process, and whether their greedy outputs agree.
    python -m provision.engine.gpu_check [--out FILE.json]   (prints the same JSON)"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .bench import run_bench
from .corpus import held_out_prompts
from .loading import start_engine
from .settings import DEFAULTS


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False      # float32 everywhere: outputs must be comparable
    torch.backends.cudnn.allow_tf32 = False
    prompts, res = held_out_prompts(a.prompts), {}
    for dev in ("cuda", "cpu"):          # the default settings, float32, on each device
        res[dev] = run_bench(start_engine(settings=DEFAULTS.replace(device=dev, dtype="float32")), prompts,
                             a.max_new_tokens)
    same = [x == y for x, y in zip(res["cuda"].pop("outputs"), res["cpu"].pop("outputs"))]
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, **res,
           "greedy_identical_cpu_cuda": all(same), "prompts_identical": f"{sum(same)}/{len(same)}"}
    text = json.dumps(out, indent=2)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
