#!/usr/bin/env bash
# The main job, for now: build the fleet and the fixture plugin, then drive the plugin through the Executa
# handshake and one invoke with the production codec (`fleet probe`). Later this becomes `fleet up`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p fleet -p fleet-echo-plugin
exec target/release/fleet probe --tool echo --args '{"hello":"world"}' -- target/release/fleet-echo-plugin "$@"
