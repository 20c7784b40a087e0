"""The CUDA_HOME a generation gets where its lock takes the toolkit from NVIDIA's wheels: the build agent lays out
venv/cuda-home (bin, include, nvvm, lib64 of links into the wheels, the unversioned library names a `-lcudart`
link needs), the seal stamps its links, and a tiny kernel compiles and links with `-L$CUDA_HOME/lib64 -lcudart`
as flashinfer's JIT links its modules, on this GPU-less machine. The wheels' own lib directory cannot be linked
against that way (only libcudart.so.13 ships), which is why the layout exists."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from provision import generations
from provision.agent import build as agentbuild
from provision.agent.host import AgentError
from provision.transport import connect

KERNEL = r"""#include <cuda_runtime.h>
#include <cstdio>
__global__ void twice(float *x) { x[threadIdx.x] *= 2.0f; }
int main() {
  int n = -1;
  cudaError_t e = cudaGetDeviceCount(&n);
  printf("cudart answered %s\n", cudaGetErrorName(e));
  return 0;
}
"""


def _manifest(target, gen_id):
    tr = connect(target)
    try:
        return generations.read(tr, gen_id)["manifest"]
    finally:
        tr.close()


def _link(home: Path, libdir: Path, work: Path) -> subprocess.CompletedProcess:
    src = work / "k.cu"
    src.write_text(KERNEL)
    env = dict(os.environ, CUDA_HOME=str(home), PATH=f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run([str(home / "bin" / "nvcc"), "-arch=sm_90", "-c", str(src), "-o", str(work / "k.o")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return subprocess.run([shutil.which("c++") or "g++", str(work / "k.o"), "-o", str(work / "k"), f"-L{libdir}",
                           "-lcudart"], capture_output=True, text=True, env=env)   # the host linker, as the JIT links


def test_generation_cuda_home_links_cudart_as_flashinfer_jit_does(toolkit_generation, tmp_path):
    target, rep, lk = toolkit_generation
    assert rep.status == "applied", rep.error
    home = Path(_manifest(target, rep.generation)["cuda_home"])
    venv = home.parent
    assert home.name == "cuda-home" and (venv / "bin" / "python").exists()
    assert sorted(p.name for p in home.iterdir()) == ["bin", "include", "lib64", "nvvm"]
    assert not list(home.glob("lib64/libcuda.so*"))
    lib64 = home / "lib64"
    assert os.readlink(lib64 / "libcudart.so") == "libcudart.so.13"
    for link in [*lib64.glob("*.so*"), home / "bin" / "nvcc", home / "include" / "cuda_runtime.h"]:
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))
        assert link.resolve().is_relative_to(venv.resolve())
    figs = rep.build["cuda_home"]
    assert figs["home"] == str(home) and figs["components"] == ["cu13"]
    stub = lib64 / "stubs" / "libcuda.so"       # -L$CUDA_HOME/lib64/stubs -lcuda: the host driver's, if need be
    if figs["libcuda"] in ("host", "none"):
        assert not stub.exists()
    else:
        assert os.readlink(stub) == figs["libcuda"] and Path(figs["libcuda"]).name == "libcuda.so.1"

    (tmp_path / "home").mkdir()
    out = _link(home, lib64, tmp_path / "home")
    assert out.returncode == 0, out.stderr
    ran = subprocess.run([str(tmp_path / "home" / "k")], capture_output=True, text=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=str(lib64)))
    assert ran.returncode == 0 and ran.stdout.startswith("cudart answered cuda"), ran.stdout + ran.stderr

    wheel_lib = (lib64 / "libcudart.so.13").resolve().parent          # site-packages/nvidia/cu13/lib
    (tmp_path / "wheel").mkdir()
    out = _link(home, wheel_lib, tmp_path / "wheel")
    assert out.returncode != 0 and "cudart" in out.stderr

    stamp = json.loads((venv.parent / "stamp.json").read_text())["files"]
    assert stamp["cuda-home/lib64/libcudart.so"][4] == "->libcudart.so.13"
    assert stamp["cuda-home/bin/nvcc"][4].startswith("->../../lib/python")


def test_probes_compile_with_the_generation_cuda_home(toolkit_generation):
    target, rep, lk = toolkit_generation
    nvcc = {r["name"]: r for r in rep.probes["results"]}["nvcc"]
    assert nvcc["status"] == "pass", nvcc
    assert nvcc["figures"]["cuda_home"] == _manifest(target, rep.generation)["cuda_home"]


def _component(nvidia: Path, name: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (nvidia / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (nvidia / name / rel).write_text(text)


def test_cuda12_layout_merges_one_directory_per_component(tmp_path):
    """CUDA 12 wheels install nvidia/cuda_runtime, nvidia/cuda_nvcc, … each with its own bin/include/lib: the
    home merges them (a name two components ship keeps the first, in name order)."""
    venv = tmp_path / "venv"
    nvidia = venv / "lib" / "python3.12" / "site-packages" / "nvidia"
    _component(nvidia, "cuda_runtime", {"include/cuda_runtime.h": "rt", "lib/libcudart.so.12": "so",
                                        "__init__.py": ""})
    _component(nvidia, "cuda_nvcc", {"bin/ptxas": "ptxas", "include/crt/host_config.h": "crt",
                                     "nvvm/libdevice/libdevice.10.bc": "bc"})
    _component(nvidia, "nvjitlink", {"lib/libnvJitLink.so.12": "so", "lib/libnvJitLink.so": "own"})
    home = venv / "cuda-home"
    figs = agentbuild.cuda_home(str(venv), str(home))
    assert figs["components"] == ["cuda_nvcc", "cuda_runtime", "nvjitlink"]
    assert (home / "include" / "cuda_runtime.h").read_text() == "rt"
    assert (home / "include" / "crt" / "host_config.h").read_text() == "crt"
    assert (home / "bin" / "ptxas").read_text() == "ptxas"
    assert (home / "nvvm" / "libdevice" / "libdevice.10.bc").read_text() == "bc"
    assert os.readlink(home / "lib64" / "libcudart.so") == "libcudart.so.12"
    assert (home / "lib64" / "libnvJitLink.so").read_text() == "own"       # the wheel's own name wins
    assert not (home / "lib64" / "__init__.py").exists()
    again = agentbuild.cuda_home(str(venv), str(home))                       # a retried build starts over
    assert again["links"] == figs["links"]


def test_cuda_home_without_nvidia_wheels_or_outside_the_venv_is_refused(tmp_path):
    venv = tmp_path / "root" / "generations" / "0001-x" / "venv"
    (venv / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    with pytest.raises(AgentError, match="has no site-packages/nvidia"):
        agentbuild.cuda_home(str(venv), str(venv / "cuda-home"))
    with pytest.raises(AgentError, match="is outside"):
        agentbuild.op_build({"root": str(tmp_path / "root"), "gen_dir": str(venv.parent), "venv": str(venv),
                             "python": shutil.which("python3"), "cuda_home": str(tmp_path / "elsewhere")})
