"""A test host whose PID 1 is a real systemd: its own PID, mount, UTS, cgroup and network namespaces, on a root of
its own (an overlay of / with a tmpfs upper layer, private /tmp and /run, `pivot_root`, `container=other`), its sshd
a unit reached over a veth pair. The host's directory (keys, provision root, unit files) is bound into it at the
same path, so a test reads the host root from outside; its /etc/systemd/system is that directory's `units/`.

systemd never boots on this machine's own root (its boot-time tmpfiles would empty /tmp). `cleanup` kills its init
by PID, which ends every process of the host.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from provision.errors import ProvisionError
from provision.loopback import LoopbackHost

SYSTEMD = "/lib/systemd/systemd"
NAMED = Path("/sys/fs/cgroup/systemd")


def own_cgroups(name: str) -> list[Path]:
    """A cgroup `name` below this process's own in every hierarchy (the name=systemd one first): the boot joins
    them all before it makes its cgroup namespace, so what the host's systemd makes stays inside them."""
    mine = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        mine[frozenset(controllers.split(",")) if controllers else frozenset()] = path
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        fstype, _, opts = right.split(" ", 2)
        if fstype not in ("cgroup", "cgroup2"):
            continue
        have = frozenset() if fstype == "cgroup2" else frozenset(opts.split(",")) - {"rw", "ro"}
        for controllers, path in mine.items():
            if controllers == have or (controllers and controllers <= have):
                out.append(Path(left.split()[4]) / path.lstrip("/") / name)
    return sorted(set(out), key=lambda p: not str(p).startswith(str(NAMED)))


def cgroup_mode() -> str:
    """`named` (v1 or hybrid: systemd's name=systemd hierarchy at /sys/fs/cgroup/systemd) or `unified` (v2)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        point, (fstype, _, opts) = left.split()[4], right.split(" ", 2)
        if point == str(NAMED) and fstype == "cgroup" and "name=systemd" in opts.split(","):
            return "named"
        if point == "/sys/fs/cgroup" and fstype == "cgroup2":
            return "unified"
    raise ProvisionError("no cgroup hierarchy systemd can boot in (neither /sys/fs/cgroup/systemd nor a cgroup2 "
                         "/sys/fs/cgroup)")

BOOT = r"""set -e
D=$1; R=$D/merged; RW=$D/rw
mount --make-rprivate /
mount -t tmpfs -o mode=0755 pv-rw "$RW"
mkdir -p "$RW/upper" "$RW/work"
mount -t overlay pv-root -o "lowerdir=/,upperdir=$RW/upper,workdir=$RW/work" "$R"
mount -t proc proc "$R/proc"
mount -t sysfs sysfs "$R/sys"
if [ "$5" = unified ]; then        # cgroup v2: the namespace's own view of the hierarchy
  mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
else                               # v1: systemd's named hierarchy, from the host's cgroup down
  mount -t tmpfs -o mode=0755 cgroup "$R/sys/fs/cgroup"
  mkdir "$R/sys/fs/cgroup/systemd"
  mount --bind "$4" "$R/sys/fs/cgroup/systemd"
fi
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=1777 tmp "$R/tmp"
mount -t tmpfs -o mode=0755 run "$R/run"
mkdir -p "$R$D" && mount --bind "$D" "$R$D"
mount --bind "$D/units" "$R/etc/systemd/system"
while IFS= read -r b; do mkdir -p "$R$b" && mount --bind "$b" "$R$b"; done < "$D/binds"
echo "$3" > "$R/etc/hostname"
hostname "$3"
mkdir -p "$R/.old" && cd "$R" && pivot_root . .old && umount -l /.old && rmdir /.old
exec env -i container=other PATH=/usr/sbin:/usr/bin:/sbin:/bin "$2" --unit=pv-host.target
"""
TARGET = """[Unit]
Description=provision test host
Requires=pv-sshd.service
After=pv-sshd.service
AllowIsolate=yes
"""
SSHD_UNIT = """[Unit]
Description=sshd of the provision test host
DefaultDependencies=no

[Service]
ExecStart=/usr/sbin/sshd -D -e -f {config}
RuntimeDirectory=sshd
RuntimeDirectoryMode=0755
"""


class SystemdHost(LoopbackHost):
    """`with SystemdHost() as h:` → h.target (trusted by the caller), h.root, h.systemctl(...), h.run(...)."""

    def __init__(self, base: str | Path | None = None, binds: tuple = ()):
        """`binds`: more directories of this machine bound into the host at the same path (read-write)."""
        super().__init__(base=base, netns=True)
        self.binds = [Path(b).resolve() for b in binds]
        self.units = self.dir / "units"
        self.init: int | None = None
        self.cgroups: list[Path] = []

    def start(self) -> "SystemdHost":
        if not Path(SYSTEMD).exists():
            raise ProvisionError(f"{SYSTEMD} not found: install systemd (apt-get install systemd)")
        self.prepare()                 # keys, namespace, sshd_config: a loopback host's, its sshd a unit here
        self.units.mkdir(exist_ok=True)
        (self.units / "pv-host.target").write_text(TARGET)
        (self.dir / "binds").write_text("".join(f"{b}\n" for b in self.binds))
        (self.units / "pv-sshd.service").write_text(SSHD_UNIT.format(config=self.dir / "sshd_config"))
        for d in ("merged", "rw"):
            (self.dir / d).mkdir(exist_ok=True)
        mode = cgroup_mode()
        self.cgroups = own_cgroups(f"pv-sd-{self._index}")
        for d in self.cgroups:
            d.mkdir(exist_ok=True)
            for f in ("cpuset.cpus", "cpuset.mems"):     # a cpuset takes no process before it has both
                if (d.parent / f).exists():
                    (d / f).write_text((d.parent / f).read_text())
        # the boot's shell joins its cgroups, then unshare makes the namespaces: systemd's cgroup root is those
        outer = ('n=0; for g in "$@"; do n=$((n + 1)); [ $n -le 5 ] || echo $$ > "$g/cgroup.procs" || exit 1; done; '
                 'exec unshare --pid --mount --uts --cgroup --fork --kill-child --propagation private '
                 'sh -c "$0" pv-boot "$@"')
        self.proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.netns}", "sh", "-c", outer, BOOT,
                                      str(self.dir), SYSTEMD, f"pv-sd-{self._index}", str(self.cgroups[0]), mode,
                                      *map(str, self.cgroups)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "boot.log", "wb"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProvisionError(f"the systemd host did not boot: {(self.dir / 'boot.log').read_text()[-600:]}")
            if self.init is None:
                self.init = self._init_pid()
            if self.init is not None and self._listening():
                return self
            time.sleep(0.1)
        raise ProvisionError(f"the systemd host's sshd did not listen within 30 s "
                             f"({(self.dir / 'boot.log').read_text()[-400:]})")

    def _init_pid(self) -> int | None:
        """The host's PID 1 as this machine numbers it: unshare's child."""
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """A command inside the host (all its namespaces, its root), as root."""
        return subprocess.run(["nsenter", "-t", str(self.init), "-a", *argv], capture_output=True, text=True,
                              timeout=kw.pop("timeout", 60), **kw)

    def systemctl(self, *args: str) -> subprocess.CompletedProcess:
        return self.run(["systemctl", *args])

    def path(self, inside: str) -> Path:
        """A path of the host's own filesystem, read from outside through its init's root."""
        return Path(f"/proc/{self.init}/root") / inside.lstrip("/")

    def stop(self) -> None:
        if self.init is not None:
            try:
                os.kill(self.init, 9)       # a PID namespace ends with its init: every process of the host goes
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.init = None
        for top in self.cgroups:         # what systemd made in them, deepest first, then them
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                try:
                    d.rmdir()
                except OSError:
                    pass
        self.cgroups = []
