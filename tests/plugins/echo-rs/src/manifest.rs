//! The `describe` manifest of the fixture plugin, in every shape `--describe-mode` can ask for.

use serde_json::{Value, json};

use crate::cli::{Config, DescribeMode};

/// The names of every tool the fixture serves, in manifest order.
#[cfg(test)]
pub(crate) const TOOL_NAMES: &[&str] = &[
    "echo",
    "inspect",
    "sleep",
    "timed_sleep",
    "progress",
    "big_result",
    "fail",
    "rpc_error",
    "crash",
    "junk",
    "flood",
    "stderr",
    "ignore_shutdown",
    "spawn_grandchild",
    "alloc",
    "fork",
    "spin",
    "reverse_rpc",
    "write_file",
    "read_file",
    "exit_after",
    "fill",
];

fn p(name: &str, ty: &str, description: &str, required: bool, default: Option<Value>) -> Value {
    let mut v = json!({ "name": name, "type": ty, "description": description, "required": required });
    if let (Some(d), Some(obj)) = (default, v.as_object_mut()) {
        obj.insert("default".to_owned(), d);
    }
    v
}

fn tool(name: &str, description: &str, parameters: &[Value]) -> Value {
    json!({ "name": name, "description": description, "parameters": parameters })
}

/// The bare manifest (what `--describe-mode normal` returns).
pub(crate) fn manifest(cfg: &Config) -> Value {
    let mut timed_sleep = tool(
        "timed_sleep",
        "Like sleep, but declares a per-tool timeout (seconds, --tool-timeout-s).",
        &[p("ms", "integer", "Milliseconds to sleep.", true, None)],
    );
    if let Some(obj) = timed_sleep.as_object_mut() {
        obj.insert("timeout".to_owned(), json!(cfg.tool_timeout_s));
    }
    let tools = vec![
        tool(
            "echo",
            "Returns its arguments verbatim as data.arguments (any arguments are accepted).",
            &[
                p("message", "string", "Free text.", false, None),
                p("payload", "object", "Free JSON.", false, None),
            ],
        ),
        tool(
            "inspect",
            "Returns pid, ppid, pgid, sid, uid, gid, groups, cwd, env, the invoke context, and how many \
             initialize / describe requests the process has received (initialize_calls, describe_calls).",
            &[],
        ),
        tool(
            "sleep",
            "Sleeps then returns slept_ms.",
            &[p("ms", "integer", "Milliseconds to sleep.", true, None)],
        ),
        timed_sleep,
        tool(
            "progress",
            "Emits `count` executa/progress notifications, then returns emitted.",
            &[
                p("count", "integer", "Number of notifications.", true, None),
                p(
                    "interval_ms",
                    "integer",
                    "Pause between notifications.",
                    false,
                    Some(json!(0)),
                ),
                p(
                    "type",
                    "string",
                    "params.type of each notification.",
                    false,
                    Some(json!("progress")),
                ),
                p(
                    "pad_bytes",
                    "integer",
                    "Length of data.pad.",
                    false,
                    Some(json!(0)),
                ),
                p("invoke_id", "string", "Overrides context.invoke_id.", false, None),
                p(
                    "omit_invoke_id",
                    "boolean",
                    "Sends no context.invoke_id.",
                    false,
                    Some(json!(false)),
                ),
            ],
        ),
        tool(
            "big_result",
            "Returns a blob of `bytes` x's, inline or through __file_transport.",
            &[
                p("bytes", "integer", "Length of data.blob.", true, None),
                p(
                    "via_file",
                    "boolean",
                    "Use __file_transport.",
                    false,
                    Some(json!(false)),
                ),
                p(
                    "file_path",
                    "string",
                    "Where to write the response file.",
                    false,
                    None,
                ),
                p(
                    "pointer_only",
                    "boolean",
                    "Send only the pointer to file_path, writing nothing (the host's checks of what is there).",
                    false,
                    Some(json!(false)),
                ),
            ],
        ),
        tool(
            "fail",
            "Returns success:false with the message.",
            &[p(
                "message",
                "string",
                "The error.",
                false,
                Some(json!("fixture failure")),
            )],
        ),
        tool(
            "rpc_error",
            "Answers with a JSON-RPC error object.",
            &[
                p("code", "integer", "error.code", false, Some(json!(-32000))),
                p(
                    "message",
                    "string",
                    "error.message",
                    false,
                    Some(json!("fixture error")),
                ),
                p("data", "object", "error.data", false, None),
            ],
        ),
        tool(
            "crash",
            "Exits the whole process at once, without answering.",
            &[
                p("exit_code", "integer", "Exit status.", false, Some(json!(101))),
                p(
                    "abort",
                    "boolean",
                    "Abort (SIGABRT) instead of exiting.",
                    false,
                    Some(json!(false)),
                ),
            ],
        ),
        tool(
            "junk",
            "Writes `lines` junk lines to stdout (non-JSON, array, object without jsonrpc, empty, \
             invalid UTF-8, cycling), then answers.",
            &[p(
                "lines",
                "integer",
                "Number of junk lines.",
                false,
                Some(json!(3)),
            )],
        ),
        tool(
            "flood",
            "Writes junk lines to stdout and/or stderr and/or unanswerable reverse-RPC requests, then answers.",
            &[
                p(
                    "stdout_bytes",
                    "integer",
                    "Bytes of junk on stdout.",
                    false,
                    Some(json!(0)),
                ),
                p(
                    "stderr_bytes",
                    "integer",
                    "Bytes of junk on stderr.",
                    false,
                    Some(json!(0)),
                ),
                p(
                    "line_bytes",
                    "integer",
                    "Bytes per junk line (newline included).",
                    false,
                    Some(json!(4096)),
                ),
                p(
                    "requests",
                    "integer",
                    "Reverse-RPC requests of an unknown method to write (their answers are not awaited).",
                    false,
                    Some(json!(0)),
                ),
                p(
                    "id_bytes",
                    "integer",
                    "Bytes of padding in each such request's id (the host echoes it in its answer).",
                    false,
                    Some(json!(0)),
                ),
                p(
                    "stop_reading",
                    "boolean",
                    "Stop reading stdin first (the reader parks after the next line).",
                    false,
                    Some(json!(false)),
                ),
            ],
        ),
        tool(
            "stderr",
            "Writes text lines to stderr, then answers.",
            &[
                p("text", "string", "The line.", true, None),
                p("repeat", "integer", "How many times.", false, Some(json!(1))),
            ],
        ),
        tool(
            "ignore_shutdown",
            "From now on keep running after stdin EOF and/or ignore SIGTERM.",
            &[
                p("eof", "boolean", "Survive stdin EOF.", false, Some(json!(true))),
                p("sigterm", "boolean", "Ignore SIGTERM.", false, Some(json!(true))),
            ],
        ),
        tool(
            "spawn_grandchild",
            "Spawns a child that sleeps forever; returns its pid.",
            &[],
        ),
        tool(
            "alloc",
            "Allocates and touches `mib` MiB, holds it, frees it.",
            &[
                p("mib", "integer", "MiB to allocate.", true, None),
                p(
                    "hold_ms",
                    "integer",
                    "How long to hold it.",
                    false,
                    Some(json!(0)),
                ),
            ],
        ),
        tool(
            "fork",
            "Spawns `count` sleeping children; returns spawned, errors, first_error.",
            &[
                p("count", "integer", "Children to spawn.", true, None),
                p(
                    "hold_ms",
                    "integer",
                    "How long each child sleeps.",
                    false,
                    Some(json!(60000)),
                ),
            ],
        ),
        tool(
            "spin",
            "Busy-loops on `threads` threads for `ms` ms.",
            &[
                p("ms", "integer", "Wall-clock milliseconds.", true, None),
                p("threads", "integer", "Busy threads.", false, Some(json!(1))),
            ],
        ),
        tool(
            "reverse_rpc",
            "Sends a reverse-RPC request to the host and returns its response.",
            &[
                p(
                    "method",
                    "string",
                    "Reverse-RPC method, e.g. storage/get.",
                    true,
                    None,
                ),
                p(
                    "params",
                    "object",
                    "Its params (context.invoke_id is added).",
                    false,
                    Some(json!({})),
                ),
                p(
                    "omit_invoke_id",
                    "boolean",
                    "Sends no context.invoke_id.",
                    false,
                    Some(json!(false)),
                ),
                p("invoke_id", "string", "Overrides context.invoke_id.", false, None),
                p(
                    "timeout_ms",
                    "integer",
                    "How long to wait for the answer.",
                    false,
                    Some(json!(10000)),
                ),
                p(
                    "count",
                    "integer",
                    "Requests written at once; above 1 every answer is awaited and returned (responses).",
                    false,
                    Some(json!(1)),
                ),
                p(
                    "frame_bytes",
                    "integer",
                    "Pads each request (params.pad) to exactly this many bytes of line; answers as count does.",
                    false,
                    Some(json!(0)),
                ),
            ],
        ),
        tool(
            "write_file",
            "Writes `content` to `path`; returns written (bytes). An I/O error gives success:false with the OS \
             error text.",
            &[
                p(
                    "path",
                    "string",
                    "Absolute, or relative to the plugin's cwd.",
                    true,
                    None,
                ),
                p("content", "string", "The text to write.", true, None),
            ],
        ),
        tool(
            "read_file",
            "Returns content (lossy UTF-8) of `path`. An I/O error gives success:false with the OS error text.",
            &[p(
                "path",
                "string",
                "Absolute, or relative to the plugin's cwd.",
                true,
                None,
            )],
        ),
        tool(
            "exit_after",
            "Answers scheduled:true at once, then exits the whole process with `code` after `ms` ms.",
            &[
                p("ms", "integer", "Delay before exiting.", true, None),
                p("code", "integer", "Exit status.", false, Some(json!(0))),
            ],
        ),
        tool(
            "fill",
            "Writes `mib` MiB of zeros to `name` in its TMPDIR (or, with `workspace`, `ANNA_WORKSPACE_DIR`), 1 MiB at a time, and \
             keeps the file; returns written (bytes) and errno (the OS error that stopped it, else null).",
            &[
                p("name", "string", "The file's name.", true, None),
                p("mib", "integer", "MiB to write.", true, None),
                p(
                    "workspace",
                    "boolean",
                    "Write in the cwd (the workspace) instead of TMPDIR.",
                    false,
                    Some(json!(false)),
                ),
            ],
        ),
    ];
    json!({
        "name": "echo",
        "display_name": "Echo fixture",
        "version": "0.1.0",
        "description": "Fixture Executa plugin of the Cloud Agents tests; behaviour is chosen by arguments.",
        "host_capabilities": cfg.host_capabilities,
        "tools": tools,
        "credentials": [
            { "name": "ECHO_API_KEY", "required": false, "sensitive": true }
        ],
    })
}

/// The `describe` result for the configured `--describe-mode`.
pub(crate) fn describe_result(cfg: &Config) -> Value {
    let mut m = manifest(cfg);
    match cfg.describe_mode {
        DescribeMode::Normal => m,
        DescribeMode::Wrapped => json!({ "manifest": m }),
        DescribeMode::OmitName => {
            if let Some(obj) = m.as_object_mut() {
                obj.remove("name");
            }
            m
        }
        DescribeMode::Invalid => {
            if let Some(obj) = m.as_object_mut() {
                obj.insert("tools".to_owned(), json!("not-a-list"));
            }
            m
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_lists_every_tool_in_order() {
        let m = manifest(&Config::default());
        let names: Vec<&str> = m["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, TOOL_NAMES);
        let timed = &m["tools"][3];
        assert_eq!(timed["timeout"], 1);
    }
}
