//! The `describe` result (the manifest) and its validator (spec §3.4).
//!
//! [`Manifest::from_value`] walks the raw JSON once and reports **every** problem with its path
//! (`$.tools[1].parameters[0].type`), not just the first one serde would stop at. Problems are errors (the
//! manifest is refused) or warnings (it loads; the host logs them). Real plugins' shapes are tolerated: no
//! `name` (identity is the installed `tool_id`), `items` or `items_type`, `required` defaulting to true,
//! `serverInfo`-era extras.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::capabilities::is_known_host_capability;
use crate::limits::{DEFAULT_INVOKE_TIMEOUT, JOB_DEADLINE_MAX_MS};

/// The largest per-tool `timeout` a manifest may declare: the longest job deadline, 24 h (spec §10.4).
pub const MAX_TOOL_TIMEOUT_SECS: f64 = (JOB_DEADLINE_MAX_MS / 1000) as f64;

/// A parameter's type (spec §3.4: `string`, `integer`, `number`, `boolean`, `array`, `object`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamType {
    /// A string.
    String,
    /// An integer.
    Integer,
    /// Any number.
    Number,
    /// A boolean.
    Boolean,
    /// An array.
    Array,
    /// An object.
    Object,
}

impl ParamType {
    fn parse(s: &str) -> Option<ParamType> {
        Some(match s {
            "string" => ParamType::String,
            "integer" => ParamType::Integer,
            "number" => ParamType::Number,
            "boolean" => ParamType::Boolean,
            "array" => ParamType::Array,
            "object" => ParamType::Object,
            _ => return None,
        })
    }

    /// The JSON Schema type name.
    pub fn as_str(self) -> &'static str {
        match self {
            ParamType::String => "string",
            ParamType::Integer => "integer",
            ParamType::Number => "number",
            ParamType::Boolean => "boolean",
            ParamType::Array => "array",
            ParamType::Object => "object",
        }
    }

    /// Whether `v` is a value of this type.
    pub fn admits(self, v: &Value) -> bool {
        match self {
            ParamType::String => v.is_string(),
            ParamType::Integer => v.is_i64() || v.is_u64(),
            ParamType::Number => v.is_number(),
            ParamType::Boolean => v.is_boolean(),
            ParamType::Array => v.is_array(),
            ParamType::Object => v.is_object(),
        }
    }
}

fn yes() -> bool {
    true
}

/// `null` reads as the type's default, like an absent member (the validator treats both alike).
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// One tool parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parameter {
    /// Argument name.
    pub name: String,
    /// Argument type (missing → `string`, with a warning).
    #[serde(rename = "type", default = "default_param_type")]
    pub param_type: ParamType,
    /// Shown to the LLM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Defaults to `true` (spec §3.4).
    #[serde(default = "yes")]
    pub required: bool,
    /// Used by the host when the argument is omitted (spec §4.1 HR-IV-06).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Value>,
    /// Allowed values.
    #[serde(rename = "enum", default, skip_serializing_if = "Option::is_none")]
    pub allowed: Option<Vec<Value>>,
    /// Array item schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items: Option<Value>,
    /// Array item type, the older spelling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub items_type: Option<ParamType>,
}

fn default_param_type() -> ParamType {
    ParamType::String
}

impl Parameter {
    /// The JSON Schema of this parameter (spec §3.4 HR-DS-05). Arrays without `items`/`items_type` are
    /// arrays of strings.
    pub fn json_schema(&self) -> Value {
        let mut s = Map::new();
        s.insert("type".into(), self.param_type.as_str().into());
        if let Some(d) = &self.description {
            s.insert("description".into(), d.clone().into());
        }
        if let Some(d) = &self.default {
            s.insert("default".into(), d.clone());
        }
        if let Some(e) = &self.allowed {
            s.insert("enum".into(), Value::Array(e.clone()));
        }
        if self.param_type == ParamType::Array {
            let items = match (&self.items, self.items_type) {
                (Some(items @ Value::Object(_)), _) => items.clone(),
                (_, Some(t)) => json!({ "type": t.as_str() }),
                _ => json!({ "type": "string" }),
            };
            s.insert("items".into(), items);
        }
        Value::Object(s)
    }
}

/// One tool of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// Unique within the plugin.
    pub name: String,
    /// Shown to the LLM.
    #[serde(default, deserialize_with = "null_as_default")]
    pub description: String,
    /// Arguments; empty = none.
    #[serde(default, deserialize_with = "null_as_default")]
    pub parameters: Vec<Parameter>,
    /// Per-tool invoke timeout in seconds (default 60).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Reserved.
    #[serde(default)]
    pub streaming: bool,
    /// Platform injects an `account` argument.
    #[serde(default)]
    pub multi_account: bool,
    /// Anything else, kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ToolDefinition {
    /// The invoke timeout: the declared one, else 60 s (spec §3.1).
    pub fn timeout(&self) -> Duration {
        self.timeout
            .map_or(DEFAULT_INVOKE_TIMEOUT, Duration::from_secs_f64)
    }

    /// The JSON Schema of the arguments (`tools.list`'s `input_schema`, spec §3.4 HR-DS-05).
    pub fn input_schema(&self) -> Value {
        let properties: Map<String, Value> = self
            .parameters
            .iter()
            .map(|p| (p.name.clone(), p.json_schema()))
            .collect();
        let required: Vec<Value> = self
            .parameters
            .iter()
            .filter(|p| p.required)
            .map(|p| p.name.clone().into())
            .collect();
        json!({ "type": "object", "properties": properties, "required": required })
    }

    /// `arguments` with the declared defaults filled in for omitted parameters (spec §4.1 HR-IV-06).
    pub fn apply_defaults(&self, arguments: &mut Map<String, Value>) {
        for p in &self.parameters {
            if let Some(d) = &p.default {
                arguments.entry(p.name.clone()).or_insert_with(|| d.clone());
            }
        }
    }
}

/// A credential the plugin declares (spec §4.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CredentialDefinition {
    /// `UPPER_SNAKE_CASE` name.
    pub name: String,
    /// Shown in settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Help text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Default `true`.
    #[serde(default = "yes")]
    pub required: bool,
    /// Default `true`.
    #[serde(default = "yes")]
    pub sensitive: bool,
    /// Default value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

/// A validated manifest (spec §3.4).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Not the identity (that is the installed `tool_id`); often omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Defaults to `name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// SemVer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// What the plugin does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// At least one.
    pub tools: Vec<ToolDefinition>,
    /// Declared credentials.
    #[serde(default, deserialize_with = "null_as_default")]
    pub credentials: Vec<CredentialDefinition>,
    /// Host capabilities the plugin uses (only known strings are kept).
    #[serde(default, deserialize_with = "null_as_default")]
    pub host_capabilities: Vec<String>,
    /// Free-form runtime hints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Value>,
    /// Anything else (author, homepage, icon, ...), kept.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// How bad a problem is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The manifest is refused.
    Error,
    /// The manifest loads; the problem is logged.
    Warning,
}

/// One problem, at a JSON path such as `$.tools[0].parameters[2].type`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// Where.
    pub path: String,
    /// How bad.
    pub severity: Severity,
    /// What.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(f, "{sev} at {}: {}", self.path, self.message)
    }
}

/// A manifest that was refused, with every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid manifest: {}", .problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct ManifestError {
    /// Every problem (errors and warnings).
    pub problems: Vec<Problem>,
}

impl ManifestError {
    /// The errors only.
    pub fn errors(&self) -> impl Iterator<Item = &Problem> {
        self.problems.iter().filter(|p| p.severity == Severity::Error)
    }
}

/// A manifest that loaded, with its warnings.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    /// The manifest.
    pub manifest: Manifest,
    /// Problems that did not stop it loading.
    pub warnings: Vec<Problem>,
}

struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn error(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            path: path.into(),
            severity: Severity::Error,
            message: message.into(),
        });
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            path: path.into(),
            severity: Severity::Warning,
            message: message.into(),
        });
    }

    fn optional_string(&mut self, obj: &Map<String, Value>, key: &str, path: &str) {
        if let Some(v) = obj.get(key)
            && !v.is_string()
            && !v.is_null()
        {
            self.error(
                format!("{path}.{key}"),
                format!("must be a string, found {}", type_name(v)),
            );
        }
    }

    fn optional_bool(&mut self, obj: &Map<String, Value>, key: &str, path: &str) {
        if let Some(v) = obj.get(key)
            && !v.is_boolean()
        {
            self.error(
                format!("{path}.{key}"),
                format!("must be a boolean, found {}", type_name(v)),
            );
        }
    }

    fn required_string(&mut self, obj: &Map<String, Value>, key: &str, path: &str) -> Option<String> {
        match obj.get(key) {
            None | Some(Value::Null) => {
                self.error(format!("{path}.{key}"), "is required");
                None
            }
            Some(Value::String(s)) if s.trim().is_empty() => {
                self.error(format!("{path}.{key}"), "must not be empty");
                None
            }
            Some(Value::String(s)) => Some(s.clone()),
            Some(v) => {
                self.error(
                    format!("{path}.{key}"),
                    format!("must be a string, found {}", type_name(v)),
                );
                None
            }
        }
    }

    fn tool(&mut self, tool: &Value, path: &str) -> Option<String> {
        let Some(obj) = tool.as_object() else {
            self.error(
                path,
                format!("a tool must be an object, found {}", type_name(tool)),
            );
            return None;
        };
        let name = self.required_string(obj, "name", path);
        match obj.get("description") {
            None | Some(Value::Null) => self.warn(
                format!("{path}.description"),
                "missing; the LLM sees no description",
            ),
            Some(Value::String(_)) => {}
            Some(v) => self.error(
                format!("{path}.description"),
                format!("must be a string, found {}", type_name(v)),
            ),
        }
        if let Some(t) = obj.get("timeout").filter(|t| !t.is_null()) {
            match t.as_f64() {
                Some(secs) if secs > 0.0 && secs <= MAX_TOOL_TIMEOUT_SECS => {}
                Some(_) => self.error(
                    format!("{path}.timeout"),
                    format!("must be a positive number of seconds, at most {MAX_TOOL_TIMEOUT_SECS}"),
                ),
                None => self.error(
                    format!("{path}.timeout"),
                    format!("must be a number, found {}", type_name(t)),
                ),
            }
        }
        self.optional_bool(obj, "streaming", path);
        self.optional_bool(obj, "multi_account", path);
        if obj.contains_key("input_schema") {
            self.warn(
                format!("{path}.input_schema"),
                "ignored: Executa tools declare `parameters`, not `input_schema`",
            );
        }
        match obj.get("parameters") {
            None | Some(Value::Null) => {}
            Some(Value::Array(params)) => {
                let mut seen: HashMap<String, usize> = HashMap::new();
                for (j, p) in params.iter().enumerate() {
                    let ppath = format!("{path}.parameters[{j}]");
                    if let Some(pname) = self.parameter(p, &ppath)
                        && let Some(first) = seen.insert(pname.clone(), j)
                    {
                        self.error(
                            format!("{ppath}.name"),
                            format!("duplicate parameter {pname:?} (also {path}.parameters[{first}])"),
                        );
                    }
                }
            }
            Some(v) => self.error(
                format!("{path}.parameters"),
                format!("must be an array, found {}", type_name(v)),
            ),
        }
        name
    }

    fn param_type(&mut self, v: Option<&Value>, path: String, what: &str) -> Option<ParamType> {
        match v {
            None => None,
            Some(Value::String(s)) => {
                match ParamType::parse(s) {
                    Some(t) => Some(t),
                    None => {
                        self.error(
                        path,
                        format!("unknown {what} {s:?}; expected string, integer, number, boolean, array or object"),
                    );
                        None
                    }
                }
            }
            Some(v) => {
                self.error(path, format!("must be a string, found {}", type_name(v)));
                None
            }
        }
    }

    fn parameter(&mut self, p: &Value, path: &str) -> Option<String> {
        let Some(obj) = p.as_object() else {
            self.error(
                path,
                format!("a parameter must be an object, found {}", type_name(p)),
            );
            return None;
        };
        let name = self.required_string(obj, "name", path);
        let ty = match obj.get("type") {
            None => {
                self.warn(format!("{path}.type"), "missing; treated as string");
                Some(ParamType::String)
            }
            v => self.param_type(v, format!("{path}.type"), "type"),
        };
        self.optional_string(obj, "description", path);
        self.optional_bool(obj, "required", path);
        if let Some(e) = obj.get("enum") {
            match e {
                Value::Array(values) if !values.is_empty() => {
                    if let Some(t) = ty {
                        for (k, v) in values.iter().enumerate() {
                            if !t.admits(v) {
                                self.error(format!("{path}.enum[{k}]"), format!("is not a {}", t.as_str()));
                            }
                        }
                    }
                }
                Value::Array(_) => self.error(format!("{path}.enum"), "must not be empty"),
                v => self.error(
                    format!("{path}.enum"),
                    format!("must be an array, found {}", type_name(v)),
                ),
            }
        }
        if let (Some(t), Some(d)) = (ty, obj.get("default"))
            && !d.is_null()
            && !t.admits(d)
        {
            self.error(
                format!("{path}.default"),
                format!("is not a {} ({d})", t.as_str()),
            );
        }
        let items_type = self.param_type(obj.get("items_type"), format!("{path}.items_type"), "items_type");
        let items = obj.get("items");
        if let Some(items) = items {
            match items.as_object() {
                Some(io) => {
                    self.param_type(io.get("type"), format!("{path}.items.type"), "items type");
                }
                None => self.error(
                    format!("{path}.items"),
                    format!("must be an object, found {}", type_name(items)),
                ),
            }
        }
        if ty == Some(ParamType::Array) && items.is_none() && items_type.is_none() {
            self.warn(
                format!("{path}.items"),
                "array without items or items_type; items are strings",
            );
        }
        if ty.is_some_and(|t| t != ParamType::Array) && (items.is_some() || items_type.is_some()) {
            self.warn(format!("{path}.items"), "items only apply to arrays; ignored");
        }
        name
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Manifest {
    /// Validates a `describe` result and builds the manifest; reports every problem with its path.
    pub fn from_value(value: &Value) -> Result<Validated, ManifestError> {
        let mut c = Checker { problems: Vec::new() };
        let Some(root) = value.as_object() else {
            c.error(
                "$",
                format!("the manifest must be an object, found {}", type_name(value)),
            );
            return Err(ManifestError { problems: c.problems });
        };
        if !root.contains_key("tools")
            && let Some(Value::Object(_)) = root.get("manifest")
        {
            c.error(
                "$.manifest",
                "describe returned {\"manifest\": …}; the result must be the bare manifest (spec §3.4 HR-DS-02)",
            );
            return Err(ManifestError { problems: c.problems });
        }
        for key in [
            "name",
            "display_name",
            "author",
            "homepage",
            "icon",
            "category",
            "license",
        ] {
            c.optional_string(root, key, "$");
        }
        for key in ["version", "description"] {
            match root.get(key) {
                None | Some(Value::Null) => c.warn(format!("$.{key}"), "missing"),
                Some(Value::String(_)) => {}
                Some(v) => c.error(
                    format!("$.{key}"),
                    format!("must be a string, found {}", type_name(v)),
                ),
            }
        }
        match root.get("tools") {
            None | Some(Value::Null) => c.error("$.tools", "is required (at least one tool)"),
            Some(Value::Array(tools)) if tools.is_empty() => {
                c.error("$.tools", "must list at least one tool")
            }
            Some(Value::Array(tools)) => {
                let mut seen: HashMap<String, usize> = HashMap::new();
                for (i, t) in tools.iter().enumerate() {
                    let path = format!("$.tools[{i}]");
                    if let Some(name) = c.tool(t, &path)
                        && let Some(first) = seen.insert(name.clone(), i)
                    {
                        c.error(
                            format!("{path}.name"),
                            format!("duplicate tool name {name:?} (also $.tools[{first}])"),
                        );
                    }
                }
            }
            Some(v) => c.error("$.tools", format!("must be an array, found {}", type_name(v))),
        }
        match root.get("credentials") {
            None | Some(Value::Null) => {}
            Some(Value::Array(creds)) => {
                for (i, cred) in creds.iter().enumerate() {
                    let path = format!("$.credentials[{i}]");
                    match cred.as_object() {
                        Some(obj) => {
                            c.required_string(obj, "name", &path);
                            c.optional_bool(obj, "required", &path);
                            c.optional_bool(obj, "sensitive", &path);
                            c.optional_string(obj, "default", &path);
                            c.optional_string(obj, "display_name", &path);
                            c.optional_string(obj, "description", &path);
                        }
                        None => c.error(
                            path,
                            format!("a credential must be an object, found {}", type_name(cred)),
                        ),
                    }
                }
            }
            Some(v) => c.error(
                "$.credentials",
                format!("must be an array, found {}", type_name(v)),
            ),
        }
        let mut host_capabilities = Vec::new();
        match root.get("host_capabilities") {
            None | Some(Value::Null) => {}
            Some(Value::Array(caps)) => {
                for (i, cap) in caps.iter().enumerate() {
                    match cap.as_str() {
                        Some(s) if is_known_host_capability(s) => host_capabilities.push(s.to_string()),
                        Some(s) => c.warn(
                            format!("$.host_capabilities[{i}]"),
                            format!("unknown host capability {s:?}; ignored, never granted"),
                        ),
                        None => c.error(
                            format!("$.host_capabilities[{i}]"),
                            format!("must be a string, found {}", type_name(cap)),
                        ),
                    }
                }
            }
            Some(v) => c.error(
                "$.host_capabilities",
                format!("must be an array, found {}", type_name(v)),
            ),
        }
        if let Some(rt) = root.get("runtime")
            && !rt.is_object()
            && !rt.is_null()
        {
            c.error("$.runtime", format!("must be an object, found {}", type_name(rt)));
        }

        if c.problems.iter().any(|p| p.severity == Severity::Error) {
            return Err(ManifestError { problems: c.problems });
        }
        let mut manifest: Manifest = match serde_json::from_value(value.clone()) {
            Ok(m) => m,
            Err(e) => {
                c.error("$", format!("cannot be read: {e}"));
                return Err(ManifestError { problems: c.problems });
            }
        };
        manifest.host_capabilities = host_capabilities;
        Ok(Validated {
            manifest,
            warnings: c.problems,
        })
    }

    /// The tool named `name`.
    pub fn tool(&self, name: &str) -> Option<&ToolDefinition> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// Whether the manifest declares `capability` in `host_capabilities`.
    pub fn declares(&self, capability: &str) -> bool {
        self.host_capabilities.iter().any(|c| c == capability)
    }
}
