"""Run from the installed wheel, outside the checkout: one real apply to a loopback host through the CLI.

The lock lives in a scratch folder and names the patch series shipped inside the package
(`patches/sglang-0.5.9`), so the build playbook, the series and the agents all come from the wheel.
"""
import hashlib
import subprocess
import sys
from pathlib import Path

import provision
from provision.loopback import LoopbackHost

work = Path(sys.argv[1])
assert Path(provision.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), provision.__file__
exe = str(Path(sys.prefix) / "bin" / "provision")
wheels = work / "wheels"
subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-deps", "-q",
                "--disable-pip-version-check", "sglang==0.5.9", "-d", str(wheels)], check=True)
whl = wheels / "sglang-0.5.9-py3-none-any.whl"
lock = work / "sglang-patched.yaml"
lock.write_text(f"""lock: 1
name: sglang-patched
platform: {{python: '{sys.version_info[0]}.{sys.version_info[1]}', cuda: {{source: none}}}}
requires: [sglang==0.5.9]
packages:
- {{name: sglang, version: 0.5.9, filename: {whl.name}, url: {whl.as_uri()},
   sha256: {hashlib.sha256(whl.read_bytes()).hexdigest()}}}
patches: [patches/sglang-0.5.9]
engine: {{kind: none, architecture: KimiK25ForConditionalGeneration}}
probes: {{}}
""")
with LoopbackHost(base=str(work)) as h:
    t = h.target
    inv = work / "hosts.yml"
    inv.write_text(f"all:\n  hosts:\n    loop:\n      ansible_host: {t.host}\n      ansible_port: {t.port}\n"
                   f"      ansible_user: {t.user}\n      ansible_ssh_private_key_file: {t.key_file}\n"
                   f"      provision_root: {h.root}\n")
    kh = ["--known-hosts", str(work / "known_hosts")]
    for argv in (["hosts", "trust", h.spec, *kh, "--yes"], ["plan", "-i", str(inv), "--lock", str(lock), *kh],
                 ["apply", "-i", str(inv), "--lock", str(lock), *kh], ["history", "-i", str(inv), *kh]):
        print(f"$ provision {' '.join(argv)}", flush=True)
        subprocess.run([exe, *argv], check=True, cwd=work)
    patched = list(Path(h.root).glob("generations/0001-*/venv/lib/python3*/site-packages/sglang/srt/models/kimi_k25.py"))
    assert patched and "get_embed_and_head" in patched[0].read_text(), "the shipped patch series was not applied"
print("installed wheel: real apply with the shipped patch series: ok")
