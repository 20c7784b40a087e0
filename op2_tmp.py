import time, resource, json, subprocess
from provision.transport import Local
from provision.facts import gather
from provision import agent
tr = Local()
tr.target.vars["provision_root"]="/tmp/op2root"
for py in ("python3", "/root/.pyenv/versions/3.11.7/bin/python3"):
    tr.target.vars["python"] = py
    for _ in range(3):
        b = resource.getrusage(resource.RUSAGE_CHILDREN); t0=time.perf_counter()
        f = gather(tr, python="3.11")
        a = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(py, f"wall {time.perf_counter()-t0:.3f} cpu {(a.ru_utime-b.ru_utime)+(a.ru_stime-b.ru_stime):.3f}")
b = resource.getrusage(resource.RUSAGE_CHILDREN); t0=time.perf_counter()
subprocess.run(["bash", "-c", "source ~/.bashrc >/dev/null 2>&1; true"])
a = resource.getrusage(resource.RUSAGE_CHILDREN)
print("bashrc", f"wall {time.perf_counter()-t0:.3f} cpu {(a.ru_utime-b.ru_utime)+(a.ru_stime-b.ru_stime):.3f}")
