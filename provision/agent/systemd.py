"""Host agent (stdlib only): systemd's manager over D-Bus, no systemctl command line. A unit's name (a lock's
value) travels as a D-Bus string argument, never as an argument of a process.

`Bus()` speaks to PID 1 on its private socket (/run/systemd/private, root), else through the system bus.
Only what a cutover and status need: a unit's state, its processes, start, stop, daemon-reload.
"""
import os
import socket
import struct

PRIVATE = "/run/systemd/private"
SYSTEM_BUS = "/run/dbus/system_bus_socket"
SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
CALL, RETURN, ERROR, SIGNAL = 1, 2, 3, 4
_ALIGN = {"y": 1, "g": 1, "v": 1, "n": 2, "q": 2, "b": 4, "i": 4, "u": 4, "h": 4, "s": 4, "o": 4, "a": 4,
          "x": 8, "t": 8, "d": 8, "(": 8, "{": 8}
_FIXED = {"y": "B", "b": "I", "n": "h", "q": "H", "i": "i", "u": "I", "h": "I", "x": "q", "t": "Q", "d": "d"}


class BusError(Exception):
    """The manager cannot be reached, or refused a call (the D-Bus error's name and message)."""

    def __init__(self, message, name=None):
        Exception.__init__(self, message)
        self.name = name


def _type_end(sig, i):
    """The index after the single complete type that starts at sig[i]."""
    c = sig[i]
    if c == "a":
        return _type_end(sig, i + 1)
    if c in "({":
        close, depth, j = ")" if c == "(" else "}", 1, i + 1
        while depth:
            depth += 1 if sig[j] == c else -1 if sig[j] == close else 0
            j += 1
        return j
    return i + 1


def _types(sig):
    i, out = 0, []
    while i < len(sig):
        j = _type_end(sig, i)
        out.append(sig[i:j])
        i = j
    return out


class _Writer:
    def __init__(self):
        self.buf = bytearray()

    def pad(self, n):
        self.buf += b"\0" * (-len(self.buf) % n)

    def put(self, t, v):
        self.pad(_ALIGN[t[0]])
        if t in _FIXED:
            self.buf += struct.pack("<" + _FIXED[t], v)
        elif t in ("s", "o"):
            raw = v.encode()
            self.buf += struct.pack("<I", len(raw)) + raw + b"\0"
        elif t == "g":
            raw = v.encode()
            self.buf += bytes([len(raw)]) + raw + b"\0"
        elif t == "v":
            sig, value = v
            self.put("g", sig)
            self.put(sig, value)
        elif t[0] == "(":
            for inner, x in zip(_types(t[1:-1]), v):
                self.put(inner, x)
        elif t[0] == "a":
            self.buf += b"\0\0\0\0"
            at = len(self.buf)
            self.pad(_ALIGN[t[1]])
            start = len(self.buf)
            for x in v:
                self.put(t[1:], x)
            struct.pack_into("<I", self.buf, at - 4, len(self.buf) - start)
        else:
            raise BusError("cannot write D-Bus type %r" % t)


class _Reader:
    def __init__(self, data, pos=0):
        self.data, self.pos = data, pos

    def get(self, t):
        self.pos += -self.pos % _ALIGN[t[0]]
        d = self.data
        if t in _FIXED:
            fmt = "<" + _FIXED[t]
            (v,) = struct.unpack_from(fmt, d, self.pos)
            self.pos += struct.calcsize(fmt)
            return bool(v) if t == "b" else v
        if t in ("s", "o"):
            (n,) = struct.unpack_from("<I", d, self.pos)
            v = d[self.pos + 4:self.pos + 4 + n].decode("utf-8", "replace")
            self.pos += 5 + n
            return v
        if t == "g":
            n = d[self.pos]
            v = d[self.pos + 1:self.pos + 1 + n].decode()
            self.pos += 2 + n
            return v
        if t == "v":
            return self.get(self.get("g"))
        if t[0] in "({":
            return [self.get(inner) for inner in _types(t[1:-1])]
        if t[0] == "a":
            (n,) = struct.unpack_from("<I", d, self.pos)
            self.pos += 4
            self.pos += -self.pos % _ALIGN[t[1]]
            end, items = self.pos + n, []
            while self.pos < end:
                items.append(self.get(t[1:]))
            return dict(items) if t[1] == "{" else items
        raise BusError("cannot read D-Bus type %r" % t)


class Bus:
    """One connection to systemd's manager: `with Bus() as bus: bus.state("sglang.service")`."""

    def __init__(self, timeout=10.0):
        self.serial, self.direct = 0, os.path.exists(PRIVATE) and os.access(PRIVATE, os.W_OK)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.buf = b""
        path = PRIVATE if self.direct else SYSTEM_BUS
        try:
            self.sock.connect(path)
            # AUTH and BEGIN in one write: the server reads BEGIN once it has said OK
            self.sock.sendall(b"\0AUTH EXTERNAL " + str(os.getuid()).encode().hex().encode() + b"\r\nBEGIN\r\n")
            line = self._line()
        except OSError as e:
            self.sock.close()
            raise BusError("systemd's manager cannot be reached at %s: %s" % (path, e.strerror or e)) from None
        if not line.startswith(b"OK "):
            self.sock.close()
            raise BusError("systemd's manager at %s refused to authenticate: %r" % (path, line[:80]))
        if not self.direct:
            self.call("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    def _line(self):
        while b"\r\n" not in self.buf:
            more = self.sock.recv(4096)
            if not more:
                raise OSError("the connection closed")
            self.buf += more
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _recv(self, n):
        while len(self.buf) < n:
            more = self.sock.recv(max(65536, n - len(self.buf)))
            if not more:
                raise BusError("systemd's manager closed the connection")
            self.buf += more
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def call(self, dest, path, iface, member, sig="", args=()):
        """One method call; its reply's values (a list), or BusError with the D-Bus error's name."""
        self.serial += 1
        body = _Writer()
        for t, v in zip(_types(sig), args):
            body.put(t, v)
        fields = [(1, ("o", path)), (2, ("s", iface)), (3, ("s", member))]
        if dest and not self.direct:
            fields.append((6, ("s", dest)))
        if sig:
            fields.append((8, ("g", sig)))
        head = _Writer()
        head.buf += struct.pack("<cBBBII", b"l", CALL, 0, 1, len(body.buf), self.serial)
        head.put("a(yv)", fields)
        head.pad(8)
        try:
            self.sock.sendall(bytes(head.buf) + bytes(body.buf))
            while True:
                kind, values, headers = self._message()
                if kind in (RETURN, ERROR) and headers.get(5) == self.serial:
                    break
        except OSError as e:
            raise BusError("systemd's manager did not answer %s: %s" % (member, e.strerror or e)) from None
        if kind == ERROR:
            text = values[0] if values and isinstance(values[0], str) else ""
            raise BusError("%s: %s" % (headers.get(4), text), name=headers.get(4))
        return values

    def _message(self):
        fixed = self._recv(16)
        if fixed[:1] != b"l":
            raise BusError("systemd's manager wrote big-endian or garbled D-Bus")
        _, kind, _, _, body_len, _, fields_len = struct.unpack("<cBBBIII", fixed)
        rest = self._recv(fields_len + (-(16 + fields_len) % 8) + body_len)
        data = fixed + rest
        r = _Reader(data, 12)
        headers = dict(r.get("a(yv)"))
        r.pos += -r.pos % 8
        sig = headers.get(8, "")
        return kind, [r.get(t) for t in _types(sig)], headers

    def _manager(self, member, sig="", args=()):
        return self.call(SYSTEMD, MANAGER_PATH, MANAGER, member, sig, args)

    def unit(self, name):
        """The unit's object path, loading it (a unit that does not exist loads as LoadState not-found)."""
        return self._manager("LoadUnit", "s", (name,))[0]

    def properties(self, name, iface=UNIT):
        return self.call(SYSTEMD, self.unit(name), PROPERTIES, "GetAll", "s", (iface,))[0]

    def state(self, name):
        """{load, active, sub, main_pid, result}: the unit as systemctl show would give it."""
        p = self.properties(name)
        out = {"load": p.get("LoadState"), "active": p.get("ActiveState"), "sub": p.get("SubState"),
               "main_pid": None, "result": None}
        if out["load"] == "loaded" and name.endswith(".service"):
            s = self.properties(name, SERVICE)
            out["main_pid"], out["result"] = s.get("MainPID") or None, s.get("Result")
        return out

    def processes(self, name):
        """The pids of the unit's processes (its cgroup's), [] when it runs none."""
        try:
            return [pid for _, pid, _ in self._manager("GetUnitProcesses", "s", (name,))[0]]
        except BusError as e:
            if e.name in ("org.freedesktop.systemd1.NoSuchUnit", "org.freedesktop.systemd1.UnitInactive"):
                return []
            raise

    def start(self, name):
        return self._manager("StartUnit", "ss", (name, "replace"))[0]

    def stop(self, name):
        return self._manager("StopUnit", "ss", (name, "replace"))[0]

    def reload(self):
        """daemon-reload: unit files written since are read."""
        self._manager("Reload")
