"""A hostile package author's build step (a Cloud Agents test fixture, tests/fleet_up.rs).

Imported by the in-tree build back-ends of the package (``hostile_backend``) and of its sdist dependency
(``dep_backend``): at import, ``probe`` tries what a hostile back-end would — read each of the worker's files the
test lists in ``targets.json``, list its directories, write outside the build directory, connect to NATS and the
front directly and through any proxy it is given — and records every outcome, with its uid and environment, in a
report the test reads. Then the back-end builds a real (tiny) wheel, so the preparation succeeds as it would for
a careful attacker: nothing looks wrong.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import socket
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    except Exception as e:  # noqa: BLE001 - every failure is an outcome
        return type(e).__name__


def _read(path: str) -> None:
    with open(path, "rb") as f:
        f.read(1)


def _write(path: str) -> None:
    with open(path, "w") as f:
        f.write("hostile")


def _connect(host: str, port: int) -> None:
    socket.create_connection((host, port), timeout=3).close()


def _through_proxy(host: str, port: int) -> str:
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    if not proxy:
        return "no-proxy"
    addr = proxy.split("://", 1)[-1].rstrip("/")
    phost, _, pport = addr.rpartition(":")
    try:
        with socket.create_connection((phost, int(pport)), timeout=3) as s:
            s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            status = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
            return status.split(" ")[1] if " " in status else status
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__


def probe(name: str) -> None:
    targets = json.loads((HERE / "targets.json").read_text())
    report = {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "env": dict(os.environ),
        "read": {p: _outcome(lambda p=p: _read(p)) for p in targets["read"]},
        "list": {},
        "write": {p: _outcome(lambda p=p: _write(p)) for p in targets["write"]},
        "connect": {f"{h}:{p}": _outcome(lambda h=h, p=p: _connect(h, p)) for h, p in targets["connect"]},
        "proxy": {f"{h}:{p}": _through_proxy(h, p) for h, p in targets["connect"]},
    }
    for d in targets["list"]:
        try:
            report["list"][d] = sorted(os.listdir(d))
        except OSError as e:
            report["list"][d] = errno.errorcode.get(e.errno, str(e.errno))
    # The project's own back-end runs in the install's directory; an sdist's in a directory of uv's: its report
    # goes beside the environment being made (the install's directory too).
    out = HERE
    target_env = os.environ.get("UV_PROJECT_ENVIRONMENT")
    if name == "sdist" and target_env:
        out = Path(target_env).parent
    (out / f".report-{name}.json").write_text(json.dumps(report, indent=1, sort_keys=True))


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build(wheel_directory: str, dist: str, version: str, files: dict[str, bytes], requires: list[str],
          scripts: dict[str, str]) -> str:
    """Writes ``<dist>-<version>-py3-none-any.whl`` with ``files`` and its metadata; returns its name."""
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = dict(files)
    entries[f"{info}/METADATA"] = meta.encode()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: hostile\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    if scripts:
        lines = "".join(f"{k} = {v}\n" for k, v in scripts.items())
        entries[f"{info}/entry_points.txt"] = f"[console_scripts]\n{lines}".encode()
    record = [_record_line(k, v) for k, v in entries.items()] + [f"{info}/RECORD,,"]
    entries[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    name = f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / name, "w") as z:
        for k, v in entries.items():
            z.writestr(k, v)
    return name
