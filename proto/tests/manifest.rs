//! `Manifest::from_value`, the `describe` validator: the public example shapes load, every invalid shape is
//! refused with the exact set of error paths, and the derived views (`input_schema`, `timeout`, defaults) are
//! exact.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use fleet_proto::executa::manifest::{Manifest, ManifestError, ParamType, Problem, Severity, Validated};
use serde_json::{Map, Value, json};

// -------------------------------------------------------------------------------------------------------------
// Helpers
// -------------------------------------------------------------------------------------------------------------

/// The spec's `describe` example, verbatim.
fn spec_example() -> Value {
    json!({
        "name": "my-tool",
        "display_name": "My Tool",
        "version": "1.0.0",
        "description": "What this plugin does.",
        "author": "Your Name",
        "homepage": "https://example.com/my-tool",
        "icon": "🔧",
        "category": "productivity",
        "license": "MIT",
        "tools": [{
            "name": "do_something",
            "description": "Description shown to the LLM.",
            "timeout": 60,
            "streaming": false,
            "parameters": [
                {"name": "input_text", "type": "string", "description": "Input.", "required": true},
                {"name": "count", "type": "integer", "description": "Repeat count.", "required": false, "default": 1},
                {"name": "tags", "type": "array", "items": {"type": "string"}, "description": "Tag list.", "required": false}
            ]
        }],
        "credentials": [{
            "name": "MY_API_KEY",
            "display_name": "My API Key",
            "description": "Get one at https://example.com/keys",
            "required": true,
            "sensitive": true
        }],
        "runtime": {"type": "uv", "min_version": "0.1.0"}
    })
}

/// A manifest whose only tool is `tool`; no other warnings.
fn with_tool(tool: Value) -> Value {
    with_tools(Value::Array(vec![tool]))
}

/// A manifest with `tools` as given; version and description present so they add no warnings.
fn with_tools(tools: Value) -> Value {
    let mut m = json!({"name": "p", "version": "1.0.0", "description": "d"});
    m["tools"] = tools;
    m
}

/// A manifest with one tool `t` whose parameters are `params`.
fn with_params(params: Value) -> Value {
    let mut t = json!({"name": "t", "description": "x"});
    t["parameters"] = params;
    with_tool(t)
}

/// Loads a manifest that must be accepted.
fn load(v: &Value) -> Validated {
    match Manifest::from_value(v) {
        Ok(m) => m,
        Err(e) => panic!("expected the manifest to load, got {e}"),
    }
}

/// Validates a manifest that must be refused.
fn refuse(v: &Value) -> ManifestError {
    match Manifest::from_value(v) {
        Ok(m) => panic!("expected the manifest to be refused, it loaded: {m:?}"),
        Err(e) => e,
    }
}

/// The sorted error paths of a refused manifest.
fn error_paths(v: &Value) -> Vec<String> {
    let e = refuse(v);
    let mut paths: Vec<String> = e.errors().map(|p| p.path.clone()).collect();
    paths.sort();
    paths
}

/// The single error of a refused manifest; fails if there is not exactly one.
fn single_error(v: &Value) -> Problem {
    let e = refuse(v);
    let errors: Vec<&Problem> = e.errors().collect();
    assert_eq!(errors.len(), 1, "expected exactly one error, got {errors:?}");
    errors[0].clone()
}

/// The sorted warning paths of a loaded manifest.
fn warning_paths(v: &Validated) -> Vec<&str> {
    assert!(
        v.warnings.iter().all(|w| w.severity == Severity::Warning),
        "a loaded manifest carries only warnings: {:?}",
        v.warnings
    );
    let mut paths: Vec<&str> = v.warnings.iter().map(|w| w.path.as_str()).collect();
    paths.sort_unstable();
    paths
}

fn sorted(paths: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = paths.iter().map(ToString::to_string).collect();
    v.sort();
    v
}

// -------------------------------------------------------------------------------------------------------------
// Public example shapes load
// -------------------------------------------------------------------------------------------------------------

#[test]
fn spec_example_loads_without_problems() {
    let v = load(&spec_example());
    assert_eq!(v.warnings, Vec::<Problem>::new());
    let m = &v.manifest;
    assert_eq!(m.name.as_deref(), Some("my-tool"));
    assert_eq!(m.display_name.as_deref(), Some("My Tool"));
    assert_eq!(m.version.as_deref(), Some("1.0.0"));
    assert_eq!(m.description.as_deref(), Some("What this plugin does."));
    assert_eq!(m.runtime, Some(json!({"type": "uv", "min_version": "0.1.0"})));
    assert_eq!(m.host_capabilities, Vec::<String>::new());

    // Unmodelled top-level members are kept verbatim.
    let mut extra = Map::new();
    extra.insert("author".into(), json!("Your Name"));
    extra.insert("homepage".into(), json!("https://example.com/my-tool"));
    extra.insert("icon".into(), json!("🔧"));
    extra.insert("category".into(), json!("productivity"));
    extra.insert("license".into(), json!("MIT"));
    assert_eq!(m.extra, extra);

    assert_eq!(m.tools.len(), 1);
    let t = &m.tools[0];
    assert_eq!(t.name, "do_something");
    assert_eq!(t.description, "Description shown to the LLM.");
    assert_eq!(t.timeout, Some(60.0));
    assert_eq!(t.timeout(), Duration::from_secs(60));
    assert!(!t.streaming);
    assert!(!t.multi_account);
    assert_eq!(t.extra, Map::new());

    let names: Vec<&str> = t.parameters.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["input_text", "count", "tags"]);
    let p = &t.parameters;
    assert_eq!(p[0].param_type, ParamType::String);
    assert!(p[0].required);
    assert_eq!(p[0].default, None);
    assert_eq!(p[1].param_type, ParamType::Integer);
    assert!(!p[1].required);
    assert_eq!(p[1].default, Some(json!(1)));
    assert_eq!(p[2].param_type, ParamType::Array);
    assert!(!p[2].required);
    assert_eq!(p[2].items, Some(json!({"type": "string"})));
    assert_eq!(p[2].items_type, None);

    assert_eq!(m.credentials.len(), 1);
    let c = &m.credentials[0];
    assert_eq!(c.name, "MY_API_KEY");
    assert_eq!(c.display_name.as_deref(), Some("My API Key"));
    assert_eq!(
        c.description.as_deref(),
        Some("Get one at https://example.com/keys")
    );
    assert!(c.required);
    assert!(c.sensitive);
    assert_eq!(c.default, None);
}

#[test]
fn spec_example_input_schema_is_exact() {
    let v = load(&spec_example());
    let t = v.manifest.tool("do_something").unwrap();
    assert_eq!(
        t.input_schema(),
        json!({
            "type": "object",
            "properties": {
                "input_text": {"type": "string", "description": "Input."},
                "count": {"type": "integer", "description": "Repeat count.", "default": 1},
                "tags": {"type": "array", "description": "Tag list.", "items": {"type": "string"}}
            },
            "required": ["input_text"]
        })
    );
}

#[test]
fn manifest_without_name_loads_with_no_problem_at_name() {
    let v = load(&json!({
        "version": "0.2.0",
        "description": "Newer examples omit the name.",
        "tools": [{"name": "echo", "description": "Echo.", "parameters": [{"name": "text", "type": "string"}]}]
    }));
    assert_eq!(v.manifest.name, None);
    assert_eq!(v.manifest.display_name, None);
    assert!(v.warnings.iter().all(|w| w.path != "$.name"), "{:?}", v.warnings);
    assert_eq!(v.warnings, Vec::<Problem>::new());
    assert_eq!(v.manifest.tools[0].name, "echo");
}

#[test]
fn items_type_and_items_object_both_define_array_items() {
    let v = load(&with_params(json!([
        {"name": "ids", "type": "array", "items_type": "integer"},
        {"name": "tags", "type": "array", "items": {"type": "string"}},
        {"name": "both", "type": "array", "items": {"type": "number"}, "items_type": "boolean"}
    ])));
    assert_eq!(v.warnings, Vec::<Problem>::new());
    let p = &v.manifest.tools[0].parameters;
    assert_eq!(p[0].items_type, Some(ParamType::Integer));
    assert_eq!(p[0].items, None);
    assert_eq!(
        p[0].json_schema(),
        json!({"type": "array", "items": {"type": "integer"}})
    );
    assert_eq!(p[1].items, Some(json!({"type": "string"})));
    assert_eq!(
        p[1].json_schema(),
        json!({"type": "array", "items": {"type": "string"}})
    );
    // `items` (an object) wins over `items_type`.
    assert_eq!(
        p[2].json_schema(),
        json!({"type": "array", "items": {"type": "number"}})
    );
}

#[test]
fn defaults_and_required_flags() {
    let v = load(&with_params(json!([
        {"name": "implicit", "type": "string"},
        {"name": "explicit", "type": "string", "required": true},
        {"name": "opt_num", "type": "number", "required": false, "default": 0.5},
        {"name": "opt_bool", "type": "boolean", "required": false, "default": false},
        {"name": "opt_obj", "type": "object", "required": false, "default": {"k": [1]}},
        {"name": "opt_arr", "type": "array", "items_type": "string", "required": false, "default": ["a"]},
        {"name": "opt_int", "type": "integer", "required": false, "default": -3},
        {"name": "opt_null", "type": "string", "required": false, "default": null}
    ])));
    assert_eq!(v.warnings, Vec::<Problem>::new());
    let t = &v.manifest.tools[0];
    let required: Vec<(&str, bool)> = t
        .parameters
        .iter()
        .map(|p| (p.name.as_str(), p.required))
        .collect();
    assert_eq!(
        required,
        [
            ("implicit", true),
            ("explicit", true),
            ("opt_num", false),
            ("opt_bool", false),
            ("opt_obj", false),
            ("opt_arr", false),
            ("opt_int", false),
            ("opt_null", false),
        ]
    );
    let defaults: Vec<Option<Value>> = t.parameters.iter().map(|p| p.default.clone()).collect();
    assert_eq!(
        defaults,
        [
            None,
            None,
            Some(json!(0.5)),
            Some(json!(false)),
            Some(json!({"k": [1]})),
            Some(json!(["a"])),
            Some(json!(-3)),
            None,
        ]
    );
    assert_eq!(t.input_schema()["required"], json!(["implicit", "explicit"]));
}

#[test]
fn host_capabilities_keep_known_and_drop_unknown_with_warning() {
    let mut m = spec_example();
    m["host_capabilities"] = json!(["llm.sample", "storage", "aps.kv", "host.upload", "llm.samples"]);
    let v = load(&m);
    assert_eq!(
        v.manifest.host_capabilities,
        ["llm.sample", "aps.kv", "host.upload"]
    );
    assert_eq!(
        warning_paths(&v),
        ["$.host_capabilities[1]", "$.host_capabilities[4]"]
    );
    assert!(
        v.warnings[0].message.contains("\"storage\""),
        "{}",
        v.warnings[0].message
    );
    assert!(v.manifest.declares("llm.sample"));
    assert!(v.manifest.declares("aps.kv"));
    assert!(v.manifest.declares("host.upload"));
    assert!(!v.manifest.declares("storage"));
    assert!(!v.manifest.declares("llm.samples"));
    assert!(!v.manifest.declares("llm.embed"));
}

#[test]
fn input_schema_on_a_tool_is_a_warning() {
    let v = load(&with_tool(json!({
        "name": "t",
        "description": "x",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}
    })));
    assert_eq!(warning_paths(&v), ["$.tools[0].input_schema"]);
    let t = &v.manifest.tools[0];
    assert_eq!(t.parameters, Vec::new());
    // The declared `input_schema` is ignored: the schema comes from `parameters`.
    assert_eq!(
        t.input_schema(),
        json!({"type": "object", "properties": {}, "required": []})
    );
}

#[test]
fn array_without_items_warns_and_defaults_to_strings() {
    let v = load(&with_params(json!([
        {"name": "q", "type": "string"},
        {"name": "list", "type": "array", "description": "Things."}
    ])));
    assert_eq!(warning_paths(&v), ["$.tools[0].parameters[1].items"]);
    let p = &v.manifest.tools[0].parameters[1];
    assert_eq!(
        p.json_schema(),
        json!({"type": "array", "description": "Things.", "items": {"type": "string"}})
    );
    assert_eq!(p.json_schema()["items"], json!({"type": "string"}));
}

#[test]
fn other_warnings_do_not_stop_loading() {
    let v = load(&json!({
        "tools": [{
            "name": "t",
            "parameters": [
                {"name": "untyped"},
                {"name": "n", "type": "integer", "items_type": "string"}
            ]
        }]
    }));
    assert_eq!(
        warning_paths(&v),
        [
            "$.description",
            "$.tools[0].description",
            "$.tools[0].parameters[0].type",
            "$.tools[0].parameters[1].items",
            "$.version",
        ]
    );
    let t = &v.manifest.tools[0];
    assert_eq!(t.description, "");
    assert_eq!(t.parameters[0].param_type, ParamType::String);
    // items on a non-array are ignored by the schema.
    assert_eq!(t.parameters[1].json_schema(), json!({"type": "integer"}));
}

#[test]
fn extras_on_tools_are_kept() {
    let v = load(&with_tool(json!({
        "name": "t",
        "description": "x",
        "multi_account": true,
        "streaming": true,
        "x_vendor": {"a": 1}
    })));
    let t = &v.manifest.tools[0];
    assert!(t.multi_account);
    assert!(t.streaming);
    let mut extra = Map::new();
    extra.insert("x_vendor".into(), json!({"a": 1}));
    assert_eq!(t.extra, extra);
}

// -------------------------------------------------------------------------------------------------------------
// ToolDefinition helpers, Manifest::tool / declares
// -------------------------------------------------------------------------------------------------------------

#[test]
fn tool_timeout_is_declared_seconds_or_sixty() {
    let v = load(&with_tools(json!([
        {"name": "none", "description": "x"},
        {"name": "int", "description": "x", "timeout": 300},
        {"name": "frac", "description": "x", "timeout": 2.5},
        {"name": "tiny", "description": "x", "timeout": 0.001}
    ])));
    let m = &v.manifest;
    assert_eq!(m.tool("none").unwrap().timeout, None);
    assert_eq!(m.tool("none").unwrap().timeout(), Duration::from_secs(60));
    assert_eq!(m.tool("int").unwrap().timeout(), Duration::from_secs(300));
    assert_eq!(m.tool("frac").unwrap().timeout(), Duration::from_millis(2500));
    assert_eq!(m.tool("tiny").unwrap().timeout(), Duration::from_millis(1));
}

#[test]
fn timeout_is_bounded_by_the_longest_job_deadline() {
    // 24 h is the longest deadline anything may run (spec §10.4): a tool may declare exactly that.
    let ok = load(&with_tool(
        json!({"name": "t", "description": "x", "timeout": 86400}),
    ));
    assert_eq!(ok.manifest.tools[0].timeout(), Duration::from_secs(86_400));
    for timeout in [json!(86400.001), json!(1e20), json!(f64::MAX)] {
        let e = single_error(&with_tool(
            json!({"name": "t", "description": "x", "timeout": timeout}),
        ));
        assert_eq!(e.path, "$.tools[0].timeout", "{timeout}");
    }
    // `null` reads as absent: the default 60 s.
    let none = load(&with_tool(
        json!({"name": "t", "description": "x", "timeout": null}),
    ));
    assert_eq!(none.manifest.tools[0].timeout(), Duration::from_secs(60));
}

#[test]
fn apply_defaults_fills_only_omitted_arguments() {
    let v = load(&spec_example());
    let t = v.manifest.tool("do_something").unwrap();

    let mut args = Map::new();
    args.insert("input_text".into(), json!("hi"));
    t.apply_defaults(&mut args);
    let mut expected = Map::new();
    expected.insert("input_text".into(), json!("hi"));
    expected.insert("count".into(), json!(1));
    assert_eq!(args, expected, "count filled; tags (no default) stays omitted");

    let mut args = Map::new();
    args.insert("input_text".into(), json!("hi"));
    args.insert("count".into(), json!(7));
    let before = args.clone();
    t.apply_defaults(&mut args);
    assert_eq!(args, before, "a provided argument is never overwritten");

    let mut args = Map::new();
    args.insert("count".into(), Value::Null);
    t.apply_defaults(&mut args);
    let mut expected = Map::new();
    expected.insert("count".into(), Value::Null);
    assert_eq!(args, expected, "an explicit null is a provided argument");

    let mut args = Map::new();
    args.insert("unknown".into(), json!(true));
    t.apply_defaults(&mut args);
    let mut expected = Map::new();
    expected.insert("unknown".into(), json!(true));
    expected.insert("count".into(), json!(1));
    assert_eq!(args, expected);
}

#[test]
fn tool_lookup_and_declares() {
    let mut m = spec_example();
    m["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "second", "description": "y"}));
    m["host_capabilities"] = json!(["llm.embed", "aps.files"]);
    let v = load(&m);
    assert_eq!(v.manifest.tool("do_something").unwrap().name, "do_something");
    assert_eq!(v.manifest.tool("second").unwrap().description, "y");
    assert!(v.manifest.tool("nope").is_none());
    assert!(v.manifest.tool("").is_none());
    assert!(v.manifest.tool("Second").is_none());
    assert!(v.manifest.declares("llm.embed"));
    assert!(v.manifest.declares("aps.files"));
    assert!(!v.manifest.declares("aps.kv"));
    assert!(!v.manifest.declares(""));
}

// -------------------------------------------------------------------------------------------------------------
// Invalid manifests: exact error paths
// -------------------------------------------------------------------------------------------------------------

#[test]
fn root_not_an_object() {
    for v in [
        json!([spec_example()]),
        json!("manifest"),
        json!(null),
        json!(3),
        json!(true),
    ] {
        assert_eq!(error_paths(&v), ["$"], "{v}");
    }
    let e = single_error(&json!([1]));
    assert_eq!(e.message, "the manifest must be an object, found an array");
}

#[test]
fn wrapped_manifest_is_refused_at_manifest() {
    let wrapped = json!({"manifest": spec_example()});
    let e = refuse(&wrapped);
    // Only this one problem: the wrapper stops the walk.
    assert_eq!(e.problems.len(), 1, "{:?}", e.problems);
    assert_eq!(e.problems[0].path, "$.manifest");
    assert_eq!(e.problems[0].severity, Severity::Error);
    assert!(
        e.to_string()
            .starts_with("invalid manifest: error at $.manifest: "),
        "{e}"
    );
}

#[test]
fn missing_or_null_tools() {
    assert_eq!(
        error_paths(&json!({"name": "p", "version": "1", "description": "d"})),
        ["$.tools"]
    );
    assert_eq!(
        error_paths(&json!({"name": "p", "version": "1", "description": "d", "tools": null})),
        ["$.tools"]
    );
    // `{}`: missing tools is the only error (the missing version/description are warnings).
    let e = refuse(&json!({}));
    assert_eq!(
        e.errors().map(|p| p.path.as_str()).collect::<Vec<_>>(),
        ["$.tools"]
    );
    let mut warnings: Vec<&str> = e
        .problems
        .iter()
        .filter(|p| p.severity == Severity::Warning)
        .map(|p| p.path.as_str())
        .collect();
    warnings.sort_unstable();
    assert_eq!(warnings, ["$.description", "$.version"]);
}

#[test]
fn empty_tools() {
    let e = single_error(&with_tools(json!([])));
    assert_eq!(e.path, "$.tools");
    assert_eq!(e.message, "must list at least one tool");
}

#[test]
fn tools_not_an_array() {
    for tools in [json!({"name": "t"}), json!("t"), json!(1)] {
        assert_eq!(error_paths(&with_tools(tools.clone())), ["$.tools"], "{tools}");
    }
    assert_eq!(
        single_error(&with_tools(json!({"name": "t"}))).message,
        "must be an array, found an object"
    );
}

#[test]
fn tool_not_an_object() {
    assert_eq!(
        error_paths(&with_tools(
            json!([{"name": "a", "description": "x"}, "b", ["c"]])
        )),
        ["$.tools[1]", "$.tools[2]"]
    );
    let e = single_error(&with_tools(json!([{"name": "a", "description": "x"}, "b"])));
    assert_eq!(e.path, "$.tools[1]");
    assert_eq!(e.message, "a tool must be an object, found a string");
}

#[test]
fn tool_without_name() {
    let e = single_error(&with_tool(json!({"description": "x"})));
    assert_eq!(e.path, "$.tools[0].name");
    assert_eq!(e.message, "is required");
    assert_eq!(
        error_paths(&with_tool(json!({"name": null, "description": "x"}))),
        ["$.tools[0].name"]
    );
}

#[test]
fn tool_with_empty_or_non_string_name() {
    for name in ["", "   "] {
        let e = single_error(&with_tool(json!({"name": name, "description": "x"})));
        assert_eq!(e.path, "$.tools[0].name");
        assert_eq!(e.message, "must not be empty");
    }
    let e = single_error(&with_tool(json!({"name": 5, "description": "x"})));
    assert_eq!(e.path, "$.tools[0].name");
    assert_eq!(e.message, "must be a string, found a number");
}

#[test]
fn duplicate_tool_names() {
    let e = single_error(&with_tools(json!([
        {"name": "a", "description": "x"},
        {"name": "b", "description": "x"},
        {"name": "a", "description": "y"}
    ])));
    assert_eq!(e.path, "$.tools[2].name");
    assert!(e.message.contains("\"a\""), "{}", e.message);
    assert!(e.message.contains("$.tools[0]"), "{}", e.message);
}

#[test]
fn bad_timeouts() {
    for timeout in [
        json!(0),
        json!(0.0),
        json!(-1),
        json!(-0.5),
        json!("60"),
        json!(true),
        json!({}),
    ] {
        let e = single_error(&with_tool(
            json!({"name": "t", "description": "x", "timeout": timeout}),
        ));
        assert_eq!(e.path, "$.tools[0].timeout", "{timeout}");
    }
    assert_eq!(
        single_error(&with_tool(json!({"name": "t", "description": "x", "timeout": 0}))).message,
        "must be a positive number of seconds, at most 86400"
    );
    assert_eq!(
        single_error(&with_tool(
            json!({"name": "t", "description": "x", "timeout": "60"})
        ))
        .message,
        "must be a number, found a string"
    );
}

#[test]
fn parameters_not_an_array() {
    for params in [json!({"name": "x"}), json!("x"), json!(3)] {
        assert_eq!(
            error_paths(&with_params(params.clone())),
            ["$.tools[0].parameters"],
            "{params}"
        );
    }
}

#[test]
fn parameter_not_an_object() {
    assert_eq!(
        error_paths(&with_params(json!([{"name": "a", "type": "string"}, "b"]))),
        ["$.tools[0].parameters[1]"]
    );
}

#[test]
fn parameter_without_name() {
    assert_eq!(
        error_paths(&with_params(
            json!([{"type": "string"}, {"name": "", "type": "string"}])
        )),
        ["$.tools[0].parameters[0].name", "$.tools[0].parameters[1].name"]
    );
}

#[test]
fn parameter_with_unknown_type() {
    let e = single_error(&with_params(json!([
        {"name": "a", "type": "string"},
        {"name": "b", "type": "integer"},
        {"name": "c", "type": "str"}
    ])));
    assert_eq!(e.path, "$.tools[0].parameters[2].type");
    assert!(e.message.contains("\"str\""), "{}", e.message);
    // A non-string type, and JSON Schema's `null` type, are errors too.
    assert_eq!(
        error_paths(&with_params(
            json!([{"name": "a", "type": 1}, {"name": "b", "type": "null"}])
        )),
        ["$.tools[0].parameters[0].type", "$.tools[0].parameters[1].type"]
    );
}

#[test]
fn default_of_the_wrong_type() {
    let params = json!([
        {"name": "i", "type": "integer", "default": "1"},
        {"name": "f", "type": "integer", "default": 1.5},
        {"name": "b", "type": "boolean", "default": "true"},
        {"name": "s", "type": "string", "default": 3},
        {"name": "a", "type": "array", "items_type": "string", "default": "x"},
        {"name": "o", "type": "object", "default": []},
        {"name": "n", "type": "number", "default": "0.5"},
        {"name": "ok", "type": "number", "default": 2}
    ]);
    assert_eq!(
        error_paths(&with_params(params)),
        sorted(&[
            "$.tools[0].parameters[0].default",
            "$.tools[0].parameters[1].default",
            "$.tools[0].parameters[2].default",
            "$.tools[0].parameters[3].default",
            "$.tools[0].parameters[4].default",
            "$.tools[0].parameters[5].default",
            "$.tools[0].parameters[6].default",
        ])
    );
}

#[test]
fn bad_enums() {
    // Not an array.
    let e = single_error(&with_params(
        json!([{"name": "e", "type": "string", "enum": "a"}]),
    ));
    assert_eq!(e.path, "$.tools[0].parameters[0].enum");
    assert_eq!(e.message, "must be an array, found a string");
    // Empty.
    let e = single_error(&with_params(json!([{"name": "e", "type": "string", "enum": []}])));
    assert_eq!(e.path, "$.tools[0].parameters[0].enum");
    assert_eq!(e.message, "must not be empty");
    // A value of the wrong type, at its own index.
    assert_eq!(
        error_paths(&with_params(json!([
            {"name": "ok", "type": "string", "enum": ["a", "b"]},
            {"name": "e", "type": "string", "enum": ["a", 2, "c", null]}
        ]))),
        [
            "$.tools[0].parameters[1].enum[1]",
            "$.tools[0].parameters[1].enum[3]"
        ]
    );
    assert_eq!(
        single_error(&with_params(
            json!([{"name": "e", "type": "integer", "enum": [1, 2.5]}])
        ))
        .path,
        "$.tools[0].parameters[0].enum[1]"
    );
}

#[test]
fn valid_enum_is_in_the_schema() {
    let v = load(&with_params(
        json!([{"name": "mode", "type": "string", "enum": ["fast", "slow"]}]),
    ));
    let p = &v.manifest.tools[0].parameters[0];
    assert_eq!(p.allowed, Some(vec![json!("fast"), json!("slow")]));
    assert_eq!(
        p.json_schema(),
        json!({"type": "string", "enum": ["fast", "slow"]})
    );
}

#[test]
fn duplicate_parameter_names() {
    let e = single_error(&with_params(json!([
        {"name": "x", "type": "string"},
        {"name": "y", "type": "string"},
        {"name": "x", "type": "integer"}
    ])));
    assert_eq!(e.path, "$.tools[0].parameters[2].name");
    assert!(e.message.contains("\"x\""), "{}", e.message);
    assert!(e.message.contains("$.tools[0].parameters[0]"), "{}", e.message);
}

#[test]
fn bad_items() {
    assert_eq!(
        error_paths(&with_params(json!([
            {"name": "a", "type": "array", "items": "string"},
            {"name": "b", "type": "array", "items_type": "strings"},
            {"name": "c", "type": "array", "items": {"type": "text"}}
        ]))),
        [
            "$.tools[0].parameters[0].items",
            "$.tools[0].parameters[1].items_type",
            "$.tools[0].parameters[2].items.type",
        ]
    );
}

#[test]
fn non_boolean_flags_and_non_string_texts() {
    assert_eq!(
        error_paths(&with_tool(json!({
            "name": "t",
            "description": 5,
            "streaming": "no",
            "multi_account": 1,
            "parameters": [{"name": "p", "type": "string", "required": "yes", "description": []}]
        }))),
        sorted(&[
            "$.tools[0].description",
            "$.tools[0].streaming",
            "$.tools[0].multi_account",
            "$.tools[0].parameters[0].required",
            "$.tools[0].parameters[0].description",
        ])
    );
    let mut m = spec_example();
    m["name"] = json!(1);
    m["version"] = json!(1.0);
    m["description"] = json!(["x"]);
    m["icon"] = json!({});
    assert_eq!(
        error_paths(&m),
        sorted(&["$.name", "$.version", "$.description", "$.icon"])
    );
}

#[test]
fn bad_credentials() {
    let mut m = spec_example();
    m["credentials"] = json!([{"display_name": "No name"}]);
    let e = single_error(&m);
    assert_eq!(e.path, "$.credentials[0].name");
    assert_eq!(e.message, "is required");

    m["credentials"] = json!({"name": "K"});
    assert_eq!(error_paths(&m), ["$.credentials"]);

    m["credentials"] = json!([{"name": "K"}, "L"]);
    assert_eq!(error_paths(&m), ["$.credentials[1]"]);

    m["credentials"] = json!([{"name": "K", "required": "yes", "sensitive": 0, "default": 1}]);
    assert_eq!(
        error_paths(&m),
        sorted(&[
            "$.credentials[0].required",
            "$.credentials[0].sensitive",
            "$.credentials[0].default",
        ])
    );
}

#[test]
fn credential_defaults_are_required_and_sensitive() {
    let mut m = spec_example();
    m["credentials"] = json!([{"name": "TOKEN"}]);
    let v = load(&m);
    let c = &v.manifest.credentials[0];
    assert_eq!(c.name, "TOKEN");
    assert!(c.required);
    assert!(c.sensitive);
}

#[test]
fn bad_host_capabilities() {
    let mut m = spec_example();
    m["host_capabilities"] = json!("llm.sample");
    let e = single_error(&m);
    assert_eq!(e.path, "$.host_capabilities");
    assert_eq!(e.message, "must be an array, found a string");

    m["host_capabilities"] = json!(["llm.sample", {"name": "aps.kv"}, 3]);
    assert_eq!(
        error_paths(&m),
        ["$.host_capabilities[1]", "$.host_capabilities[2]"]
    );
}

#[test]
fn runtime_not_an_object() {
    for runtime in [json!("uv"), json!(["uv"]), json!(1)] {
        let mut m = spec_example();
        m["runtime"] = runtime.clone();
        assert_eq!(error_paths(&m), ["$.runtime"], "{runtime}");
    }
    let mut m = spec_example();
    m["runtime"] = Value::Null;
    assert_eq!(load(&m).manifest.runtime, None);
}

#[test]
fn several_problems_are_reported_together() {
    let m = json!({
        "name": 5,
        "version": "1.0.0",
        "tools": [
            {
                "name": "a",
                "description": "x",
                "timeout": 0,
                "parameters": [
                    {"name": "p", "type": "strng"},
                    {"name": "p", "type": "integer", "default": "x"},
                    {"name": "e", "type": "string", "enum": []}
                ]
            },
            {"description": "no name"},
            {"name": "a", "description": "x", "streaming": "yes"},
            42
        ],
        "credentials": [{"display_name": "x"}],
        "host_capabilities": ["llm.sample", 7, "storage"],
        "runtime": "uv"
    });
    let e = refuse(&m);
    let mut errors: Vec<&str> = e.errors().map(|p| p.path.as_str()).collect();
    errors.sort_unstable();
    let expected = sorted(&[
        "$.name",
        "$.tools[0].timeout",
        "$.tools[0].parameters[0].type",
        "$.tools[0].parameters[1].default",
        "$.tools[0].parameters[1].name",
        "$.tools[0].parameters[2].enum",
        "$.tools[1].name",
        "$.tools[2].streaming",
        "$.tools[2].name",
        "$.tools[3]",
        "$.credentials[0].name",
        "$.host_capabilities[1]",
        "$.runtime",
    ]);
    assert_eq!(errors, expected);
    // Warnings found along the way are kept in `problems`, but `errors()` leaves them out.
    let mut warnings: Vec<&str> = e
        .problems
        .iter()
        .filter(|p| p.severity == Severity::Warning)
        .map(|p| p.path.as_str())
        .collect();
    warnings.sort_unstable();
    assert_eq!(warnings, ["$.description", "$.host_capabilities[2]"]);
    assert_eq!(e.problems.len(), expected.len() + 2);
    // The Display lists every problem.
    let text = e.to_string();
    for path in &expected {
        assert!(
            text.contains(&format!("error at {path}: ")),
            "{path} missing from {text}"
        );
    }
}

// -------------------------------------------------------------------------------------------------------------
// `null` members the validator treats as absent must load like absent ones
// -------------------------------------------------------------------------------------------------------------

#[test]
fn null_optional_texts_load_like_absent() {
    let mut m = spec_example();
    m["display_name"] = Value::Null;
    m["version"] = Value::Null;
    m["runtime"] = Value::Null;
    m["tools"][0]["parameters"][0]["description"] = Value::Null;
    m["credentials"][0]["display_name"] = Value::Null;
    let v = load(&m);
    assert_eq!(warning_paths(&v), ["$.version"]);
    assert_eq!(v.manifest.display_name, None);
    assert_eq!(v.manifest.version, None);
    assert_eq!(v.manifest.tools[0].parameters[0].description, None);
    assert_eq!(v.manifest.credentials[0].display_name, None);
}

#[test]
fn null_parameters_load_like_absent() {
    let v = load(&with_tool(
        json!({"name": "t", "description": "x", "parameters": null}),
    ));
    assert_eq!(v.manifest.tools[0].parameters, Vec::new());
}

#[test]
fn null_tool_description_loads_with_a_warning() {
    let v = load(&with_tool(json!({"name": "t", "description": null})));
    assert_eq!(warning_paths(&v), ["$.tools[0].description"]);
    assert_eq!(v.manifest.tools[0].description, "");
}

#[test]
fn null_credentials_load_like_absent() {
    let mut m = spec_example();
    m["credentials"] = Value::Null;
    let v = load(&m);
    assert_eq!(v.manifest.credentials, Vec::new());
}

#[test]
fn null_host_capabilities_load_like_absent() {
    let mut m = spec_example();
    m["host_capabilities"] = Value::Null;
    let v = load(&m);
    assert_eq!(v.manifest.host_capabilities, Vec::<String>::new());
}
