"""How the engine runs a checkpoint: device, precision, speculation tree, context and CPU threads.

One set of defaults for the CLI, the server, the benches and the loader. Standard library only, so the CLI
reads the defaults (and the host agents the flags) without importing torch."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineSettings:
    device: str = _opt("cpu", "cpu, cuda, cuda:1, ...")
    dtype: str = _opt("auto", "auto: where the engine is fastest (bfloat16 on CUDA; on CPU bfloat16 for a large "
                              "target where the CPU has bfloat16 instructions, else float32); "
                              "or float32, bfloat16, float16")
    steps: int = _opt(5, "draft steps (tree depth)")
    topk: int = _opt(4, "beams per step (1 = chain)")
    num_draft_tokens: int = _opt(16, "tokens verified per step, root included (0: from steps and topk)")
    max_seq_len: int = _opt(1024, "context length (KV cache size)")
    threads: int = _opt(1, "CPU threads (0 = torch default; 1 suits the tiny pair)")

    def replace(self, **changes) -> "EngineSettings":
        return dataclasses.replace(self, **changes)


DEFAULTS = EngineSettings()
HELP = {"model": "target checkpoint directory (default: the bundled tiny pair)",
        "draft": "EAGLE-3 draft directory (default: MODEL/draft)",
        **{f.name: f.metadata["help"] for f in dataclasses.fields(EngineSettings)}}


def flag(name: str) -> str:
    """The command-line flag of a setting: num_draft_tokens → --num-draft-tokens."""
    return "--" + name.replace("_", "-")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """--model, --draft and a flag per setting, defaults from DEFAULTS (the modules' own command lines)."""
    ap.add_argument("--model", help=HELP["model"])
    ap.add_argument("--draft", help=HELP["draft"])
    for f in dataclasses.fields(EngineSettings):
        ap.add_argument(flag(f.name), type=type(f.default), default=f.default, help=f.metadata["help"])


def from_arguments(a: argparse.Namespace) -> EngineSettings:
    return EngineSettings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(EngineSettings)})


KERNEL_VARS = ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def kernel_cache(prefix: str = sys.prefix) -> dict:
    """The host's kernel cache for the generation whose venv is `prefix`: the variables its probes wrote to
    <generation>/kernels.env (agent/kernels.py), so the engine finds what they compiled; {} outside a generation."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(prefix)), "kernels.env")) as f:
            pairs = [line.rstrip("\n").split("=", 1) for line in f if "=" in line]
    except OSError:
        return {}
    return {k: v for k, v in pairs if k in KERNEL_VARS and os.path.isabs(v)}
