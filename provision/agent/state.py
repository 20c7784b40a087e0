"""Host agent (stdlib only): the generations store — create, mark, switch `current`, roll back, history.

Payload: {op, root, ...}; returns one JSON object (status, history, logs, rollback, switch and gc: their declared
Reply, steps/state.py; a refusal: {"error": one line}). `current` is only ever changed by
rename(2) of a freshly made symlink, so it always points at a complete generation.
"""
import errno
import json
import os
import re
import shutil
import stat
import time

from ..layout import Layout, cache_entry, pick_generation, venv_python
from ..steps import Shape
from ..steps.state import (Collected, Gc, GcArgs, History, HistoryArgs, HistoryGeneration, KernelsCollected, Logs,
                           LogsArgs, LogTail, ProbeLine, ProbeMark, QuickCheck, Recovered, Rollback, RollbackArgs,
                           Status, StoreCollected, Switched, VerifyMark)
from . import kernels, store as filestore
from .host import (AgentError, current, current_link, current_problem, disk_full, ensure_root, event, fsync_dir,
                   generations as gens, manifest_of, read_json, try_lock, write_atomic)
from .service import restart, serving
from .verify import adopt as record_adoption, quick


def now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_history(lay):
    """(the events of the host's history, oldest first; a warning for each line that is not one JSON object,
    naming history.jsonl:LINE, which is skipped). No history: none."""
    try:
        with open(lay.history, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return [], []
    out, broken = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line.decode("utf-8"))
        except ValueError:
            ev = None
        if isinstance(ev, dict):
            out.append(ev)
        else:
            broken.append(n)
    return out, ["%s:%d is not an event (cut off or damaged: %d bytes); skipped" % (lay.history, n, len(lines[n - 1]))
                 for n in broken]


def events(lay):
    """The events of the host's history, oldest first (see `read_history`)."""
    return read_history(lay)[0]


def record(lay, event):
    """Append one event as one line; a history whose last line was cut off gets its newline first, so that the
    event is a line of its own."""
    event = dict(event, time=now())
    with open(lay.history, "a+b") as f:
        start = b""
        if f.seek(0, 2) > 0:
            f.seek(-1, 2)
            start = b"" if f.read(1) == b"\n" else b"\n"
        f.write(start + json.dumps(event, sort_keys=True).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    return event


def switch_link(lay, gen_id):
    """The commit point: rename(2) of a fresh symlink over `current`, then fsync of the root. A `current` that is
    a directory (which a rename cannot replace) is first renamed aside, never deleted: returns where it went."""
    if not os.path.isdir(lay.gen(gen_id).dir):
        raise AgentError("no generation %s under %s" % (gen_id, lay.root))
    tmp, aside = lay.current_tmp(os.getpid()), None
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(lay.link_target(gen_id), tmp)
        if os.path.isdir(lay.current) and not os.path.islink(lay.current):
            aside = "%s.set-aside-%s" % (lay.current, time.strftime("%Y%m%dT%H%M%S", time.gmtime()))
            os.rename(lay.current, aside)
        try:
            os.replace(tmp, lay.current)   # rename(2): atomic
        except OSError:
            if aside and not os.path.lexists(lay.current):
                os.rename(aside, lay.current)
            raise
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(lay.root)
    return aside


def remove_venv(lay, gen_id):
    """Free a generation's space first (its venv; an adopted one is a link and only the link goes)."""
    venv = lay.gen(gen_id).venv
    if os.path.islink(venv):
        os.unlink(venv)
    elif os.path.isdir(venv):
        with filestore.proofs_kept(lay.file_store):
            try:
                filestore.rmtree(venv)      # its links to the host's store included (immutable: see store.unlink)
            except OSError:
                shutil.rmtree(venv, ignore_errors=True)


def oserr(e):
    return "%s: %s" % (e.filename or "", e.strerror or e)


def update_manifest(lay, gen_id, fields):
    """Write `fields` into a generation's manifest; one that cannot be read is never overwritten (AgentError)."""
    path = lay.gen(gen_id).manifest
    man = manifest_of(lay.gen(gen_id))
    if man.get("status") == "unreadable":
        raise AgentError("generation %s: %s; it is left as it is" % (gen_id, man["unreadable"]))
    man.update(fields)
    write_atomic(path, json.dumps(man, indent=2, sort_keys=True))
    return man


def id_number(gen_id):
    m = re.match(r"^(\d{4,})-", gen_id or "")
    return int(m.group(1)) if m else 0


def highest_number(lay):
    """The highest generation number this root ever used: its counter, the generations kept, `current`
    (whose directory may be gone) and every generation history names (gc removes directories, not history)."""
    try:
        with open(lay.last_number) as f:
            counter = int(f.read().strip() or 0)
    except (OSError, ValueError):
        counter = 0
    named = [n for n, _, _ in gens(lay)] + [id_number(current(lay))]
    for ev in events(lay):
        ids = [ev.get(k) for k in ("generation", "to", "from")] + list(ev.get("removed") or [])
        named += [id_number(i) for i in ids if isinstance(i, str)]
    return max([counter] + named)


def op_prepare(lay, a):
    """Allocate the next generation directory and write its lock and a 'building' manifest."""
    make_dirs(lay)
    number = highest_number(lay) + 1
    write_atomic(lay.last_number, "%d\n" % number)   # before the dir: a number is never reused
    gen_id = "%04d-%s" % (number, a["lock_name"])
    gen = lay.gen(gen_id)
    os.makedirs(gen.dir)
    write_atomic(gen.lock_yaml, a["lock_text"])
    lines = []
    for p in a.get("packages", []):   # content-addressed: cache/wheels/<sha256>/<filename>
        entry = cache_entry(lay.wheel_cache, p["sha256"], p["filename"])
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        lines.append("%s @ file://%s --hash=sha256:%s" % (p["name"], entry, p["sha256"]))
    write_atomic(gen.requirements, "".join(l + "\n" for l in lines))
    man = dict(a.get("manifest", {}), id=gen_id, number=number, status="building", created=now())
    write_atomic(gen.manifest, json.dumps(man, indent=2, sort_keys=True))
    return {"id": gen_id, "dir": gen.dir, "venv": gen.venv}


def make_dirs(lay):
    """The root (see `ensure_root`) and the directories a generation's making writes into."""
    ensure_root(lay.root)
    for d in (lay.generations, lay.wheel_cache, lay.runs):
        os.makedirs(d, exist_ok=True)


def op_mark(lay, a):
    """Update a generation's manifest (and history); a failure removes the venv before writing anything."""
    if a.get("fields", {}).get("status") in ("failed", "abandoned") and current(lay) == a["id"]:
        return {"error": "generation %s is current: it is never marked %s" % (a["id"], a["fields"]["status"])}
    if a.get("remove_venv"):
        remove_venv(lay, a["id"])
    event = dict(a["event"], generation=a["id"]) if a.get("event") else None
    man, failed = mark_recorded(lay, a["id"], a.get("fields", {}), event)
    return {"id": a["id"], "status": man.get("status"), "bookkeeping_failed": failed}


def mark_recorded(lay, gen_id, fields, event=None):
    """Update a generation's manifest, then record `event`. The manifest is the truth and is written first,
    holding the event as `pending_event` until history has it: a failure to record is returned (not raised)
    and `recover` records it on the next run. Returns (manifest, [what failed])."""
    if not event:
        return update_manifest(lay, gen_id, fields), []
    event = dict(event, event_id=event.get("event_id") or "%s@%s" % (gen_id, time.time()))
    man = update_manifest(lay, gen_id, dict(fields, pending_event=event))
    try:
        record(lay, event)
    except OSError as e:
        return man, ["history: " + oserr(e)]
    return update_manifest(lay, gen_id, {"pending_event": None}), []


def op_switch(lay, a):
    """Make generation `id` current. Before the rename its manifest says `switching`; the rename is the
    commit; what follows (manifest `ready`, history) is bookkeeping, and a failure there is reported as
    such (switched: true) and repaired by `recover` on the next run."""
    gen_id = a["id"]
    before = current(lay)
    gen = lay.gen(gen_id)
    man = manifest_of(gen) if os.path.isdir(gen.dir) else None
    if not man:
        return {"error": "no generation %s under %s" % (gen_id, lay.root)}
    if man.get("status") == "unreadable":
        return {"error": "generation %s: %s; never switched to" % (gen_id, man["unreadable"])}
    if man.get("status") in ("failed", "abandoned", "building", "built", "removing"):
        return {"error": "generation %s is %s: never switched to" % (gen_id, man.get("status"))}
    if not os.path.exists(gen.python):
        return {"error": "generation %s has no venv/bin/python: not runnable" % gen_id}
    event = dict(a.get("event", {}), event=a.get("kind", "switch"), **{"from": before, "to": gen_id})
    ev, failed, seconds = commit(lay, gen_id, man, event)
    return Switched(from_=before, to=gen_id, switched=True, switch_seconds=seconds, event=ev, bookkeeping_failed=failed)


def commit(lay, gen_id, man, event):
    """Switch `current` to `gen_id` and record `event`. Before the rename the manifest says `switching` and
    holds the event (and the status it returns to); the rename is the commit; what follows (history, then
    the manifest back to runnable) is bookkeeping: its failure is returned, never raised, and `recover`
    settles it. Returns (event recorded or None, [what failed], seconds)."""
    event = dict(event, switch_id="%s@%s" % (gen_id, time.time()))
    runnable = "adopted" if man.get("status") == "adopted" else "ready"
    update_manifest(lay, gen_id, {"status": "switching", "switch_event": event, "runnable_as": runnable})
    t0 = time.perf_counter()
    try:
        aside = switch_link(lay, gen_id)           # ---- the commit ----
        if aside:
            event["current_set_aside"] = aside
    except OSError:
        if current(lay) != gen_id:
            update_manifest(lay, gen_id, {"status": runnable, "switch_event": None})
            raise
    seconds = time.perf_counter() - t0
    failed, ev = [], None
    try:   # history first: a manifest still `switching` tells `recover` the event may be missing
        ev = record(lay, event)
    except OSError as e:
        failed.append("history: " + oserr(e))
    if not failed:
        try:
            update_manifest(lay, gen_id, {"status": runnable, "committed": man.get("committed") or now(),
                                           "switch_event": None})
        except OSError as e:
            failed.append("manifest: " + oserr(e))
    return ev, failed, seconds


def recorded(lay, switch_id):
    """Whether history holds the event of this switch (looked for from the end)."""
    try:
        with open(lay.history) as f:
            return any(switch_id in line for line in reversed(f.readlines()[-1000:]))
    except OSError:
        return False


def op_recover(lay, a):
    """Settle what an interrupted run left (the caller holds the host lock): a generation `switching` that
    `current` names is committed (manifest and history repaired); one left building/built/verified, or
    switching but not current, is abandoned and its venv removed; failed ones lose their venv; temp
    files, partial downloads in the cache (`.part-`) and what an interrupted gc set aside (.trash) go. A generation
    whose manifest cannot be read is not known to be incomplete: it is kept as it is and named in `unreadable`."""
    cur = current(lay)
    out = {"abandoned": [], "repaired": [], "freed": [], "removed_tmp": [], "removed_partial": [], "errors": [],
           "unreadable": unreadable(gens(lay))}
    for d in [lay.root] + [lay.gen(g).dir for _, g, _ in gens(lay)]:
        for f in os.listdir(d) if os.path.isdir(d) else []:
            if re.search(r"\.tmp-\d+$", f) or f.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(d, f))
                    out["removed_tmp"].append(os.path.join(d, f))
                except OSError as e:
                    out["errors"].append(oserr(e))
    for d in partial_dirs(lay):     # downloads and pushes an interrupted run left half-written
        for f in os.listdir(d):
            if PARTIAL.search(f):
                try:
                    os.unlink(os.path.join(d, f))
                    out["removed_partial"].append(os.path.join(d, f))
                except OSError as e:
                    out["errors"].append(oserr(e))
    out["trash_bytes"], errs = empty_trash(lay)    # what an interrupted gc set aside
    out["errors"] += errs
    out["settled"] = []
    for _, gen_id, man in gens(lay):
        status = man.get("status")
        venv = lay.gen(gen_id).venv
        try:
            if man.get("pending_event"):   # a marking whose event history lacks
                ev = man["pending_event"]
                if not recorded(lay, ev.get("event_id") or gen_id):
                    record(lay, dict(ev, repaired=True))
                man = update_manifest(lay, gen_id, {"pending_event": None})
                out["repaired"].append(gen_id)
            if status == "switching":   # settled by where `current` points: the rename is the commit
                runnable = man.get("runnable_as") or "ready"
                if gen_id == cur:
                    ev = man.get("switch_event") or {"event": "switch", "to": gen_id, "switch_id": gen_id}
                    if not recorded(lay, ev.get("switch_id") or gen_id):
                        record(lay, dict(ev, repaired=True))
                    update_manifest(lay, gen_id, {"status": runnable, "committed": man.get("committed") or now(),
                                                   "switch_event": None})
                    out["repaired"].append(gen_id)
                else:   # never committed: it stays the complete generation it was
                    update_manifest(lay, gen_id, {"status": runnable, "switch_event": None})
                    out["settled"].append(gen_id)
            elif status in (None, "building", "built", "verified") and gen_id != cur:
                remove_venv(lay, gen_id)
                _, failed = mark_recorded(lay, gen_id, {"status": "abandoned", "abandoned_from": status or "incomplete",
                                             "reason": "left %s by an interrupted run" % (status or "incomplete")},
                              {"event": "abandoned", "generation": gen_id, "was": status or "incomplete"})
                out["abandoned"].append(gen_id)
                out["errors"] += ["%s: %s" % (gen_id, f) for f in failed]
            elif status == "removing" and gen_id != cur:   # a gc that could not set it aside, interrupted
                with filestore.proofs_kept(lay.file_store):
                    filestore.rmtree(lay.gen(gen_id).dir)
                out["freed"].append(gen_id)
            elif status in ("failed", "abandoned") and os.path.lexists(venv) and gen_id != cur:
                remove_venv(lay, gen_id)
                out["freed"].append(gen_id)
        except OSError as e:
            out["errors"].append("%s: %s" % (gen_id, oserr(e)))
    return out


PARTIAL = re.compile(r"\.part-\d+-\d+$")      # agent/cache.py's `store`: <entry>.part-<pid>-<thread>


def partial_dirs(lay):
    """The cache entry directories (wheels and the tool's uv) where a `.part-` file can be left."""
    for store in lay.stores.values():
        for sha in sorted(os.listdir(store)) if os.path.isdir(store) else []:
            d = os.path.join(store, sha)
            if os.path.isdir(d) and not os.path.islink(d):
                yield d


RUNNABLE = ("ready", "adopted")


def unreadable(all_gens):
    """One line for each generation whose manifest cannot be read: what is wrong, and that it is kept."""
    return ["generation %s: %s; kept as it is (repair or remove it by hand)" % (g, m["unreadable"])
            for _, g, m in all_gens if m.get("status") == "unreadable"]
SWITCHES = ("apply", "switch", "rollback")     # the events of a rename of `current` (op_switch's kinds, rollback)


def switches(lay):
    """(from, to) of every recorded switch of `current`, oldest first (history read through `events`)."""
    return [(ev.get("from"), ev["to"]) for ev in events(lay)
            if ev.get("event") in SWITCHES and isinstance(ev.get("to"), str) and "from" in ev]


def rollback_target(lay, all_gens, cur):
    """What a plain `rollback` returns to: (generation or None, [(id, why) skipped]). The generation that was
    current before the last switch to `current` (an apply that reused an older generation included); when that
    one is no longer runnable, the one current before it, and so on back through history. A host whose
    history records no switch to `current` falls back to the newest runnable generation below it."""
    if cur is None:
        return None, []
    by_id = {g[1]: g for g in all_gens}
    sw = switches(lay)
    last = max((i for i, (_, to) in enumerate(sw) if to == cur), default=None)
    if last is None:
        cur_n = id_number(cur)
        older = [g for g in all_gens if g[0] < cur_n and runnable(lay, g)]
        return (older[-1] if older else None), []
    skipped, seen = [], {cur}
    for frm, _ in reversed(sw[:last + 1]):
        if not isinstance(frm, str) or frm in seen:
            continue
        seen.add(frm)
        g = by_id.get(frm)
        if g is not None and runnable(lay, g):
            return g, skipped
        skipped.append((frm, "removed" if g is None else "no venv/bin/python" if g[2].get("status") in RUNNABLE
                        else g[2].get("unreadable") or g[2].get("status") or "incomplete"))
    return None, skipped


def runnable(lay, g):
    """Whether generation (number, id, manifest) can be switched to: ready or adopted, its interpreter there."""
    return g[2].get("status") in RUNNABLE and os.path.exists(lay.gen(g[1]).python)


def op_gc(lay, a):
    """Remove failed/abandoned generations, runnable ones beyond the newest `keep`, and cache entries (wheels,
    uv's unpacked wheels) no remaining generation needs; never `current` nor what `rollback` returns to.
    Each is first renamed aside into <root>/.trash (atomic: never a half-deleted generation under
    generations/), then its files are deleted in parallel, then the store entries no kept generation links
    (`store`). `bytes` is what the removal frees: each inode once, and only when every link it has is among the
    files removed. Progress events: each phase, and at least every 2 s within one. Takes the host lock."""
    args = GcArgs.given(a)
    recovered = op_recover(lay, a) if not args.dry_run else None
    cur = current(lay)
    all_gens = gens(lay)
    back, _ = rollback_target(lay, all_gens, cur)
    protected = {cur, back[1] if back else None}
    spare = [g for g in all_gens if g[2].get("status") in RUNNABLE and g[1] not in protected]
    keep = max(0, args.keep - len([p for p in protected if p]))
    kept_runnable = {g[1] for g in spare[-keep:]} if keep else set()   # keep > len(spare): every one
    doomed = [g for g in all_gens if g[1] not in protected and g[1] not in kept_runnable
              and g[2].get("status") != "unreadable"]
    kept = [g for g in all_gens if g not in doomed]
    needed, dists = set(), set()
    for _, gen_id, _ in kept:
        try:
            text = open(lay.gen(gen_id).requirements).read()
        except OSError:
            continue
        needed |= set(re.findall(r"--hash=sha256:([0-9a-f]{64})", text))
        dists |= {wheel_dist(f) for f in re.findall(r"/([^/\s]+\.whl) --hash=", text)}
    out = {"dry_run": args.dry_run, "current": cur, "rollback_target": back[1] if back else None,
           "generations": [], "cache": [], "uv_cache": [], "bytes": 0, "shared_bytes": 0, "errors": [],
           "recovered": recovered, "warnings": read_history(lay)[1] + unreadable(all_gens) +
           [p for p in [current_problem(lay)] if p]}
    items = []    # (the list in `out` it is reported in, its entry, its path, its name in the trash)
    for _, gen_id, man in doomed:
        entry = {"id": gen_id, "status": man.get("status"), "run_dir": man.get("run_dir")}
        items.append(("generations", entry, lay.gen(gen_id).dir, "gen-" + gen_id))
    cache = lay.wheel_cache
    for sha in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        if sha not in needed:
            items.append(("cache", {"sha256": sha}, os.path.join(cache, sha), "wheel-" + sha))
    for name in unused_uv_archives(lay, dists):
        items.append(("uv_cache", {"archive": name}, os.path.join(lay.uv_archives, name),
                      "uv-" + name))
    for kind, entry, _, _ in items:
        out[kind].append(entry)
    out["kernels"] = kernels.collect(lay, [g[1] for g in kept], dry_run=args.dry_run)
    tick = Ticker()
    tick("survey", force=True, items=len(items))
    if args.dry_run:
        paths = [path for _, _, path, _ in items]
        unlinked = store_unlinked(lay, survey(paths))
        account(out, items + unlinked, survey(paths + [p for _, _, p, _ in unlinked]))
        store_figures(out, unlinked)
        return collected(out)
    t0 = time.monotonic()
    free0 = fs_free(lay.root)
    trash, paths = set_aside(lay, items, out["errors"])
    unlinked = store_unlinked(lay, survey(paths))
    sv = survey(paths + [p for _, _, p, _ in unlinked])
    tick("remove", force=True, items=len(items), store_entries=len(unlinked))
    n = len(items)         # the generations' and caches' links first, then the store entries they leave unlinked
    with filestore.proofs_kept(lay.file_store):
        removed = remove_surveyed({"files": sv["files"][:n], "dirs": sv["dirs"][:n]}, args.jobs or 16,
                                  out["errors"], tick)
        for k, c in remove_surveyed({"files": sv["files"][n:], "dirs": sv["dirs"][n:]}, args.jobs or 16,
                                    out["errors"], tick).items():
            removed[k] = removed.get(k, 0) + c
    account(out, items + unlinked, sv, removed)
    store_figures(out, unlinked)
    tick("done", force=True, bytes=out["bytes"])
    for d in (trash, os.path.dirname(trash)):    # this run's trash, then .trash itself when nothing else is there
        try:
            os.rmdir(d)
        except OSError:
            break
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["fs_freed"] = fs_free(lay.root) - free0       # the filesystem's own figure (others may write meanwhile)
    try:
        record(lay, {"event": "gc", "removed": [g["id"] for g in out["generations"] if g.get("removed")],
                      "cache_entries": len(out["cache"]), "uv_cache_entries": len(out["uv_cache"]),
                      "bytes": out["bytes"], "shared_bytes": out["shared_bytes"]})
    except OSError as e:
        out["errors"].append("history: " + oserr(e))
    return collected(out)


def collected(out):
    """gc's reply from the figures it gathered in `out` (its items' entries as `account` filled them in)."""
    made = {"generations": [Collected(**g) for g in out.pop("generations")],
            "recovered": Recovered.given(out.pop("recovered")) if out.get("recovered") else None,
            "kernels": KernelsCollected.given(out.pop("kernels")) if out.get("kernels") else None,
            "store": StoreCollected.given(out.pop("store")) if out.get("store") else None}
    return Gc(**made, **{k: v for k, v in out.items() if k not in made})


class Ticker:
    """gc's progress: an event when a phase begins, and at least every `every` seconds within one."""

    def __init__(self, every=2.0):
        self.t0 = self.last = time.monotonic()
        self.every = every

    def __call__(self, phase, force=False, **fields):
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.last = now
            event(step="gc", phase=phase, seconds=round(now - self.t0, 2), **fields)


def store_unlinked(lay, sv):
    """The store entries no kept generation links once what `sv` surveyed is gone: every link but the entry's own
    is among those files (or there was none). As gc items ("store", {...}, path, None)."""
    inodes = sv["inodes"]
    out = []
    for path, st in filestore.entries(lay.file_store):
        seen = inodes.get((st.st_dev, st.st_ino), (0, 0, 0))[2]
        if st.st_nlink - seen <= 1:
            out.append(("store", {"entry": os.path.basename(path)}, path, None))
    return out


def store_figures(out, unlinked):
    """The store's part of a gc: entries removed and the bytes they alone held (the rest counted with the
    generation that held their last link)."""
    out["store"] = {"entries": len(unlinked), "bytes": sum(e["bytes"] for _, e, _, _ in unlinked)}


def fs_free(root):
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def set_aside(lay, items, errors):
    """Rename each item into a fresh directory under <root>/.trash (one rename each, atomic). A generation
    that cannot be renamed there is first marked `removing` (never runnable again), then deleted in place.
    Returns (the trash directory of this run, the paths to delete in the order of `items`)."""
    trash = os.path.join(lay.trash, "gc-%d-%d" % (os.getpid(), time.time() * 1e6))
    os.makedirs(trash)
    paths = []
    for kind, entry, path, name in items:
        dest = os.path.join(trash, name)
        try:
            os.rename(path, dest)
        except OSError as e:
            if kind == "generations":
                try:
                    update_manifest(lay, entry["id"], {"status": "removing", "reason": "gc: " + oserr(e)})
                except OSError as e2:
                    errors.append("%s: %s" % (entry["id"], oserr(e2)))
                    paths.append(None)
                    continue
            dest = path
        paths.append(dest)
    if os.path.isdir(lay.generations):
        fsync_dir(lay.generations)
    return trash, paths


def survey(paths):
    """One walk of each path (symlinks not followed): {paths, dirs: [[dir] per path], files: [[(dir, [(name,
    inode key)])] per path], keys: [[inode key of every entry] per path], inodes: {(st_dev, st_ino): (st_nlink,
    bytes on disk, links seen)}}. A directory's own blocks count as an inode of one link."""
    inodes, out = {}, {"paths": paths, "dirs": [], "files": [], "keys": [], "inodes": None}

    def note(st):
        key = (st.st_dev, st.st_ino)
        n, b, seen = inodes.get(key, (1 if stat.S_ISDIR(st.st_mode) else st.st_nlink, st.st_blocks * 512, 0))
        inodes[key] = (n, b, seen + 1)
        keys.append(key)
        return key

    for path in paths:
        dirs, files_by_dir, keys = [], [], []
        try:
            top = os.lstat(path) if path else None
        except OSError:
            top = None
        if top is not None and not stat.S_ISDIR(top.st_mode):
            files_by_dir.append((os.path.dirname(path), [(os.path.basename(path), note(top))]))
        stack = [path] if top is not None and stat.S_ISDIR(top.st_mode) else []
        while stack:
            d = stack.pop()
            try:
                note(os.lstat(d))
                entries = list(os.scandir(d))
            except OSError:
                continue
            dirs.append(d)
            here = []
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                else:
                    here.append((e.name, note(st)))
            if here:
                files_by_dir.append((d, here))
        out["dirs"].append(dirs)
        out["files"].append(files_by_dir)
        out["keys"].append(keys)
    out["inodes"] = inodes
    return out


def remove_surveyed(sv, jobs, errors, tick=None):
    """Delete what `survey` walked: every directory's files in parallel (`jobs` threads), then the
    directories, deepest first (`tick`: gc's progress). Returns {inode key: links removed}."""
    from concurrent.futures import ThreadPoolExecutor

    def unlink_all(item):
        d, names = item
        done, errs = [], []
        for name, key in names:
            try:
                filestore.unlink(os.path.join(d, name))
                done.append(key)
                if tick and len(done) % 1000 == 0:      # a directory of many files: still heard from
                    tick("remove")
            except FileNotFoundError:
                done.append(key)
            except OSError as e:
                errs.append(oserr(e))
        return done, errs

    work = [item for per_path in sv["files"] for item in per_path]
    removed = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(work) or 1))) as pool:
        for i, (done, errs) in enumerate(pool.map(unlink_all, work)):
            for key in done:
                removed[key] = removed.get(key, 0) + 1
            errors += errs[:3]
            if tick:
                tick("remove", directories=i + 1, of=len(work))
    for dirs in sv["dirs"]:
        for d in sorted(dirs, key=lambda p: p.count(os.sep), reverse=True):
            try:
                st = os.lstat(d)
                os.rmdir(d)
                removed[(st.st_dev, st.st_ino)] = 1
            except FileNotFoundError:
                pass
            except OSError as e:
                if len(errors) < 10:
                    errors.append(oserr(e))
    return removed


def empty_trash(lay, jobs=16):
    """Delete what an earlier gc set aside under <root>/.trash and did not finish (nothing there is a
    generation any more), .trash included. Returns (bytes freed, [errors])."""
    base = lay.trash
    if not os.path.isdir(base) or os.path.islink(base):
        return 0, []
    errors = []
    sv = survey([base])
    with filestore.proofs_kept(lay.file_store):
        removed = remove_surveyed(sv, jobs, errors)
    return sum(size for k, (n, size, _) in sv["inodes"].items() if removed.get(k, 0) >= n), errors


def account(out, items, sv, removed=None):
    """Each item's `bytes`: what removing it frees (an inode counted once, in the first item that holds it,
    and only when every one of its links is removed); `shared_bytes`: what stays because a link lives on
    outside. With `removed` (links actually deleted, per inode) the figures are those of what was done;
    without, of what would be (a dry run)."""
    inodes, counted = sv["inodes"], set()
    for (kind, entry, _, _), path, keys in zip(items, sv["paths"], sv["keys"]):
        freed = shared = 0
        for k in keys:
            if k in counted:
                continue
            counted.add(k)
            nlink, size, seen = inodes[k]
            if (removed.get(k, 0) if removed is not None else seen) >= nlink:
                freed += size
            else:
                shared += size
        entry["bytes"], entry["shared_bytes"] = freed, shared
        if removed is not None:
            entry["removed"] = path is not None and not os.path.lexists(path)
        out["bytes"] += freed
        out["shared_bytes"] += shared


def op_logs(lay, a):
    """A generation's logs (the tail of each `*.log` in its dir), its probe results and failure reason; the
    generation named by number or id (`generation`), the newest by default."""
    args = LogsArgs.given(a)
    gen_id = pick(lay, args.generation, default="newest")
    gen = lay.gen(gen_id)
    gdir = gen.dir
    if not os.path.isdir(gdir):
        return {"error": "no generation %s under %s" % (gen_id, lay.root)}
    tail = args.tail
    logs = {}
    for f in sorted(os.listdir(gdir)):
        if f.endswith(".log"):
            with open(os.path.join(gdir, f), "rb") as fh:
                fh.seek(0, 2)
                size = fh.tell()
                fh.seek(max(0, size - tail))
                logs[f] = LogTail(bytes=size, text=fh.read().decode("utf-8", "replace"))
    probes = read_json(gen.probes_json, None)
    man = read_json(gen.manifest, {})
    return Logs(id=gen_id, dir=gdir, status=man.get("status"), reason=man.get("reason"), run_dir=man.get("run_dir"),
                logs=logs, probes=[ProbeLine(name=r.get("name"), status=r.get("status"), reason=r.get("reason"))
                                   for r in (probes or {}).get("results", [])])


def pick(lay, name=None, default="current"):
    """A generation's id under the root from its id or number (None: `current`, or with default "newest" the
    newest), the CLI's rule; AgentError naming what the root holds when none matches."""
    try:
        return pick_generation([(n, i) for n, i, _ in gens(lay)], current(lay), name, default)
    except LookupError as e:
        raise AgentError({"none": "no generations under %s: adopt or apply first" % lay.root,
                          "no current": "no current generation under %s; name one (generation=N)" % lay.root}
                         .get(str(e), str(e))) from None


def op_rollback(lay, a):
    """Switch back to generation `to` (a number or id), or to the newest ready one below current. Settles
    what an interrupted run left first (the caller holds the host lock, except for a dry run)."""
    args = RollbackArgs.given(a)
    recovered = None if args.dry_run else op_recover(lay, a)
    before, broken = current_link(lay)
    all_gens = gens(lay)
    if not all_gens:
        return {"error": "no managed generations on this host: nothing to roll back to"}
    to = args.to
    if before is None and to is None:   # no history to follow from here: the operator names the generation
        return {"error": "%s; name the generation to switch to: rollback --to GEN (have: %s)" % (
            broken or "no current generation under %s" % lay.root, ", ".join(g[1] for g in all_gens))}
    if to is not None:
        match = [g for g in all_gens if str(g[0]) == str(to).lstrip("0") or g[1] == str(to) or
                 (str(to).isdigit() and g[0] == int(to))]
        if not match:
            return {"error": "no generation %s (have: %s)" % (to, ", ".join(g[1] for g in all_gens))}
        target = match[0]
        if target[2].get("status") == "unreadable":
            return {"error": "generation %s: %s; not switched to it" % (target[1], target[2]["unreadable"])}
        if target[2].get("status") not in ("ready", "adopted"):
            return {"error": "generation %s is %s, not runnable" % (target[1], target[2].get("status"))}
    else:
        target, skipped = rollback_target(lay, all_gens, before)
        if target is None:
            why = "; history names %s" % ", ".join("%s (%s)" % s for s in skipped) if skipped else ""
            return {"error": "no earlier runnable generation to roll back to from %s%s" % (before, why)}
    warnings = read_history(lay)[1] + unreadable(all_gens) + ([broken] if broken else [])
    if target[1] == before:
        return Rollback(from_=before, to=before, noop=True, warnings=warnings)
    forward = before is not None and target[0] > id_number(before)
    check = None if args.force else quick(lay, target[1])
    if check and check["verdict"] == "drift":
        return {"error": "generation %s fails verification (%s); not switched to it (--force switches anyway)"
                % (target[1], check["named"]), "check": check}
    check = QuickCheck.given(check) if check else None
    if args.dry_run:
        return Rollback(from_=before, to=target[1], forward=forward, dry_run=True, check=check, warnings=warnings)
    ev, failed, seconds = commit(lay, target[1], target[2], {
        "event": "rollback", "from": before, "to": target[1], "lock": target[2].get("lock_name"),
        "forward": forward, "forced": args.force, "current_was": broken})
    if ev and ev.get("current_set_aside"):
        warnings.append("what was at %s is kept at %s" % (lay.current, ev["current_set_aside"]))
    svc = (target[2].get("stack") or {}).get("service") or {}
    restarted = restart(lay, svc) if args.restart and isinstance(svc.get("unit"), str) else None
    return Rollback(from_=before, to=target[1], forward=forward, switch_seconds=seconds, switched=True, event=ev,
                    check=check, bookkeeping_failed=failed, recovered=Recovered.given(recovered), warnings=warnings,
                    service=restarted)


def op_adopt(lay, a):
    """Record an unmanaged environment as generation 0000 (a symlink to it; nothing is moved), with the record of
    its files no RECORD lists that verify compares (bin/, pyvenv.cfg, the creator's: verify.adopt)."""
    make_dirs(lay)
    gen_id = "0000-%s" % a["lock_name"]
    gen = lay.gen(gen_id)
    if os.path.exists(gen.dir):
        return {"error": "generation %s already exists" % gen_id}
    prefix = a["prefix"]
    if not os.path.exists(venv_python(prefix)):
        return {"error": "%s has no bin/python: not a Python environment" % prefix}
    os.makedirs(gen.dir)
    os.symlink(prefix, gen.venv)
    record_adoption(gen, prefix)
    write_atomic(gen.lock_yaml, a["lock_text"])
    man = dict(a.get("manifest", {}), id=gen_id, number=0, status="adopted", created=now(), adopted_from=prefix)
    write_atomic(gen.manifest, json.dumps(man, indent=2, sort_keys=True))
    record(lay, {"event": "adopt", "generation": gen_id, "path": prefix, "lock": a["lock_name"]})
    if not os.path.lexists(lay.current):
        switch_link(lay, gen_id)
    return {"id": gen_id, "dir": gen.dir}


def op_history(lay, a):
    args = HistoryArgs.given(a)
    evs, warnings = read_history(lay)
    all_gens = gens(lay)
    return History(current=current(lay), events=evs[-args.limit:] if args.limit > 0 else [],
                   warnings=warnings + unreadable(all_gens) + [p for p in [current_problem(lay)] if p],
                   generations=[HistoryGeneration.given(dict(m, id=name, number=n)) for n, name, m in all_gens])


def files(path):
    """lstat of every file under `path` (symlinks not followed, unreadable entries skipped)."""
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if e.is_dir(follow_symlinks=False):
                stack.append(e.path)
            else:
                yield st


def disk_used(path):
    """Bytes under `path`, each hard-linked file counted once; symlinks are not followed."""
    seen, total = set(), 0
    for st in files(path):
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def wheel_dist(filename):
    """(normalized name, version) of a wheel file name (name-version-tags.whl), or of a dist-info dir name."""
    parts = filename.split("-")
    return (re.sub(r"[-_.]+", "-", parts[0]).lower(), parts[1] if len(parts) > 1 else "")


def unused_uv_archives(lay, dists):
    """The names of uv's unpacked wheels (cache/uv/archive-v0/*) whose distribution (its dist-info's name and
    version) no kept generation's requirements name. Generations own copies of their files, so an archive is
    only what makes the next install of the same wheel fast."""
    base = lay.uv_archives
    if not os.path.isdir(base):
        return []
    out = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        infos = [e[:-len(".dist-info")] for e in os.listdir(path) if e.endswith(".dist-info")]
        if infos and all(wheel_dist(i) not in dists for i in infos):
            out.append(name)
    return out


def op_status(lay, a):
    """One row for a fleet table: current generation, its lock, since when, last probe and verify verdicts, the
    last probe of another generation when it came after (an attempt that did not become current), disk used."""
    cur, all_gens = current(lay), gens(lay)
    man = next((m for _, name, m in all_gens if name == cur), {})
    since, probe, attempt = None, None, None
    for ev in events(lay):
        if ev.get("to") == cur and "from" in ev or (ev.get("event") == "adopt" and ev.get("generation") == cur):
            since = ev.get("time")
        if ev.get("event") == "probe":   # the current generation's last, and the last of any (the last attempt)
            attempt = {"generation": ev.get("generation"), "status": ev.get("status"), "time": ev.get("time"),
                       "summary": ev.get("summary")}
            if ev.get("generation") == cur:
                probe = {k: v for k, v in attempt.items() if k != "generation"}
    broken = current_problem(lay)
    if cur and not any(name == cur for _, name, _ in all_gens):
        broken = "its directory generations/%s is missing" % cur
    elif cur and not os.path.exists(lay.gen(cur).python):
        broken = "its venv/bin/python is missing"
    verify = man.get("verify")
    if broken:   # the verdicts of what was there no longer hold
        probe = verify = None
    svc = (man.get("stack") or {}).get("service") or {}
    return Status(root=lay.root, current=cur, lock=man.get("lock_name"), since=since or man.get("created"),
                  broken=broken, probe=ProbeMark.given(probe) if probe else None,
                  verify=VerifyMark.given(verify) if verify else None, generations=len(all_gens),
                  last_attempt=ProbeMark.given(attempt) if attempt and attempt["generation"] != cur else None,
                  ready=sum(1 for _, _, m in all_gens if m.get("status") in ("ready", "adopted")),
                  disk_bytes=disk_used(lay.root) if os.path.isdir(lay.root) else 0,
                  serving=serving(lay, svc) if isinstance(svc, dict) and isinstance(svc.get("unit"), str) else None)


def op_read(lay, a):
    gen = lay.gen(a["id"])
    try:
        lock_text = open(gen.lock_yaml).read()
    except OSError:
        lock_text = None
    return {"id": a["id"], "manifest": read_json(gen.manifest, {}), "lock_text": lock_text}


def on_root(op):
    """An operation on the payload's root: under the host lock when the payload asks (`take_lock`), an OSError
    reported as one line naming the file (a root on a read-only filesystem: naming the root and that)."""
    def run(a):
        lay, held = Layout(a["root"]), None
        denied = root_unreadable(lay.root)
        if denied:
            return {"error": denied}
        try:
            if a.get("take_lock"):
                held, holder = try_lock(lay.root)
                if held is None:
                    return {"error": "another run holds the host lock %s (%s)" % (lay.lock_file, holder)}
            out = op(lay, a)
            return out.as_json() if isinstance(out, Shape) else out
        except ValueError as e:         # an argument not of its declared shape (steps/state.py)
            return {"error": "%s: argument %s" % (a.get("op"), e)}
        except OSError as e:
            if e.errno == errno.EROFS or read_only(lay.root):
                return {"error": "host root %s is read-only (%s: %s); nothing was written" % (
                    lay.root, e.filename or lay.root, e.strerror)}
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                return {"error": "%s failed: %s; %s" % (
                    doing(a), "%s: %s" % (e.filename, e.strerror) if e.filename else e.strerror, disk_full(lay))}
            return {"error": "%s: %s" % (e.filename or lay.root, e.strerror)}
        finally:
            if held is not None:
                held.close()
    return run


def root_unreadable(root):
    """Why this user cannot read the host root that is there (another user's, e.g. root's: `become`), else None;
    never "no generations" for a root it cannot see into."""
    try:
        os.listdir(root)
    except FileNotFoundError:
        return None
    except PermissionError as e:
        return "cannot read the host root %s (%s): run as its owner (root: Ansible's become, sudo)" % (
            root, e.strerror)
    except OSError:
        return None
    return None


def doing(a):
    """The operation of payload `a`, in a few words (for an error)."""
    fields = a.get("fields") or {}
    if a.get("op") == "mark" and fields.get("status"):
        return "recording generation %s as %s" % (a.get("id"), fields["status"])
    if a.get("id"):
        return "%s of generation %s" % (a.get("op"), a["id"])
    return str(a.get("op"))


def read_only(root):
    """Whether the filesystem holding `root` is mounted read-only."""
    try:
        return bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        return False


OPS = {name: on_root(op) for name, op in {
    "prepare": op_prepare, "mark": op_mark, "switch": op_switch, "rollback": op_rollback, "adopt": op_adopt,
    "history": op_history, "read": op_read, "recover": op_recover, "gc": op_gc, "logs": op_logs,
    "status": op_status}.items()}
