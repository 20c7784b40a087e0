"""The hosts a command names (HOST, this machine, or an Ansible inventory's, read by Ansible itself: group and host
vars, `--limit` patterns), each a Target named by its inventory name. What Ansible would read ambiguously (a host
given twice, an undefined child group) is refused first, in one line.
"""
from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

from .errors import InputError, InventoryError
from .transport import DEADLINE, NOTICE, TIMEOUT, Target, check_address, check_root, parse_port

# Host variables provision reads, and the Target field each sets; everything else stays Ansible's business.
_KEPT = {"provision_root": "root", "provision_nvidia_smi": "nvidia_smi", "ansible_python_interpreter": "python"}


class Inventory:
    """An inventory as Ansible reads it (read once): which hosts a pattern names, and those hosts as Targets."""

    def __init__(self, path: Path):
        from ansible import constants
        from ansible.inventory.manager import InventoryManager
        from ansible.parsing.dataloader import DataLoader

        self.where = str(path)
        if not Path(path).exists():
            raise InventoryError("inventory not found", where=self.where)
        constants.HOST_PATTERN_MISMATCH = "ignore"   # a pattern that matches nothing is our one line, not a warning
        refuse_ambiguity(Path(path))
        with self._errors(), _ansible_warnings() as warned:
            self.loader = DataLoader()
            self.inv = InventoryManager(loader=self.loader, sources=[self.where])
            if not self.inv.list_hosts("all"):
                failed = [w for w in warned if w.startswith("Failed to parse")] or warned
                raise InventoryError(f"Ansible cannot read it: {failed[0]}" if failed else "inventory names no hosts",
                                     where=self.where)

    def matches(self, pattern: str) -> bool:
        """Whether `pattern` (a host, a group or an Ansible pattern) names a host of the inventory."""
        return bool(self._matching(pattern))

    def targets(self, known_hosts: Path, limit: str | None = None, host: str | None = None) -> list[Target]:
        """The hosts in inventory order, narrowed by the pattern `limit` and by `host` (a host, group or pattern
        named on the command line): the hosts both match."""
        from ansible.vars.manager import VariableManager

        with self._errors():
            hosts = self._matching(limit) if limit else self.inv.get_hosts("all")
            if not hosts:
                raise InventoryError(f"--limit {limit!r} matches no host of the inventory", where=self.where)
            if limit:
                self._each_term_names_a_host(limit, f"--limit {limit!r}")
            if host is not None:
                named = self._matching(host)
                if not named:
                    raise InventoryError(f"{host!r} names no host or group of the inventory", where=self.where)
                self._each_term_names_a_host(host, repr(host))
                hosts = [h for h in hosts if h in named]
                if not hosts:
                    raise InventoryError(f"{host!r} and --limit {limit!r} name no host in common", where=self.where)
            vm = VariableManager(loader=self.loader, inventory=self.inv)
            out = [_target(h.name, vm.get_vars(host=h, include_hostvars=False, stage="all"), known_hosts, self.where)
                   for h in hosts]
        _refuse_duplicates(out, self.where)
        return out

    def _each_term_names_a_host(self, pattern: str, said: str) -> None:
        """Each host, group or wildcard that `pattern` adds (`a,b`, `a:b`; not `!x`, `&g`, `@file`) matches a host:
        Ansible drops one that matches nothing, so `--limit h1,h33` would act on h1 alone, silently."""
        from ansible.inventory.manager import split_host_pattern

        for term in split_host_pattern(pattern):
            if term and term[0] not in "!&@" and not self._matching(term):
                raise InventoryError(f"{term!r} (in {said}) names no host or group of the inventory"
                                     if term != pattern else f"{term!r} names no host or group of the inventory",
                                     where=self.where)

    def _matching(self, pattern: str) -> list:
        """The hosts `pattern` matches, read as `--limit` reads it (`a:b`, `g:&h`, `g:!x`, `@file`)."""
        from ansible.errors import AnsibleError

        try:
            self.inv.subset(pattern)
            return self.inv.get_hosts("all")
        except AnsibleError as e:
            raise InventoryError(f"host pattern {pattern!r}: {' '.join(str(e).split())}", where=self.where) from None
        finally:
            self.inv.subset(None)

    @contextlib.contextmanager
    def _errors(self):
        from ansible.errors import AnsibleError

        try:
            yield
        except AnsibleError as e:
            raise InventoryError(f"cannot read inventory: {' '.join(str(e).split())}", where=self.where) from None


def select(host: str | None, args: tuple = (), *, local: bool = False, inventory: Path | None = None,
           limit: str | None = None, known_hosts: Path, key: Path | None = None, root: str | None = None,
           timeout: float = TIMEOUT, deadline: float = DEADLINE, notice: float = NOTICE,
           local_by_default: bool = False, become: bool = False) -> tuple[list[Target], tuple]:
    """(hosts, args): the hosts a command acts on, from HOST, --local or -i (narrowed by --limit, and by HOST), and
    its positionals after HOST (`args`, in order), as meant; `local_by_default`: no HOST and no -i is this machine;
    `become`: host commands run as root through sudo where the inventory names no become user.

    The first positional is HOST. With --local there is no HOST: the first positional is the verb's first
    argument after HOST. With -i, HOST narrows like --limit. Without --limit a first positional is always HOST,
    and one that names no host of the inventory is an error before any host is contacted, never the verb's next
    argument (which would act on every host; `all` names every host). With --limit naming the hosts, HOST may be
    left out: a first positional that names no inventory host is then the verb's first argument after HOST.
    """
    if limit and not inventory:
        raise InventoryError("--limit narrows an inventory: give -i INVENTORY", where="--limit")
    if local and inventory:
        raise InputError("give --local (this machine) or -i (an inventory's hosts), not both", where="--local")
    if root:
        check_root(root, "--root")
    local = local or (local_by_default and not (host or inventory))
    inv = Inventory(inventory) if inventory else None
    if host is not None and args and args[-1] is None and (
            local or (limit and inv is not None and not inv.matches(host))):
        host, args = None, (host, *args[:-1])
    if local:
        if host is not None:
            raise InputError(f"acts on this machine: {host!r} is one argument too many", where="--local")
        ts = [Target(host="local", known_hosts=known_hosts)]
    elif inv is not None:
        ts = inv.targets(known_hosts, limit=limit, host=host)
    elif host:
        ts = [Target.parse(host, known_hosts=known_hosts)]
    else:
        raise InputError("name a host, or use --local or -i INVENTORY", where="HOST")
    for t in ts:
        t.timeout, t.deadline, t.notice = timeout, deadline, notice
        if become and not t.become:
            t.become = "root"
        if key:
            t.key_file = str(key)
        if root:
            t.root = root
    return ts, args


def only(targets: list[Target]) -> Target:
    """The one host of a command that acts on one host."""
    if len(targets) != 1:
        raise InputError(f"this command acts on one host; {len(targets)} match (narrow with --limit)", where="-i")
    return targets[0]


def load_inventory(path: Path, known_hosts: Path, limit: str | None = None, host: str | None = None) -> list[Target]:
    """The inventory's hosts (narrowed by the Ansible pattern `limit` and the named `host`), in inventory order."""
    return Inventory(path).targets(known_hosts, limit, host)


# The ssh options of Ansible's ssh connection that a host's inventory may set: provision's connection is that plugin's
# ssh command line (transport.ssh_command), so a bastion, extra options or an ssh_config file are honoured.
SSH_ARGS = ("ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_ssh_args")
CONNECTIONS = ("ssh", "local")


def _target(name: str, v: dict, known_hosts: Path, where: str) -> Target:
    at = f"{where}: host {name}"

    def value(key: str, default=None):
        x = v.get(key, default)
        if isinstance(x, str) and ("{{" in x or "{%" in x):
            raise InventoryError(f"{key} is a template ({x!r}); provision reads inventory values as data: "
                                 "write the value itself", where=at)
        return x

    connection = value("ansible_connection")
    if connection not in (None, *CONNECTIONS):
        raise InventoryError(f"ansible_connection {connection!r} is not one provision runs host steps over "
                             f"({', '.join(CONNECTIONS)})", where=at)
    become = _become(value, at)
    if value("ansible_connection") == "local":
        t = Target(host="local", known_hosts=known_hosts, alias=name, inventory=where)
    else:
        port = parse_port(value("ansible_port", value("ansible_ssh_port", 22)), f"{where}: host {name}: ansible_port")
        user = value("ansible_user", value("ansible_ssh_user"))
        key = value("ansible_ssh_private_key_file", value("ansible_private_key_file"))
        host, user = str(value("ansible_host", name)), str(user) if user else None
        check_address(host, user, f"{where}: host {name}")
        t = Target(host=host, user=user, port=port, key_file=str(key) if key else None, known_hosts=known_hosts,
                   alias=name, inventory=where, ssh_args={k: str(value(k)) for k in SSH_ARGS if value(k)})
    t.become = become
    for theirs, ours in _KEPT.items():
        if value(theirs) is not None:
            setattr(t, ours, str(value(theirs)))
    if value("provision_root") is not None:
        check_root(t.root, f"{where}: host {name}: provision_root")
    return t


def _become(value, at: str) -> str | None:
    """The user the host's commands run as (ansible_become, ansible_become_user; default root), or None; sudo is
    the one method."""
    from ansible.module_utils.parsing.convert_bool import boolean

    try:
        on = boolean(value("ansible_become", False), strict=True)
    except TypeError:
        raise InventoryError(f"ansible_become {value('ansible_become')!r} is not a boolean", where=at) from None
    if not on:
        return None
    for name in ("ansible_become_password", "ansible_become_pass", "ansible_sudo_pass", "ansible_sudo_password"):
        if value(name) is not None:
            raise InventoryError(f"{name}: provision runs sudo without a password (sudo -n); give "
                                 f"{value('ansible_become_user') or 'root'}'s sudo rule NOPASSWD for this user, or "
                                 f"connect as root", where=at)
    method = value("ansible_become_method")
    if method not in (None, "sudo"):
        raise InventoryError(f"ansible_become_method {method!r}: provision becomes another user through sudo only",
                             where=at)
    user = str(value("ansible_become_user") or "root")
    check_address("localhost", user, f"{at}: ansible_become_user")
    return user


def _refuse_duplicates(targets: list[Target], where: str) -> None:
    seen: dict[tuple, str] = {}
    for t in targets:
        k = (t.host, t.port, t.root)
        if k in seen:
            raise InventoryError(f"hosts {seen[k]} and {t.name} are the same host ({t.address}, root "
                            f"{t.root}); name it once", where=where)
        seen[k] = t.name


@contextlib.contextmanager
def _ansible_warnings():
    """Ansible's warnings while it reads an inventory, collected (one line each) instead of printed: a failed
    parse is then our one line, naming the first reason."""
    from ansible.utils.display import Display

    display, seen = Display(), []

    def keep(msg="", *a, exception=None, **kw):
        why = " ".join(str(exception or msg).split())
        seen.append(why.split(" <<< caused by >>> ")[0][:300])
    saved = display.__dict__.get("warning"), display.__dict__.get("error_as_warning")
    display.warning = display.error_as_warning = keep
    try:
        yield seen
    finally:
        for name, fn in zip(("warning", "error_as_warning"), saved):
            if fn is None:
                display.__dict__.pop(name, None)
            else:
                setattr(display, name, fn)


# ------------------------------------------------------------------ ambiguity, refused before Ansible reads it

YAML_EXTS = (".yml", ".yaml", ".json")


def refuse_ambiguity(path: Path) -> None:
    """InventoryError (file:line) for what Ansible would read silently one way or another, or refuse with
    pages of warnings: a host given twice with different values for one variable, a YAML duplicate key or a
    host list where a mapping belongs, a child group defined nowhere. Files of a directory count together."""
    hosts: dict[str, dict[str, tuple]] = {}          # host → var → (value, where)
    defined: set[str] = {"all", "ungrouped"}
    children: list[tuple[str, str, str]] = []        # (group, child, where)
    for f in _sources(path):
        if f.suffix in YAML_EXTS or (not f.suffix and _looks_yaml(f)):
            _read_yaml(f, hosts, defined, children)
        else:
            _read_ini(f, hosts, defined, children)
    for group, child, where in children:
        if child not in defined:
            raise InventoryError(f"group {group!r} names child group {child!r}, which is defined nowhere "
                                 "(no hosts, children or vars)", where=where)


def _sources(path: Path) -> list[Path]:
    """The files Ansible reads as inventory sources under `path` (its ignore rules; executables are scripts)."""
    from ansible.inventory.manager import IGNORED

    if not path.is_dir():
        return [path]
    out = []
    for name in sorted(os.listdir(path)):
        if IGNORED.search(name.encode()):
            continue
        p = path / name
        if p.is_dir():
            out += _sources(p)
        elif p.is_file() and not os.access(p, os.X_OK):
            out.append(p)
    return out


def _looks_yaml(f: Path) -> bool:
    try:
        head = f.read_text(errors="replace")[:4096]
    except OSError:
        return False
    lines = [ln for ln in head.splitlines() if ln.strip() and not ln.lstrip().startswith(("#", ";"))]
    return bool(lines) and not lines[0].lstrip().startswith("[")


def _host_var(hosts: dict, host: str, var: str, value, where: str) -> None:
    had = hosts.setdefault(host, {}).get(var)
    if had is not None and str(had[0]) != str(value):
        first = had[1].rsplit(":", 1)
        at = f"line {first[1]}" if first[0] == where.rsplit(":", 1)[0] else had[1]
        raise InventoryError(f"host {host!r} is listed twice with different {var} ({had[0]} at {at}, "
                             f"{value} here); list it once", where=where)
    hosts[host].setdefault(var, (value, where))


def _read_yaml(f: Path, hosts: dict, defined: set, children: list) -> None:
    from . import yamlio
    from .errors import LockError

    try:
        doc = yamlio.load(f)
    except LockError as e:
        raise InventoryError(e.message, where=e.where) from None
    data = doc.data
    if not isinstance(data, dict) or "plugin" in data:
        return          # an inventory plugin's configuration, or not ours to judge: Ansible says what it is

    def group(name: str, body, keys: tuple) -> None:
        where = doc.where(*keys)
        if body is None:
            return
        if not isinstance(body, dict):
            raise InventoryError(f"group {name!r} must be a mapping (hosts, children, vars), not "
                                 f"{type(body).__name__}", where=where)
        if body:
            defined.add(name)
        hs = body.get("hosts")
        if isinstance(hs, list):
            raise InventoryError(f"the hosts of group {name!r} are a list; write them as a mapping "
                                 f"(`name:` or `name: {{vars}}` per line)", where=doc.where(*keys, "hosts"))
        if hs is not None and not isinstance(hs, dict):
            raise InventoryError(f"the hosts of group {name!r} must be a mapping, not {type(hs).__name__}",
                                 where=doc.where(*keys, "hosts"))
        for h, hv in (hs or {}).items():
            for var, value in (hv.items() if isinstance(hv, dict) else ()):
                if not isinstance(value, (dict, list)):
                    _host_var(hosts, str(h), str(var), value, doc.where(*keys, "hosts", h, var))
            hosts.setdefault(str(h), {})
        kids = body.get("children")
        if kids is not None and not isinstance(kids, dict):
            raise InventoryError(f"the children of group {name!r} must be a mapping, not {type(kids).__name__}",
                                 where=doc.where(*keys, "children"))
        for child, cbody in (kids or {}).items():
            children.append((name, str(child), doc.where(*keys, "children", child)))
            group(str(child), cbody, keys + ("children", child))

    for name, body in data.items():
        group(str(name), body, (name,))


def _read_ini(f: Path, hosts: dict, defined: set, children: list) -> None:
    try:
        text = f.read_text()
    except (OSError, UnicodeDecodeError):
        return          # Ansible says why it cannot read it
    section, kind = "ungrouped", "hosts"
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        where = f"{f}:{n}"
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section, _, kind = line[1:-1].strip().partition(":")
            kind = kind or "hosts"
            if kind in ("hosts", "children"):
                defined.add(section)
            continue
        if kind == "children":
            children.append((section, line.split()[0], where))
        elif kind == "hosts":
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                return  # Ansible says what is wrong with the line
            if not words:
                continue
            name, port = words[0], None
            if name.count(":") == 1 and name.rsplit(":", 1)[1].isdigit():
                name, port = name.rsplit(":", 1)
            if port is not None:
                _host_var(hosts, name, "ansible_port", port, where)
            for w in words[1:]:
                var, eq, value = w.partition("=")
                if eq:
                    _host_var(hosts, name, var, value, where)
            hosts.setdefault(name, {})
