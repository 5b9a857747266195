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
    // No script declared: the environment `uv sync` prepares before the first spawn holds it, if anything does.
    assert_eq!(
        install.argv,
        vec![s(&dir.join(".fleet-venv/bin/tool-acme-weather-1a2b"))]
    );
    assert_eq!(
        install.prepare,
        Some(Prepare::UvSync {
            uv: f.bin.path().join("uv"),
            python: None,
            venv: dir.join(".fleet-venv"),
        })
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
fn python_without_uv_or_script_names_what_was_tried() {
    let f = Fixture::new(&["node", "go"]);
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    f.file("py/pyproject.toml", "");
    let (cat, problems) = f.load();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, f.manifest("py"));
    let CatalogueError::NothingToLaunch { kind, tried } = &problems[0].error else {
        panic!("{}", problems[0]);
    };
    assert_eq!(*kind, InstallType::Python);
    assert_eq!(
        tried,
        &strings(&[
            "`[project.scripts]` (pyproject.toml declares no script)",
            "`.fleet-venv/bin/py` after `uv sync` (`uv` is not on PATH)",
            "the scripts py.py, main.py, __main__.py (none exists)",
        ])
    );
    assert_eq!(
        problems[0].to_string(),
        format!(
            "{}: type python: nothing to launch; tried `[project.scripts]` (pyproject.toml declares no script); \
             `.fleet-venv/bin/py` after `uv sync` (`uv` is not on PATH); the scripts py.py, main.py, __main__.py (none \
             exists) (or set `command`)",
            f.manifest("py").display()
        )
    );
}

#[test]
fn python_without_pyproject_or_script_is_an_error() {
    let f = Fixture::new(&["uv"]);
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    let err = f.load_err();
    assert!(
        matches!(&err, CatalogueError::NothingToLaunch { tried, .. }
            if tried[0].contains("no pyproject.toml") && tried[1].contains("main.py")),
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

/// `package.json` `bin[tool_id]` → `bin[name]` (the manifest's `name`, `slug`, then the package's `name`) →
/// `bin` (a string) → `main` → `module`.
#[test]
fn node_entry_resolution_order() {
    let f = Fixture::new(&["node"]);
    let all = [
        "from-bin-map.js",
        "from-bin-string.js",
        "from-main.js",
        "from-module.mjs",
        "other.js",
        "by-name.js",
        "by-slug.js",
        "by-pkg.js",
    ];
    // (sub, executa.json extra fields, package.json, the entry expected)
    let cases: [(&str, &str, &str, &str); 10] = [
        (
            "a-bin-map",
            r#", "name": "nm""#,
            r#"{"bin": {"other": "other.js", "nm": "by-name.js", "ID": "./from-bin-map.js"}, "main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-bin-map.js",
        ),
        (
            "b-bin-string",
            "",
            r#"{"bin": "from-bin-string.js", "main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-bin-string.js",
        ),
        (
            "c-bin-map-without-id",
            "",
            r#"{"bin": {"other": "other.js"}, "main": "from-main.js"}"#,
            "from-main.js",
        ),
        (
            "d-main",
            "",
            r#"{"main": "from-main.js", "module": "from-module.mjs"}"#,
            "from-main.js",
        ),
        (
            "e-module",
            "",
            r#"{"module": "from-module.mjs"}"#,
            "from-module.mjs",
        ),
        // Node resolves `main` without its extension; so do we.
        ("f-main-no-ext", "", r#"{"main": "from-main"}"#, "from-main.js"),
        (
            "g-bin-name",
            r#", "name": "nm", "slug": "sl""#,
            r#"{"name": "pk", "bin": {"sl": "by-slug.js", "nm": "by-name.js", "pk": "by-pkg.js"}, "main": "from-main.js"}"#,
            "by-name.js",
        ),
        (
            "h-bin-slug",
            r#", "slug": "sl""#,
            r#"{"name": "pk", "bin": {"sl": "by-slug.js", "pk": "by-pkg.js"}, "main": "from-main.js"}"#,
            "by-slug.js",
        ),
        (
            "i-bin-package-name",
            "",
            r#"{"name": "pk", "bin": {"pk": "./by-pkg.js"}, "main": "from-main.js"}"#,
            "by-pkg.js",
        ),
        (
            "j-bin-map-before-string-forms",
            r#", "name": "nm""#,
            r#"{"name": "pk", "bin": {"pk": "by-pkg.js"}, "main": "from-main.js"}"#,
            "by-pkg.js",
        ),
    ];
    for (sub, extra, pkg, _) in &cases {
        let id = format!("tool-{sub}");
        f.install(sub, &format!(r#"{{"tool_id": "{id}", "type": "node"{extra}}}"#));
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
    for (sub, _, _, want) in cases {
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

// ---------------------------------------------------------------------------------------------------------------
// What authors ship: `[project.scripts]` and `package.json` `bin` named after the plugin's `name`/`slug`.

use fleet_worker::catalogue::{Needed, PYTHON_SCRIPT_LAUNCHER, Prepare, Runner};

/// The fixture plugin directories laid out like the public SDK's examples.
fn sdk_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/plugins")
        .join(name)
}

/// Copies the files of `from` into `<cat>/<sub>/`.
fn copy_fixture(f: &Fixture, from: &Path, sub: &str) -> PathBuf {
    let dir = f.cat.path().join(sub);
    fs::create_dir_all(&dir).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    dir
}

/// The launch of a console script without `uv`.
fn launcher(python: String, root: &Path, module: &str, attr: &str, script: &str) -> Vec<String> {
    vec![
        python,
        "-c".into(),
        PYTHON_SCRIPT_LAUNCHER.into(),
        s(root),
        module.into(),
        attr.into(),
        script.into(),
    ]
}

const TWO_SCRIPTS: &str = "[project.scripts]\nother = \"other_mod:run\"\n";

#[test]
fn python_script_is_the_tool_id_then_name_then_slug_then_the_only_one() {
    // (sub, executa.json extra fields, [project.scripts] body, the script expected)
    let cases: [(&str, &str, &str, &str); 4] = [
        (
            "a-tool-id",
            r#", "name": "n", "slug": "sl""#,
            "n = \"mod:main\"\nsl = \"mod:main\"\nID = \"mod:main\"\n",
            "ID",
        ),
        (
            "b-name",
            r#", "name": "nm", "slug": "sl""#,
            "sl = \"mod:main\"\nnm = \"mod:main\"\n",
            "nm",
        ),
        (
            "c-slug",
            r#", "name": "nm", "slug": "sl""#,
            "sl = \"mod:main\"\n",
            "sl",
        ),
        ("d-only", "", "whatever = \"mod:main\"\n", "whatever"),
    ];
    for with_uv in [true, false] {
        let f = Fixture::new(if with_uv { &["uv", "python3"] } else { &["python3"] });
        for (sub, extra, scripts, _) in &cases {
            let id = format!("tool-{sub}");
            f.install(sub, &format!(r#"{{"tool_id": "{id}", "type": "python"{extra}}}"#));
            // A second script that never matches, except in the only-script case.
            let body = scripts.replace("ID", &id);
            let body = if *sub == "d-only" {
                body
            } else {
                format!("{body}other = \"other_mod:run\"\n")
            };
            f.file(
                &format!("{sub}/pyproject.toml"),
                &format!("[project]\nname = \"x\"\n\n[project.scripts]\n{body}"),
            );
            f.file(&format!("{sub}/mod.py"), "def main(): return 0\n");
        }
        let (cat, problems) = f.load();
        assert!(problems.is_empty(), "{}", show(&problems));
        for (sub, _, _, want) in cases {
            let id = format!("tool-{sub}");
            let want = want.replace("ID", &id);
            let dir = canon(&f.cat.path().join(sub));
            let install = cat.get(&id).unwrap();
            let (python, prepare) = if with_uv {
                let venv = dir.join(".fleet-venv");
                let prepare = Prepare::UvSync {
                    uv: f.bin.path().join("uv"),
                    python: Some(f.bin.path().join("python3")),
                    venv: venv.clone(),
                };
                (s(&venv.join("bin/python")), Some(prepare))
            } else {
                (f.runtime("python3"), None)
            };
            assert_eq!(
                install.argv,
                launcher(python, &dir, "mod", "main", &want),
                "{sub}, uv: {with_uv}"
            );
            assert_eq!(install.prepare, prepare, "{sub}, uv: {with_uv}");
        }
    }
}

#[test]
fn python_scripts_none_of_which_matches_are_named() {
    let f = Fixture::new(&["uv", "python3"]);
    f.install(
        "py",
        r#"{"tool_id": "tool-x", "type": "python", "name": "nm", "slug": "sl"}"#,
    );
    f.file("py/pyproject.toml", &format!("{TWO_SCRIPTS}another = \"m:f\"\n"));
    let CatalogueError::NothingToLaunch { kind, tried } = f.load_err() else {
        panic!("expected NothingToLaunch");
    };
    assert_eq!(kind, InstallType::Python);
    assert_eq!(
        tried,
        strings(&[
            "`[project.scripts]` key `tool-x` (the manifest's `tool_id`)",
            "`[project.scripts]` key `nm` (the manifest's `name`)",
            "`[project.scripts]` key `sl` (the manifest's `slug`)",
            "the only `[project.scripts]` entry (it declares 2: another, other)",
            "the scripts tool-x.py, main.py, __main__.py (none exists)",
        ])
    );
}

#[test]
fn python_without_uv_imports_the_module_from_the_flat_or_src_layout() {
    let f = Fixture::new(&["python3"]);
    // src layout, a package, a dotted attribute, extras ignored.
    f.install("src", r#"{"tool_id": "t-src", "type": "python"}"#);
    f.file(
        "src/pyproject.toml",
        "[project.scripts]\nrun-it = \"pkg.cli:app.main [fast]\"\n",
    );
    f.file("src/src/pkg/__init__.py", "");
    f.file("src/src/pkg/cli.py", "");
    // The module is nowhere: every place looked at is named.
    f.install("missing", r#"{"tool_id": "t-missing", "type": "python"}"#);
    f.file("missing/pyproject.toml", "[project.scripts]\nx = \"gone:main\"\n");
    let (cat, problems) = f.load();
    assert_eq!(problems.len(), 1, "{}", show(&problems));
    let dir = canon(&f.cat.path().join("src"));
    assert_eq!(cat.get("t-src").unwrap().code, vec![dir.join("src/pkg/cli.py")]);
    assert_eq!(
        cat.get("t-src").unwrap().argv,
        launcher(
            f.runtime("python3"),
            &dir.join("src"),
            "pkg.cli",
            "app.main",
            "run-it"
        )
    );
    let CatalogueError::NothingToLaunch { tried, .. } = &problems[0].error else {
        panic!("{}", problems[0]);
    };
    assert_eq!(
        tried,
        &strings(&[
            "`[project.scripts]` `x` = module `gone`: none of gone.py, gone, src/gone.py, src/gone exists"
        ])
    );
}

#[test]
fn python_fallback_scripts_still_run_without_uv() {
    let f = Fixture::new(&["python3"]);
    // No pyproject at all, a pyproject without scripts, a fallback named after the tool id.
    f.install("a", r#"{"tool_id": "a", "type": "python"}"#);
    f.file("a/main.py", "");
    f.install("b", r#"{"tool_id": "b", "type": "python"}"#);
    f.file("b/pyproject.toml", "[project]\nname = \"b\"\n");
    f.file("b/__main__.py", "");
    f.install("c", r#"{"tool_id": "c", "type": "python"}"#);
    f.file("c/c.py", "");
    f.file("c/main.py", "");
    let (cat, problems) = f.load();
    assert!(problems.is_empty(), "{}", show(&problems));
    for (id, script) in [("a", "main.py"), ("b", "__main__.py"), ("c", "c.py")] {
        let want = canon(&f.cat.path().join(id)).join(script);
        assert_eq!(
            cat.get(id).unwrap().argv,
            vec![f.runtime("python3"), s(&want)],
            "{id}"
        );
    }
    // A script found but no python3 at all: the missing interpreter is named.
    let g = Fixture::new(&[]);
    g.install("a", r#"{"tool_id": "a", "type": "python"}"#);
    g.file("a/pyproject.toml", "[project.scripts]\na = \"a:main\"\n");
    g.file("a/a.py", "");
    let err = g.load_err();
    assert!(
        matches!(
            err,
            CatalogueError::MissingRuntime {
                kind: InstallType::Python,
                program: "python3"
            }
        ),
        "{err}"
    );
}

#[test]
fn bad_pyproject_names_the_file_and_the_field() {
    let cases = [
        ("[project\n", "invalid TOML"),
        ("project = 1\n", "`project` must be a table, found integer"),
        (
            "[project]\nscripts = [1]\n",
            "`[project.scripts]` must be a table, found array",
        ),
        (
            "[project.scripts]\nx = 1\n",
            "`[project.scripts]` `x` must be a string (\"module:function\"), found integer",
        ),
        (
            "[project.scripts]\nx = \"nocolon\"\n",
            "`[project.scripts]` `x` = \"nocolon\": expected \"module:function\"",
        ),
        (
            "[project.scripts]\nx = \"os; import evil:main\"\n",
            "the module is not a dotted Python name",
        ),
        (
            "[project.scripts]\nx = \"m:main()\"\n",
            "the function is not a dotted Python name",
        ),
    ];
    for (toml, want) in cases {
        let f = Fixture::new(&["python3"]);
        let pyproject = f.file("p/pyproject.toml", toml);
        f.install("p", r#"{"tool_id": "p", "type": "python"}"#);
        let err = f.load_err();
        assert!(
            matches!(&err, CatalogueError::Toml { path, .. } | CatalogueError::BadFile { path, .. }
                if *path == canon(&pyproject)),
            "{toml:?}: {err}"
        );
        let shown = err.to_string();
        assert!(shown.contains(want), "{toml:?}: {shown}");
    }
}

#[test]
fn name_and_slug_must_be_strings() {
    assert_invalid(
        r#"{"tool_id": "t", "type": "binary", "name": 3}"#,
        "name",
        "expected a string, found a number",
    );
    assert_invalid(
        r#"{"tool_id": "t", "type": "binary", "slug": []}"#,
        "slug",
        "expected a string, found an array",
    );
}

#[test]
fn the_sdk_python_example_runs_its_script_with_or_without_uv() {
    for with_uv in [true, false] {
        let f = Fixture::new(if with_uv { &["uv", "python3"] } else { &["python3"] });
        let dir = canon(&copy_fixture(&f, &sdk_fixture("sdk-python"), "basic-tool"));
        let install = f.load_one();
        assert_eq!(install.tool_id, "tool-dev-example-text-tool");
        let python = if with_uv {
            s(&dir.join(".fleet-venv/bin/python"))
        } else {
            f.runtime("python3")
        };
        assert_eq!(
            install.argv,
            launcher(python, &dir, "example_plugin", "main", "example-text-tool"),
            "uv: {with_uv}"
        );
        assert_eq!(install.prepare.is_some(), with_uv);
        // The module is fingerprinted with the interpreter: a changed plugin is quarantined.
        assert_eq!(install.code, vec![dir.join("example_plugin.py")]);
    }
}

#[test]
fn node_without_an_entry_names_every_key_tried() {
    let f = Fixture::new(&["node"]);
    f.install(
        "n",
        r#"{"tool_id": "t", "type": "node", "name": "nm", "slug": "sl"}"#,
    );
    f.file("n/package.json", r#"{"name": "pk", "bin": {"other": "x.js"}}"#);
    let err = f.load_err();
    assert_eq!(
        err.to_string(),
        "`package.json` has no entry point: none of `bin.t`, `bin.nm`, `bin.sl`, `bin.pk`, `bin`, `main`, \
         `module` (`bin` a string) (or set `command`)"
    );
}

#[test]
fn the_sdk_node_example_runs_its_bin() {
    let f = Fixture::new(&["node"]);
    let dir = canon(&copy_fixture(&f, &sdk_fixture("sdk-node"), "node-tool"));
    let install = f.load_one();
    assert_eq!(install.tool_id, "tool-dev-example-node-tool");
    assert_eq!(
        install.argv,
        vec![f.runtime("node"), s(&dir.join("example_plugin.js"))]
    );
}

// ---------------------------------------------------------------------------------------------------------------
// Plugins under per-user uids: what "other" users cannot reach is reported at load, with its fix.

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
}

/// A fixture whose catalogue and fake PATH other users can traverse (whatever the umask made them).
fn open_fixture(runtimes: &[&str]) -> Fixture {
    let f = Fixture::new(runtimes);
    chmod(f.cat.path(), 0o755);
    chmod(f.bin.path(), 0o755);
    f
}

#[test]
fn an_interpreter_under_a_closed_home_is_skipped_then_reported_with_its_fix() {
    let f = open_fixture(&[]);
    // A pyenv-style shim in a 0700 home, as root's `/root/.pyenv/shims/python3`.
    let home = TempDir::new().unwrap();
    chmod(home.path(), 0o700);
    let shims = home.path().join(".pyenv/shims");
    fs::create_dir_all(&shims).unwrap();
    write_exec(&shims.join("python3"), "#!/bin/sh\nexit 0\n");
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    f.file("py/main.py", "");
    chmod(&f.cat.path().join("py"), 0o755);

    // Only the shim: reported at load, with both fixes.
    let opts =
        LoadOptions::with_search_path([shims.clone()]).with_runner(Runner::OtherUsers { private_tmp: false });
    let (cat, problems) = Catalogue::load(f.cat.path(), &opts).unwrap();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 1, "{}", show(&problems));
    let CatalogueError::RuntimeUnreachable { program, blocked } = &problems[0].error else {
        panic!("{}", problems[0]);
    };
    assert_eq!(program, "python3");
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0].path, shims.join("python3"));
    let home_c = canon(home.path());
    assert_eq!(blocked[0].blockers[0].path, home_c);
    assert_eq!(
        problems[0].error.to_string(),
        format!(
            "`python3` is on PATH only where the plugins' uids cannot execute it: {} ({} (mode 700) is not \
             searchable by other users); install `python3` system-wide (e.g. /usr/bin/python3), or run `chmod \
             o+x {}`",
            shims.join("python3").display(),
            home_c.display(),
            home_c.display()
        )
    );
    // The worker itself could run it: `run_as: inherit` is not affected.
    let own = LoadOptions::with_search_path([shims.clone()]);
    let (cat, problems) = Catalogue::load(f.cat.path(), &own).unwrap();
    assert!(problems.is_empty(), "{}", show(&problems));
    assert_eq!(cat.get("py").unwrap().argv[0], s(&shims.join("python3")));

    // The shim first, a reachable python3 after it: the next entry is used.
    let sys = TempDir::new().unwrap();
    chmod(sys.path(), 0o755);
    write_exec(&sys.path().join("python3"), "#!/bin/sh\nexit 0\n");
    let opts = LoadOptions::with_search_path([shims.clone(), sys.path().to_path_buf()])
        .with_runner(Runner::OtherUsers { private_tmp: false });
    let (cat, problems) = Catalogue::load(f.cat.path(), &opts).unwrap();
    assert!(problems.is_empty(), "{}", show(&problems));
    assert_eq!(cat.get("py").unwrap().argv[0], s(&sys.path().join("python3")));
    assert_eq!(opts.lookup("python3"), Some(sys.path().join("python3")));

    // Once the home is opened, the shim is usable again.
    chmod(home.path(), 0o711);
    let opts =
        LoadOptions::with_search_path([shims.clone()]).with_runner(Runner::OtherUsers { private_tmp: false });
    assert_eq!(opts.lookup("python3"), Some(shims.join("python3")));
}

#[test]
fn a_catalogue_under_a_closed_directory_is_one_problem_naming_the_chmod() {
    let f = open_fixture(&["python3"]);
    f.install("py", r#"{"tool_id": "py", "type": "python"}"#);
    f.file("py/main.py", "");
    chmod(f.cat.path(), 0o700); // as `mktemp -d` makes it
    let opts = f.opts().with_runner(Runner::OtherUsers { private_tmp: false });
    let (cat, problems) = Catalogue::load(f.cat.path(), &opts).unwrap();
    assert!(cat.is_empty());
    assert_eq!(problems.len(), 1, "{}", show(&problems));
    let cat_c = canon(f.cat.path());
    assert_eq!(problems[0].path, f.cat.path());
    assert_eq!(
        problems[0].to_string(),
        format!(
            "the catalogue directory {} is out of the plugins' reach: {} (mode 700) is not searchable by other \
             users; fix: `chmod o+x {}`",
            f.cat.path().display(),
            cat_c.display(),
            cat_c.display()
        )
    );
    // Plugins with a private /tmp see their install mounted back, the directories leading there re-created.
    if cat_c.starts_with("/tmp") {
        let private = f.opts().with_runner(Runner::OtherUsers { private_tmp: true });
        let (cat, problems) = Catalogue::load(f.cat.path(), &private).unwrap();
        assert!(problems.is_empty(), "{}", show(&problems));
        assert_eq!(cat.len(), 1);
    } else {
        println!("skipping the private /tmp half: the fixture is not under /tmp");
    }
}

#[test]
fn an_install_dir_program_or_module_out_of_reach_is_reported_per_install() {
    let f = open_fixture(&["python3"]);
    // A closed install directory.
    let closed = f.install("a-closed", r#"{"tool_id": "a", "type": "python"}"#);
    f.file("a-closed/main.py", "");
    chmod(&closed, 0o750);
    // A binary only its owner and group may run.
    let bin = f.install("b-bin", r#"{"tool_id": "b", "type": "binary"}"#);
    chmod(&bin, 0o755);
    let exe = f.exec("b-bin/bin/b");
    chmod(&exe, 0o750);
    // A script's module other users cannot read.
    let module = f.install("c-module", r#"{"tool_id": "c", "type": "python"}"#);
    chmod(&module, 0o755);
    f.file(
        "c-module/pyproject.toml",
        "[project.scripts]\nc = \"secret:main\"\n",
    );
    let secret = f.file("c-module/secret.py", "");
    chmod(&secret, 0o600);

    let opts = f.opts().with_runner(Runner::OtherUsers { private_tmp: false });
    let (cat, problems) = Catalogue::load(f.cat.path(), &opts).unwrap();
    assert!(
        cat.is_empty(),
        "{:?}",
        cat.iter().map(|i| &i.tool_id).collect::<Vec<_>>()
    );
    assert_eq!(problems.len(), 3, "{}", show(&problems));
    let unreachable = |i: usize| match &problems[i].error {
        CatalogueError::Unreachable { what, path, blockers } => (*what, path.clone(), blockers.clone()),
        other => panic!("problem {i}: {other}"),
    };
    let (what, path, blockers) = unreachable(0);
    assert_eq!((what, path), (Needed::InstallDir, canon(&closed)));
    assert!(
        problems[0]
            .to_string()
            .ends_with(&format!("fix: `chmod o+x {}`", canon(&closed).display()))
    );
    assert_eq!(blockers.len(), 1);
    let (what, path, _) = unreachable(1);
    assert_eq!((what, path), (Needed::Program, canon(&exe)));
    assert!(
        problems[1]
            .to_string()
            .ends_with(&format!("fix: `chmod o+x {}`", canon(&exe).display()))
    );
    let (what, path, _) = unreachable(2);
    assert_eq!((what, path), (Needed::Module, canon(&secret)));
    assert!(
        problems[2]
            .to_string()
            .ends_with(&format!("fix: `chmod o+r {}`", canon(&secret).display()))
    );

    // The worker's own uid is not held to other users' bits.
    let (cat, problems) = Catalogue::load(f.cat.path(), &f.opts()).unwrap();
    assert!(problems.is_empty(), "{}", show(&problems));
    assert_eq!(cat.len(), 3);
}

#[test]
fn with_uv_a_module_the_project_does_not_hold_comes_from_its_environment() {
    let f = Fixture::new(&["uv"]);
    let dir = f.install("wrap", r#"{"tool_id": "wrap", "type": "python"}"#);
    f.file(
        "wrap/pyproject.toml",
        "[project]\ndependencies = [\"someone-elses-plugin\"]\n\n[project.scripts]\nwrap = \"their_plugin.cli:main\"\n",
    );
    let install = f.load_one();
    let dir = canon(&dir);
    assert_eq!(
        install.argv,
        launcher(
            s(&dir.join(".fleet-venv/bin/python")),
            &dir,
            "their_plugin.cli",
            "main",
            "wrap"
        )
    );
}
