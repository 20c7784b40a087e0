"""`provision patches check|apply|revert` and `provision contract ARCH` (parse, call, render)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..transport import TIMEOUT
from .common import (HostArg, each_host, InventoryOpt, KeyOpt, KnownHostsOpt,
                     TimeoutOpt, LimitOpt, LocalOpt, RootOpt, console,
                     edge, print_json, targets)

SeriesOpt = typer.Option(None, "--series", "-s",
                         help="series directory (repeatable); default: the series shipped with provision for the "
                              "installed release")
PythonOpt = typer.Option(None, "--python",
                         help="interpreter of the target environment (default: <root>/current/venv/bin/python)")
SitePackagesOpt = typer.Option(None, "--site-packages",
                               help="act on this site-packages directory on this machine (or on HOST)")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")

MARKS = {"applied": "+", "would-apply": "+", "already-applied": "=", "reverted": "-", "not-applied": "·",
         "skipped-by-gate": "~", "upstream": "✓", "failed": "✗"}


def _line(text: str) -> None:
    console.print(text, markup=False, soft_wrap=True)


def _render_patches(report: dict) -> None:
    for s in report["series"]:
        _line(f"{report['host']}: {s['package']} {s['version']} in {s['site_packages']}  "
                      f"(series {s['name']}, {s['package']}{s['specifier']})")
        for p in s["patches"]:
            extra = f"  {p['reason']}" if p.get("reason") else ""
            _line(f"  {MARKS.get(p['status'], '?')} {p['name']:<48} {p['status']}{extra}")
            for f in p.get("files", []):
                _line(f"      {f}")
    counts: dict = {}
    for s in report["series"]:
        for p in s["patches"]:
            counts[p["status"]] = counts.get(p["status"], 0) + 1
    _line("Patches: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + (" (nothing written)" if not report["written"] else f"; wrote {len(report['changed'])} files"))
    for path, digest in report["files"].items():
        _line(f"  sha256 {digest[:16]}…  {path}")


def _render_contract(r: dict) -> None:
    if not r.get("found"):
        _line(f"{r['host']}: {r['arch']}: {r.get('reason', 'not found')}")
        _line("EAGLE-3 contract: FAIL")
        return
    pkg = r["package"]
    _line(f"{r['host']}: {r['arch']}  ({pkg['name']} {pkg['version']}, {r['at']})")
    _line("  MRO: " + " → ".join(m.rsplit(".", 1)[-1] if m.startswith("sglang.") else m for m in r["mro"]))
    src = "derived from the installed EAGLE worker" if r["required_source"] == "derived" else "fallback list"
    _line(f"  required methods ({src}):")
    for m in r["methods"]:
        if m["status"] == "defined":
            detail = f"defined ({m['at']})"
        elif m["status"] == "inherited":
            detail = f"inherited from {m['from']} ({m['at']})"
        elif m.get("via"):
            v = m["via"]
            how = "defined" if v["status"] == "defined" else f"inherited from {v['from']}"
            detail = f"MISSING; reachable via self.{v['member']} ({v['class']}, {how})"
        else:
            detail = "MISSING"
        _line(f"    {'✓' if m['status'] != 'missing' else '✗'} {m['method']:<30} {detail}")
    missing = sum(m["status"] == "missing" for m in r["methods"])
    _line(f"EAGLE-3 contract: {'PASS' if r['ok'] else 'FAIL'} "
                  f"({len(r['methods']) - missing} of {len(r['methods'])} methods present)")


def _targets(host, local, inventory, key, known_hosts, root, site_packages, limit=None, timeout=TIMEOUT):
    if site_packages and not (host or inventory):
        local = True
    return targets(host, local, inventory, key, known_hosts, root, limit, timeout)


def register(app: typer.Typer) -> None:
    sub = typer.Typer(no_args_is_help=True, help="SGLang source patch series: check, apply, revert.")
    app.add_typer(sub, name="patches")

    def _run(mode, host, series, python, site_packages, json_out, local, inventory, key, known_hosts, root, limit,
             timeout):
        from .. import patches as patchmod
        from ..bundled import PATCHES

        dirs = series or patchmod.discover_series(PATCHES)
        loaded = [patchmod.load_series(d) for d in dirs]
        sp = str(site_packages) if site_packages else None
        reports = each_host(_targets(host, local, inventory, key, known_hosts, root, site_packages, limit, timeout),
                            lambda tr: patchmod.apply_series(tr, loaded, python=patchmod.env_python(tr, python, site_packages),
                                                             check_only=mode == "check", revert=mode == "revert",
                                                             site_packages=sp, matching=not series))
        if json_out:
            print_json(reports[0] if len(reports) == 1 else reports)
        else:
            for r in reports:
                _render_patches(r)
        if not all(r["ok"] for r in reports):
            raise typer.Exit(1)

    def verb(mode: str, doc: str):
        def command(host: Optional[str] = HostArg, series: Optional[List[Path]] = SeriesOpt,
                    python: Optional[str] = PythonOpt, site_packages: Optional[Path] = SitePackagesOpt,
                    json_out: bool = JsonOpt, local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt,
                    limit: Optional[str] = LimitOpt, key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt,
                    timeout: float = TimeoutOpt, root: Optional[str] = RootOpt):
            _run(mode, host, series, python, site_packages, json_out, local, inventory, key, known_hosts, root, limit,
                 timeout)

        command.__doc__ = doc
        sub.command(name=mode)(edge(command))

    verb("check", "Show what applying the series would do; writes nothing (exit 1 if a patch fails).")
    verb("apply", "Apply the series: all-or-nothing, idempotent; prints each patched file's sha256.")
    verb("revert", "Revert the series to the pristine files.")

    @app.command()
    @edge
    def contract(arch: str = typer.Argument(..., help="architecture name, or a model's config.json on the host"),
                 host: Optional[str] = HostArg, python: Optional[str] = PythonOpt,
                 site_packages: Optional[Path] = SitePackagesOpt, json_out: bool = JsonOpt,
                 local: bool = LocalOpt, inventory: Optional[Path] = InventoryOpt, limit: Optional[str] = LimitOpt,
                 key: Optional[Path] = KeyOpt, known_hosts: Path = KnownHostsOpt, timeout: float = TimeoutOpt,
                 root: Optional[str] = RootOpt):
        """EAGLE-3 interface contract of ARCH in the installed SGLang (static; never imports it)."""
        from .. import patches as patchmod

        sp = str(site_packages) if site_packages else None
        reports = each_host(_targets(host, local, inventory, key, known_hosts, root, site_packages, limit, timeout),
                            lambda tr: patchmod.check_contract(tr, arch, patchmod.env_python(tr, python, site_packages),
                                                               site_packages=sp))
        if json_out:
            print_json(reports[0] if len(reports) == 1 else reports)
        else:
            for r in reports:
                _render_contract(r)
        if not all(r["ok"] for r in reports):
            raise typer.Exit(1)
