"""Host agent (stdlib only): the generations store — create, mark, switch `current`, roll back, history.

Run as `python3 - OP B64JSON < state.py`; prints one JSON line. `current` is only ever changed by
rename(2) of a freshly made symlink, so it always points at a complete generation.
"""
import base64
import fcntl
import json
import os
import re
import shutil
import sys
import time


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_atomic(path, text):
    tmp = "%s.tmp-%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def gens(root):
    gdir = os.path.join(root, "generations")
    out = []
    for name in sorted(os.listdir(gdir)) if os.path.isdir(gdir) else []:
        m = re.match(r"^(\d{4})-(.+)$", name)
        if m:
            man = read_json(os.path.join(gdir, name, "manifest.json"), {})
            out.append((int(m.group(1)), name, man))
    return out


def current(root):
    link = os.path.join(root, "current")
    return os.path.basename(os.readlink(link).rstrip("/")) if os.path.islink(link) else None


def record(root, event):
    event = dict(event, time=now())
    with open(os.path.join(root, "history.jsonl"), "a") as f:
        f.write(json.dumps(event, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return event


def switch_link(root, gen_id):
    target = os.path.join("generations", gen_id)
    if not os.path.isdir(os.path.join(root, target)):
        raise SystemExit(json.dumps({"error": "no generation %s under %s" % (gen_id, root)}))
    tmp = os.path.join(root, ".current.tmp-%d" % os.getpid())
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(root, "current"))   # rename(2): atomic


def update_manifest(root, gen_id, fields):
    path = os.path.join(root, "generations", gen_id, "manifest.json")
    man = read_json(path, {})
    man.update(fields)
    write_atomic(path, json.dumps(man, indent=2, sort_keys=True))
    return man


def op_prepare(root, a):
    """Allocate the next generation directory and write its lock and a 'building' manifest."""
    for sub in ("generations", "cache/wheels", "runs"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    existing = gens(root)
    number = max([n for n, _, _ in existing], default=0) + 1
    gen_id = "%04d-%s" % (number, a["lock_name"])
    gdir = os.path.join(root, "generations", gen_id)
    os.makedirs(gdir)
    write_atomic(os.path.join(gdir, "lock.yaml"), a["lock_text"])
    cache = os.path.join(root, "cache", "wheels")
    lines = []
    for p in a.get("packages", []):   # content-addressed: cache/wheels/<sha256>/<filename>
        os.makedirs(os.path.join(cache, p["sha256"]), exist_ok=True)
        lines.append("%s @ file://%s/%s/%s --hash=sha256:%s" % (p["name"], cache, p["sha256"], p["filename"], p["sha256"]))
    write_atomic(os.path.join(gdir, "requirements.txt"), "".join(l + "\n" for l in lines))
    man = dict(a.get("manifest", {}), id=gen_id, number=number, status="building", created=now())
    write_atomic(os.path.join(gdir, "manifest.json"), json.dumps(man, indent=2, sort_keys=True))
    return {"id": gen_id, "dir": gdir, "venv": os.path.join(gdir, "venv")}


def op_mark(root, a):
    man = update_manifest(root, a["id"], a.get("fields", {}))
    if a.get("event"):
        record(root, dict(a["event"], generation=a["id"]))
    if a.get("remove_venv"):
        shutil.rmtree(os.path.join(root, "generations", a["id"], "venv"), ignore_errors=True)
    return {"id": a["id"], "status": man.get("status")}


def op_switch(root, a):
    before = current(root)
    t0 = time.perf_counter()
    switch_link(root, a["id"])
    update_manifest(root, a["id"], {"status": "ready"} if a.get("ready") else {})
    ev = record(root, dict(a.get("event", {}), event=a.get("kind", "switch"), **{"from": before, "to": a["id"]}))
    return {"from": before, "to": a["id"], "switch_seconds": time.perf_counter() - t0, "event": ev}


def op_rollback(root, a):
    """Switch back to generation `to` (a number or id), or to the newest ready one below current."""
    before = current(root)
    all_gens = gens(root)
    if not all_gens or before is None:
        return {"error": "no managed generations on this host: nothing to roll back to"}
    to = a.get("to")
    if to is not None:
        match = [g for g in all_gens if str(g[0]) == str(to).lstrip("0") or g[1] == str(to) or
                 (str(to).isdigit() and g[0] == int(to))]
        if not match:
            return {"error": "no generation %s (have: %s)" % (to, ", ".join(g[1] for g in all_gens))}
        target = match[0]
        if target[2].get("status") not in ("ready", "adopted"):
            return {"error": "generation %s is %s, not runnable" % (target[1], target[2].get("status"))}
    else:
        cur_n = int(before.split("-", 1)[0])
        older = [g for g in all_gens if g[0] < cur_n and g[2].get("status") in ("ready", "adopted")]
        if not older:
            return {"error": "no earlier runnable generation before %s" % before}
        target = older[-1]
    if target[1] == before:
        return {"from": before, "to": before, "noop": True}
    t0 = time.perf_counter()
    switch_link(root, target[1])
    ev = record(root, {"event": "rollback", "from": before, "to": target[1], "lock": target[2].get("lock_name")})
    return {"from": before, "to": target[1], "switch_seconds": time.perf_counter() - t0, "event": ev}


def op_adopt(root, a):
    """Record an unmanaged environment as generation 0000 (a symlink to it; nothing is moved)."""
    for sub in ("generations", "cache/wheels", "runs"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    gen_id = "0000-%s" % a["lock_name"]
    gdir = os.path.join(root, "generations", gen_id)
    if os.path.exists(gdir):
        return {"error": "generation %s already exists" % gen_id}
    prefix = a["prefix"]
    if not os.path.exists(os.path.join(prefix, "bin", "python")):
        return {"error": "%s has no bin/python: not a Python environment" % prefix}
    os.makedirs(gdir)
    os.symlink(prefix, os.path.join(gdir, "venv"))
    write_atomic(os.path.join(gdir, "lock.yaml"), a["lock_text"])
    man = dict(a.get("manifest", {}), id=gen_id, number=0, status="adopted", created=now(), adopted_from=prefix)
    write_atomic(os.path.join(gdir, "manifest.json"), json.dumps(man, indent=2, sort_keys=True))
    record(root, {"event": "adopt", "generation": gen_id, "path": prefix, "lock": a["lock_name"]})
    if current(root) is None:
        switch_link(root, gen_id)
    return {"id": gen_id, "dir": gdir}


def op_history(root, a):
    events = []
    try:
        with open(os.path.join(root, "history.jsonl")) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return {"current": current(root), "events": events[-int(a.get("limit", 200)):],
            "generations": [dict(m, id=name, number=n) for n, name, m in gens(root)]}


def op_read(root, a):
    gdir = os.path.join(root, "generations", a["id"])
    try:
        lock_text = open(os.path.join(gdir, "lock.yaml")).read()
    except OSError:
        lock_text = None
    return {"id": a["id"], "manifest": read_json(os.path.join(gdir, "manifest.json"), {}), "lock_text": lock_text}


OPS = {"prepare": op_prepare, "mark": op_mark, "switch": op_switch, "rollback": op_rollback,
       "adopt": op_adopt, "history": op_history, "read": op_read}


def main(argv):
    op, arg = argv[0], json.loads(base64.b64decode(argv[1]).decode()) if len(argv) > 1 else {}
    root = arg["root"]
    if op not in OPS:
        print(json.dumps({"error": "unknown op %s" % op}))
        return
    held = None
    if arg.get("take_lock"):
        os.makedirs(root, exist_ok=True)
        held = open(os.path.join(root, ".lock"), "a+")
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.seek(0)
            print(json.dumps({"error": "another run holds the host lock %s/.lock (%s)" % (root, held.read().strip())}))
            return
    try:
        print(json.dumps(OPS[op](root, arg)))
    except OSError as e:
        print(json.dumps({"error": "%s: %s" % (e.filename or root, e.strerror)}))


if __name__ == "__main__":
    main(sys.argv[1:])
