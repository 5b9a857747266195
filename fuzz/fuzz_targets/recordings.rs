//! The plugin developer's recordings (spec §15.4) as `fleet replay` and `fleet fixture` read them: one line of
//! any of the four formats (`fleet_proto::recording::parse_line`) and a whole F3 mock file
//! (`fleet_proto::mocks::parse_jsonl`).
//!
//! Checked: nothing panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for line in text.lines() {
        let _ = fleet_proto::recording::parse_line(line);
    }
    let _ = fleet_proto::mocks::parse_jsonl(text);
});
