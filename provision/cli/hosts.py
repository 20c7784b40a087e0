"""`provision hosts`: trust a host's SSH key (after showing it) and show a host's facts."""
from __future__ import annotations

import typer

from ..transport import Target, fingerprint, key_change, record_host_key, scan_host_key
from .common import HOSTS, Hosts, JsonOpt, console, edge, exit_for, host_options, over_hosts, print_json, print_rows


@edge
@host_options(forks=False, local=False, key=False, root=False, become=False)
def trust(yes: bool = typer.Option(False, "--yes", "-y", help="record without asking"), hosts: Hosts = HOSTS,
          json_out: bool = JsonOpt):
    """Show each host's SSH key fingerprint and record exactly that key in the managed known_hosts."""
    from ..errors import InputError

    if json_out and not yes:
        raise InputError("--json cannot ask: add --yes to record the key shown", where="--json")
    out = [_trust(t, yes, (lambda text: None) if json_out else console.print) for t in hosts.targets()]
    if json_out:
        print_json(out[0] if len(out) == 1 else out)
    if any(r is None for r in out):
        raise typer.Exit(1)


@edge
@host_options()
def facts(json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """The facts a plan is made from (one round trip per host: playbooks/facts.yml through Ansible)."""
    from ..plays import Play, facts_of
    from ..units import human_size

    rows = over_hosts(hosts.targets(), Play("facts", read=facts_of), hosts.forks)

    def show(r):
        f = r.value.to_json()
        gpus = ", ".join(f"{g['index']}:{g['name']} sm{g['compute_cap']}" for g in f["gpus"]) or "none"
        console.print(f"{r.host}: {f['os'].get('pretty')} {f['os'].get('arch')}, pythons "
                      f"{', '.join(f['pythons'])}, uv {'yes' if f['uv'] else 'no'}\n"
                      f"  GPUs: {gpus}; driver {f.get('driver') or '-'}; nvcc {f.get('nvcc_on_path_version') or '-'}\n"
                      f"  root {f['root']}: {len(f['generations'])} generations, current {f['current'] or '-'}; "
                      f"{human_size(f['disk_free_bytes'])} free", markup=False)
    print_rows(rows, show, json_out, to_json=lambda f: f.to_json())
    exit_for(rows)


@edge
@host_options()
def unlock(json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """Break the host lock of a run whose controller is gone. The lock's holder hears its controller's heartbeat;
    a holder that has heard none for longer than its own bound (about 30 s: the controller was killed, the network
    was cut, or the holder is stopped) is orphaned, and unlock ends it and the agents of its run, then the lock is
    free. While the holder still hears its controller, unlock refuses (exit 1) and names it (playbooks/unlock.yml
    through Ansible)."""
    from ..plays import Play, unlock_of

    rows = over_hosts(hosts.targets(), Play("unlock", read=unlock_of), hosts.forks)
    print_rows(rows, lambda r: console.print(unlock_text(r.host, r.value), markup=False, soft_wrap=True), json_out)
    exit_for(rows, bad=lambda v: v["state"] == "held")


def unlock_text(host: str, out: dict) -> str:
    heard = f"{out['heard']:g} s ago" if "heard" in out else "at an unknown time"
    bound = f" (its bound: {out['bound']:g} s)" if "bound" in out else ""
    if out["state"] == "free":
        return f"{host}: {out['lock']} is not held"
    if out["state"] == "broken":
        return (f"{host}: broke {out['lock']}: its holder {out.get('holder', 'unknown')} last heard its controller "
                f"{heard}{bound}; ended pids {', '.join(map(str, out['ended'])) or '-'}")
    return (f"{host}: {out['lock']} is held by {out.get('holder', 'unknown')}, which last heard its controller "
            f"{heard}{bound}: {out.get('why') or 'left alone'}; not unlocked")


def register(app: typer.Typer) -> None:
    hosts = typer.Typer(no_args_is_help=True, help="Host keys and facts.")
    app.add_typer(hosts, name="hosts")
    for verb in (trust, facts):
        hosts.command()(verb)
    app.command()(unlock)


def _trust(t: Target, yes: bool, say) -> dict | None:
    """Scan t's key once, show it, record exactly it (after asking unless `yes`); None if declined."""
    key = scan_host_key(t)
    shown = {"host": t.name, "address": t.address, "key": key.get_name(), "fingerprint": fingerprint(key)}
    say(f"{t.name} offers {key.get_name()} {fingerprint(key)}")
    trusted, replaces = key_change(t, key)
    if trusted:
        say(f"Already trusted in {t.known_hosts}; nothing changed.")
        return dict(shown, recorded=False, replaced=[])
    for k in replaces:
        say(f"This REPLACES the recorded key {k.get_name()} {fingerprint(k)} for {t.name}.")
    if not yes and not typer.confirm("Record this key as trusted?"):
        return None
    replaced = record_host_key(t, key)
    tail = f" (replaced {', '.join(replaced)})" if replaced else ""
    say(f"Recorded {key.get_name()} {fingerprint(key)} for {t.name} in {t.known_hosts}{tail}.")
    return dict(shown, recorded=True, replaced=replaced)
