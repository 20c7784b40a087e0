import sys, os, time, json, subprocess, statistics
from pathlib import Path
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd()+"/bench")
import core_bench as cb
from provision import apply as applymod, lock as lockmod
from provision.loopback import LoopbackHost
from provision.transport import connect, trust_host
mode = sys.argv[1] if len(sys.argv) > 1 else "time"
with LoopbackHost(login_rc=False) as clean:
    trust_host(clean.target)
    tr = connect(clean.target)
    applymod.apply(tr, lockmod.load(cb.BENCH_B))
    applymod.apply(tr, lockmod.load(cb.BENCH_B).__class__ and lockmod.load(cb.LOCKS / "a.yaml")) if False else None
    b2 = Path(clean.dir) / "b2.yaml"
    b2.write_text(Path(cb.BENCH_B).read_text().replace("name: bench-b", "name: bench-b2"))
    applymod.apply(tr, lockmod.load(b2))
    args = ["rollback", *cb.host_args(clean.target), "--json"]
    if mode == "time":
        for _ in range(5):
            t0 = time.perf_counter(); out = json.loads(cb.cli(*args)); w = time.perf_counter() - t0
            print(f"wall {w:.3f}s switch {out['switch_seconds']*1000:.1f}ms seconds {out['seconds']:.3f}", os.getloadavg()[0])
            applymod.rollback(tr, to="2")
    else:
        cmd = [sys.executable, *mode.split(), "-m", "provision", *map(str, args)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        open("/tmp/op2_out.txt", "w").write(p.stderr + p.stdout)
        print(p.stdout[-500:])
    tr.close()
