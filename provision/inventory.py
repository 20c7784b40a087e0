"""Ansible inventories (YAML or INI) read into Targets, through ansible-core's own inventory parser."""
from __future__ import annotations

from pathlib import Path

from .errors import HostError
from .transport import Target, parse_port


def load_inventory(path: Path, known_hosts: Path) -> list[Target]:
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader

    if not Path(path).exists():
        raise HostError("inventory not found", where=str(path))
    try:
        inv = InventoryManager(loader=DataLoader(), sources=[str(path)])
    except AnsibleError as e:
        raise HostError(f"cannot read inventory: {e}", where=str(path)) from None
    out = []
    for h in inv.get_hosts():
        v = h.get_vars()
        if v.get("ansible_connection") == "local":
            t = Target(host="local", known_hosts=known_hosts)
        else:
            t = Target(host=str(v.get("ansible_host", h.name)), user=v.get("ansible_user"),
                       port=parse_port(v.get("ansible_port", 22), f"{path}: host {h.name}: ansible_port"), key_file=v.get("ansible_ssh_private_key_file"),
                       known_hosts=known_hosts)
        t.vars = {k: v[k] for k in ("provision_root", "provision_nvidia_smi") if k in v}
        if "ansible_python_interpreter" in v:
            t.vars["python"] = v["ansible_python_interpreter"]
        out.append(t)
    if not out:
        raise HostError("inventory names no hosts", where=str(path))
    return out
