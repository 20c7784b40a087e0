"""`provision hosts`: trust a host's SSH key (after showing it) and show a host's facts."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..transport import Target, fingerprint, known_host_keys, record_host_key, scan_host_key
from .common import (ForksOpt, HostArg, InventoryOpt, JsonOpt, KeyOpt, KnownHostsOpt, LimitOpt, LocalOpt, RootOpt,
                     console, edge, exit_for, over_hosts, print_json, print_rows, targets)


def register(app: typer.Typer) -> None:
    hosts = typer.Typer(no_args_is_help=True, help="Host keys and facts.")
    app.add_typer(hosts, name="hosts")

    @hosts.command()
    @edge
    def trust(host: str, yes: bool = typer.Option(False, "--yes", "-y", help="record without asking"),
              known_hosts: Path = KnownHostsOpt, json_out: bool = JsonOpt):
        """Show HOST's SSH key fingerprint and record exactly that key in the managed known_hosts."""
        from ..errors import InputError

        if json_out and not yes:
            raise InputError("--json cannot ask: add --yes to record the key shown", where="--json")
        say = (lambda text: None) if json_out else console.print
        t = Target.parse(host, known_hosts=known_hosts)
        key = scan_host_key(t)
        shown = {"host": t.name, "key": key.get_name(), "fingerprint": fingerprint(key)}
        say(f"{t.name} offers {key.get_name()} {fingerprint(key)}")
        known = known_host_keys(t)
        if any(k.asbytes() == key.asbytes() for k in known) and len(known) == 1:
            if json_out:
                print_json(dict(shown, recorded=False, replaced=[]))
            say(f"Already trusted in {known_hosts}; nothing changed.")
            return
        others = [f"{k.get_name()} {fingerprint(k)}" for k in known if k.asbytes() != key.asbytes()]
        for o in others:
            say(f"This REPLACES the recorded key {o} for {t.name}.")
        if not yes and not typer.confirm("Record this key as trusted?"):
            raise typer.Exit(1)
        replaced = record_host_key(t, key)
        if json_out:
            print_json(dict(shown, recorded=True, replaced=replaced))
        tail = f" (replaced {', '.join(replaced)})" if replaced else ""
        say(f"Recorded {key.get_name()} {fingerprint(key)} for {t.name} in {known_hosts}{tail}.")

    @hosts.command()
    @edge
    def facts(host: Optional[str] = HostArg, json_out: bool = JsonOpt,
              local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt, limit: Optional[str] = LimitOpt,
              forks: int = ForksOpt, key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt,
              root: Optional[str] = RootOpt):
        """The facts a plan is made from (one round trip per host, hosts in parallel)."""
        from ..facts import gather

        rows = over_hosts(targets(host, local, inventory, key, known_hosts, root, limit), gather, forks)

        def show(r):
            f = r.value
            gpus = ", ".join(f"{g['index']}:{g['name']} sm{g['compute_cap']}" for g in f["gpus"]) or "none"
            console.print(f"{r.host}: {f['os'].get('pretty')} {f['os'].get('arch')}, pythons "
                          f"{', '.join(f['pythons'])}, uv {'yes' if f['uv'] else 'no'}\n"
                          f"  GPUs: {gpus}; driver {f.get('driver') or '-'}; nvcc {f.get('nvcc_on_path_version') or '-'}\n"
                          f"  root {f['root']}: {len(f['generations'])} generations, current {f['current'] or '-'}; "
                          f"{f['disk_free_bytes'] >> 30} GiB free", markup=False)
        print_rows(rows, show, json_out)
        exit_for(rows)
