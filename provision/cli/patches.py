"""`provision patches check|apply|revert` and `provision contract ARCH` (parse, call, render)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import typer

from .common import HOSTS, Hosts, console, each_host, edge, host_options, options, print_json

SeriesOpt = typer.Option(None, "--series", "-s",
                         help="series directory (repeatable); default: the series shipped with provision for the "
                              "installed release")
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


@dataclass
class Env:
    """The environment a patch verb acts on: its interpreter, or a bare site-packages directory."""

    python: Optional[str] = None
    site_packages: Optional[Path] = None


# The options that name the environment on the host: parameter name → (type, typer parameter).
ENV_PARAMS = {
    "python": (Optional[str], typer.Option(None, "--python", help="interpreter of the target environment (default: "
                                                                   "<root>/current/venv/bin/python)")),
    "site_packages": (Optional[Path], typer.Option(None, "--site-packages", help="act on this site-packages "
                                                                                  "directory on this machine (or on "
                                                                                  "HOST)")),
}
env_options = options("env", Env, ENV_PARAMS)
ENV = Env()     # the default of an `env` parameter that follows others with defaults (env_options replaces it)


def _each(hosts: Hosts, env: Env, render, json_out: bool, play) -> None:
    """`play` (a plays.Play, given the environment's python and site_packages) on each host (a --site-packages
    alone is this machine's); each report rendered, exit 1 unless all are ok."""
    sp = str(env.site_packages) if env.site_packages else None
    play.extravars.update(python=env.python, site_packages=sp)
    reports = each_host(hosts.targets(local_by_default=env.site_packages is not None), play, hosts.forks)
    if json_out:
        print_json(reports[0] if len(reports) == 1 else reports)
    else:
        for r in reports:
            render(r)
    if not all(r["ok"] for r in reports):
        raise typer.Exit(1)


# The series verbs, each the one function `series_verb` under its name: name → help.
SERIES_VERBS = {"check": "Show what applying the series would do; writes nothing (exit 1 if a patch fails).",
                "apply": "Apply the series: all-or-nothing, idempotent; prints each patched file's sha256.",
                "revert": "Revert the series to the pristine files."}


@edge
@host_options(forks=False)
@env_options
def series_verb(ctx: typer.Context, series: Optional[List[Path]] = SeriesOpt, env: Env = ENV,
                json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """check, apply or revert the series (the verb's name says which)."""
    from .. import patches as patchmod
    from ..plays import Play

    mode = ctx.info_name
    patchmod.chosen_series(series)      # a series refused here, before any host is contacted
    play = Play("patches", {"mode": mode, "series": [str(Path(d).resolve()) for d in series or []]})
    _each(hosts, env, _render_patches, json_out, play)


@edge
@host_options(forks=False)
@env_options
def contract(arch: str = typer.Argument(..., help="architecture name, or a model's config.json on the host"),
             env: Env = ENV, json_out: bool = JsonOpt, hosts: Hosts = HOSTS):
    """EAGLE-3 interface contract of ARCH in the installed SGLang (static; never imports it)."""
    from ..plays import Play

    _each(hosts, env, _render_contract, json_out, Play("contract", {"arch": arch}))


def register(app: typer.Typer) -> None:
    sub = typer.Typer(no_args_is_help=True, help="SGLang source patch series: check, apply, revert.")
    app.add_typer(sub, name="patches")
    for name, doc in SERIES_VERBS.items():
        sub.command(name, help=doc)(series_verb)
    app.command()(contract)
