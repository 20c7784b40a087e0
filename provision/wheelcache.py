"""The controller's wheel cache (`apply --wheels-from controller`): each wheel of a lock is fetched once
per controller, in parallel, verified by sha256 on its way in, and kept by hash under
PROVISION_HOME/cache/wheels/<sha256>/<filename>; the build pushes them to each host's store by hash. A fleet's
hosts (threads of one process, or the play's worker processes) share each download: a flock per wheel, under
<cache>/.locks."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from .errors import ProvisionError
from .lock import SHA_RE, Lock
from .transport import CONTROLLER_HOME

CACHE = CONTROLLER_HOME / "cache" / "wheels"


class WheelCache:
    """Wheels by sha256 in `root`; concurrent `fetch` calls (one per host of a fleet, in one process or in
    several) share each download."""

    def __init__(self, root: Path = CACHE, jobs: int = 8, stall: float = 30.0):
        self.root, self.jobs, self.stall = Path(root), jobs, stall

    @contextlib.contextmanager
    def held(self, sha256: str):
        """This wheel's flock (<root>/.locks/<sha256>), held for the block: a second fetch of it, from another
        thread or process, waits until the first is done and then finds the file."""
        if not SHA_RE.match(sha256):
            raise ProvisionError(f"bad sha256 {sha256!r} (64 lowercase hex digits)")
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / sha256, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def path(self, sha256: str, filename: str) -> Path:
        """<root>/<sha256>/<filename>, by the host store's own rule (a plain name under a 64-hex dir)."""
        from .agent.cache import AgentError, entry

        try:
            return Path(entry(str(self.root), sha256, filename))
        except AgentError as e:
            raise ProvisionError(str(e)) from None

    def fetch(self, lock: Lock, packages: list[dict]) -> list[Path]:
        """The local file of every package (those with a `url`), downloading what the cache lacks with the
        host's fetcher (parallel, retried, resumed); a download whose sha256 differs from the lock is refused
        (one line naming the lock's line)."""
        from .agent.fetch import AgentError, Download, Fetcher, fetchable

        lines = {p.pin: p.line for p in lock.packages}
        todo = [p for p in packages if p.get("url")]
        with contextlib.ExitStack() as stack:
            for sha in sorted({p["sha256"] for p in todo}):   # in sha256 order: a second host waits for the first
                stack.enter_context(self.held(sha))          # host's downloads
            missing, seen = [], set()
            for p in todo:
                dest = self.path(p["sha256"], p["filename"])
                if not dest.is_file() and p["sha256"] not in seen:
                    seen.add(p["sha256"])
                    missing.append(Download(p["url"], str(dest), p["sha256"], p["label"], p.get("size")))
            fetcher = Fetcher(self.jobs, self.stall)
            try:
                for d in missing:
                    fetchable(d.url, d.label)
                fetcher.run(missing)
            except AgentError as e:
                label = fetcher.failed[0][0].label if fetcher.failed else str(e).split(":", 1)[0]
                raise ProvisionError(f"{e} (fetched by the controller)",
                                     where=f"{lock.path}:{lines.get(label, 0)}") from None
            finally:
                for d in missing:
                    dest = Path(d.path)
                    if not dest.exists():
                        with contextlib.suppress(OSError):     # the entry's dir goes too when nothing landed
                            dest.parent.rmdir()
        return [self.path(p["sha256"], p["filename"]) for p in todo]

