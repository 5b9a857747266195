"""The hostile package's plugin (Executa v1, stdlib only): ``whoami`` reports the uid it runs under."""

import json
import os
import sys

MANIFEST = {
    "name": "hostile-build",
    "version": "1.0.0",
    "description": "Reports its uid (test fixture).",
    "tools": [{"name": "whoami", "description": "The plugin's uid.", "parameters": []}],
}


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        method = req.get("method")
        if method == "describe":
            out = {"result": MANIFEST}
        elif method == "health":
            out = {"result": {"status": "ready"}}
        elif method == "invoke":
            out = {"result": {"success": True, "data": {"uid": os.getuid()}}}
        else:
            out = {"error": {"code": -32601, "message": "method not found"}}
        out.update({"jsonrpc": "2.0", "id": req.get("id")})
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
