"""The host root's state steps, declared once: status, history, logs, rollback, switch, gc. The host's state agent
(agent/state.py) answers each with its Reply; the Ansible modules of playbooks/library are written from these
declarations (steps/modules.py); the controller reads the replies back through them (provision.replies)."""
from __future__ import annotations

from . import Args, Reply, Step, dataclass, doc, field, gen_id, clean_or_drift


# ---------------------------------------------------------------- what settling an interrupted run found

@dataclass(frozen=True)
class Recovered(Reply):
    """`recover`: what an interrupted run left, settled (each list names what it touched)."""
    STEP = "recover"
    abandoned: list[str] = field(default_factory=list, metadata=doc("generations left unfinished, abandoned"))
    repaired: list[str] = field(default_factory=list, metadata=doc("switches whose records were repaired"))
    settled: list = field(default_factory=list, metadata=doc("switches not current, settled back"))
    freed: list = field(default_factory=list, metadata=doc("failed generations whose venv was removed"))
    removed_tmp: list[str] = field(default_factory=list, metadata=doc("temporary files removed"))
    removed_partial: list[str] = field(default_factory=list, metadata=doc("partial downloads removed"))
    unreadable: list[str] = field(default_factory=list, metadata=doc("manifests that cannot be read (kept)"))
    errors: list[str] = field(default_factory=list, metadata=doc("what could not be settled"))
    trash_bytes: int = field(default=0, metadata=doc("bytes an interrupted gc had set aside, removed"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of what it found", rest=True))


# ---------------------------------------------------------------- status

@dataclass(frozen=True)
class StatusArgs(Args):
    pass


@dataclass(frozen=True)
class ProbeMark(Reply):
    """A probe verdict as status shows it (the last attempt names its generation)."""
    status: str | None = field(default=None, metadata=doc("pass, fail or stopped"))
    time: str | None = field(default=None, metadata=doc("when it ran (UTC)"))
    summary: dict[str, int] | None = field(default=None, metadata=doc(
        "how many probes ended each way (pass, fail, skip, warn)"))
    generation: str | None = field(default=None, metadata=doc("the generation it probed (the last attempt only)"))


@dataclass(frozen=True)
class VerifyMark(Reply):
    verdict: str = field(metadata=clean_or_drift("clean or drift"))
    time: str | None = field(default=None, metadata=doc("when it ran (UTC)"))
    how: str | None = field(default=None, metadata=doc("what it compared"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of its record", rest=True))


@dataclass(frozen=True)
class Serving(Reply):
    """The current generation's service unit as systemd has it, and what its processes run."""
    unit: str = field(metadata=doc("the unit (the current generation's lock names it: service.unit)"))
    load: str | None = field(default=None, metadata=doc("systemd's LoadState: loaded, not-found …"))
    active: str | None = field(default=None, metadata=doc("its ActiveState: active, inactive, failed, activating …"))
    sub: str | None = field(default=None, metadata=doc("its SubState: running, dead, exited …"))
    main_pid: int | None = field(default=None, metadata=doc("its main process, or null"))
    processes: int = field(default=0, metadata=doc("how many processes its cgroup holds"))
    generations: list[str] = field(default_factory=list, metadata=gen_id(
        "the generations its processes run: their interpreter, mapped libraries or named files under generations/"))
    healthy: bool | None = field(default=None, metadata=doc(
        "whether its health check passed (service.health, at service.url), null where it is not active"))
    health: str | None = field(default=None, metadata=doc("what the health check did, or why it failed"))
    error: str | None = field(default=None, metadata=doc("why systemd's manager could not be asked, or null"))


@dataclass(frozen=True)
class Status(Reply):
    STEP = "status"
    generations: int = field(metadata=doc("how many generations the root keeps"))
    ready: int = field(metadata=doc("how many of them are runnable"))
    disk_bytes: int = field(metadata=doc("bytes under the root, each hard-linked file once"))
    root: str | None = field(default=None, metadata=doc("the host root read", path=True))
    current: str | None = field(default=None, metadata=gen_id("the generation `current` names, or null"))
    lock: str | None = field(default=None, metadata=doc("its lock's name"))
    since: str | None = field(default=None, metadata=doc("when it became current (UTC)"))
    broken: str | None = field(default=None, metadata=doc(
        "what is wrong with `current` (its link, directory or interpreter), or null"))
    probe: ProbeMark | None = field(default=None, metadata=doc("its last probe (status, time, summary)"))
    verify: VerifyMark | None = field(default=None, metadata=doc("its last verification"))
    last_attempt: ProbeMark | None = field(default=None, metadata=doc(
        "the last probe of a generation that did not stay current"))
    serving: Serving | None = field(default=None, metadata=doc(
        "the service unit and what it runs, where the current generation's lock names one"))


STATUS = Step("status", "state", "status", StatusArgs, Status,
              "The current generation of a provision host root, its lock, last probe and disk use",
              ("Reads the host root only; never changes it. The same reply as `provision status --json`.",))


# ---------------------------------------------------------------- history

@dataclass(frozen=True)
class HistoryArgs(Args):
    limit: int = field(default=200, metadata=doc("How many of the latest history events to return."))


@dataclass(frozen=True)
class GenerationVerify(Reply):
    """A generation's last verify verdict as its manifest records it."""
    verdict: str | None = field(default=None, metadata=doc("clean or drift"))
    time: str | None = field(default=None, metadata=doc("when it ran (UTC)"))
    how: str | None = field(default=None, metadata=doc("what it compared"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of its record", rest=True))


@dataclass(frozen=True)
class HistoryGeneration(Reply):
    """One generation as history lists it: its manifest, with its id and number."""
    id: str = field(metadata=gen_id("the generation"))
    number: int = field(metadata=doc("its number"))
    status: str | None = field(default=None, metadata=doc("ready, adopted, failed, ..."))
    lock_name: str | None = field(default=None, metadata=doc("its lock's name"))
    created: str | None = field(default=None, metadata=doc("when it was made (UTC)"))
    skipped_probes: list[str] = field(default_factory=list, metadata=doc("probes its apply skipped"))
    probes_summary: dict[str, int] | None = field(default=None, metadata=doc(
        "how many of its probes ended each way"))
    verify: GenerationVerify | None = field(default=None, metadata=doc("its last verification"))
    reason: str | None = field(default=None, metadata=doc("why it failed"))
    run_dir: str | None = field(default=None, metadata=doc("the controller's run directory of its build"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of its manifest, as written", rest=True))


@dataclass(frozen=True)
class History(Reply):
    STEP = "history"
    current: str | None = field(default=None, metadata=gen_id("the generation `current` names, or null"))
    generations: list[HistoryGeneration] = field(default_factory=list, metadata=doc(
        "each generation's manifest with its id and number, oldest first"))
    events: list[dict] = field(default_factory=list, metadata=doc("the latest history events, oldest first"))
    warnings: list[str] = field(default_factory=list, metadata=doc(
        "history lines and manifests that could not be read (the task's warnings too)", key="warnings"))


HISTORY = Step("history", "state", "history", HistoryArgs, History,
               "The generations of a provision host root and its latest history events",
               ("Reads the host root only; never changes it.",))


# ---------------------------------------------------------------- logs

@dataclass(frozen=True)
class LogsArgs(Args):
    generation: str | None = field(default=None, metadata=doc(
        "The generation (its number or id); default the newest."))
    tail: int = field(default=65536, metadata=doc("Bytes from the end of each log."))


@dataclass(frozen=True)
class LogTail(Reply):
    bytes: int = field(metadata=doc("the log's size"))
    text: str = field(metadata=doc("its tail"))


@dataclass(frozen=True)
class ProbeLine(Reply):
    name: str = field(metadata=doc("the probe"))
    status: str = field(metadata=doc("its verdict"))
    reason: str | None = field(default=None, metadata=doc("why it failed or was skipped"))


@dataclass(frozen=True)
class Logs(Reply):
    STEP = "logs"
    id: str = field(metadata=gen_id("the generation"))
    dir: str = field(metadata=doc("its directory on the host", path=True))
    logs: dict[str, LogTail] = field(metadata=doc("each log file's name to {bytes: its size, text: its tail}"))
    probes: list[ProbeLine] = field(metadata=doc("each probe's name, status and reason"))
    status: str | None = field(default=None, metadata=doc("its status (ready, failed, ...)"))
    reason: str | None = field(default=None, metadata=doc("why it failed, or null"))
    run_dir: str | None = field(default=None, metadata=doc("the controller's run directory of its build, or null"))


LOGS = Step("logs", "state", "logs", LogsArgs, Logs,
            "The tail of each log of a generation, its probe results and why it failed",
            ("Reads the host root only; never changes it. The same reply as `provision logs --json`.",))


# ---------------------------------------------------------------- rollback

@dataclass(frozen=True)
class RollbackArgs(Args):
    to: str | None = field(default=None, metadata=doc(
        "The generation to switch to (its number or id); default the one current before the last switch."))
    force: bool = field(default=False, metadata=doc("Switch to a generation that fails its check."))
    restart: bool = field(default=True, metadata=doc(
        "Restart the service the generation's lock names (service.unit) once switched, and check its health; "
        "false leaves the server alone."))
    dry_run: bool = field(default=False, metadata=doc("Name the target without switching (check mode).",
                                                      option=False))


@dataclass(frozen=True)
class Restarted(Reply):
    """The service restarted on the generation switched to: stopped, started, and healthy or why not."""
    STEP = "restart"
    unit: str = field(metadata=doc("the unit (service.unit of the generation's lock)"))
    healthy: bool = field(default=False, metadata=doc("whether it answered its health check within the deadline"))
    health: str | None = field(default=None, metadata=doc("what the last health check did, or why it failed"))
    stop_seconds: float | None = field(default=None, metadata=doc("from the stop until its processes were gone"))
    seconds: float | None = field(default=None, metadata=doc(
        "from the stop to healthy (the server's downtime), or to the failure"))
    main_pid: int | None = field(default=None, metadata=doc("its main process after the start"))
    generations: list[str] = field(default_factory=list, metadata=gen_id("the generations its processes run"))
    error: str | None = field(default=None, metadata=doc("why it is not serving healthy, in one line, or null"))


@dataclass(frozen=True)
class QuickCheck(Reply):
    """A generation's files against its build's stamp (`verify` agent's `quick`, and inside a rollback)."""
    STEP = "check"
    verdict: str = field(metadata=clean_or_drift("clean or drift"))
    files: int = field(default=0, metadata=doc("files checked"))
    hashed: int = field(default=0, metadata=doc("files hashed (their stat had changed)"))
    seconds: float = field(default=0.0, metadata=doc("seconds the check took"))
    how: str | None = field(default=None, metadata=doc("what it compared"))
    named: str | None = field(default=None, metadata=doc("the files that drifted, named"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of the check (what drifted, by kind)",
                                                          rest=True))


@dataclass(frozen=True)
class Rollback(Reply):
    STEP = "rollback"
    to: str = field(metadata=gen_id("the generation current now (check mode - the one it would be)"))
    from_: str | None = field(default=None, metadata=gen_id("the generation current before", key="from"))
    noop: bool = field(default=False, metadata=doc("true when `to` already is current (nothing switched)"))
    forward: bool = field(default=False, metadata=doc("whether `to` is newer than `from`"))
    dry_run: bool = field(default=False, metadata=doc("true in check mode"))
    switched: bool = field(default=False, metadata=doc("true once `current` was renamed to `to`"))
    switch_seconds: float | None = field(default=None, metadata=doc("seconds of the switch itself"))
    check: QuickCheck | None = field(default=None, metadata=doc(
        "the target's check against its stamp (verdict, files, figures)"))
    event: dict | None = field(default=None, metadata=doc("the history event recorded"))
    recovered: Recovered | None = field(default=None, metadata=doc("what settling an interrupted run found"))
    bookkeeping_failed: list[str] = field(default_factory=list, metadata=doc(
        "records that failed after the switch (it stands; the next run repairs)"))
    warnings: list[str] = field(default_factory=list, metadata=doc("what the host root says is amiss"))
    service: Restarted | None = field(default=None, metadata=doc(
        "the service restarted on `to`, where its lock names one and restart is on"))
    seconds: float | None = field(default=None, metadata=doc("the step as the controller timed it", given=True))


ROLLBACK = Step("rollback", "state", "rollback", RollbackArgs, Rollback,
                "Switch `current` back to the generation current before the last switch, or to a given one",
                ("Under the host lock, settles what an interrupted run left, checks the target generation against "
                 "its build's stamp and refuses one that drifted (unless force), then renames `current` (the "
                 "commit point) and records it; where the generation's lock names a service, restarts its unit "
                 "and waits for its health (unless restart is false).",
                 "Check mode names the target without switching."), check_mode="dry_run")


# ---------------------------------------------------------------- switch (apply's commit point)

@dataclass(frozen=True)
class SwitchArgs(Args):
    to: str = field(metadata=doc("The generation to make current (its id, as the stage task returns it)."))
    lock: str | None = field(default=None, metadata=doc(
        "The name of the lock the generation holds, recorded in the history event."))
    skipped_probes: list[str] = field(default_factory=list, metadata=doc(
        "Probes the apply skipped, recorded in the history event."))
    reuse: bool = field(default=False, metadata=doc(
        "Whether the apply reused an existing generation rather than building one."))


@dataclass(frozen=True)
class Switched(Reply):
    """`switch`: the rename of `current` committed (`to`); what failed after it (`bookkeeping_failed`)."""
    STEP = "switch"
    to: str = field(metadata=gen_id("the generation current now"))
    from_: str | None = field(default=None, metadata=gen_id("the generation current before", key="from"))
    switched: bool = field(default=False, metadata=doc("true once `current` was renamed to `to`"))
    switch_seconds: float | None = field(default=None, metadata=doc("seconds of the switch itself"))
    event: dict | None = field(default=None, metadata=doc("the history event recorded"))
    bookkeeping_failed: list[str] = field(default_factory=list, metadata=doc(
        "records that failed after the switch (it stands; the next run repairs)"))


SWITCH = Step("switch", "state", "switch", SwitchArgs, Switched,
              "Make a staged generation of the host current, recorded as the apply that built it",
              ("Under the host lock, renames `current` to the generation (the commit point) and records the switch "
               "in the host's history as an apply of its lock (the event `apply`), as a one-host `provision apply` "
               "does.",
               "Refuses a generation that is not runnable (failed, abandoned, still building, without its "
               "interpreter).",
               "The play's `stage` task (provision_apply) builds, seals and probes the generation and stops before "
               "this."), module="plugin")


# ---------------------------------------------------------------- gc

@dataclass(frozen=True)
class GcArgs(Args):
    keep: int = field(default=3, metadata=doc("Runnable generations to keep, current and the rollback target "
                                              "included."))
    dry_run: bool = field(default=False, metadata=doc("Name what would go, removing nothing (check mode).",
                                                      option=False))
    jobs: int | None = field(default=None, metadata=doc("Threads deleting files (default 16).", option=False))


@dataclass(frozen=True)
class Collected(Reply):
    """One generation gc removed (or would remove) and what removing it frees."""
    id: str = field(metadata=gen_id("the generation"))
    status: str | None = field(default=None, metadata=doc("its status"))
    bytes: int = field(default=0, metadata=doc("bytes removing it frees"))
    shared_bytes: int = field(default=0, metadata=doc("bytes that stay, linked from what is kept"))
    removed: bool | None = field(default=None, metadata=doc("whether it is gone (not in check mode)"))
    run_dir: str | None = field(default=None, metadata=doc("the controller's run directory of its build"))


@dataclass(frozen=True)
class KernelEntry(Reply):
    key: str = field(metadata=doc("the kernel cache entry"))
    bytes: int = field(default=0, metadata=doc("its bytes"))
    rest: dict = field(default_factory=dict, metadata=doc("the rest of its record", rest=True))


@dataclass(frozen=True)
class KernelsCollected(Reply):
    """gc's part of the host's kernel cache: the entries no kept generation records, removed (or that would be)."""
    removed: list[KernelEntry] = field(default_factory=list, metadata=doc("the entries removed"))
    kept: list[str] = field(default_factory=list, metadata=doc("the entries a kept generation uses"))
    bytes: int = field(default=0, metadata=doc("bytes freed"))
    errors: list[str] = field(default_factory=list, metadata=doc("removals that failed"))


@dataclass(frozen=True)
class StoreCollected(Reply):
    """gc's part of the host's file store: the entries no kept generation links, and the bytes they alone held."""
    entries: int = field(default=0, metadata=doc("store entries removed"))
    bytes: int = field(default=0, metadata=doc("the bytes they alone held"))


@dataclass(frozen=True)
class Gc(Reply):
    STEP = "gc"
    dry_run: bool = field(default=False, metadata=doc("true in check mode (nothing removed)"))
    generations: list[Collected] = field(default_factory=list, metadata=doc(
        "each generation removed (or that would be), with its status and the bytes it frees"))
    cache: list = field(default_factory=list, metadata=doc("the cached wheels removed"))
    uv_cache: list = field(default_factory=list, metadata=doc("uv's unpacked wheels removed"))
    kernels: KernelsCollected | None = field(default=None, metadata=doc(
        "compiled kernel caches no kept generation uses, removed"))
    store: StoreCollected | None = field(default=None, metadata=doc(
        "store entries no kept generation links, removed, and the bytes they alone held"))
    bytes: int = field(default=0, metadata=doc("bytes freed (each inode once, only when no link to it is left)"))
    shared_bytes: int = field(default=0, metadata=doc("bytes that stay, linked from what is kept"))
    errors: list[str] = field(default_factory=list, metadata=doc("removals that failed (what was done is "
                                                                 "reported)"))
    current: str | None = field(default=None, metadata=gen_id("the generation `current` names (kept)"))
    rollback_target: str | None = field(default=None, metadata=gen_id(
        "the generation a rollback returns to (kept)"))
    seconds: float | None = field(default=None, metadata=doc("seconds the removal took (not in check mode)"))
    fs_freed: int | None = field(default=None, metadata=doc(
        "the filesystem's own figure of space freed (not in check mode)"))
    recovered: Recovered | None = field(default=None, metadata=doc(
        "what settling an interrupted run found (not in check mode)"))
    warnings: list[str] = field(default_factory=list, metadata=doc("what the host root says is amiss"))
    run_dirs: list[str] = field(default_factory=list, metadata=doc(
        "the controller's run directories of the generations removed (or that would be)", given=True))


GC = Step("gc", "state", "gc", GcArgs, Gc,
          "Remove old and failed generations of a provision host root and cache entries none needs",
          ("Under the host lock, removes failed and abandoned generations, runnable ones beyond the newest `keep`, "
           "and cached wheels no remaining generation needs; never `current` nor the generation a rollback "
           "returns to.",
           "Check mode names what would go, removing nothing. The controller's own run directories are the CLI's "
           "to remove (`provision gc`)."), module="plugin", check_mode="dry_run")


STEPS = (STATUS, HISTORY, LOGS, ROLLBACK, SWITCH, GC)
