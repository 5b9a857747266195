"""What a hostile plugin tries against its confinement, for both dialects' fixtures (stdlib only).

``probe(request)`` takes ``{"connect": ["host:port", ...], "pids": [int, ...], "read": [path, ...],
"write": [path, ...], "create": [path, ...]}`` and reports, without raising, what each attempt gave: ``"ok"`` or
the errno name (``ECONNREFUSED``, ``ENETUNREACH``, ``EACCES``, ``ENOENT``, ``EPERM``, ``EROFS``, ...); a file it
creates it removes again. It also reports its own uid and pid, how many processes ``/proc`` shows and how many of them
belong to another uid, what ``/tmp``, ``/dev/shm``, ``/dev`` and ``/sys/fs/cgroup`` hold, the cgroup directories
named like the worker's or a user's anywhere beneath ``/sys/fs/cgroup`` (``"cgroup_names"``), the directories
there (``"cgroup_tree"``), its memory limit as the cgroup files there say (``"cgroup_memory_limit"``), the paths of
``/proc/self/cgroup`` (``"proc_cgroup"``), whether a pseudo-terminal opens and carries a line (``"pty"``), and what
``unshare(CLONE_NEWUSER)``, ``mount``, ``ptrace(PTRACE_TRACEME)`` and ``chroot`` return; the descriptors it holds
(``"fds"``: number → ``readlink``, taken first thing); and the side doors around a seccomp filter (``syscalls()``:
``getpid`` under its x32 number, and i386's ``getpid`` through ``int 0x80`` in a child, which a filter kills).
Run as a script, it prints ``syscalls()`` as JSON: the same calls from an unconfined process.

Egress: ``"tunnel": ["host:port", ...]`` asks the proxy named by ``HTTPS_PROXY`` for a ``CONNECT`` to each target
and, when it answers 200, sends a ``GET /`` through the tunnel: ``{"status": "200", "body": "..."}``, the
proxy's status, or ``"no proxy"``; ``"fetch": [url, ...]`` fetches with urllib as a client honouring the proxy
variables does: ``{"status": 200, "body": "..."}`` or ``{"error": ...}``.
"""

import ctypes
import errno
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

CLONE_NEWUSER = 0x10000000
PTRACE_TRACEME = 0
X32_SYSCALL_BIT = 0x40000000
SYS_GETPID = 39  # x86_64 and x32

# Run in a child (a filter kills it): i386's getpid (20) through `int 0x80` from this 64-bit process, as machine
# code in an executable mapping — `mov eax, 20; int 0x80; ret`.
I386_GETPID = r"""
import ctypes, mmap
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")
print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())
"""


def _err(e):
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return type(e).__name__


def _libc_call(fn, *args):
    ctypes.set_errno(0)
    rc = fn(*args)
    if rc == -1:
        return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    return "ok"


def _open_fds():
    """Every descriptor this process holds, with what it points to (the listing's own is closed by then)."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[name] = os.readlink("/proc/self/fd/" + name)
        except OSError:
            pass
    return fds


def _cgroup_names():
    """Every directory under ``/sys/fs/cgroup`` (all hierarchies, walked whole) named like the worker's
    subtree (``cloud-agents-…``) or a user's ceiling (``user-…``)."""
    names = set()
    for _top, dirs, _files in os.walk("/sys/fs/cgroup"):
        names.update(d for d in dirs if d.startswith(("cloud-agents-", "user-")))
    return sorted(names)


def _cgroup_tree(limit=50):
    """The directories under ``/sys/fs/cgroup``, relative, sorted (at most ``limit``)."""
    found = []
    for top, dirs, _files in os.walk("/sys/fs/cgroup"):
        found.extend(os.path.relpath(os.path.join(top, d), "/sys/fs/cgroup") for d in dirs)
        if len(found) >= limit:
            break
    return sorted(found)[:limit]


def _first_line(paths):
    """The first line of the first of ``paths`` that reads, else the last error's name."""
    result = "ENOENT"
    for path in paths:
        try:
            with open(path) as f:
                return f.readline().strip()
        except OSError as e:
            result = _err(e)
    return result


def syscalls():
    """``x32_getpid``: ``"ok"`` or the errno name; ``i386_getpid``: ``"ok"``, the signal that ended the child
    (``"SIGSYS"``: a seccomp filter killed it) or ``"exit N"`` (``"n/a"`` off x86_64)."""
    out = {}
    libc = ctypes.CDLL(None, use_errno=True)
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(X32_SYSCALL_BIT + SYS_GETPID))
    out["x32_getpid"] = "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    if platform.machine() != "x86_64":
        out["i386_getpid"] = "n/a"
    else:
        child = subprocess.run([sys.executable, "-c", I386_GETPID], capture_output=True)
        if child.returncode < 0:
            out["i386_getpid"] = signal.Signals(-child.returncode).name
        elif child.returncode == 0:
            out["i386_getpid"] = "ok"
        else:
            out["i386_getpid"] = "exit %d" % child.returncode
    return out


def _recv_all(sock, limit=65536):
    data = b""
    while len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _tunnel(target):
    proxy = os.environ.get("HTTPS_PROXY")
    if not proxy:
        return "no proxy"
    host, port = proxy.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.settimeout(15)
            s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (target, target)).encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(1)
                if not chunk:
                    break
                head += chunk
            status = head.split(b" ", 2)[1].decode() if head.count(b" ") >= 1 else "none"
            if status != "200":
                return {"status": status}
            s.sendall(b"GET / HTTP/1.0\r\nHost: test\r\n\r\n")
            body = _recv_all(s).split(b"\r\n\r\n", 1)[-1]
            return {"status": status, "body": body.decode(errors="replace")}
    except OSError as e:
        return _err(e)


def _fetch(url):
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            return {"status": r.status, "body": r.read(4096).decode(errors="replace")}
    except urllib.error.HTTPError as e:
        return {"status": e.code}
    except urllib.error.URLError as e:
        return {"error": _err(e.reason) if isinstance(e.reason, OSError) else type(e.reason).__name__}
    except OSError as e:
        return {"error": _err(e)}


def probe(req):
    out = {"fds": _open_fds(), "uid": os.getuid(), "pid": os.getpid()}
    connect = {}
    for target in req.get("connect") or []:
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                connect[target] = "ok"
        except OSError as e:
            connect[target] = _err(e)
    out["connect"] = connect
    out["tunnel"] = {t: _tunnel(t) for t in req.get("tunnel") or []}
    out["fetch"] = {u: _fetch(u) for u in req.get("fetch") or []}
    out["proxy_env"] = os.environ.get("HTTP_PROXY")
    out["env_keys"] = sorted(os.environ)

    visible = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    foreign = 0
    for pid in visible:
        try:
            if os.stat("/proc/%d" % pid).st_uid != os.getuid():
                foreign += 1
        except OSError:
            pass
    out["proc_count"] = len(visible)
    out["proc_foreign"] = foreign
    out["pids"] = {str(p): ("visible" if os.path.exists("/proc/%d" % p) else "absent") for p in req.get("pids") or []}

    reads = {}
    for path in req.get("read") or []:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
            reads[path] = "ok"
        except OSError as e:
            reads[path] = _err(e)
    out["read"] = reads
    writes = {}
    for path in req.get("write") or []:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
            writes[path] = "ok"
        except OSError as e:
            writes[path] = _err(e)
    out["write"] = writes
    creates = {}
    for path in req.get("create") or []:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(path)
            creates[path] = "ok"
        except OSError as e:
            creates[path] = _err(e)
    out["create"] = creates

    for key, path in (("tmp", "/tmp"), ("shm", "/dev/shm"), ("dev", "/dev"), ("cgroup_dir", "/sys/fs/cgroup")):
        try:
            out[key] = sorted(os.listdir(path))
        except OSError as e:
            out[key] = _err(e)
    out["cgroup_names"], out["cgroup_tree"] = _cgroup_names(), _cgroup_tree()
    out["cgroup_memory_limit"] = _first_line(("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"))
    with open("/proc/self/cgroup") as f:
        out["proc_cgroup"] = sorted({line.rstrip("\n").split(":", 2)[2] for line in f if line.strip()})
    try:
        master, slave = os.openpty()
        os.write(master, b"x\n")
        out["pty"] = "ok" if os.read(slave, 2) == b"x\n" else "garbled"
        os.close(master)
        os.close(slave)
    except OSError as e:
        out["pty"] = _err(e)

    libc = ctypes.CDLL(None, use_errno=True)
    out["unshare_newuser"] = _libc_call(libc.unshare, ctypes.c_int(CLONE_NEWUSER))
    out["mount"] = _libc_call(libc.mount, b"none", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None)
    out["ptrace"] = _libc_call(libc.ptrace, ctypes.c_long(PTRACE_TRACEME), 0, None, None)
    out["chroot"] = _libc_call(libc.chroot, b"/")
    out.update(syscalls())
    return out


if __name__ == "__main__":
    print(json.dumps(syscalls()))
