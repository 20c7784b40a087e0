"""Host agent (stdlib only): the tool's own code (the engine and its helpers) unpacked once under the root, by
content-addressed name. Payload {op: unpack, root, name, tar?}.
"""
import base64
import io
import os
import shutil
import tarfile

from .host import AgentError, ensure_root, inside


def op_unpack(a):
    """{root, name, tar?}: the tool's code at <root>/tool/<name>, once (content-addressed name); without
    `tar`, says whether it is there already."""
    lay = ensure_root(a["root"])
    name = a["name"]
    if not name.isalnum():
        raise AgentError("bad bundle name %r" % name)
    final = lay.tool_dir(name)
    if os.path.exists(os.path.join(final, ".complete")):
        return {"path": final, "complete": True}
    if not a.get("tar"):
        return {"path": final, "complete": False}
    tmp = "%s.tmp-%d" % (final, os.getpid())
    os.makedirs(tmp)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(a["tar"]))) as t:
        for m in t.getmembers():
            if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in m.name.split("/"):
                raise AgentError("unsafe member in bundle: %r" % m.name)
        t.extractall(tmp)
    open(os.path.join(tmp, ".complete"), "w").close()
    if os.path.exists(final):
        shutil.rmtree(inside(lay.root, final))
    os.replace(tmp, final)
    return {"path": final, "complete": True}


OPS = {"unpack": op_unpack}
