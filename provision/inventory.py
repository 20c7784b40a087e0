"""Ansible inventories read by Ansible itself (InventoryManager + VariableManager): group and host vars,
group_vars/ and host_vars/, `--limit` patterns; each host becomes a Target named by its inventory name.
"""
from __future__ import annotations

from pathlib import Path

from .errors import InventoryError
from .transport import Target, check_address, parse_port

# Host variables provision reads; everything else stays Ansible's business.
_KEPT = {"provision_root": "provision_root", "provision_nvidia_smi": "provision_nvidia_smi",
         "ansible_python_interpreter": "python"}


def load_inventory(path: Path, known_hosts: Path, limit: str | None = None) -> list[Target]:
    """The inventory's hosts (narrowed by the Ansible pattern `limit`), in inventory order."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    where = str(path)
    if not Path(path).exists():
        raise InventoryError("inventory not found", where=where)
    try:
        loader = DataLoader()
        inv = InventoryManager(loader=loader, sources=[where])
        if not inv.list_hosts("all"):
            raise InventoryError("inventory names no hosts (or Ansible cannot parse it)", where=where)
        if limit:
            inv.subset(limit)
        hosts = inv.get_hosts("all")
        if not hosts:
            raise InventoryError(f"--limit {limit!r} matches no host of the inventory", where=where)
        vm = VariableManager(loader=loader, inventory=inv)
        out = [_target(h.name, vm.get_vars(host=h, include_hostvars=False, stage="all"), known_hosts, where)
               for h in hosts]
    except AnsibleError as e:
        raise InventoryError(f"cannot read inventory: {' '.join(str(e).split())}", where=where) from None
    _refuse_duplicates(out, where)
    return out


def _target(name: str, v: dict, known_hosts: Path, where: str) -> Target:
    def value(key: str, default=None):
        x = v.get(key, default)
        if isinstance(x, str) and ("{{" in x or "{%" in x):
            raise InventoryError(f"{key} is a template ({x!r}); provision reads inventory values as data: "
                                 "write the value itself", where=f"{where}: host {name}")
        return x

    if value("ansible_connection") == "local":
        t = Target(host="local", known_hosts=known_hosts, alias=name)
    else:
        port = parse_port(value("ansible_port", value("ansible_ssh_port", 22)), f"{where}: host {name}: ansible_port")
        user = value("ansible_user", value("ansible_ssh_user"))
        key = value("ansible_ssh_private_key_file", value("ansible_private_key_file"))
        host, user = str(value("ansible_host", name)), str(user) if user else None
        check_address(host, user, f"{where}: host {name}")
        t = Target(host=host, user=user, port=port, key_file=str(key) if key else None, known_hosts=known_hosts,
                   alias=name)
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
