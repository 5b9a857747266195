//! `fleet_worker::catalogue`: loading `executa.json` installs and resolving their launch commands.
//!
//! Every test builds its own catalogue and a fake `PATH` directory (executable `uv` / `node` / `go` scripts),
//! passed through `LoadOptions::search_path`, so nothing depends on what the machine has installed.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_worker::catalogue::{
    Catalogue, CatalogueError, CatalogueProblem, DESCRIBED_MARKER, Install, InstallType, LoadOptions,
    MAX_MANIFEST_BYTES,
};
use fleet_worker::config::LimitOverrides;
use fleet_worker::proto::limits;
use tempfile::TempDir;

struct Fixture {
    cat: TempDir,
    bin: TempDir,
}

impl Fixture {
    /// A catalogue and a fake PATH holding `runtimes`.
    fn new(runtimes: &[&str]) -> Fixture {
        let f = Fixture {
            cat: TempDir::new().unwrap(),
            bin: TempDir::new().unwrap(),
        };
        for name in runtimes {
            write_exec(&f.bin.path().join(name), "#!/bin/sh\nexit 0\n");
        }
        f
    }

    fn opts(&self) -> LoadOptions {
        LoadOptions::with_search_path([self.bin.path()])
    }

    /// Writes `<cat>/<sub>/executa.json`; returns the install directory.
    fn install(&self, sub: &str, json: &str) -> PathBuf {
        let dir = self.cat.path().join(sub);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("executa.json"), json).unwrap();
        dir
    }

    /// Writes `<cat>/<rel>`.
    fn file(&self, rel: &str, contents: &str) -> PathBuf {
        let path = self.cat.path().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, contents).unwrap();
        path
    }

    /// Writes `<cat>/<rel>` with mode 0755.
    fn exec(&self, rel: &str) -> PathBuf {
        let path = self.cat.path().join(rel);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        write_exec(&path, "#!/bin/sh\nexit 0\n");
        path
    }

    fn manifest(&self, sub: &str) -> PathBuf {
        self.cat.path().join(sub).join("executa.json")
    }

    fn runtime(&self, name: &str) -> String {
        s(&self.bin.path().join(name))
    }

    fn load(&self) -> (Catalogue, Vec<CatalogueProblem>) {
        Catalogue::load(self.cat.path(), &self.opts()).unwrap()
    }

    /// Loads a catalogue expected to hold exactly one good install.
    fn load_one(&self) -> Install {
        let (cat, problems) = self.load();
        assert!(problems.is_empty(), "unexpected problems: {}", show(&problems));
        assert_eq!(cat.len(), 1);
        cat.iter().next().unwrap().clone()
    }

    /// Loads a catalogue expected to hold exactly one bad install; returns its error.
    fn load_err(&self) -> CatalogueError {
        let (cat, mut problems) = self.load();
        assert!(
            cat.is_empty(),
            "unexpectedly loaded: {:?}",
            cat.iter().map(|i| &i.tool_id).collect::<Vec<_>>()
        );
        assert_eq!(problems.len(), 1, "problems: {}", show(&problems));
        let problem = problems.remove(0);
        problem.error
    }
}

fn write_exec(path: &Path, contents: &str) {
    fs::write(path, contents).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o755)).unwrap();
}

fn s(path: &Path) -> String {
    path.to_str().unwrap().to_string()
}

fn canon(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap()
}

fn show(problems: &[CatalogueProblem]) -> String {
    problems.iter().map(|p| format!("\n  {p}")).collect()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

// ---------------------------------------------------------------------------------------------------------------
// Default launch commands per type.

#[test]
fn python_default_command() {
    let f = Fixture::new(&["uv"]);
    let dir = f.install(
        "weather",
        r#"{"tool_id": "tool-acme-weather-1a2b", "type": "python"}"#,
    );
    f.file("weather/pyproject.toml", "[project]\nname = \"weather\"\n");
    let install = f.load_one();
    let dir = canon(&dir);
    assert_eq!(install.tool_id, "tool-acme-weather-1a2b");
    assert_eq!(install.kind, InstallType::Python);
    assert_eq!(
        install.argv,
        vec![
            f.runtime("uv"),
            "run".into(),
            "--project".into(),
            s(&dir),
            install.tool_id.clone()
        ]
    );
    assert_eq!(install.dir, dir);
    assert!(install.enabled);
    assert!(install.is_runnable());
    assert_eq!(install.limits, LimitOverrides::default());
    assert!(install.env.is_empty());
    assert_eq!(install.idle_timeout, None);
    assert!(install.first_launch);
    assert_eq!(install.describe_timeout(), limits::DESCRIBE_TIMEOUT_FIRST_LAUNCH);
    assert_eq!(install.manifest_path(), dir.join("executa.json"));
}

#[test]
fn python_without_uv_names_uv() {
    let f = Fixture::new(&["node", "go"]);
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    f.file("py/pyproject.toml", "");
    let (cat, problems) = f.load();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, f.manifest("py"));
    assert!(matches!(
        problems[0].error,
        CatalogueError::MissingRuntime {
            kind: InstallType::Python,
            program: "uv"
        }
    ));
    let shown = problems[0].to_string();
    assert_eq!(
        shown,
        format!(
            "{}: type python needs `uv` on PATH (or set `command`)",
            f.manifest("py").display()
        )
    );
}

#[test]
fn python_without_pyproject_is_an_error() {
    let f = Fixture::new(&["uv"]);
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    let err = f.load_err();
    assert!(
        matches!(&err, CatalogueError::NoEntrypoint { reason } if reason.contains("pyproject.toml")),
        "{err}"
    );
}

#[test]
fn node_default_command() {
    let f = Fixture::new(&["node"]);
    let dir = f.install("n", r#"{"tool_id": "tool-n", "type": "node"}"#);
    f.file("n/package.json", r#"{"name": "n", "main": "index.js"}"#);
    f.file("n/index.js", "");
    let install = f.load_one();
    assert_eq!(install.kind, InstallType::Node);
    assert_eq!(
        install.argv,
        vec![f.runtime("node"), s(&canon(&dir).join("index.js"))]
    );
}

#[test]
fn node_entry_resolution_order() {
    let f = Fixture::new(&["node"]);
    let all = [
        "from-bin-map.js",
        "from-bin-string.js",
        "from-main.js",
        "from-module.mjs",
        "other.js",
    ];
    let cases: [(&str, &str, &str); 6] = [
        (
            "a-bin-map",
            r#"{"bin": {"other": "other.js", "ID": "./from-bin-map.js"}, "main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-bin-map.js",
        ),
        (
            "b-bin-string",
            r#"{"bin": "from-bin-string.js", "main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-bin-string.js",
        ),
        (
            "c-bin-map-without-id",
            r#"{"bin": {"other": "other.js"}, "main": "from-main.js"}"#,
            "from-main.js",
        ),
        (
            "d-main",
            r#"{"main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-main.js",
        ),
        ("e-module", r#"{"module": "from-module.mjs"}"#, "from-module.mjs"),
        // Node resolves `main` without its extension; so do we.
        ("f-main-no-ext", r#"{"main": "from-main"}"#, "from-main.js"),
    ];
    for (sub, pkg, _) in &cases {
        let id = format!("tool-{sub}");
        f.install(sub, &format!(r#"{{"tool_id": "{id}", "type": "node"}}"#));
        f.file(
            &format!("{sub}/package.json"),
            &pkg.replace("\"ID\"", &format!("\"{id}\"")),
        );
        for file in all {
            f.file(&format!("{sub}/{file}"), "");
        }
    }
    let (cat, problems) = f.load();
    assert!(problems.is_empty(), "{}", show(&problems));
    assert_eq!(cat.len(), cases.len());
    for (sub, _, want) in cases {
        let install = cat.get(&format!("tool-{sub}")).unwrap();
        let want = canon(&f.cat.path().join(sub)).join(want);
        assert_eq!(install.argv, vec![f.runtime("node"), s(&want)], "{sub}");
    }
}

#[test]
fn node_without_package_json_or_entry() {
    let f = Fixture::new(&["node"]);
    f.install("a-no-pkg", r#"{"tool_id": "a", "type": "node"}"#);
    f.install("b-no-entry", r#"{"tool_id": "b", "type": "node"}"#);
    f.file(
        "b-no-entry/package.json",
        r#"{"name": "b", "bin": {"other": "x.js"}, "main": ""}"#,
    );
    f.install("c-missing-file", r#"{"tool_id": "c", "type": "node"}"#);
    f.file("c-missing-file/package.json", r#"{"main": "dist/index.js"}"#);
    let pkg = f
        .install("d-bad-json", r#"{"tool_id": "d", "type": "node"}"#)
        .join("package.json");
    fs::write(&pkg, "{not json").unwrap();
    let (cat, problems) = f.load();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 4, "{}", show(&problems));
    let reason = |i: usize| match &problems[i].error {
        CatalogueError::NoEntrypoint { reason } => reason.clone(),
        other => panic!("problem {i}: {other}"),
    };
    assert!(reason(0).contains("package.json"), "{}", reason(0));
    assert!(reason(1).contains("no entry point"), "{}", reason(1));
    assert!(
        reason(2).contains("dist/index.js") && reason(2).contains("does not exist"),
        "{}",
        reason(2)
    );
    assert!(matches!(&problems[3].error, CatalogueError::Json { path, .. } if *path == canon(&pkg)));
    assert!(
        problems[3].to_string().contains("package.json: invalid JSON"),
        "{}",
        problems[3]
    );
}

#[test]
fn node_without_node_on_path() {
    let f = Fixture::new(&["uv", "go"]);
    f.install("n", r#"{"tool_id": "n", "type": "node"}"#);
    f.file("n/package.json", r#"{"main": "index.js"}"#);
    f.file("n/index.js", "");
    let err = f.load_err();
    assert!(
        matches!(
            err,
            CatalogueError::MissingRuntime {
                kind: InstallType::Node,
                program: "node"
            }
        ),
        "{err}"
    );
}

#[test]
fn go_default_command_and_missing_go() {
    let f = Fixture::new(&["go"]);
    f.install("g", r#"{"tool_id": "g", "type": "go"}"#);
    f.file("g/go.mod", "module example.com/g\n");
    let install = f.load_one();
    assert_eq!(install.kind, InstallType::Go);
    assert_eq!(install.argv, vec![f.runtime("go"), "run".into(), ".".into()]);

    let f = Fixture::new(&["uv", "node"]);
    f.install("g", r#"{"tool_id": "g", "type": "go"}"#);
    f.file("g/go.mod", "module example.com/g\n");
    let err = f.load_err();
    assert!(
        matches!(
            err,
            CatalogueError::MissingRuntime {
                kind: InstallType::Go,
                program: "go"
            }
        ),
        "{err}"
    );
    assert_eq!(err.to_string(), "type go needs `go` on PATH (or set `command`)");
}

#[test]
fn binary_with_and_without_bin_tool_id() {
    let f = Fixture::new(&[]);
    let dir = f.install("present", r#"{"tool_id": "tool-bin", "type": "binary"}"#);
    f.exec("present/bin/tool-bin");
    let install = f.load_one();
    assert_eq!(install.kind, InstallType::Binary);
    assert_eq!(install.argv, vec![s(&canon(&dir).join("bin/tool-bin"))]);

    let f = Fixture::new(&[]);
    f.install("absent", r#"{"tool_id": "tool-bin", "type": "binary"}"#);
    f.exec("absent/bin/some-other-name");
    let err = f.load_err();
    assert_eq!(
        err.to_string(),
        "type binary needs an executable `bin/tool-bin` (or set `command`)"
    );

    let f = Fixture::new(&[]);
    f.install("not-exec", r#"{"tool_id": "tool-bin", "type": "binary"}"#);
    f.file("not-exec/bin/tool-bin", "");
    let err = f.load_err();
    assert!(
        matches!(&err, CatalogueError::NoEntrypoint { reason } if reason.contains("is not executable")),
        "{err}"
    );

    let f = Fixture::new(&[]);
    let dir = f.install(
        "absent-with-command",
        r#"{"tool_id": "tool-bin", "type": "binary", "command": ["./run"]}"#,
    );
    f.exec("absent-with-command/run");
    assert_eq!(f.load_one().argv, vec![s(&canon(&dir).join("run"))]);
}

// ---------------------------------------------------------------------------------------------------------------
// Explicit `command`.

#[test]
fn command_relative_path_is_resolved_against_the_install_dir() {
    let f = Fixture::new(&[]); // no uv: the explicit command needs none
    let dir = f.install(
        "py",
        r#"{"tool_id": "py", "type": "python", "command": ["./scripts/start.sh", "--flag", "./not-resolved", ""]}"#,
    );
    f.exec("py/scripts/start.sh");
    let install = f.load_one();
    assert_eq!(
        install.argv,
        vec![
            s(&canon(&dir).join("scripts/start.sh")),
            "--flag".into(),
            "./not-resolved".into(),
            "".into()
        ]
    );
}

#[test]
fn command_bare_name_is_looked_up_on_path() {
    let f = Fixture::new(&["python3"]);
    f.install(
        "py",
        r#"{"tool_id": "py", "type": "python", "command": ["python3", "-m", "tool"]}"#,
    );
    assert_eq!(
        f.load_one().argv,
        vec![f.runtime("python3"), "-m".into(), "tool".into()]
    );
}

#[test]
fn command_absolute_path() {
    let f = Fixture::new(&["python3"]);
    let abs = f.runtime("python3");
    f.install(
        "py",
        &format!(r#"{{"tool_id": "py", "type": "node", "command": ["{abs}", "main.py"]}}"#),
    );
    assert_eq!(f.load_one().argv, vec![abs, "main.py".into()]);
}

#[test]
fn command_that_cannot_be_found() {
    let f = Fixture::new(&["uv"]);
    f.file("not-exec.sh", "");
    f.install(
        "a-bare",
        r#"{"tool_id": "a", "type": "python", "command": ["python3"]}"#,
    );
    f.install(
        "b-relative",
        r#"{"tool_id": "b", "type": "python", "command": ["./missing.sh"]}"#,
    );
    f.install(
        "c-not-exec",
        r#"{"tool_id": "c", "type": "python", "command": ["../not-exec.sh"]}"#,
    );
    f.install("d-dir", r#"{"tool_id": "d", "type": "python", "command": ["/"]}"#);
    let (cat, problems) = f.load();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 4, "{}", show(&problems));
    assert!(
        matches!(&problems[0].error, CatalogueError::CommandNotFound { program } if program == "python3")
    );
    assert_eq!(
        problems[0].error.to_string(),
        "`command[0]` `python3` was not found on PATH"
    );
    assert!(matches!(
        &problems[1].error,
        CatalogueError::CommandUnusable { path, reason }
            if *path == canon(&f.cat.path().join("b-relative")).join("missing.sh") && reason == "does not exist"
    ));
    assert!(matches!(
        &problems[2].error,
        CatalogueError::CommandUnusable { reason, .. } if reason == "is not executable"
    ));
    assert!(matches!(
        &problems[3].error,
        CatalogueError::CommandUnusable { reason, .. } if reason == "is not a regular file"
    ));
}

#[test]
fn lookup_ignores_relative_dirs_and_non_executables() {
    let bin = TempDir::new().unwrap();
    fs::write(bin.path().join("tool"), "").unwrap(); // not executable
    fs::create_dir(bin.path().join("dir-tool")).unwrap();
    let other = TempDir::new().unwrap();
    write_exec(&other.path().join("tool"), "");
    let opts = LoadOptions::with_search_path([
        PathBuf::from("."),
        bin.path().to_path_buf(),
        other.path().to_path_buf(),
    ]);
    assert_eq!(opts.lookup("tool"), Some(other.path().join("tool")));
    assert_eq!(opts.lookup("dir-tool"), None);
    assert_eq!(opts.lookup(""), None);
    assert_eq!(opts.lookup("a/tool"), None);
}

// ---------------------------------------------------------------------------------------------------------------
// Field validation.

/// Loads `json` as the only install (a binary with a usable `bin/t`) and returns its error.
fn field_error(json: &str) -> CatalogueError {
    let f = Fixture::new(&[]);
    f.install("x", json);
    f.exec("x/bin/t");
    f.load_err()
}

fn assert_invalid(json: &str, want_field: &str, want_reason: &str) {
    match field_error(json) {
        CatalogueError::InvalidField { field, reason } => {
            assert_eq!(field, want_field, "{json}");
            assert!(
                reason.contains(want_reason),
                "{json}: reason {reason:?} lacks {want_reason:?}"
            );
        }
        other => panic!("{json}: expected InvalidField({want_field}), got {other:?}"),
    }
}

#[test]
fn missing_and_bad_tool_id() {
    assert!(matches!(
        field_error(r#"{"type": "binary"}"#),
        CatalogueError::MissingField { field: "tool_id" }
    ));
    assert!(matches!(
        field_error(r#"{"tool_id": null, "type": "binary"}"#),
        CatalogueError::MissingField { field: "tool_id" }
    ));
    assert_invalid(
        r#"{"tool_id": "", "type": "binary"}"#,
        "tool_id",
        "must not be empty",
    );
    assert_invalid(
        r#"{"tool_id": 7, "type": "binary"}"#,
        "tool_id",
        "expected a string, found a number",
    );
    assert_invalid(
        r#"{"tool_id": "../t", "type": "binary"}"#,
        "tool_id",
        "must match",
    );
    assert_invalid(r#"{"tool_id": "a/b", "type": "binary"}"#, "tool_id", "must match");
    assert_invalid(
        r#"{"tool_id": "--help", "type": "binary"}"#,
        "tool_id",
        "must match",
    );
    assert_invalid(r#"{"tool_id": "a b", "type": "binary"}"#, "tool_id", "must match");
    let long = "a".repeat(129);
    assert_invalid(
        &format!(r#"{{"tool_id": "{long}", "type": "binary"}}"#),
        "tool_id",
        "longer than 128",
    );
}

#[test]
fn missing_and_unknown_type() {
    assert!(matches!(
        field_error(r#"{"tool_id": "t"}"#),
        CatalogueError::MissingField { field: "type" }
    ));
    let err = field_error(r#"{"tool_id": "t", "type": "ruby"}"#);
    assert!(matches!(&err, CatalogueError::UnknownType { found } if found == "ruby"));
    assert_eq!(
        err.to_string(),
        "unknown type `ruby` (expected python, node, go or binary)"
    );
    assert!(matches!(
        field_error(r#"{"tool_id": "t", "type": "Binary"}"#),
        CatalogueError::UnknownType { .. }
    ));
    assert_invalid(
        r#"{"tool_id": "t", "type": ["binary"]}"#,
        "type",
        "expected a string, found an array",
    );
}

#[test]
fn bad_command() {
    let base = r#""tool_id": "t", "type": "binary""#;
    assert_invalid(
        &format!(r#"{{{base}, "command": "./bin/t"}}"#),
        "command",
        "expected an array of strings, found a string",
    );
    assert_invalid(
        &format!(r#"{{{base}, "command": []}}"#),
        "command",
        "must not be empty",
    );
    assert_invalid(
        &format!(r#"{{{base}, "command": ["./bin/t", 1]}}"#),
        "command[1]",
        "expected a string, found a number",
    );
    assert_invalid(
        &format!(r#"{{{base}, "command": [null]}}"#),
        "command[0]",
        "expected a string, found null",
    );
    assert_invalid(
        &format!(r#"{{{base}, "command": [""]}}"#),
        "command[0]",
        "must not be empty",
    );
    assert_invalid(
        &format!(r#"{{{base}, "command": ["./bin/t", "a\u0000b"]}}"#),
        "command[1]",
        "NUL",
    );
}

#[test]
fn bad_enabled_idle_timeout_and_protocol() {
    let base = r#""tool_id": "t", "type": "binary""#;
    assert_invalid(
        &format!(r#"{{{base}, "enabled": "no"}}"#),
        "enabled",
        "expected a boolean",
    );
    assert_invalid(
        &format!(r#"{{{base}, "idle_timeout_secs": 0}}"#),
        "idle_timeout_secs",
        "must be > 0",
    );
    assert_invalid(
        &format!(r#"{{{base}, "idle_timeout_secs": -5}}"#),
        "idle_timeout_secs",
        "must be > 0",
    );
    assert_invalid(
        &format!(r#"{{{base}, "idle_timeout_secs": 1e300}}"#),
        "idle_timeout_secs",
        "too big",
    );
    assert_invalid(
        &format!(r#"{{{base}, "idle_timeout_secs": "60"}}"#),
        "idle_timeout_secs",
        "expected a number",
    );
    assert_invalid(
        &format!(r#"{{{base}, "protocol": "mcp"}}"#),
        "protocol",
        "unsupported protocol `mcp`",
    );
    assert_invalid(
        &format!(r#"{{{base}, "ping_interval_secs": 0}}"#),
        "ping_interval_secs",
        "must be > 0",
    );
    assert_invalid(
        &format!(r#"{{{base}, "allow_methods": ["ok", 3]}}"#),
        "allow_methods[1]",
        "expected a method name",
    );
    assert_invalid(
        &format!(r#"{{{base}, "protocol": 1}}"#),
        "protocol",
        "expected a string",
    );
}

#[test]
fn bad_limits() {
    let base = r#""tool_id": "t", "type": "binary""#;
    assert_invalid(
        &format!(r#"{{{base}, "limits": {{"memory": 1}}}}"#),
        "limits",
        "unknown field `memory`",
    );
    assert_invalid(
        &format!(r#"{{{base}, "limits": {{"pids_max": -1}}}}"#),
        "limits",
        "-1",
    );
    assert_invalid(
        &format!(r#"{{{base}, "limits": {{"cpu_millis": 1.5}}}}"#),
        "limits",
        "1.5",
    );
    assert_invalid(
        &format!(r#"{{{base}, "limits": {{"memory_bytes": 0}}}}"#),
        "limits.memory_bytes",
        "must be > 0",
    );
    assert_invalid(
        &format!(r#"{{{base}, "limits": [1]}}"#),
        "limits",
        "expected an object, found an array",
    );
}

#[test]
fn bad_env() {
    let base = r#""tool_id": "t", "type": "binary""#;
    assert_invalid(
        &format!(r#"{{{base}, "env": ["HOME", "FOO=bar"]}}"#),
        "env[1]",
        "names only",
    );
    assert_invalid(
        &format!(r#"{{{base}, "env": ["1ABC"]}}"#),
        "env[0]",
        "not a variable name",
    );
    assert_invalid(
        &format!(r#"{{{base}, "env": [""]}}"#),
        "env[0]",
        "not a variable name",
    );
    assert_invalid(
        &format!(r#"{{{base}, "env": ["A-B"]}}"#),
        "env[0]",
        "not a variable name",
    );
    assert_invalid(
        &format!(r#"{{{base}, "env": [42]}}"#),
        "env[0]",
        "expected a variable name",
    );
    assert_invalid(
        &format!(r#"{{{base}, "env": "HOME"}}"#),
        "env",
        "expected an array",
    );
}

#[test]
fn invalid_json_names_the_file() {
    let f = Fixture::new(&[]);
    f.install("broken", r#"{"tool_id": "t", "type": "binary",}"#);
    let (cat, problems) = f.load();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 1);
    let manifest = f.manifest("broken");
    assert_eq!(problems[0].path, manifest);
    assert!(matches!(&problems[0].error, CatalogueError::Json { path, .. } if *path == manifest));
    let shown = problems[0].to_string();
    assert!(
        shown.starts_with(&format!("{}: invalid JSON: ", manifest.display())),
        "{shown}"
    );
    assert!(shown.contains("line 1"), "{shown}");

    let err = field_error("[1, 2]");
    assert!(
        matches!(err, CatalogueError::NotAnObject { found: "an array" }),
        "{err}"
    );
}

#[test]
fn manifest_that_is_not_a_small_regular_file() {
    let f = Fixture::new(&[]);
    fs::create_dir_all(f.cat.path().join("a-dir/executa.json")).unwrap();
    fs::create_dir_all(f.cat.path().join("b-fifo")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        f.manifest("b-fifo"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_bits_truncate(0o644),
        0,
    )
    .unwrap();
    let big = format!(
        r#"{{"tool_id": "t", "type": "binary", "_comment": "{}"}}"#,
        "x".repeat(usize::try_from(MAX_MANIFEST_BYTES).unwrap())
    );
    f.install("c-big", &big);
    let (cat, problems) = f.load(); // must not block on the FIFO
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 3, "{}", show(&problems));
    assert!(matches!(&problems[0].error, CatalogueError::NotAFile { path } if *path == f.manifest("a-dir")));
    assert!(matches!(&problems[1].error, CatalogueError::NotAFile { path } if *path == f.manifest("b-fifo")));
    assert!(matches!(
        &problems[2].error,
        CatalogueError::TooLarge {
            limit: MAX_MANIFEST_BYTES,
            ..
        }
    ));
}

// ---------------------------------------------------------------------------------------------------------------
// Catalogue-level behaviour.

#[test]
fn duplicate_tool_id_first_wins() {
    let f = Fixture::new(&[]);
    let a = f.install("a", r#"{"tool_id": "dup", "type": "binary"}"#);
    f.exec("a/bin/dup");
    f.install("b", r#"{"tool_id": "dup", "type": "binary"}"#);
    f.exec("b/bin/dup");
    let (cat, problems) = f.load();
    assert_eq!(cat.len(), 1);
    assert_eq!(cat.get("dup").unwrap().dir, canon(&a));
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, f.manifest("b"));
    assert!(matches!(
        &problems[0].error,
        CatalogueError::Duplicate { tool_id, first } if tool_id == "dup" && *first == f.manifest("a")
    ));
    let shown = problems[0].to_string();
    assert!(
        shown.contains(&s(&f.manifest("a"))) && shown.contains(&s(&f.manifest("b"))),
        "{shown}"
    );
}

#[test]
fn disabled_entry_is_listed_but_not_runnable() {
    let f = Fixture::new(&[]); // no uv: a disabled install's launch is not resolved
    f.install("off", r#"{"tool_id": "off", "type": "python", "enabled": false}"#);
    let install = f.load_one();
    assert!(!install.enabled);
    assert!(!install.is_runnable());
    assert!(install.argv.is_empty());
    assert_eq!(install.kind, InstallType::Python);
}

#[test]
fn extensions_parse_and_unknown_fields_are_ignored() {
    let f = Fixture::new(&[]);
    f.install(
        "full",
        r#"{
            "_comment": "dev install",
            "tool_id": "tool-acme-x-1",
            "type": "binary",
            "enabled": true,
            "version": "1.2.3",
            "runtime": {"whatever": [1, 2]},
            "limits": {"memory_bytes": 268435456, "cpu_millis": 500},
            "env": ["OPENAI_BASE_URL", "_X1", "OPENAI_BASE_URL"],
            "idle_timeout_secs": 90.5,
            "protocol": "executa",
            "command": null
        }"#,
    );
    f.exec("full/bin/tool-acme-x-1");
    let install = f.load_one();
    assert_eq!(
        install.limits,
        LimitOverrides {
            memory_bytes: Some(268_435_456),
            pids_max: None,
            cpu_millis: Some(500)
        }
    );
    assert_eq!(install.env, strings(&["OPENAI_BASE_URL", "_X1"]));
    assert_eq!(install.idle_timeout, Some(Duration::from_secs_f64(90.5)));
    assert_eq!(install.protocol, Some(fleet_worker::catalogue::Dialect::Executa));
    assert!(install.enabled);
}

#[test]
fn hidden_dirs_plain_files_and_dirs_without_manifest_are_skipped() {
    let f = Fixture::new(&[]);
    f.install(".staging-123", r#"{"tool_id": "hidden", "type": "binary"}"#);
    f.exec(".staging-123/bin/hidden");
    fs::create_dir(f.cat.path().join("scratch")).unwrap();
    f.file("README.md", "plugins live here");
    f.file("executa.json", r#"{"tool_id": "top", "type": "binary"}"#);
    f.install("ok", r#"{"tool_id": "ok", "type": "binary"}"#);
    f.exec("ok/bin/ok");
    let (cat, problems) = f.load();
    assert!(problems.is_empty(), "{}", show(&problems));
    assert_eq!(cat.iter().map(|i| i.tool_id.as_str()).collect::<Vec<_>>(), ["ok"]);
}

#[test]
fn symlinked_install_dir_is_followed_and_canonical() {
    let f = Fixture::new(&[]);
    let real = f.install(".versions/v1", r#"{"tool_id": "linked", "type": "binary"}"#);
    f.exec(".versions/v1/bin/linked");
    std::os::unix::fs::symlink(&real, f.cat.path().join("linked")).unwrap();
    let install = f.load_one();
    assert_eq!(install.dir, canon(&real));
    assert_eq!(install.argv, vec![s(&canon(&real).join("bin/linked"))]);
}

#[test]
fn a_broken_entry_does_not_prevent_the_others() {
    let f = Fixture::new(&["uv", "node"]);
    f.install("a-python", r#"{"tool_id": "py", "type": "python"}"#);
    f.file("a-python/pyproject.toml", "");
    f.install("b-bad-json", "{");
    f.install("c-node", r#"{"tool_id": "js", "type": "node"}"#);
    f.file("c-node/package.json", r#"{"bin": "cli.js"}"#);
    f.file("c-node/cli.js", "");
    f.install("d-go-without-go", r#"{"tool_id": "gg", "type": "go"}"#);
    f.file("d-go-without-go/go.mod", "");
    f.install("e-binary", r#"{"tool_id": "bb", "type": "binary"}"#);
    f.exec("e-binary/bin/bb");
    f.install(
        "f-dup",
        r#"{"tool_id": "js", "type": "binary", "command": ["uv"]}"#,
    );
    f.install(
        "g-disabled",
        r#"{"tool_id": "off", "type": "go", "enabled": false}"#,
    );
    f.install("h-no-type", r#"{"tool_id": "nt"}"#);
    fs::create_dir(f.cat.path().join("i-empty")).unwrap();

    let (cat, problems) = f.load();
    let ids: BTreeSet<&str> = cat.iter().map(|i| i.tool_id.as_str()).collect();
    assert_eq!(ids, BTreeSet::from(["bb", "js", "off", "py"]));
    assert_eq!(cat.len(), 4);
    assert!(!cat.is_empty());
    assert_eq!((&cat).into_iter().count(), 4);
    assert_eq!(cat.dir(), f.cat.path());

    let got: Vec<(PathBuf, String)> = problems
        .iter()
        .map(|p| (p.path.clone(), p.error.to_string()))
        .collect();
    let bad_json = f.manifest("b-bad-json");
    let want = vec![
        (
            bad_json.clone(),
            format!(
                "{}: invalid JSON: EOF while parsing an object at line 1 column 1",
                bad_json.display()
            ),
        ),
        (
            f.manifest("d-go-without-go"),
            "type go needs `go` on PATH (or set `command`)".to_string(),
        ),
        (
            f.manifest("f-dup"),
            format!(
                "duplicate tool_id `js`: already provided by {}",
                f.manifest("c-node").display()
            ),
        ),
        (
            f.manifest("h-no-type"),
            "missing required field `type`".to_string(),
        ),
    ];
    assert_eq!(got, want);
}

#[test]
fn first_launch_until_marked_described() {
    let f = Fixture::new(&[]);
    f.install("b", r#"{"tool_id": "b", "type": "binary"}"#);
    f.exec("b/bin/b");
    let install = f.load_one();
    assert!(install.first_launch);
    assert_eq!(install.marker_path(), install.dir.join(DESCRIBED_MARKER));
    install.mark_described().unwrap();
    install.mark_described().unwrap(); // idempotent

    let again = f.load_one();
    assert!(!again.first_launch);
    assert_eq!(again.describe_timeout(), limits::DESCRIBE_TIMEOUT);
}

#[test]
fn marker_symlink_is_not_followed() {
    let f = Fixture::new(&[]);
    let dir = f.install("b", r#"{"tool_id": "b", "type": "binary"}"#);
    f.exec("b/bin/b");
    let target = f.cat.path().join("elsewhere");
    std::os::unix::fs::symlink(&target, dir.join(DESCRIBED_MARKER)).unwrap();
    let install = f.load_one();
    assert!(install.first_launch, "a dangling symlink is not a marker");
    assert!(install.mark_described().is_err());
    assert!(
        !target.exists(),
        "mark_described created a file through a symlink"
    );
    assert!(f.load_one().first_launch);
}

#[test]
fn unreadable_catalogue_dir_is_an_error() {
    let f = Fixture::new(&[]);
    let missing = f.cat.path().join("nope");
    match Catalogue::load(&missing, &f.opts()) {
        Err(CatalogueError::Io { path, source }) => {
            assert_eq!(path, missing);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Io, got {other:?}"),
    }
    let file = f.file("plain", "");
    let err = Catalogue::load(&file, &f.opts()).unwrap_err();
    assert!(
        matches!(&err, CatalogueError::Io { path, .. } if *path == file),
        "{err}"
    );
    assert!(
        err.to_string().starts_with(&format!("{}: ", file.display())),
        "{err}"
    );
}

#[test]
fn empty_catalogue() {
    let f = Fixture::new(&[]);
    let (cat, problems) = f.load();
    assert!(cat.is_empty() && problems.is_empty());
    assert_eq!(cat.len(), 0);
    assert!(cat.get("anything").is_none());
}

#[test]
fn animus_fields() {
    let f = Fixture::new(&[]);
    f.install(
        "an",
        r#"{"tool_id": "an", "type": "binary", "protocol": "animus", "ping_interval_secs": 0.5,
            "allow_methods": ["notes/add", "notes.search"]}"#,
    );
    f.exec("an/bin/an");
    let install = f.load_one();
    assert_eq!(install.protocol, Some(fleet_worker::catalogue::Dialect::Animus));
    assert_eq!(install.ping_interval, Some(Duration::from_millis(500)));
    assert_eq!(
        install.allow_methods,
        Some(vec!["notes/add".to_string(), "notes.search".to_string()])
    );
    let f = Fixture::new(&[]);
    f.install("ex", r#"{"tool_id": "ex", "type": "binary"}"#);
    f.exec("ex/bin/ex");
    let install = f.load_one();
    assert_eq!(install.protocol, None, "absent: probed");
    assert_eq!(install.allow_methods, None);
}
