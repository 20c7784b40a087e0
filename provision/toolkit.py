"""CUDA toolkits per source and major version: where a generation's CUDA_HOME is and whether that
source can give it an nvcc. NVIDIA's CUDA 13 wheels install one tree (site-packages/nvidia/cu13 with
bin/nvcc); CUDA 12 wheels install one directory per component (nvidia/cuda_runtime, nvidia/cuda_nvcc, …)
and the 12.x nvcc wheel carries ptxas and nvvm but no nvcc; apt and host toolkits live under
/usr/local/cuda-X.Y. A wheels toolkit is no toolkit home as such (no lib64, no unversioned library names),
so the build agent lays one out in the venv (layout.cuda_home_in: bin, include, nvvm, lib64 of links into the wheels) and
the generation's CUDA_HOME is that directory."""
from __future__ import annotations

from .layout import cuda_home_in

FIRST_SINGLE_TREE = 13      # the first CUDA major whose wheels install one toolkit tree


def _major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def home(lock, venv: str) -> str | None:
    """CUDA_HOME of a generation of `lock` whose venv is `venv` (recorded in its manifest)."""
    cu = lock.platform.cuda
    if cu.source == "wheels":
        return wheels_home(lock, venv)
    if cu.source == "apt":
        return cu.home or f"/usr/local/cuda-{'.'.join(cu.version.split('.')[:2])}"
    if cu.source == "host":
        return cu.home or "/usr/local/cuda"
    return None


def wheels_home(lock, venv: str) -> str | None:
    """The toolkit home the build agent lays out in `venv` (None: the lock's toolkit is not from wheels)."""
    cu = lock.platform.cuda
    return cuda_home_in(venv) if cu.source == "wheels" and cu.version else None


def nvcc_missing(lock) -> str | None:
    """Why the lock's toolkit source cannot provide the nvcc its `nvcc` probe requires (None: it can)."""
    cu = lock.platform.cuda
    major = _major(cu.version)
    if cu.source == "wheels" and major is not None and major < FIRST_SINGLE_TREE:
        return (f"CUDA {cu.version} from wheels has no nvcc (CUDA {major} wheels install one directory per "
                "component and the nvcc wheel carries no nvcc binary), so the nvcc probe cannot pass; take the "
                f"toolkit from the host (source: host, home: /usr/local/cuda-{'.'.join(cu.version.split('.')[:2])}) "
                "or from apt (source: apt, package: cuda-toolkit-X-Y)")
    return None
