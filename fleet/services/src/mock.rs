//! Mock upstreams from F3 `MockEntry` files (spec §15.4 HR-FX-01): what a reverse-RPC family in `mock` mode
//! ([`crate::dev`]) answers instead of its upstream.
//!
//! * **Sources, in this order:** the `--mocks` files of `fleet up` (in command-line order), then the calling
//!   plugin's own `dev.fixtures` (the `executa.json` `dev` block, spec §15.5: patterns relative to the plugin
//!   directory, in manifest order, the files of one pattern in byte order of their names). Within them the first
//!   matching entry wins (top-down, as the spec observes).
//! * **Addressing:** a wire method is split at its first `/` (`host/uploadFile` → `host`/`uploadFile`,
//!   `agent/session.run` → `agent`/`session.run`); the local-dev routing names are aliases:
//!   `embeddings/create` → `llm`/`embed` (spec §15.4) and `sampling/createMessage` → `llm`/`complete` (the
//!   documented sampling fixture row is an `llm`/`complete` entry).
//! * **Predicates** (all must hold): `contentIncludes` — a case-sensitive substring of any string in the call's
//!   params; `promptIncludes` — of `params.prompt`; `modeEquals` — `params.mode` equals it; `tool_id` — the
//!   calling plugin; `method` — the tool of the invoke the call belongs to.
//! * **Answers:** an entry's `result` or `error` as is; its `events` as a buffered agent run
//!   (`{run_id, stream_id, frames, final}`, each frame tagged with `seq` and `stream_id`, the host's `done: true`
//!   terminator last, at most 4 096 frames); no matching entry: a deterministic echo in the family's result
//!   shape (the last user message echoed back, a hash-derived embedding, a 1×1 PNG, …).
//! * **Policy is not mocked:** a call reaches a mock only after the same gates as a real upstream — negotiation
//!   and manifest (the worker), the family's token and the user's grant ([`crate::FleetServices::serve`]) —
//!   and it passes the family's own request validation and per-invoke budget here, so the codes a plugin sees
//!   (`-32004`, `-32006`, `-32204`, `-32211`, …) are the real ones. Only the upstream is replaced.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use fleet_proto::executa::reverse::{Family, agent, image, methods, upload as upload_codes};
use fleet_proto::jsonrpc::ErrorObject;
use fleet_proto::limits;
use fleet_proto::mocks::{MockEntry, MockLineError, parse_jsonl};
use fleet_proto::util::now_ms;
use fleet_store::rfc3339_ms;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::image::request::{ImageRequest, Kind};
use crate::{CallContext, llm, upload};

/// `model` (and `_meta.provider`) of every echo.
pub const MOCK_MODEL: &str = "mock";

/// Dimensions of an echoed embedding.
pub const MOCK_EMBED_DIMENSIONS: usize = 8;

/// The file every plugin manifest is (`executa.json`).
const MANIFEST_FILE: &str = "executa.json";

/// A 1×1 transparent PNG, the echoed image (as a `data:` URL).
const PNG_1X1_B64: &str =
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";

/// Why mock fixtures could not be loaded (at start-up).
#[derive(Debug, thiserror::Error)]
pub enum MockFileError {
    /// A file could not be read.
    #[error("mock file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A line is not a valid `MockEntry` (the error names its 1-based line).
    #[error("mock file {}: {source}", path.display())]
    Entry {
        /// The file.
        path: PathBuf,
        /// The line and what is wrong with it.
        source: MockLineError,
    },
    /// A plugin's `dev.fixtures` is not a list of relative patterns.
    #[error("{}: dev.fixtures: {reason}", manifest.display())]
    Fixtures {
        /// The plugin's `executa.json`.
        manifest: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Every loaded mock entry: the `--mocks` files' and each plugin's `dev.fixtures`.
#[derive(Debug, Clone, Default)]
pub struct MockSet {
    global: Vec<MockEntry>,
    per_tool: HashMap<String, Vec<MockEntry>>,
}

/// The call a mock is looked up for.
#[derive(Debug, Clone, Copy)]
pub struct CallSite<'a> {
    /// The wire method (`image/generate`).
    pub method: &'a str,
    /// Its params (without `context`).
    pub params: &'a Value,
    /// The calling plugin.
    pub tool_id: &'a str,
    /// The tool of the invoke the call belongs to.
    pub tool: &'a str,
}

impl MockSet {
    /// Loads `files` (in order) as the entries every plugin sees, and `per_tool` as each plugin's own.
    pub fn new(global: Vec<MockEntry>, per_tool: HashMap<String, Vec<MockEntry>>) -> MockSet {
        MockSet { global, per_tool }
    }

    /// Parses every file, in order, into one list.
    ///
    /// # Errors
    /// The first unreadable file or broken line ([`MockFileError::Entry`] names file and line).
    pub fn load_files(files: &[PathBuf]) -> Result<Vec<MockEntry>, MockFileError> {
        let mut entries = Vec::new();
        for path in files {
            entries.extend(load_file(path)?);
        }
        Ok(entries)
    }

    /// The `dev.fixtures` of every plugin of a catalogue directory (`<dir>/*/executa.json`), by `tool_id`.
    /// Entries whose `executa.json` is unreadable or has no `tool_id` are skipped (the catalogue reports them).
    ///
    /// # Errors
    /// A `dev.fixtures` that is not a list of relative patterns, or a broken fixture file.
    pub fn load_dev_fixtures(plugins_dir: &Path) -> Result<HashMap<String, Vec<MockEntry>>, MockFileError> {
        let mut out = HashMap::new();
        let Ok(read) = fs::read_dir(plugins_dir) else {
            return Ok(out);
        };
        let mut dirs: Vec<PathBuf> = read
            .filter_map(Result::ok)
            .filter(|e| !e.file_name().as_encoded_bytes().starts_with(b"."))
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        for dir in dirs {
            let manifest = dir.join(MANIFEST_FILE);
            let Some(value) = fs::read(&manifest)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            else {
                continue;
            };
            let Some(tool_id) = value.get("tool_id").and_then(Value::as_str) else {
                continue;
            };
            let Some(fixtures) = value.get("dev").and_then(|d| d.get("fixtures")) else {
                continue;
            };
            let bad = |reason: String| MockFileError::Fixtures {
                manifest: manifest.clone(),
                reason,
            };
            let patterns = fixtures
                .as_array()
                .ok_or_else(|| bad("must be an array of file patterns".into()))?;
            let mut entries = Vec::new();
            for (i, pattern) in patterns.iter().enumerate() {
                let pattern = pattern
                    .as_str()
                    .ok_or_else(|| bad(format!("[{i}] must be a string")))?;
                for file in expand(&dir, pattern).map_err(|r| bad(format!("[{i}] {pattern:?}: {r}")))? {
                    entries.extend(load_file(&file)?);
                }
            }
            out.insert(tool_id.to_owned(), entries);
        }
        Ok(out)
    }

    /// Number of entries, all sources together.
    pub fn len(&self) -> usize {
        self.global.len() + self.per_tool.values().map(Vec::len).sum::<usize>()
    }

    /// No entry at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first entry answering `site`: the global files first, then the plugin's own fixtures.
    pub fn find(&self, site: &CallSite<'_>) -> Option<&MockEntry> {
        self.global
            .iter()
            .chain(self.per_tool.get(site.tool_id).into_iter().flatten())
            .find(|e| matches(e, site))
    }
}

fn load_file(path: &Path) -> Result<Vec<MockEntry>, MockFileError> {
    let text = fs::read_to_string(path).map_err(|source| MockFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_jsonl(&text).map_err(|source| MockFileError::Entry {
        path: path.to_path_buf(),
        source,
    })
}

/// The files a `dev.fixtures` pattern names under `dir`: a relative path whose last component may hold `*` and
/// `?` wildcards (a pattern without them names one file, which must exist).
fn expand(dir: &Path, pattern: &str) -> Result<Vec<PathBuf>, String> {
    let path = Path::new(pattern);
    let components: Vec<Component<'_>> = path.components().collect();
    if components
        .iter()
        .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err("must be a path relative to the plugin directory, without `..`".into());
    }
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return Err("names no file".into());
    };
    let parent = path.parent().unwrap_or(Path::new(""));
    if parent.to_string_lossy().contains(['*', '?', '[']) {
        return Err("only the file name may hold wildcards".into());
    }
    if name.contains('[') {
        return Err("character classes (`[…]`) are not supported; use `*` and `?`".into());
    }
    if !name.contains(['*', '?']) {
        return Ok(vec![dir.join(path)]);
    }
    let Ok(read) = fs::read_dir(dir.join(parent)) else {
        return Ok(Vec::new());
    };
    let mut files: Vec<PathBuf> = read
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| wildcard(name, n)))
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// Whether `name` matches `pattern` (`*`: any run of characters, `?`: one character).
fn wildcard(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

/// The `ns`/`method` pairs a wire method answers to: its split at the first `/`, then the local-dev aliases.
pub fn addresses(method: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::with_capacity(2);
    if let Some(split) = method.split_once('/') {
        out.push(split);
    }
    match method {
        methods::EMBEDDINGS_CREATE => out.push(("llm", "embed")),
        methods::SAMPLING_CREATE_MESSAGE => out.push(("llm", "complete")),
        _ => {}
    }
    out
}

/// Whether `entry` answers `site`: its address is one of the method's and every predicate holds.
pub fn matches(entry: &MockEntry, site: &CallSite<'_>) -> bool {
    let m = &entry.matcher;
    let param = |key: &str| site.params.get(key).and_then(Value::as_str);
    addresses(site.method)
        .iter()
        .any(|(ns, method)| entry.ns == *ns && entry.method == *method)
        && m.content_includes
            .as_deref()
            .is_none_or(|needle| any_string_contains(site.params, needle))
        && m.prompt_includes
            .as_deref()
            .is_none_or(|needle| param("prompt").is_some_and(|p| p.contains(needle)))
        && m.mode_equals
            .as_deref()
            .is_none_or(|mode| param("mode") == Some(mode))
        && m.tool_id.as_deref().is_none_or(|t| t == site.tool_id)
        && m.method.as_deref().is_none_or(|t| t == site.tool)
}

/// Whether any string anywhere in `v` contains `needle`.
fn any_string_contains(v: &Value, needle: &str) -> bool {
    match v {
        Value::String(s) => s.contains(needle),
        Value::Array(items) => items.iter().any(|i| any_string_contains(i, needle)),
        Value::Object(m) => m.values().any(|i| any_string_contains(i, needle)),
        _ => false,
    }
}

// -------------------------------------------------------------------------------------------------------------
// Serving
// -------------------------------------------------------------------------------------------------------------

/// Serves one call of a family in `mock` mode, after its token verified: the family's request checks and
/// budget, then the first matching entry, else the echo.
pub(crate) fn serve(
    set: &MockSet,
    ctx: &CallContext,
    family: Family,
    site: &CallSite<'_>,
) -> Result<Value, ErrorObject> {
    let entry = set.find(site);
    match family {
        Family::Sampling => sampling(ctx, site, entry),
        Family::Embeddings => {
            let (alias, inputs) = llm::validate_embed(site.params, ctx)?;
            answer(entry, site, ctx).unwrap_or_else(|| Ok(echo_embeddings(&alias, &inputs)))
        }
        Family::Agent => agent(ctx, site, entry),
        Family::Image => image(ctx, site, entry),
        Family::Upload => upload(ctx, site, entry),
        // Storage and files were counted by the caller; anything else has no checks of its own here.
        _ => answer(entry, site, ctx).unwrap_or_else(|| Ok(echo_generic(site))),
    }
}

/// An entry's canned answer: its `result`, its `error`, or its `events` as an agent run.
fn answer(
    entry: Option<&MockEntry>,
    site: &CallSite<'_>,
    ctx: &CallContext,
) -> Option<Result<Value, ErrorObject>> {
    let entry = entry?;
    if let Some(e) = &entry.error {
        let mut error = ErrorObject::new(e.code, e.message.clone());
        error.data = e.data.clone();
        return Some(Err(error));
    }
    if let Some(events) = &entry.events {
        let payloads = events.iter().map(|e| e.payload.clone()).collect();
        return Some(run_result(site, ctx, payloads));
    }
    entry.result.clone().map(Ok)
}

/// Tokens an answer reports (`usage.totalTokens`, else input + output, else the OpenAI names).
fn reported_tokens(v: &Value) -> Option<u64> {
    let u = v.get("usage")?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    n("totalTokens")
        .or_else(|| Some(n("inputTokens")? + n("outputTokens")?))
        .or_else(|| n("total_tokens"))
}

fn sampling(ctx: &CallContext, site: &CallSite<'_>, entry: Option<&MockEntry>) -> Result<Value, ErrorObject> {
    let (max_tokens, last_user) = llm::validate_sampling(site.params)?;
    ctx.budget.admit_sampling().map_err(llm::exhausted)?;
    let value = answer(entry, site, ctx).unwrap_or_else(|| Ok(echo_completion(&last_user)))?;
    // As upstream: the reported usage, else the call's `maxTokens`.
    ctx.budget
        .settle_sampling(reported_tokens(&value).unwrap_or(u64::from(max_tokens)));
    Ok(value)
}

fn agent_invalid(message: impl Into<String>) -> ErrorObject {
    agent::AGENT_INVALID_REQUEST.error(message)
}

fn agent(ctx: &CallContext, site: &CallSite<'_>, entry: Option<&MockEntry>) -> Result<Value, ErrorObject> {
    let p = site.params;
    let text = |k: &str| p.get(k).and_then(Value::as_str);
    let admit = || {
        ctx.budget
            .admit_sampling()
            .map_err(|e| agent::AGENT_QUOTA_EXCEEDED.error(e.to_string()))
    };
    let settle = |v: &Value| ctx.budget.settle_sampling(reported_tokens(v).unwrap_or(0));
    match site.method.strip_prefix("agent/").unwrap_or_default() {
        "complete" => {
            let last = match p.get("messages").and_then(Value::as_array) {
                Some(m) if !m.is_empty() => m
                    .iter()
                    .rev()
                    .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
                    .and_then(|m| {
                        let c = m.get("content")?;
                        c.as_str().or_else(|| c.get("text").and_then(Value::as_str))
                    })
                    .unwrap_or_default()
                    .to_owned(),
                _ => return Err(agent_invalid("messages must be a non-empty array")),
            };
            admit()?;
            let value = answer(entry, site, ctx).unwrap_or_else(|| Ok(echo_completion(&last)))?;
            settle(&value);
            Ok(value)
        }
        "session.run" => {
            if !text("app_session_uuid").is_some_and(|u| u.starts_with("aps_")) {
                return Err(agent_invalid("app_session_uuid must be a session id (aps_…)"));
            }
            let content = text("content").unwrap_or_default();
            if content.trim().is_empty() {
                return Err(agent_invalid("content must not be empty"));
            }
            admit()?;
            let value = answer(entry, site, ctx).unwrap_or_else(|| {
                run_result(
                    site,
                    ctx,
                    vec![json!({"event": "token", "text": format!("echo: {content}")})],
                )
            })?;
            settle(&value);
            Ok(value)
        }
        "session.history" => {
            if let Some(limit) = p.get("limit")
                && !limit.as_u64().is_some_and(|l| (1..=200).contains(&l))
            {
                return Err(agent_invalid("limit must be an integer in 1..=200"));
            }
            answer(entry, site, ctx).unwrap_or_else(|| Ok(json!({"messages": []})))
        }
        other => answer(entry, site, ctx).unwrap_or_else(|| Ok(echo_agent(other, site, ctx))),
    }
}

fn image(ctx: &CallContext, site: &CallSite<'_>, entry: Option<&MockEntry>) -> Result<Value, ErrorObject> {
    let p = site.params;
    let edit = site.method == methods::IMAGE_EDIT;
    if edit && !ctx.granted(fleet_proto::executa::capabilities::LLM_IMAGE_EDIT) {
        return Err(image::IMAGE_NOT_GRANTED.error("the user has not granted llm.image.edit to this plugin"));
    }
    // The real service's validation (`-32104`, `-32106` over the host's cap).
    let kind = if edit { Kind::Edit } else { Kind::Generate };
    let n = ImageRequest::parse(kind, p)?.n;
    // The invoke's image cap, as the real service counts it.
    let reserved = match ctx.budget.reserve_images(n) {
        Ok(r) => r,
        Err(crate::Exhausted::Images { asked, images, cap }) => {
            return Err(crate::image::request::over_invoke_cap(asked, images, cap));
        }
        Err(other) => return Err(image::IMAGE_MAX_IMAGES_EXCEEDED.error(other.to_string())),
    };
    let answered = answer(entry, site, ctx).unwrap_or_else(|| {
        let (w, h) = p
            .get("size")
            .and_then(Value::as_str)
            .and_then(|s| s.split_once('x'))
            .and_then(|(w, h)| Some((w.parse::<u64>().ok()?, h.parse::<u64>().ok()?)))
            .unwrap_or((1024, 1024));
        let one = json!({
            "url": format!("data:image/png;base64,{PNG_1X1_B64}"),
            "mimeType": "image/png",
            "width": w,
            "height": h,
        });
        Ok(json!({
            "images": vec![one; usize::try_from(n).unwrap_or(1)],
            "model": MOCK_MODEL,
            "_meta": {"provider": MOCK_MODEL},
        }))
    });
    if answered.is_ok() {
        reserved.settle(n);
    }
    answered
}

fn upload(ctx: &CallContext, site: &CallSite<'_>, entry: Option<&MockEntry>) -> Result<Value, ErrorObject> {
    let p = site
        .params
        .as_object()
        .ok_or_else(|| upload_codes::INVALID_REQUEST.error("params must be an object"))?;
    match upload::mode_of(p)? {
        "inline" => {
            let (d, bytes) = upload::check_inline(ctx, p)?;
            let reservation = ctx
                .budget
                .reserve_upload(bytes.len() as u64)
                .map_err(upload::exhausted)?;
            let value = answer(entry, site, ctx).unwrap_or_else(|| {
                let url = format!("data:{};base64,{}", d.mime, STANDARD.encode(&bytes));
                Ok(upload_envelope(
                    &mock_key(ctx, &d.filename),
                    &url,
                    d.mime.as_str(),
                    bytes.len() as u64,
                    "inline",
                ))
            })?;
            reservation.commit();
            Ok(value)
        }
        "negotiate" => {
            let (d, _) = upload::check_negotiate(ctx, p)?;
            answer(entry, site, ctx).unwrap_or_else(|| {
                let ttl = limits::UPLOAD_PUT_URL_TTL.as_secs();
                Ok(json!({
                    "r2_key": mock_key(ctx, &d.filename),
                    "put_url": "data:,",
                    "headers": {"Content-Type": d.mime.as_str()},
                    "expires_in": ttl,
                    "expires_at": rfc3339_ms(now_ms() + ttl * 1000),
                    "_meta": {"mode": "presigned-put", "provider": MOCK_MODEL},
                }))
            })
        }
        "confirm" => {
            let key = match p.get("r2_key") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                _ => return Err(upload_codes::INVALID_REQUEST.error("missing 'r2_key'")),
            };
            let reservation = ctx.budget.reserve_upload(0).map_err(upload::exhausted)?;
            let value = answer(entry, site, ctx).unwrap_or_else(|| {
                Ok(upload_envelope(
                    &key,
                    "data:,",
                    "application/octet-stream",
                    0,
                    "confirm",
                ))
            })?;
            reservation.commit();
            Ok(value)
        }
        other => Err(upload_codes::INVALID_REQUEST.error(format!(
            "unknown mode {other:?}; one of inline, negotiate, confirm"
        ))),
    }
}

fn mock_key(ctx: &CallContext, filename: &str) -> String {
    format!(
        "mock-uploads/{}/{}/{}",
        short_hash(&[&ctx.tool_id]),
        short_hash(&[&ctx.invoke_id]),
        short_hash(&[filename])
    )
}

/// The upload result envelope of a mocked upload ([`crate::upload::result_envelope`]).
fn upload_envelope(key: &str, url: &str, mime: &str, size: u64, mode: &str) -> Value {
    let expires_at_ms = now_ms() + limits::UPLOAD_GET_URL_TTL.as_secs() * 1000;
    crate::upload::result_envelope(
        key,
        url,
        mime,
        size,
        expires_at_ms,
        &json!({"mode": mode, "provider": MOCK_MODEL}),
    )
}

/// 16 hex digits of SHA-256 over `parts` (deterministic ids).
fn short_hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    hex::encode(&h.finalize()[..8])
}

fn words(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

/// The echoed completion: `echo: <last user message>`, with its word counts as usage.
pub fn echo_completion(last_user: &str) -> Value {
    let text = format!("echo: {last_user}");
    let (input, output) = (words(last_user), words(&text));
    json!({
        "role": "assistant",
        "content": {"type": "text", "text": text},
        "model": MOCK_MODEL,
        "stopReason": "endTurn",
        "usage": {"inputTokens": input, "outputTokens": output, "totalTokens": input + output},
        "_meta": {"provider": MOCK_MODEL},
    })
}

/// The echoed embeddings: [`MOCK_EMBED_DIMENSIONS`] numbers in `[-1, 1]` from each input's SHA-256.
pub fn echo_embeddings(alias: &str, inputs: &[String]) -> Value {
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let digest = Sha256::digest(input.as_bytes());
            let embedding: Vec<f64> = digest[..MOCK_EMBED_DIMENSIONS]
                .iter()
                .map(|b| f64::from(*b) / 127.5 - 1.0)
                .collect();
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let tokens: u64 = inputs.iter().map(|i| words(i)).sum();
    json!({
        "object": "list",
        "model": alias,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "_meta": {
            "alias": alias,
            "dimensions": MOCK_EMBED_DIMENSIONS,
            "backendModel": MOCK_MODEL,
            "provider": MOCK_MODEL,
        },
    })
}

/// A buffered agent run of `payloads` (spec §8.2): `{run_id, stream_id, frames, final}`, every frame tagged with
/// `seq` and `stream_id`, the `done: true` terminator last.
fn run_result(site: &CallSite<'_>, ctx: &CallContext, payloads: Vec<Value>) -> Result<Value, ErrorObject> {
    let frames_total = payloads.len() + 1;
    if frames_total > limits::AGENT_MAX_FRAMES {
        return Err(agent::AGENT_QUOTA_EXCEEDED.error_with(
            format!(
                "the run has {frames_total} frames, more than the {} allowed",
                limits::AGENT_MAX_FRAMES
            ),
            Map::from_iter([("maxFrames".to_owned(), json!(limits::AGENT_MAX_FRAMES))]),
        ));
    }
    let content = site
        .params
        .get("content")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let run_id = site.params.get("run_id").and_then(Value::as_str).map_or_else(
        || format!("run_{}", short_hash(&[&ctx.invoke_id, content])),
        str::to_owned,
    );
    let stream_id = format!("stream_{}", short_hash(&[&run_id]));
    let mut text = String::new();
    let mut final_text: Option<String> = None;
    let mut frames: Vec<Value> = Vec::with_capacity(frames_total);
    for (seq, payload) in payloads.into_iter().enumerate() {
        let mut frame = match payload {
            Value::Object(m) => m,
            other => Map::from_iter([("data".to_owned(), other)]),
        };
        if let Some(t) = frame.get("text").and_then(Value::as_str) {
            if frame.get("event").and_then(Value::as_str) == Some("final") {
                final_text = Some(t.to_owned());
            } else {
                text.push_str(t);
            }
        }
        frame.insert("seq".into(), json!(seq));
        frame.insert("stream_id".into(), json!(stream_id));
        frames.push(Value::Object(frame));
    }
    frames.push(json!({"done": true, "seq": frames.len(), "stream_id": stream_id}));
    Ok(json!({
        "run_id": run_id,
        "stream_id": stream_id,
        "frames": frames,
        "final": {"text": final_text.unwrap_or(text)},
    }))
}

/// The echo of the other `agent/session.*` methods: the shapes of spec §8.2 with deterministic ids.
fn echo_agent(method: &str, site: &CallSite<'_>, ctx: &CallContext) -> Value {
    let p = site.params;
    let uuid = p.get("app_session_uuid").and_then(Value::as_str).map_or_else(
        || format!("aps_mock_{}", short_hash(&[&ctx.tool_id, &ctx.invoke_id])),
        str::to_owned,
    );
    let ttl = p.get("ttl_seconds").and_then(Value::as_u64).unwrap_or(600);
    match method {
        "session.create" => json!({
            "app_session_uuid": uuid,
            "thread_id": format!("thread_{}", short_hash(&[&uuid])),
            "kind": p.get("kind").cloned().unwrap_or_else(|| json!("agent")),
            "agent_submode": p.get("agent_submode").cloned().unwrap_or_else(|| json!("auto")),
            "granted_tools": ["*"],
            "expires_in": ttl,
        }),
        "session.cancel" => {
            json!({"cancelled": true, "run_id": p.get("run_id").cloned().unwrap_or(Value::Null)})
        }
        "session.delete" => json!({"deleted": true, "app_session_uuid": uuid}),
        "session.list" => json!({"sessions": []}),
        "session.refresh" => json!({"app_session_uuid": uuid, "expires_in": ttl}),
        _ => echo_generic(site),
    }
}

/// The echo of a call without a family-specific shape: its method and params.
fn echo_generic(site: &CallSite<'_>) -> Value {
    json!({"echo": {"method": site.method, "params": site.params}, "_meta": {"provider": MOCK_MODEL}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(line: &str) -> MockEntry {
        MockEntry::parse(line).unwrap()
    }

    fn site<'a>(method: &'a str, params: &'a Value) -> CallSite<'a> {
        CallSite {
            method,
            params,
            tool_id: "tool-a",
            tool: "run",
        }
    }

    #[test]
    fn a_wire_method_is_split_at_its_first_slash_and_aliased() {
        assert_eq!(addresses("host/uploadFile"), vec![("host", "uploadFile")]);
        assert_eq!(addresses("image/generate"), vec![("image", "generate")]);
        assert_eq!(addresses("agent/session.run"), vec![("agent", "session.run")]);
        assert_eq!(
            addresses("embeddings/create"),
            vec![("embeddings", "create"), ("llm", "embed")]
        );
        assert_eq!(
            addresses("sampling/createMessage"),
            vec![("sampling", "createMessage"), ("llm", "complete")]
        );
        let p = json!({});
        let embed = entry(r#"{"ns":"llm","method":"embed","result":{}}"#);
        assert!(matches(&embed, &site("embeddings/create", &p)));
        assert!(!matches(&embed, &site("sampling/createMessage", &p)));
        let upload = entry(r#"{"ns":"host","method":"uploadFile","result":{}}"#);
        assert!(matches(&upload, &site("host/uploadFile", &p)));
        assert!(!matches(&upload, &site("image/generate", &p)));
        let complete = entry(r#"{"ns":"llm","method":"complete","result":{}}"#);
        assert!(matches(&complete, &site("sampling/createMessage", &p)));
        assert!(!matches(&complete, &site("agent/complete", &p)));
    }

    #[test]
    fn content_includes_is_a_case_sensitive_substring_of_any_string_in_the_params() {
        let e =
            entry(r#"{"ns":"llm","method":"complete","match":{"contentIncludes":"weather"},"result":{}}"#);
        let hit =
            json!({"messages": [{"role": "user", "content": {"type": "text", "text": "the weather today"}}]});
        let miss =
            json!({"messages": [{"role": "user", "content": {"type": "text", "text": "the Weather today"}}]});
        let key_only = json!({"weather": 1});
        assert!(matches(&e, &site("sampling/createMessage", &hit)));
        assert!(!matches(&e, &site("sampling/createMessage", &miss)));
        assert!(
            !matches(&e, &site("sampling/createMessage", &key_only)),
            "keys are not content"
        );
    }

    #[test]
    fn prompt_includes_looks_at_the_prompt_only() {
        let e = entry(r#"{"ns":"image","method":"generate","match":{"promptIncludes":"Mars"},"result":{}}"#);
        assert!(matches(
            &e,
            &site("image/generate", &json!({"prompt": "A poster of Mars"}))
        ));
        assert!(!matches(
            &e,
            &site("image/generate", &json!({"prompt": "A poster of mars"}))
        ));
        assert!(!matches(&e, &site("image/generate", &json!({"size": "Mars"}))));
    }

    #[test]
    fn mode_equals_compares_the_mode_exactly() {
        let e = entry(r#"{"ns":"host","method":"uploadFile","match":{"modeEquals":"inline"},"result":{}}"#);
        assert!(matches(&e, &site("host/uploadFile", &json!({"mode": "inline"}))));
        assert!(!matches(
            &e,
            &site("host/uploadFile", &json!({"mode": "inline2"}))
        ));
        assert!(!matches(&e, &site("host/uploadFile", &json!({}))));
    }

    #[test]
    fn tool_id_and_method_name_the_plugin_and_the_invoked_tool() {
        let e = entry(
            r#"{"ns":"llm","method":"complete","match":{"tool_id":"tool-a","method":"run"},"result":{}}"#,
        );
        let p = json!({});
        assert!(matches(&e, &site("sampling/createMessage", &p)));
        let other_plugin = CallSite {
            tool_id: "tool-b",
            ..site("sampling/createMessage", &p)
        };
        assert!(!matches(&e, &other_plugin));
        let other_tool = CallSite {
            tool: "walk",
            ..site("sampling/createMessage", &p)
        };
        assert!(!matches(&e, &other_tool));
    }

    #[test]
    fn the_first_match_wins_and_the_plugins_own_fixtures_come_after_the_files() {
        let global = vec![
            entry(r#"{"ns":"image","method":"generate","match":{"promptIncludes":"Mars"},"result":{"n":1}}"#),
            entry(r#"{"ns":"image","method":"generate","result":{"n":2}}"#),
        ];
        let own = HashMap::from([(
            "tool-a".to_owned(),
            vec![
                entry(r#"{"ns":"image","method":"generate","result":{"n":3}}"#),
                entry(r#"{"ns":"image","method":"edit","result":{"n":4}}"#),
            ],
        )]);
        let set = MockSet::new(global, own);
        let found = |method: &str, prompt: &str, tool_id: &str| {
            let p = json!({"prompt": prompt});
            let s = CallSite {
                tool_id,
                ..site(method, &p)
            };
            set.find(&s)
                .and_then(|e| e.result.clone())
                .map(|r| r["n"].clone())
        };
        assert_eq!(found("image/generate", "Mars", "tool-a"), Some(json!(1)));
        assert_eq!(found("image/generate", "Venus", "tool-a"), Some(json!(2)));
        assert_eq!(found("image/edit", "Venus", "tool-a"), Some(json!(4)));
        assert_eq!(
            found("image/edit", "Venus", "tool-b"),
            None,
            "another plugin's fixtures"
        );
        assert_eq!(set.len(), 4);
    }

    #[test]
    fn wildcards_match_file_names() {
        assert!(wildcard("*.jsonl", "a.jsonl"));
        assert!(wildcard("*.jsonl", ".jsonl"));
        assert!(!wildcard("*.jsonl", "a.json"));
        assert!(wildcard("a?c*", "abcdef"));
        assert!(!wildcard("a?c", "ac"));
        assert!(wildcard("*", "x"));
    }

    #[test]
    fn patterns_stay_in_the_plugin_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("fixtures")).unwrap();
        for name in ["b.jsonl", "a.jsonl", "c.txt"] {
            std::fs::write(dir.path().join("fixtures").join(name), "").unwrap();
        }
        let names = |files: Vec<PathBuf>| -> Vec<String> {
            files
                .iter()
                .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            names(expand(dir.path(), "fixtures/*.jsonl").unwrap()),
            ["a.jsonl", "b.jsonl"]
        );
        assert_eq!(names(expand(dir.path(), "./fixtures/c.txt").unwrap()), ["c.txt"]);
        assert!(expand(dir.path(), "nowhere/*.jsonl").unwrap().is_empty());
        for bad in ["../x.jsonl", "/etc/*.jsonl", "*/a.jsonl", "fixtures/[ab].jsonl"] {
            assert!(expand(dir.path(), bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn echoes_are_deterministic() {
        assert_eq!(echo_completion("hi there"), echo_completion("hi there"));
        assert_eq!(echo_completion("hi there")["content"]["text"], "echo: hi there");
        let a = echo_embeddings("anna-managed-v1", &["x".into(), "y".into()]);
        assert_eq!(a, echo_embeddings("anna-managed-v1", &["x".into(), "y".into()]));
        assert_eq!(
            a["data"][0]["embedding"].as_array().unwrap().len(),
            MOCK_EMBED_DIMENSIONS
        );
        assert_ne!(a["data"][0]["embedding"], a["data"][1]["embedding"]);
    }
}
