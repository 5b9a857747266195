//! The arguments of every `tools.*` method as the front parses them (`fleet_proto::api::parse_body` straight
//! from the request body, then the method's `validate`), and the same through a JSON tree (`parse_args`, the
//! path of the HTTP gateway's envelope and of agents' delegated calls). The first byte picks the method.
//!
//! Checked: nothing panics; every refusal is `invalid_arg`.
#![no_main]

use fleet_proto::api::{
    ApiError, ApiErrorCode, CancelJobArgs, GetJobArgs, InvokeArgs, InvokeAsyncArgs, JobId, ListJobsArgs,
    ListToolsArgs, parse_args, parse_body,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn refused_as_invalid_arg<T>(r: Result<T, ApiError>) {
    if let Err(e) = r {
        assert_eq!(e.code, ApiErrorCode::InvalidArg, "{e:?}");
    }
}

fn both<T: serde::de::DeserializeOwned>(body: &[u8], check: impl Fn(&T) -> Result<(), ApiError>) {
    refused_as_invalid_arg(parse_body::<T>(body).and_then(|a| check(&a)));
    if let Ok(tree) = serde_json::from_slice::<Value>(body) {
        refused_as_invalid_arg(parse_args::<T>(&tree).and_then(|a| check(&a)));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((which, body)) = data.split_first() else {
        return;
    };
    match which % 7 {
        0 => both::<ListToolsArgs>(body, |_| Ok(())),
        1 => both::<InvokeArgs>(body, |a| a.validate().map(drop)),
        2 => both::<InvokeAsyncArgs>(body, |a| a.validate().map(drop)),
        3 => both::<GetJobArgs>(body, GetJobArgs::validate),
        4 => both::<CancelJobArgs>(body, CancelJobArgs::validate),
        5 => both::<ListJobsArgs>(body, ListJobsArgs::validate),
        _ => {
            if let Ok(text) = std::str::from_utf8(body)
                && let Ok(id) = text.parse::<JobId>()
            {
                assert_eq!(
                    id.as_str().parse::<JobId>().ok(),
                    Some(id),
                    "a job id round-trips"
                );
            }
        }
    }
});
