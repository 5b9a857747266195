#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser that takes outside bytes (fuzz/; docs/testing.md, "Fuzzing").
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Runs each target (all by default) for SECONDS (default: $FUZZ_SECONDS, else 20) with libFuzzer through
# cargo-fuzz, which it installs (pinned) when missing. The targets are built on the stable toolchain without a
# sanitizer (the code under test is safe Rust; libFuzzer's coverage instrumentation is stable rustc flags), into
# fuzz/target/. Each corpus starts from fuzz/seeds/<target>/ and the test fixtures (plugins' executa.json, replay
# recordings); what a run finds is kept in fuzz/corpus/<target>/ (not committed) for the next run.
#
# Prints one line per target: executions, executions per second, coverage (edges, `cov`), features (`ft`), corpus
# size, findings. Exits non-zero when any target crashed, leaked or timed out; the input is kept in
# fuzz/artifacts/<target>/ and its path printed — turn it into a regression test (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
fuzz="$root/fuzz"

CARGO_FUZZ_VERSION=0.13.1
seconds=${1:-${FUZZ_SECONDS:-20}}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(sed -n 's/^name = "\(.*\)"$/\1/p' "$fuzz/Cargo.toml" | grep -v '^fleet-fuzz$')
fi

if [ "$(cargo fuzz --version 2>/dev/null | awk '{print $2}')" != "$CARGO_FUZZ_VERSION" ]; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install --quiet --locked cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi

# The build is kept outside the checkout, so a fresh clone on the same machine (CI) reuses it.
export CARGO_TARGET_DIR="${FLEET_FUZZ_TARGET_DIR:-$HOME/.cache/cloud-agents/fuzz-target}"
build=(cargo fuzz build --sanitizer none --release --debug-assertions --codegen-units 16 --target-dir "$CARGO_TARGET_DIR")
started=$(date +%s)
# `cargo fuzz build` takes one target or all: build all when several are asked for (a no-op when built).
if [ ${#targets[@]} -eq 1 ]; then
    (cd "$fuzz" && "${build[@]}" "${targets[0]}")
else
    (cd "$fuzz" && "${build[@]}")
fi
echo "fuzz build: $(( $(date +%s) - started )) s"
bin_dir="$CARGO_TARGET_DIR/x86_64-unknown-linux-gnu/release"

# Seeds from the test fixtures (each prefixed by the byte that selects the parser in its target).
fixtures="$CARGO_TARGET_DIR/fixture-seeds"
rm -rf "$fixtures"
mkdir -p "$fixtures"/{manifests,recordings,frame_codec}
i=0
for f in "$root"/plugins/*/executa.json "$root"/tests/plugins/*/executa.json; do
    [ -f "$f" ] || continue
    { printf '\x00'; cat "$f"; } >"$fixtures/manifests/executa-$i"
    i=$((i + 1))
done
for f in "$root"/tests/fixtures/replay/*.jsonl; do
    [ -f "$f" ] || continue
    cp "$f" "$fixtures/recordings/"
done

failed=()
for t in "${targets[@]}"; do
    corpus="$fuzz/corpus/$t"
    artifacts="$fuzz/artifacts/$t"
    mkdir -p "$corpus" "$artifacts"
    seeds=("$fuzz/seeds/$t")
    [ -d "$fixtures/$t" ] && seeds+=("$fixtures/$t")
    [ -d "${seeds[0]}" ] || seeds=("${seeds[@]:1}")
    log="$CARGO_TARGET_DIR/fuzz-$t.log"
    set +e
    "$bin_dir/$t" "$corpus" "${seeds[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="$artifacts/" >"$log" 2>&1
    rc=$?
    set -e
    last=$(grep -E '^#[0-9]+' "$log" | tail -n1)
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    cov=$(grep -oE 'cov: [0-9]+' <<<"$last" | awk '{print $2}')
    ft=$(grep -oE 'ft: [0-9]+' <<<"$last" | awk '{print $2}')
    corp=$(grep -oE 'corp: [0-9]+' <<<"$last" | awk '{print $2}')
    if [ "$rc" = 0 ]; then
        findings=0
    else
        findings=1
        failed+=("$t")
        echo "---- $t: libFuzzer exited $rc; the end of its log ($log):"
        tail -n 40 "$log"
        ls -1 "$artifacts"/* 2>/dev/null | sed 's/^/input kept: /' || true
    fi
    printf 'fuzz %-14s %4ss  execs %-9s %6s/s  cov %-6s ft %-6s corpus %-5s findings %s\n' \
        "$t" "$seconds" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$findings"
done
echo "fuzz total: $(( $(date +%s) - started )) s for ${#targets[@]} targets"
if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzzing found inputs that fail: ${failed[*]}" >&2
    exit 1
fi
