"""The controller's wheel cache (`apply --wheels-from controller`): each wheel of a lock is fetched once
per controller, in parallel, verified by sha256 on its way in, and kept by hash under
PROVISION_HOME/cache/wheels/<sha256>/<filename>; the build pushes them to each host's store by hash."""
from __future__ import annotations

import contextlib
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import ProvisionError
from .lock import Lock
from .transport import CONTROLLER_HOME

CACHE = CONTROLLER_HOME / "cache" / "wheels"
CHUNK = 1 << 20


class WheelCache:
    """Wheels by sha256 in `root`; concurrent `fetch` calls (one per host of a fleet) share each download."""

    def __init__(self, root: Path = CACHE, jobs: int = 8, timeout: float = 300):
        self.root, self.jobs, self.timeout = Path(root), jobs, timeout
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def path(self, sha256: str, filename: str) -> Path:
        """<root>/<sha256>/<filename>, by the host store's own rule (a plain name under a 64-hex dir)."""
        from .agent.build import AgentError, entry

        try:
            return Path(entry({"wheels": str(self.root)}, sha256, filename))
        except AgentError as e:
            raise ProvisionError(str(e)) from None

    def fetch(self, lock: Lock, packages: list[dict]) -> list[Path]:
        """The local file of every package (those with a `url`), downloading what the cache lacks;
        a download whose sha256 differs from the lock is refused (one line naming the lock's line)."""
        lines = {p.pin: p.line for p in lock.packages}
        todo = [p for p in packages if p.get("url")]
        with ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(todo) or 1))) as pool:
            futures = [pool.submit(self._one, p) for p in todo]
            errors = []
            for p, fut in zip(todo, futures):
                try:
                    fut.result()
                except ProvisionError as e:
                    errors.append((p, e.message))
                except OSError as e:    # urllib's URLError and HTTPError are OSErrors
                    why = getattr(e, "reason", None) or e
                    errors.append((p, f"{p['label']}: cannot fetch {p['url'][:120]}: {why}"))
        if errors:
            p, msg = errors[0]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ProvisionError(msg + more, where=f"{lock.path}:{lines.get(p['label'], 0)}")
        return [self.path(p["sha256"], p["filename"]) for p in todo]

    def _one(self, p: dict) -> None:
        from .agent.build import AgentError, fetchable, store    # the host's rule and its verified store

        with self._guard:
            one = self._locks.setdefault(p["sha256"], threading.Lock())
        with one:                     # a second host waits for the first host's download of this wheel
            dest = self.path(p["sha256"], p["filename"])
            if dest.is_file():
                return
            try:
                fetchable(p["url"], p["label"])
                req = urllib.request.Request(p["url"], headers={"User-Agent": "provision"})
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    store(str(dest), p["sha256"], iter(lambda: r.read(CHUNK), b""), p["label"])
            except AgentError as e:
                raise ProvisionError(f"{e} (fetched by the controller)") from None
            finally:
                if not dest.exists():
                    with contextlib.suppress(OSError):     # the entry's dir goes too when nothing landed in it
                        dest.parent.rmdir()


_SHARED: dict[Path, WheelCache] = {}
_SHARED_GUARD = threading.Lock()


def shared(root: Path = CACHE) -> WheelCache:
    """The one cache object of this process for `root` (so a fleet's hosts share its downloads)."""
    with _SHARED_GUARD:
        return _SHARED.setdefault(Path(root), WheelCache(root))
