//! Every number the spec fixes, in one place.
//!
//! Each constant cites the section of `shared/spec/executa-host.md` (the host requirements catalogue) that
//! defines it. Code elsewhere refers to these names, never to the literals.

use std::time::Duration;

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;

// ---------------------------------------------------------------------------------------------------------------
// Transport (spec §2)
// ---------------------------------------------------------------------------------------------------------------

/// Largest stdio frame in either direction, excluding the terminating LF (spec §2 HR-TX-04, §16 A-1: 16 MiB).
pub const MAX_FRAME_BYTES: usize = 16 * MIB;

/// Soft per-message threshold above which plugins are told to use file transport (spec §2 HR-TX-06, §5).
pub const FILE_TRANSPORT_THRESHOLD_BYTES: usize = 512 * KIB;

/// Largest file accepted through `__file_transport` (spec §5 HR-FT-03: "suggest 16 MiB, matching the frame cap").
pub const MAX_FILE_TRANSPORT_BYTES: usize = MAX_FRAME_BYTES;

/// How much of a bad frame is quoted back in an error (derived: bounded excerpts, spec §2 HR-TX-07).
pub const FRAME_EXCERPT_BYTES: usize = 256;

/// Bytes of reverse-RPC request frames one plugin session may have in flight at once (host policy, not a spec
/// number: 32 MiB, two [`MAX_FRAME_BYTES`] frames, so one legal frame of the largest size always fits while another
/// is served). Each request holds its frame's length from before its params are parsed until its answer is
/// written; a request past what is left is refused like one past the count cap (`-32603`), never queued. It bounds
/// what a plugin can make the worker hold, outside the plugin's cgroup, as raw and parsed params.
pub const MAX_REVERSE_BYTES_IN_FLIGHT: usize = 2 * MAX_FRAME_BYTES;

// ---------------------------------------------------------------------------------------------------------------
// Plugin lifecycle timeouts (spec §3.1, §3.9)
// ---------------------------------------------------------------------------------------------------------------

/// `initialize` must be answered within 5 s, else the session downgrades to v1 (spec §3.1 `INITIALIZE_TIMEOUT`).
pub const INITIALIZE_TIMEOUT: Duration = Duration::from_secs(5);
/// Normal `describe` timeout (spec §3.1 `DESCRIBE_TIMEOUT`).
pub const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// `describe` timeout on the first launch of a freshly installed plugin (spec §3.1
/// `DESCRIBE_TIMEOUT_BINARY_COLD_START`, §16 A-41).
pub const DESCRIBE_TIMEOUT_FIRST_LAUNCH: Duration = Duration::from_secs(60);
/// `health` timeout (spec §3.1 `HEALTH_TIMEOUT`).
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);
/// Per-invoke timeout when the manifest's tool declares none (spec §3.1 `DEFAULT_INVOKE_TIMEOUT`).
pub const DEFAULT_INVOKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Grace between closing stdin and SIGTERM, and between SIGTERM and SIGKILL (spec §3.7 HR-SD-01).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Restart attempts after an unexpected exit before the session is Stopped (spec §3.8 HR-RS-01).
pub const MAX_RESTART_ATTEMPTS: u32 = 3;
/// Base of the exponential restart backoff: 1 s, 2 s, 4 s (spec §3.8 HR-RS-01).
pub const RESTART_BACKOFF_BASE: Duration = Duration::from_secs(1);
/// A cancelled invoke still busy after this long gets its process tree killed (spec §10.6 HR-CJ-03).
pub const CANCEL_KILL_FALLBACK: Duration = Duration::from_millis(500);
/// Default timeout of a reverse `sampling/createMessage` (spec §3.9 `DEFAULT_SAMPLING_TIMEOUT`).
pub const DEFAULT_SAMPLING_TIMEOUT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------------------------------------------
// App-facing sync invoke (spec §10.3)
// ---------------------------------------------------------------------------------------------------------------

/// `tools.invoke` `timeoutMs` below this is `invalid_arg` (spec §10.3 HR-SI-01).
pub const INVOKE_TIMEOUT_MIN_MS: u64 = 1_000;
/// `tools.invoke` `timeoutMs` above this is clamped (spec §10.3 HR-SI-01, §16 A-43).
pub const INVOKE_TIMEOUT_MAX_MS: u64 = 90_000;
/// `tools.invoke` default when `timeoutMs` is omitted and the manifest declares none (spec §10.3, §16 A-3).
pub const INVOKE_TIMEOUT_DEFAULT_MS: u64 = 65_000;
/// Host grace added to the plugin-facing deadline so cancel/ack can land (spec §10.3 HR-SI-02).
pub const INVOKE_TIMEOUT_GRACE_MS: u64 = 2_000;
/// Largest serialized sync result: the NATS `max_payload` (spec §10.3 HR-SI-05: 4 194 304 bytes).
pub const MAX_SYNC_RESULT_BYTES: usize = 4 * MIB;

// ---------------------------------------------------------------------------------------------------------------
// Async jobs (spec §10.4–§10.8, §8.10)
// ---------------------------------------------------------------------------------------------------------------

/// Default job deadline: 30 min (spec §10.4).
pub const JOB_DEADLINE_DEFAULT_MS: u64 = 30 * 60 * 1_000;
/// Job deadlines below this are raised to it: 60 s (spec §10.4).
pub const JOB_DEADLINE_MIN_MS: u64 = 60_000;
/// Job deadlines above this are clamped to it: 24 h (spec §10.4).
pub const JOB_DEADLINE_MAX_MS: u64 = 86_400_000;
/// Largest serialized `args` of `tools.invokeAsync`: 64 KB (spec §10.4).
pub const MAX_JOB_ARGS_BYTES: usize = 64 * KIB;
/// Largest serialized job result: 256 KB; above it the job fails with `result_too_large` (spec §10.4, §4.4 HR-RD-06).
pub const MAX_JOB_RESULT_BYTES: usize = 256 * KIB;
/// Longest `clientTag`, in characters (spec §10.4).
pub const MAX_CLIENT_TAG_CHARS: usize = 120;
/// Longest cancel `reason`, in characters (spec §10.6 HR-CJ-04).
pub const MAX_CANCEL_REASON_CHARS: usize = 200;
/// Active (queued or running) jobs per user (spec §10.4 `job_quota_exceeded`).
pub const MAX_ACTIVE_JOBS_PER_USER: usize = 5;
/// Long jobs running at once per agent (spec §10.4 `long_job_capacity`, §12.2 HR-NT-06: "per agent identity, not per
/// worker process"). Here the agent is the user's slice of the fleet: of a user's active jobs, the first this many
/// in admission order may run, wherever they run; the others wait `queued` and start as those end.
pub const MAX_LONG_JOBS_PER_AGENT: usize = 3;
/// Largest stored progress event: 8 KB (spec §8.10 HR-PG-05).
pub const MAX_PROGRESS_EVENT_BYTES: usize = 8 * KIB;
/// Progress events kept per job (the ring) (spec §8.10 HR-PG-05).
pub const PROGRESS_RING_SIZE: usize = 500;
/// Progress events accepted per second per invoke (spec §8.10 HR-PG-04).
pub const PROGRESS_EVENTS_PER_SECOND: u32 = 50;
/// `tools.getJob` `limit` range and default (spec §10.7: 1–500).
pub const GET_JOB_LIMIT_MAX: u32 = 500;
/// `tools.listJobs` `limit` maximum (spec §10.8: 1–100).
pub const LIST_JOBS_LIMIT_MAX: u32 = 100;
/// `tools.listJobs` `limit` default (spec §10.8: 20).
pub const LIST_JOBS_LIMIT_DEFAULT: u32 = 20;
/// Longest `tools.listJobs` `cursor`, in characters (derived: the paging extension of §10.8; the fleet's cursors
/// are at most 33).
pub const LIST_JOBS_CURSOR_MAX_CHARS: usize = 64;
/// `tools.listJobs` `since` lookback cap, and minimum job retention: 7 days (spec §10.8 HR-LJ-01).
pub const JOB_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Jobs one user may have created within the job retention (the fleet keeps 8 days): `tools.invokeAsync` beyond it is
/// `job_quota_exceeded` with `{retained, max, retry_after_ms}` until the user's oldest jobs leave the window (derived:
/// the spec bounds a user's active jobs (§10.4) but not the rows kept for the 7-day `listJobs` lookback (§10.8
/// HR-LJ-01); without a bound one user's rows grow without limit, and refusing keeps every row its 7 days, where
/// evicting would not).
pub const MAX_RETAINED_JOBS_PER_USER: usize = 10_000;

// ---------------------------------------------------------------------------------------------------------------
// Reverse RPC budgets (spec §7.4, §8)
// ---------------------------------------------------------------------------------------------------------------

/// Largest `maxTokens` of one sampling call (spec §8.1, §7.4 `DEFAULT_SAMPLING_MAX_TOKENS_PER_CALL`).
pub const SAMPLING_MAX_TOKENS_PER_CALL: u32 = 8_192;
/// Sampling calls per invoke (spec §7.4 `DEFAULT_SAMPLING_MAX_CALLS_PER_INVOKE`).
pub const SAMPLING_MAX_CALLS_PER_INVOKE: u32 = 8;
/// Sampling tokens per invoke, from the upstream's reported usage (spec §7.4).
pub const SAMPLING_MAX_TOKENS_PER_INVOKE: u32 = 32_000;
/// Messages in one sampling call (spec §8.1).
pub const SAMPLING_MAX_MESSAGES: usize = 64;
/// Storage reverse RPCs per invoke (spec §7.4, `storage_token.max_calls`).
pub const STORAGE_MAX_CALLS_PER_INVOKE: u32 = 200;
/// Upload: largest inline decoded payload (spec §8.7 `INLINE_MAX_BYTES`).
pub const UPLOAD_INLINE_MAX_BYTES: usize = 8 * MIB;
/// Upload: default largest single file (spec §7.4, `upload_token.max_file_bytes`).
pub const UPLOAD_MAX_FILE_BYTES: usize = 20 * MIB;
/// Upload: bytes per invoke (spec §7.4, `upload_token.max_total_bytes`).
pub const UPLOAD_MAX_TOTAL_BYTES_PER_INVOKE: usize = 80 * MIB;
/// Upload: files per invoke (spec §7.4, `upload_token.max_files`).
pub const UPLOAD_MAX_FILES_PER_INVOKE: u32 = 16;
/// Embeddings: inputs per request (spec §7.4, Nexus's authoritative cap).
pub const EMBED_MAX_INPUTS: usize = 64;
/// Embeddings: characters per input (spec §7.4, Nexus's authoritative cap).
pub const EMBED_MAX_INPUT_CHARS: usize = 32_000;
/// Images per `image/generate` or `image/edit` call, the host's cap (spec §8.6: `-32106` with `data.hostCap = 8`).
pub const IMAGE_MAX_PER_CALL: u64 = 8;
/// Images per `image/generate` call a grant allows when it sets no `max_per_call` (spec §7.4
/// `max_per_call_generate`: 4).
pub const IMAGE_DEFAULT_MAX_PER_CALL_GENERATE: u32 = 4;
/// Images per `image/edit` call a grant allows when it sets no `max_per_call` (spec §7.4 `max_per_call_edit`: 1).
pub const IMAGE_DEFAULT_MAX_PER_CALL_EDIT: u32 = 1;
/// Images one invoke may get from `image/generate` and `image/edit` together when the grant sets no
/// `max_per_invoke` (spec §7.4 `image_token.max_images`, `DEFAULT_IMAGE_MAX_IMAGES`: 4; over it `-32106` with
/// `data.images`, `data.maxImages`).
pub const IMAGE_DEFAULT_MAX_PER_INVOKE: u32 = 4;
/// The window of the per-invoke image count (spec §7.4: Redis `img:invoke:{tool_invoke_id}`, 30-min TTL): an
/// invoke's count starts again 30 min after its first image.
pub const IMAGE_INVOKE_WINDOW: Duration = Duration::from_secs(30 * 60);
/// Images per user in any rolling 24 h a grant allows when it sets no `max_images_per_day` (spec §8.6: the
/// example's `images_quota: 50`).
pub const IMAGE_DEFAULT_MAX_PER_DAY: u32 = 50;
/// The window of the daily image quota (spec §8.6: "rolling 24 h, shared across grants").
pub const IMAGE_QUOTA_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// `reference_image_urls` per call at most (spec §7.4 `_MAX_REFERENCE_IMAGES`).
pub const IMAGE_MAX_REFERENCE_URLS: usize = 4;
/// Image subcall timeout without `_clientTimeoutS` (spec §7.3 `IMAGE_DEFAULT_REQUEST_TIMEOUT_S`: 180 s).
pub const IMAGE_DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(180);
/// Image subcall timeout cap, whatever `_clientTimeoutS` asks (spec §7.3 `IMAGE_MAX_REQUEST_TIMEOUT_S`: 240 s).
pub const IMAGE_MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(240);
/// Lifetime of the links `image/*` returns (spec §8.6, §16 A-33 `R2_TRANSIENT_PRESIGN_EXPIRY`: 1800 s).
pub const R2_TRANSIENT_PRESIGN_EXPIRY: Duration = Duration::from_secs(1800);
/// Frames of one buffered agent run (spec §8.2 HR-AG-01: 4 096).
pub const AGENT_MAX_FRAMES: usize = 4_096;
/// `agent/session.create`: default `ttl_seconds` (spec §8.2).
pub const AGENT_SESSION_DEFAULT_TTL: Duration = Duration::from_secs(600);
/// `agent/session.create` / `.refresh`: largest `ttl_seconds` (spec §8.2 `MAX_APP_SESSION_TTL_SECONDS`).
pub const AGENT_SESSION_MAX_TTL: Duration = Duration::from_secs(7_200);
/// Hard lifetime of an agent session, whatever its refreshes (spec §8.2 HR-AG-04: agent 24 h).
pub const AGENT_SESSION_MAX_LIFETIME: Duration = Duration::from_secs(24 * 3_600);
/// Sessions the host keeps (LRU, spec §8.2 "bounded (LRU, ~4096 entries)").
pub const AGENT_SESSION_CACHE_MAX: usize = 4_096;
/// Longest session `label` (spec §8.2: ≤ 120 chars).
pub const AGENT_LABEL_MAX_CHARS: usize = 120;
/// Longest session `system_prompt` (spec §8.2: ≤ 4 000).
pub const AGENT_SYSTEM_PROMPT_MAX_CHARS: usize = 4_000;
/// `agent/session.run`: default `recursion_limit` (spec §8.2: default 8).
pub const AGENT_DEFAULT_RECURSION_LIMIT: u32 = 8;
/// `agent/session.run`: largest `recursion_limit` (spec §8.2: `1 ≤ n ≤ 32`).
pub const AGENT_MAX_RECURSION_LIMIT: u32 = 32;
/// `agent/session.run`: most image attachments (spec §8.2: images ≤ 6).
pub const AGENT_MAX_ATTACHMENTS: usize = 6;
/// `agent/session.run`: largest attachment (spec §8.2: ≤ 20 MB each, read as MiB), as the attachment states it
/// (`size_bytes` or `size`) or as its inline `data:` URL carries it.
pub const AGENT_MAX_ATTACHMENT_BYTES: u64 = 20 * 1024 * 1024;
/// `agent/session.history`: `limit` range (spec §8.2: 1..200).
pub const AGENT_HISTORY_MAX_LIMIT: u64 = 200;
/// `agent/session.list`: default `limit` (spec §8.2: 50).
pub const AGENT_LIST_DEFAULT_LIMIT: u64 = 50;
/// `agent/complete`: `maxTokens` when the plugin sends none (ours: the spec makes it optional, names no default).
pub const AGENT_COMPLETE_DEFAULT_MAX_TOKENS: u32 = 1_024;
/// `max_tokens` of each chat step of an agent run (ours), also what a step is charged when the upstream reports
/// no usage.
pub const AGENT_STEP_MAX_TOKENS: u32 = 2_048;
/// Messages an agent session remembers (ours; the oldest are dropped).
pub const AGENT_SESSION_MAX_MESSAGES: usize = 200;
/// Tools offered to the upstream in one run (the OpenAI API's limit).
pub const AGENT_MAX_TOOLS: usize = 128;
/// Longest entry of a session's `quota_caps.allowed_tools` (a tool id, `tool_id.tool` or `*`; not a spec number:
/// the fleet keeps sessions in JetStream KV, whose records are bounded).
pub const AGENT_TOOL_PATTERN_MAX_BYTES: usize = 256;
/// Longest OpenAI function name (`^[a-zA-Z0-9_-]{1,64}$`).
pub const AGENT_TOOL_NAME_MAX_CHARS: usize = 64;
/// Longest wait of one delegated tool call: the sync invoke ceiling (spec §10.3: 90 s), cut to the parent's time.
pub const AGENT_TOOL_CALL_MAX_MS: u64 = 90_000;
/// Largest tool result handed back to the model (ours; the frame carries it whole).
pub const AGENT_TOOL_RESULT_MAX_BYTES: usize = 64 * KIB;
/// Depth of delegated tool calls: an agent session's tool call (depth 1) may itself run a session whose tool
/// calls are depth 2; deeper is refused (ours: the spec names no cap).
pub const AGENT_DELEGATION_MAX_DEPTH: u32 = 2;
/// Sampling: the model budget derived from `_clientTimeoutS` is clamped to at least this (spec §7.3 HR-DL-01).
pub const SAMPLING_MODEL_BUDGET_MIN: Duration = Duration::from_secs(30);
/// Sampling: the model budget derived from `_clientTimeoutS` is clamped to at most this (spec §7.3 HR-DL-01).
pub const SAMPLING_MODEL_BUDGET_MAX: Duration = Duration::from_secs(300);
/// Sampling: `temperature` the host substitutes when the plugin sends none (spec §8.1).
pub const SAMPLING_DEFAULT_TEMPERATURE: f64 = 0.7;
/// Sampling: largest serialized `responseFormat` JSON schema, 32 KB (spec §8.1 schema hard limits).
pub const SAMPLING_SCHEMA_MAX_BYTES: usize = 32 * KIB;
/// Sampling: deepest nesting of a `responseFormat` JSON schema (spec §8.1 schema hard limits).
pub const SAMPLING_SCHEMA_MAX_DEPTH: usize = 8;
/// Sampling: most nodes (objects + arrays + leaves) of a `responseFormat` JSON schema (spec §8.1).
pub const SAMPLING_SCHEMA_MAX_NODES: usize = 512;
/// Sampling: longest `json_schema.name`, which must match `^[a-zA-Z0-9_-]{1,64}$` (spec §8.1).
pub const SAMPLING_SCHEMA_NAME_MAX_CHARS: usize = 64;
/// Embeddings: timeout of the upstream HTTP call (spec §8.5 HR-EM-01 `EMBED_REQUEST_TIMEOUT`).
pub const EMBED_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------------------------
// APS storage and files, host uploads (spec §8.3, §8.4, §8.7, §16)
// ---------------------------------------------------------------------------------------------------------------

/// Longest `storage/*` key and list prefix, in characters (spec §8.3 HR-ST-04 `validate_kv_key`).
pub const STORAGE_KEY_MAX_CHARS: usize = 1024;
/// Largest KV value, canonical UTF-8 JSON (spec §8.3 HR-ST-04, §16 A-23: 256 KB) → `-32025`.
pub const STORAGE_VALUE_MAX_BYTES: usize = 256 * KIB;
/// Largest `storage/set` `ttl_seconds` (spec §8.3 HR-ST-04: 1..31 536 000).
pub const STORAGE_TTL_MAX_SECONDS: u64 = 31_536_000;
/// Tags per `storage/set` (spec §8.3: `tags?` ≤ 32).
pub const STORAGE_TAGS_MAX: usize = 32;
/// `storage/list` and `files/list` `limit` default (spec §8.3).
pub const STORAGE_LIST_LIMIT_DEFAULT: usize = 100;
/// `storage/list` and `files/list` `limit` maximum (spec §8.3: 1..1000).
pub const STORAGE_LIST_LIMIT_MAX: usize = 1000;
/// Per-user storage quota, KV values and files together (spec §8.4 `-32024`: "default 5 GB per user").
pub const STORAGE_QUOTA_DEFAULT_BYTES: u64 = 5 * 1024 * 1024 * 1024;
/// Time one storage call may take (spec §7.3 HR-DL-01: "storage HTTP 15 s").
pub const STORAGE_REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest `files/*` path, in characters (spec §8.4 HR-FI-02 `validate_path`).
pub const FILES_PATH_MAX_CHARS: usize = 1024;
/// Largest APS file (spec §8.4 `OBJECT_MAX_BYTES = 256 * 1024 * 1024`) → `-32025`.
pub const FILES_OBJECT_MAX_BYTES: u64 = 256 * 1024 * 1024;
/// Longest `files/upload_begin` `content_type` (spec §8.4: ≤ 120).
pub const FILES_CONTENT_TYPE_MAX_CHARS: usize = 120;
/// `files/upload_begin` presigned PUT lifetime (spec §8.4: soft reservation `ttl_seconds=600`).
pub const FILES_UPLOAD_TTL: Duration = Duration::from_secs(600);
/// Uploads one user may have begun and not completed at once, `files/upload_begin` and `host/uploadFile`
/// `negotiate` together (ours; each holds its bytes of the user's quota until it completes or expires) → `-32024` /
/// `-32202` past it.
pub const PENDING_UPLOADS_MAX_PER_USER: usize = 32;
/// `files/download_url` default link lifetime (spec §8.4, §16 A-26: `ttl` default 300).
pub const FILES_DOWNLOAD_TTL_DEFAULT: Duration = Duration::from_secs(300);
/// `files/download_url` longest link lifetime (spec §8.4, §16 A-26: `ttl` 1..3600).
pub const FILES_DOWNLOAD_TTL_MAX: Duration = Duration::from_secs(3600);
/// `host/uploadFile` negotiate PUT URL lifetime (spec §8.7 `DEFAULT_PRESIGN_PUT_EXPIRY`: 300 s).
pub const UPLOAD_PUT_URL_TTL: Duration = Duration::from_secs(300);
/// `host/uploadFile` download URL lifetime (spec §8.7 `R2_TRANSIENT_PRESIGN_EXPIRY`, §16 A-33: 1800 s).
pub const UPLOAD_GET_URL_TTL: Duration = Duration::from_secs(1800);
/// `host/uploadFile` channel cap (spec §7.3 `UPLOAD_MAX_REQUEST_TIMEOUT_S`: 300 s).
pub const UPLOAD_REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------------------------------
// Web (spec §8.9, §7.4, §17.1)
// ---------------------------------------------------------------------------------------------------------------

/// `web/fetch`: characters of extracted content per page; `max_chars` is clamped to it (spec §8.9, §7.4).
pub const WEB_FETCH_MAX_CHARS_PER_PAGE: usize = 8_000;
/// `web/fetch`: bytes read of one page's body; a longer body stops being read and the page is `TOO_LARGE`
/// (spec §8.9 "256 KB/response").
pub const WEB_FETCH_MAX_BODY_BYTES: usize = 256 * KIB;
/// `web/fetch`: bytes of content in one answer, summed over its pages in order; pages past it are
/// `RESPONSE_BUDGET_EXCEEDED` (spec §7.4 "256 KB/response … `RESPONSE_BUDGET_EXCEEDED`").
pub const WEB_FETCH_RESPONSE_BUDGET_BYTES: usize = 256 * KIB;
/// `web/fetch`: URLs per call, at least 1 (spec §8.9, §17.1).
pub const WEB_FETCH_MAX_URLS: usize = 10;
/// `web/fetch`, `web/image_fetch`: redirects followed, each re-checked (spec §8.9, §17.1).
pub const WEB_MAX_REDIRECTS: usize = 5;
/// The only ports a fetch may connect to (spec §8.9 SSRF policy).
pub const WEB_FETCH_PORTS: [u16; 4] = [80, 443, 8080, 8443];
/// `web_grant.maxResultsPerCall` default and cap of `web/search` (spec §8.9).
pub const WEB_MAX_RESULTS_PER_CALL: usize = 10;
/// `web/image_search` `max_results` default (spec §8.9, the app-side twin: 8, cap 50; capped here by
/// [`WEB_MAX_RESULTS_PER_CALL`] as well).
pub const WEB_IMAGE_SEARCH_DEFAULT_RESULTS: usize = 8;
/// `web/image_fetch` `max_bytes` default (spec §8.9, the app-side twin: 5 MiB).
pub const WEB_IMAGE_FETCH_DEFAULT_BYTES: usize = 5 * MIB;
/// `web/image_fetch` `max_bytes` cap (spec §8.9, the app-side twin: 20 MiB).
pub const WEB_IMAGE_FETCH_MAX_BYTES: usize = 20 * MIB;
/// Longest a `web/*` call may take when neither `_clientTimeoutS` nor the invoke's deadline is shorter (derived:
/// the SDK web namespace's default, spec §8.9 "SDK web-namespace default is 60s").
pub const WEB_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Per-page timeout of `web/fetch` when `timeout_ms` is absent (derived; bounded by [`WEB_REQUEST_TIMEOUT`]).
pub const WEB_FETCH_DEFAULT_PAGE_TIMEOUT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------------------------
// Tokens (spec §11)
// ---------------------------------------------------------------------------------------------------------------

/// TTL of the per-invoke `sampling_token`, `storage_token` and `upload_token` (spec §11).
pub const INVOKE_TOKEN_TTL: Duration = Duration::from_secs(600);
/// Upper bound of a long job's token TTL: `min(job_timeout + 5 min, 1 h)` (spec §11 HR-JW-02).
pub const LONG_JOB_TOKEN_TTL_CAP: Duration = Duration::from_secs(3600);
/// Slack added to a long job's timeout for its token TTL (spec §11 HR-JW-02).
pub const LONG_JOB_TOKEN_TTL_SLACK: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------------------------------
// Animus (seed 004; `../shared/spec/animus.md` §1.3, §3.2, §3.4, §3.6)
// ---------------------------------------------------------------------------------------------------------------

/// Time a plugin gets to answer `initialize` (the CLI host allows 30 s; a dialect with liveness checks gets 10 s).
pub const ANIMUS_INITIALIZE_TIMEOUT: Duration = Duration::from_secs(10);
/// `$/ping` answer timeout (spec §6: "Hosts SHOULD impose a short timeout (≤ 1s)").
pub const ANIMUS_PING_TIMEOUT: Duration = Duration::from_secs(1);
/// Default period between pings of a live Animus process (per install: `ping_interval_secs`).
pub const ANIMUS_PING_INTERVAL: Duration = Duration::from_secs(10);
/// Consecutive ping misses after which the process is recycled ("repeated misses", spec §3.7: 3).
pub const ANIMUS_PING_MAX_MISSES: u32 = 3;
/// `health/check` answer timeout (the CLI host's 2 s).
pub const ANIMUS_HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// `agent/cancel` answer timeout (spec §3.4 step 2: 10 s).
pub const ANIMUS_AGENT_CANCEL_TIMEOUT: Duration = Duration::from_secs(10);
/// Grace for the run to end after the cancel notifications (spec §3.4 step 3: 5 s).
pub const ANIMUS_CANCEL_GRACE: Duration = Duration::from_secs(5);
/// `shutdown` answer timeout before `exit` is sent anyway (spec §3.4 step 4, §3.6: 2 s).
pub const ANIMUS_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
/// `--manifest` probe: time allowed (spec §3.2: 3 s).
pub const ANIMUS_MANIFEST_PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// `--manifest` probe: stdout kept (spec §3.2: 1 MiB); more is a failed probe.
pub const ANIMUS_MANIFEST_PROBE_MAX_BYTES: usize = MIB;
