"""What a hostile plugin tries against its confinement, for both dialects' fixtures (stdlib only).

``probe(request)`` takes ``{"connect": ["host:port", ...], "pids": [int, ...], "read": [path, ...],
"write": [path, ...], "create": [path, ...]}`` and reports, without raising, what each attempt gave: ``"ok"`` or
the errno name (``ECONNREFUSED``, ``ENETUNREACH``, ``EACCES``, ``ENOENT``, ``EPERM``, ``EROFS``, ...); a file it
creates it removes again. It also reports its own uid, how many processes ``/proc`` shows and how many of them
belong to another uid, what ``/tmp`` and ``/dev/shm`` hold, and what
``unshare(CLONE_NEWUSER)``, ``mount``, ``ptrace(PTRACE_TRACEME)`` and ``chroot`` return.

Egress: ``"tunnel": ["host:port", ...]`` asks the proxy named by ``HTTPS_PROXY`` for a ``CONNECT`` to each target
and, when it answers 200, sends a ``GET /`` through the tunnel: ``{"status": "200", "body": "..."}``, the
proxy's status, or ``"no proxy"``; ``"fetch": [url, ...]`` fetches with urllib as a client honouring the proxy
variables does: ``{"status": 200, "body": "..."}`` or ``{"error": ...}``.
"""

import ctypes
import errno
import os
import socket
import urllib.error
import urllib.request

CLONE_NEWUSER = 0x10000000
PTRACE_TRACEME = 0


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
    out = {"uid": os.getuid()}
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

    for key, path in (("tmp", "/tmp"), ("shm", "/dev/shm")):
        try:
            out[key] = sorted(os.listdir(path))
        except OSError as e:
            out[key] = _err(e)

    libc = ctypes.CDLL(None, use_errno=True)
    out["unshare_newuser"] = _libc_call(libc.unshare, ctypes.c_int(CLONE_NEWUSER))
    out["mount"] = _libc_call(libc.mount, b"none", b"/tmp", b"tmpfs", ctypes.c_ulong(0), None)
    out["ptrace"] = _libc_call(libc.ptrace, ctypes.c_long(PTRACE_TRACEME), 0, None, None)
    out["chroot"] = _libc_call(libc.chroot, b"/")
    return out
