"""SDK-layout fixture plugin of the Cloud Agents tests (stdlib only).

Started through its ``[project.scripts]`` entry (``example_plugin:main``), never as a file: it speaks
line-delimited JSON-RPC 2.0 (Executa v1: ``initialize`` is answered method-not-found) with ``describe``,
``health`` and ``invoke`` of ``word_count {text}`` (which also reports ``sys.argv[0]``, the script name the
launcher set). Exits 0 on stdin EOF.
"""

from __future__ import annotations

import json
import sys

MANIFEST = {
    "name": "example-text-tool",
    "version": "1.0.0",
    "description": "Counts words (SDK-layout fixture).",
    "tools": [
        {
            "name": "word_count",
            "description": "Count the words of a text.",
            "parameters": [
                {"name": "text", "type": "string", "description": "The text.", "required": True}
            ],
        }
    ],
}


def handle(req: dict) -> dict:
    method = req.get("method")
    if method == "describe":
        return {"result": MANIFEST}
    if method == "health":
        return {"result": {"status": "ready"}}
    if method == "invoke":
        params = req.get("params") or {}
        if params.get("tool") != "word_count":
            return {"error": {"code": -32601, "message": f"unknown tool: {params.get('tool')}"}}
        text = (params.get("arguments") or {}).get("text", "")
        return {"result": {"success": True, "data": {"words": len(text.split()), "argv0": sys.argv[0]}}}
    return {"error": {"code": -32601, "message": f"method not found: {method}"}}


def main() -> int:
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as exc:
            out = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": str(exc)}}
        else:
            if "id" not in req:
                continue
            out = {"jsonrpc": "2.0", "id": req["id"], **handle(req)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
