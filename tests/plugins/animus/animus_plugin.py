#!/usr/bin/env python3
"""Fixture Animus plugins (seed 004) for the host's tests: one script, one behaviour per `--mode`.

Standard library only; written from the spec (`../shared/spec/animus.md` §1), deliberately not sharing any code
with the host. Frames are one JSON object per line on stdout; stderr is for humans.

Modes:
  provider        streams agent/thinking|toolCall|toolResult|output, answers agent/run and agent/resume;
                  advertises agent/cancel but not cancellation (so `agent/cancel` is its cancel path)
  cancel-request  advertises `cancellation: true`, no agent/cancel: honours `$/cancelRequest` (-32002)
  agent-cancel    advertises agent/cancel only: honours it (`{cancelled: true}`, the run answers -32002)
  ignore-cancel   advertises both, honours neither (nor `shutdown`, nor stdin EOF while a run is going)
  no-ping         never answers `$/ping`
  wrong-major     protocol_version 2.0.0
  eager           writes a response and a notification before reading anything (answers before initialize)
  custom          plugin_kind custom with the methods notes/add, notes/count (and notes/secret, not allow-listed)
                  and the MCP tool notes.search (through mcp/tool_call); fixture/deaf {requests, id_bytes} answers,
                  then writes that many requests (ids padded) the host must answer and never reads stdin again
  subject         plugin_kind subject_backend (a kind the fleet refuses)
  rude-exit       exits as soon as `shutdown` arrives, without answering it

Prompts of agent/run steer the run: "slow" streams one delta every 50 ms until cancelled (at most 60 s),
"fail" streams a non-recoverable agent/error and still answers exit_code 0, "exit2" answers exit_code 2,
"flood" sends 300 deltas at once, "big" sends a 10 KB delta, "error:<code>[:<category>]" answers a JSON-RPC error.
`--probe-lib DIR` (with `--mode custom`) adds the method `confine/probe`: `confine_probe.probe(params)` from DIR
(the Executa fixture's directory), so both dialects run the same attacks on the sandbox. `--no-manifest` makes `--manifest` unsupported (the plugin starts its loop instead); `--health S` sets the
`health/check` status (default healthy). `--init-delay-ms N` answers `initialize` only after N ms (a slow start).
"""

import json
import os
import sys
import threading
import time

LOCK = threading.Lock()
ARGS = sys.argv[1:]


def arg(name, default=None):
    if name in ARGS:
        i = ARGS.index(name)
        if i + 1 < len(ARGS):
            return ARGS[i + 1]
    return default


MODE = arg("--mode", "provider")
VERSION = "2.0.0" if MODE == "wrong-major" else "1.1.0"
KIND = {"custom": "custom", "subject": "subject_backend"}.get(MODE, "provider")

if KIND == "provider":
    METHODS = ["agent/run", "agent/resume", "health/check"]
    if MODE in ("provider", "agent-cancel", "ignore-cancel", "no-ping", "eager", "wrong-major"):
        METHODS.append("agent/cancel")
elif KIND == "custom":
    METHODS = ["notes/add", "notes/count", "notes/secret", "health/check", "$harness/flag", "mcp/tool_call",
               "fixture/deaf"]
    if arg("--probe-lib"):
        sys.path.insert(0, arg("--probe-lib"))
        METHODS.append("confine/probe")
else:
    METHODS = ["subject/list", "subject/get", "health/check"]
CANCELLATION = MODE in ("cancel-request", "ignore-cancel")


def send(obj):
    line = json.dumps(obj, separators=(",", ":")) + "\n"
    with LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


def notify(method, params):
    send({"jsonrpc": "2.0", "method": method, "params": params})


def answer(id_, result):
    send({"jsonrpc": "2.0", "id": id_, "result": result})


def fail(id_, code, message, data=None):
    err = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    send({"jsonrpc": "2.0", "id": id_, "error": err})


if "--manifest" in ARGS and "--no-manifest" not in ARGS:
    print(json.dumps({
        "name": "fixture-" + MODE, "version": "0.1.0", "plugin_kind": KIND,
        "description": "Cloud Agents test fixture", "protocol_version": VERSION, "capabilities": METHODS,
        "env_required": [{"name": "FIXTURE_KEY", "sensitive": True, "required": False}],
    }))
    sys.exit(0)


class Run:
    def __init__(self, id_, session_id):
        self.id = id_
        self.session_id = session_id
        self.cancelled = threading.Event()


RUNS = {}  # request id (json) -> Run
SESSIONS = {}  # session id -> Run
NOTES = []
STATE = {"initialized": False, "seq": 0, "init_traceparent": None}


def agent_run(id_, params, resume):
    STATE["seq"] += 1
    session_id = params.get("session_id") if resume else "sess-%d-%d" % (os.getpid(), STATE["seq"])
    run = Run(id_, session_id)
    RUNS[json.dumps(id_)] = run
    SESSIONS[session_id] = run
    control = params.get("control_session_id")
    if control:
        SESSIONS[control] = run
    threading.Thread(target=run_body, args=(run, params), daemon=True).start()


def run_body(run, params):
    prompt = params.get("prompt", "")
    sid = run.session_id
    started = time.time()
    try:
        if prompt.startswith("error:"):
            parts = prompt.split(":")
            data = {"category": parts[2]} if len(parts) > 2 else None
            fail(run.id, int(parts[1]), "fixture error " + parts[1], data)
            return
        notify("agent/thinking", {"session_id": sid, "text": "planning"})
        notify("agent/toolCall", {"session_id": sid, "name": "fixture.echo", "arguments": {"p": prompt},
                                   "server": None})
        notify("agent/toolResult", {"session_id": sid, "name": "fixture.echo", "output": {"ok": True},
                                     "success": True})
        if prompt == "slow":
            deadline = time.time() + 60
            n = 0
            while time.time() < deadline:
                if run.cancelled.is_set():
                    if MODE != "ignore-cancel":
                        fail(run.id, -32002, "cancelled", {"category": "cancelled"})
                        return
                n += 1
                notify("agent/output", {"session_id": sid, "text": "tick %d " % n})
                time.sleep(0.05)
        elif prompt == "flood":
            for i in range(300):
                notify("agent/output", {"session_id": sid, "text": "d%d " % i})
        elif prompt == "big":
            notify("agent/output", {"session_id": sid, "text": "x" * 10240})
        elif prompt == "fail":
            notify("agent/error", {"session_id": sid, "message": "upstream refused", "recoverable": False})
        else:
            notify("agent/error", {"session_id": sid, "message": "retrying", "recoverable": True})
            notify("agent/output", {"session_id": sid, "text": "hello "})
        notify("agent/output", {"session_id": sid, "text": "RESULT: " + prompt, "final": True})
        answer(run.id, {
            "session_id": sid,
            "exit_code": 2 if prompt == "exit2" else 0,
            "output": "RESULT: " + prompt,
            "metadata": [{"cwd": params.get("cwd"), "project_root": params.get("project_root"),
                          "timeout_secs": params.get("timeout_secs"), "env": sorted(params.get("env", {})),
                          "control_session_id": params.get("control_session_id"),
                          "model": params.get("model"), "resumed": params.get("session_id"),
                          "init_traceparent": STATE["init_traceparent"],
                          "traceparent": params.get("traceparent")}],
            "tool_calls": [{"tool": "fixture.echo", "arguments": {"p": prompt}, "server": None}],
            "tool_results": [{"tool": "fixture.echo", "output": {"ok": True}, "success": True}],
            "thinking": ["planning"],
            "errors": [],
            "duration_ms": int((time.time() - started) * 1000),
            "backend": "fixture:" + MODE,
        })
    finally:
        RUNS.pop(json.dumps(run.id), None)


def handle(msg):
    method = msg.get("method")
    id_ = msg.get("id")
    params = msg.get("params") or {}
    if method is None:
        return  # a response to us: we send no requests
    if id_ is None:  # notifications
        if method == "initialized":
            STATE["initialized"] = True
        elif method == "$/cancelRequest" and MODE == "cancel-request":
            run = RUNS.get(json.dumps(params.get("id")))
            if run:
                run.cancelled.set()
        elif method == "exit":
            if not (MODE == "ignore-cancel" and RUNS):
                sys.exit(0)
        return
    if method == "initialize":
        time.sleep(int(arg("--init-delay-ms", "0")) / 1000)
        STATE["init_traceparent"] = (params.get("init_extensions") or {}).get("traceparent")
        answer(id_, {
            "protocol_version": VERSION,
            "plugin_info": {"name": "fixture-" + MODE, "version": "0.1.0", "plugin_kind": KIND},
            "capabilities": {"methods": METHODS, "streaming": True, "progress": False,
                             "cancellation": CANCELLATION,
                             "mcp_tools": [{"name": "notes.search", "description": "Search the notes",
                                            "input_schema": {"type": "object",
                                                             "properties": {"q": {"type": "string"}}}}]
                             if KIND == "custom" else []},
        })
    elif method == "$/ping":
        if MODE != "no-ping":
            answer(id_, {})
    elif method == "health/check":
        answer(id_, {"status": arg("--health", "healthy"), "uptime_ms": 1})
    elif method == "shutdown":
        if MODE == "rude-exit":
            os._exit(0)
        if MODE == "ignore-cancel" and RUNS:
            return
        answer(id_, {})
    elif method in ("agent/run", "agent/resume") and KIND == "provider":
        agent_run(id_, params, method == "agent/resume")
    elif method == "agent/cancel" and "agent/cancel" in METHODS:
        run = SESSIONS.get(params.get("session_id"))
        if MODE == "ignore-cancel":
            return
        if run:
            run.cancelled.set()
        answer(id_, {"session_id": params.get("session_id"), "cancelled": run is not None})
    elif method == "notes/add" and KIND == "custom":
        NOTES.append(params.get("text"))
        answer(id_, {"count": len(NOTES)})
    elif method == "mcp/tool_call" and KIND == "custom":
        q = (params.get("arguments") or {}).get("q", "")
        answer(id_, {"tool": params.get("name"), "hits": [n for n in NOTES if q in (n or "")]})
    elif method in ("notes/count", "notes/secret") and KIND == "custom":
        answer(id_, {"count": len(NOTES), "secret": method == "notes/secret"})
    elif method == "fixture/deaf" and KIND == "custom":
        # Answers, then floods requests the host must answer and never reads its stdin again.
        answer(id_, {"deaf": True})
        pad = "p" * int(params.get("id_bytes", 0))
        for i in range(int(params.get("requests", 0))):
            send({"jsonrpc": "2.0", "id": "flood-%d-%s" % (i, pad), "method": "fixture/flood"})
        while True:
            time.sleep(3600)
    elif method == "confine/probe" and "confine/probe" in METHODS:
        import confine_probe

        answer(id_, confine_probe.probe(params))
    elif method.startswith("subject/") and KIND == "subject_backend":
        answer(id_, {"subjects": []})
    else:
        fail(id_, -32601, "method %r not found" % method)


def main():
    if MODE == "eager":
        # Before reading anything: a response nobody asked for, and a stray notification.
        send({"jsonrpc": "2.0", "id": 1, "result": {"session_id": "early", "exit_code": 0}})
        send({"jsonrpc": "2.0", "id": 0, "result": {}})
        notify("agent/output", {"session_id": "early", "text": "too early"})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        handle(msg)
    # stdin EOF: an implicit exit, except for the plugin that ignores everything while it runs.
    if MODE == "ignore-cancel":
        while RUNS:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
