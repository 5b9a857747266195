//! `image/generate` and `image/edit` params (spec §8.6), validated before anything else happens
//! (`-32104 IMAGE_INVALID_REQUEST`; `n` over the host's cap of 8: `-32106` with `data.hostCap`).

use fleet_proto::executa::reverse::image as codes;
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use serde_json::{Map, Value, json};

/// Longest prompt accepted, in characters (a host choice: the spec names none).
pub const MAX_PROMPT_CHARS: usize = 32_000;

/// Largest side of an explicit `size` (`WxH`), in pixels (a host choice).
pub const MAX_SIDE: u32 = 8_192;

/// Accepted `quality` values (spec §8.6).
pub const QUALITIES: [&str; 3] = ["low", "medium", "high"];
/// Accepted `resolution` values (spec §8.6).
pub const RESOLUTIONS: [&str; 4] = ["0.5K", "1K", "2K", "4K"];
/// Accepted `output_format` values (spec §8.6).
pub const OUTPUT_FORMATS: [&str; 3] = ["png", "jpeg", "webp"];
/// Accepted `thinking_level` values (spec §8.6).
pub const THINKING_LEVELS: [&str; 2] = ["minimal", "high"];

/// Which method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `image/generate`.
    Generate,
    /// `image/edit`.
    Edit,
}

/// A validated request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ImageRequest {
    pub(crate) kind: Kind,
    pub(crate) prompt: String,
    pub(crate) n: u32,
    pub(crate) size: Option<String>,
    pub(crate) quality: Option<String>,
    pub(crate) output_format: Option<String>,
    pub(crate) references: Vec<String>,
    pub(crate) image_url: Option<String>,
    pub(crate) mask_url: Option<String>,
    pub(crate) hints: Vec<String>,
}

fn invalid(message: impl Into<String>) -> ErrorObject {
    codes::IMAGE_INVALID_REQUEST.error(message)
}

/// A member, treating `null` as absent.
fn member<'a>(p: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    p.get(key).filter(|v| !v.is_null())
}

/// An optional string member that must be one of `allowed`.
fn one_of(p: &Map<String, Value>, key: &str, allowed: &[&str]) -> Result<Option<String>, ErrorObject> {
    match member(p, key) {
        None => Ok(None),
        Some(Value::String(s)) if allowed.contains(&s.as_str()) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("{key} must be one of {}", allowed.join(", ")))),
    }
}

/// `WxH` with both sides in 1..=[`MAX_SIDE`], or `auto`.
fn valid_size(s: &str) -> bool {
    if s == "auto" {
        return true;
    }
    let side = |t: &str| {
        !t.is_empty()
            && t.len() <= 5
            && t.bytes().all(|b| b.is_ascii_digit())
            && t.parse::<u32>().is_ok_and(|v| (1..=MAX_SIDE).contains(&v))
    };
    s.split_once('x').is_some_and(|(w, h)| side(w) && side(h))
}

/// A non-empty URL string member.
fn url_member(p: &Map<String, Value>, key: &str) -> Result<Option<String>, ErrorObject> {
    match member(p, key) {
        None => Ok(None),
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.trim().to_owned())),
        Some(_) => Err(invalid(format!("{key} must be a non-empty string"))),
    }
}

/// The `-32106` of `n` over a cap: `data.hostCap` for the host's, `data.images`/`data.maxImages` for a grant's.
pub(crate) fn over_cap(n: u32, cap: u32, host: bool) -> ErrorObject {
    let mut data = Map::from_iter([
        ("images".to_owned(), json!(n)),
        ("maxImages".to_owned(), json!(cap)),
    ]);
    if host {
        data.insert("hostCap".to_owned(), json!(limits::IMAGE_MAX_PER_CALL));
    }
    let whose = if host {
        "the host's cap"
    } else {
        "the grant's max_per_call"
    };
    codes::IMAGE_MAX_IMAGES_EXCEEDED.error_with(format!("n = {n} is over {whose} of {cap}"), data)
}

/// `-32106` for a call that would take its invoke over the per-invoke cap (spec §7.4 `max_images`): `data.images`
/// is the invoke's count had the call been served, `data.maxImages` the cap.
pub(crate) fn over_invoke_cap(asked: u32, images: u32, cap: u32) -> ErrorObject {
    codes::IMAGE_MAX_IMAGES_EXCEEDED.error_with(
        format!("{asked} more images would take this invoke to {images}, over its cap of {cap}"),
        Map::from_iter([
            ("images".to_owned(), json!(images)),
            ("maxImages".to_owned(), json!(cap)),
        ]),
    )
}

impl ImageRequest {
    /// Validates `params` of `kind`.
    pub(crate) fn parse(kind: Kind, params: &Value) -> Result<ImageRequest, ErrorObject> {
        let p = params
            .as_object()
            .ok_or_else(|| invalid("params must be an object"))?;
        let prompt = match member(p, "prompt") {
            Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(Value::String(_)) | None => return Err(invalid("prompt must be a non-empty string")),
            Some(_) => return Err(invalid("prompt must be a string")),
        };
        if prompt.chars().count() > MAX_PROMPT_CHARS {
            return Err(invalid(format!(
                "prompt is longer than {MAX_PROMPT_CHARS} characters"
            )));
        }
        let n = match member(p, "n") {
            None => 1,
            Some(v) => {
                let n = v
                    .as_u64()
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| invalid("n must be an integer ≥ 1"))?;
                if n > limits::IMAGE_MAX_PER_CALL {
                    let host = u32::try_from(limits::IMAGE_MAX_PER_CALL).unwrap_or(u32::MAX);
                    return Err(over_cap(u32::try_from(n).unwrap_or(u32::MAX), host, true));
                }
                u32::try_from(n).map_err(|_| invalid("n is too large"))?
            }
        };
        let size = match member(p, "size") {
            None => None,
            Some(Value::String(s)) if valid_size(s) => Some(s.clone()),
            Some(_) => {
                return Err(invalid(format!(
                    "size must be \"WIDTHxHEIGHT\" (sides 1–{MAX_SIDE}) or \"auto\""
                )));
            }
        };
        let quality = one_of(p, "quality", &QUALITIES)?;
        one_of(p, "resolution", &RESOLUTIONS)?;
        let output_format = one_of(p, "output_format", &OUTPUT_FORMATS)?;
        one_of(p, "thinking_level", &THINKING_LEVELS)?;
        if member(p, "enable_web_search").is_some_and(|v| !v.is_boolean()) {
            return Err(invalid("enable_web_search must be a boolean"));
        }
        if member(p, "metadata").is_some_and(|v| !v.is_object()) {
            return Err(invalid("metadata must be an object"));
        }
        let references = match member(p, "reference_image_urls") {
            None => Vec::new(),
            Some(Value::Array(a))
                if a.len() <= limits::IMAGE_MAX_REFERENCE_URLS
                    && a.iter().all(|u| u.as_str().is_some_and(|s| !s.trim().is_empty())) =>
            {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(|s| s.trim().to_owned())
                    .collect()
            }
            Some(_) => {
                return Err(invalid(format!(
                    "reference_image_urls must be at most {} non-empty strings",
                    limits::IMAGE_MAX_REFERENCE_URLS
                )));
            }
        };
        let (image_url, mask_url) = match kind {
            Kind::Generate => (None, None),
            Kind::Edit => (
                Some(url_member(p, "image_url")?.ok_or_else(|| invalid("image_url is required"))?),
                url_member(p, "mask_url")?,
            ),
        };
        let hints = hints(member(p, "modelPreferences"))?;
        Ok(ImageRequest {
            kind,
            prompt,
            n,
            size,
            quality,
            output_format,
            references,
            image_url,
            mask_url,
            hints,
        })
    }
}

/// `modelPreferences.hints[*].name`, in order.
fn hints(prefs: Option<&Value>) -> Result<Vec<String>, ErrorObject> {
    let Some(prefs) = prefs else {
        return Ok(Vec::new());
    };
    let prefs = prefs
        .as_object()
        .ok_or_else(|| invalid("modelPreferences must be an object"))?;
    let Some(hints) = member(prefs, "hints") else {
        return Ok(Vec::new());
    };
    let hints = hints
        .as_array()
        .ok_or_else(|| invalid("modelPreferences.hints must be an array"))?;
    let mut out = Vec::new();
    for h in hints {
        match h.as_object().map(|h| member(h, "name")) {
            Some(None) => {}
            Some(Some(Value::String(n))) => out.push(n.clone()),
            _ => {
                return Err(invalid(
                    "modelPreferences.hints[] must be objects with a string name",
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: Result<ImageRequest, ErrorObject>) -> i64 {
        r.err().map_or(0, |e| e.code)
    }

    #[test]
    fn every_limit_holds_at_its_boundary() {
        let gen_ = |p: Value| ImageRequest::parse(Kind::Generate, &p);
        assert_eq!(gen_(json!({"prompt": "x", "n": 8})).map(|r| r.n), Ok(8));
        let e = gen_(json!({"prompt": "x", "n": 9})).unwrap_err();
        assert_eq!(
            (e.code, e.data.as_ref().map(|d| d["hostCap"].clone())),
            (-32106, Some(json!(8)))
        );
        let refs = |k: usize| json!({"prompt": "x", "reference_image_urls": vec!["https://a/b.png"; k]});
        assert_eq!(gen_(refs(4)).map(|r| r.references.len()), Ok(4));
        assert_eq!(code(gen_(refs(5))), -32104);
        for bad in [
            json!({"prompt": ""}),
            json!({"prompt": " \n\t"}),
            json!({}),
            json!({"prompt": 3}),
            json!({"prompt": "x", "n": 0}),
            json!({"prompt": "x", "n": 1.5}),
            json!({"prompt": "x", "size": "big"}),
            json!({"prompt": "x", "size": "1024x0"}),
            json!({"prompt": "x", "size": "9000x10"}),
            json!({"prompt": "x", "quality": "ultra"}),
            json!({"prompt": "x", "resolution": "8K"}),
            json!({"prompt": "x", "output_format": "gif"}),
            json!({"prompt": "x", "thinking_level": "medium"}),
            json!({"prompt": "x", "enable_web_search": "yes"}),
            json!({"prompt": "x", "reference_image_urls": [1]}),
            json!({"prompt": "x", "reference_image_urls": "https://a/b.png"}),
            json!({"prompt": "x".repeat(MAX_PROMPT_CHARS + 1)}),
        ] {
            assert_eq!(code(gen_(bad.clone())), -32104, "{bad}");
        }
        let ok = gen_(
            json!({"prompt": "x", "size": "1024x1536", "quality": "high", "resolution": "2K",
            "output_format": "webp", "thinking_level": "minimal", "enable_web_search": true,
            "modelPreferences": {"hints": [{"name": "dall"}]}}),
        )
        .unwrap();
        assert_eq!(ok.hints, vec!["dall".to_owned()]);
        assert_eq!(
            code(ImageRequest::parse(Kind::Edit, &json!({"prompt": "x"}))),
            -32104
        );
        let edit = ImageRequest::parse(
            Kind::Edit,
            &json!({"prompt": "x", "image_url": "/v1/files/u/a", "mask_url": null}),
        )
        .unwrap();
        assert_eq!(
            (edit.image_url.as_deref(), edit.mask_url),
            (Some("/v1/files/u/a"), None)
        );
    }
}
