"""Ansible inventories read by Ansible itself (InventoryManager + VariableManager): group and host vars,
group_vars/ and host_vars/, `--limit` patterns; each host becomes a Target named by its inventory name.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from .errors import InventoryError
from .transport import Target, check_address, parse_port

# Host variables provision reads; everything else stays Ansible's business.
_KEPT = {"provision_root": "provision_root", "provision_nvidia_smi": "provision_nvidia_smi",
         "ansible_python_interpreter": "python"}


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
        with self._errors():
            self.loader = DataLoader()
            self.inv = InventoryManager(loader=self.loader, sources=[self.where])
            if not self.inv.list_hosts("all"):
                raise InventoryError("inventory names no hosts (or Ansible cannot parse it)", where=self.where)

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
            if host is not None:
                named = self._matching(host)
                if not named:
                    raise InventoryError(f"{host!r} names no host or group of the inventory", where=self.where)
                hosts = [h for h in hosts if h in named]
                if not hosts:
                    raise InventoryError(f"{host!r} and --limit {limit!r} name no host in common", where=self.where)
            vm = VariableManager(loader=self.loader, inventory=self.inv)
            out = [_target(h.name, vm.get_vars(host=h, include_hostvars=False, stage="all"), known_hosts, self.where)
                   for h in hosts]
        _refuse_duplicates(out, self.where)
        return out

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


def load_inventory(path: Path, known_hosts: Path, limit: str | None = None, host: str | None = None) -> list[Target]:
    """The inventory's hosts (narrowed by the Ansible pattern `limit` and the named `host`), in inventory order."""
    return Inventory(path).targets(known_hosts, limit, host)


def _target(name: str, v: dict, known_hosts: Path, where: str) -> Target:
    def value(key: str, default=None):
        x = v.get(key, default)
        if isinstance(x, str) and ("{{" in x or "{%" in x):
            raise InventoryError(f"{key} is a template ({x!r}); provision reads inventory values as data: "
                                 "write the value itself", where=f"{where}: host {name}")
        return x

    if value("ansible_connection") == "local":
        t = Target(host="local", known_hosts=known_hosts, alias=name, inventory=where)
    else:
        port = parse_port(value("ansible_port", value("ansible_ssh_port", 22)), f"{where}: host {name}: ansible_port")
        user = value("ansible_user", value("ansible_ssh_user"))
        key = value("ansible_ssh_private_key_file", value("ansible_private_key_file"))
        host, user = str(value("ansible_host", name)), str(user) if user else None
        check_address(host, user, f"{where}: host {name}")
        t = Target(host=host, user=user, port=port, key_file=str(key) if key else None, known_hosts=known_hosts,
                   alias=name, inventory=where)
    t.vars = {ours: str(value(theirs)) for theirs, ours in _KEPT.items() if value(theirs) is not None}
    return t


def _refuse_duplicates(targets: list[Target], where: str) -> None:
    seen: dict[tuple, str] = {}
    for t in targets:
        k = (t.host, t.port, t.vars.get("provision_root"))
        if k in seen:
            raise InventoryError(f"hosts {seen[k]} and {t.name} are the same host ({t.address}, root "
                            f"{t.vars.get('provision_root') or 'default'}); name it once", where=where)
        seen[k] = t.name
