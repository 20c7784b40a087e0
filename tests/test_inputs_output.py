"""Output is text, not markup: values from locks, hosts and errors print exactly as they are."""
from __future__ import annotations

import io

from rich.console import Console

from provision.cli import common
from provision.cli.core import StepPrinter, history_table
from provision.cli.probe import probe_table
from provision.replies import History

VALUES = ["[six==1.17.0]", "[/x]", "host:abc:", "[bold red]loud[/]", ":thumbs_up:"]


def rendered(renderable) -> str:
    """Through a console that reads markup and emoji codes: only Text cells survive it unchanged."""
    out = io.StringIO()
    Console(file=out, width=200).print(renderable)
    return out.getvalue()


def test_tables_show_values_literally():
    h = History.of({"current": "0001-x", "generations": [{"id": "0001-x", "number": 1, "lock_name": v, "created": v,
                                                          "status": v, "probes_summary": {"pass": 1}} for v in VALUES]},
                   "host:abc:")
    text = rendered(history_table(h, "host:abc:"))
    assert "generations on host:abc:" in text
    for v in VALUES:
        assert v in text
    rep = {"generation": "[/x]", "host": "host:abc:", "summary": {"pass": 1},
           "results": [{"name": v, "status": "fail", "reason": v, "seconds": 0.1} for v in VALUES]}
    text = rendered(probe_table(rep))
    for v in VALUES:
        assert v in text


def test_errors_and_progress_lines_show_values_literally():
    from provision.errors import LockError

    @common.edge
    def fails():
        raise LockError("requirement [six==1.17.0] closes [/x] at host:abc: " + "x" * 100, where="l.yaml:3")

    with common.err_console.capture() as cap:          # the CLI's own console
        try:
            fails()
        except BaseException as e:                      # typer.Exit
            assert getattr(e, "exit_code", None) == 2
    want = "error: l.yaml:3: requirement [six==1.17.0] closes [/x] at host:abc: " + "x" * 100
    assert cap.get().splitlines() == [want]                 # one line however long

    with common.err_console.capture() as cap:
        p = StepPrinter(False)
        p("build", "start", "")
        p("build", "info", "[/x] fetch [six==1.17.0]")
        p("build", "done", "[/x] host:abc:")
    assert "[/x] host:abc:" in cap.get()
