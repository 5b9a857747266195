//! The arguments of every operator method (`fleet.v1.admin.{grants,credentials,plugins,creds}.*`) as the fleet
//! parses them: `fleet_proto::admin::parse_args` on the request payload. The first byte picks the method.
//!
//! Checked: nothing panics; every refusal is `invalid_arg`.
#![no_main]

use fleet_proto::admin::{credentials, creds, grants, parse_args, plugins};
use fleet_proto::api::{ApiError, ApiErrorCode};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn parse<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Option<T> {
    let r: Result<T, ApiError> = parse_args(payload);
    match r {
        Ok(a) => Some(a),
        Err(e) => {
            assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e:?}");
            None
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((which, payload)) = data.split_first() else {
        return;
    };
    match which % 11 {
        0 => {
            if let Some(a) = parse::<grants::SetArgs>(payload)
                && let Some(web) = &a.web_grant
            {
                let _ = (web.capabilities(), web.settings());
            }
        }
        1 => drop(parse::<grants::GetArgs>(payload)),
        2 => drop(parse::<credentials::SetArgs>(payload)),
        3 => drop(parse::<credentials::ListArgs>(payload)),
        4 => drop(parse::<credentials::DeleteArgs>(payload)),
        5 => drop(parse::<plugins::InstallArgs>(payload)),
        6 => drop(parse::<Value>(payload)),
        7 => drop(parse::<plugins::RemoveArgs>(payload)),
        8 => drop(parse::<plugins::DescribeArgs>(payload)),
        9 => drop(parse::<creds::NameArgs>(payload)),
        _ => {
            if let Ok(text) = std::str::from_utf8(payload) {
                let (pattern, rest) = text.split_once('\n').unwrap_or((text, ""));
                let (tool_id, tool) = rest.split_once('\n').unwrap_or((rest, ""));
                let _ = grants::tool_pattern_covers(pattern, tool_id, tool);
                let _ = plugins::Format::parse(pattern);
                let _ = plugins::Format::infer(pattern);
            }
        }
    }
});
