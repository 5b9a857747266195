//! The comparison of a recorded JSON value with a replayed one: the first path where they differ, and the
//! fields only the replay has. A pure function: no I/O, no policy beyond `strict`.
//!
//! Every field present in the recording must be present and equal in the replay; arrays must have the same
//! length and equal elements (compared the same way); numbers compare by value (`1` equals `1.0`). A field only
//! the replay has is listed in [`Diff::extra`] and passes, unless `strict`, where it is the mismatch.

use serde_json::Value;

/// What differs.
#[derive(Debug, Clone, PartialEq)]
pub struct Mismatch {
    /// The JSON path of the first difference (`$.result.data.items[2]`).
    pub path: String,
    /// The recorded value there (`None`: absent from the recording).
    pub recorded: Option<Value>,
    /// The replayed value there (`None`: absent from the replay).
    pub replayed: Option<Value>,
}

/// The outcome of [`diff`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Diff {
    /// The first difference, in document order (object keys sorted), if any.
    pub mismatch: Option<Mismatch>,
    /// The paths of fields present only in the replay (passes unless strict), up to the first mismatch.
    pub extra: Vec<String>,
}

impl Diff {
    /// Whether the replay matches the recording.
    pub fn is_match(&self) -> bool {
        self.mismatch.is_none()
    }
}

/// Compares `recorded` with `replayed` from the root `$`.
pub fn diff(recorded: &Value, replayed: &Value, strict: bool) -> Diff {
    let mut out = Diff::default();
    walk("$".to_owned(), recorded, replayed, strict, &mut out);
    out
}

fn walk(path: String, recorded: &Value, replayed: &Value, strict: bool, out: &mut Diff) {
    if out.mismatch.is_some() {
        return;
    }
    match (recorded, replayed) {
        (Value::Object(r), Value::Object(p)) => {
            for (key, rv) in r {
                if out.mismatch.is_some() {
                    return;
                }
                let at = child(&path, key);
                match p.get(key) {
                    Some(pv) => walk(at, rv, pv, strict, out),
                    None => {
                        out.mismatch = Some(Mismatch {
                            path: at,
                            recorded: Some(rv.clone()),
                            replayed: None,
                        });
                    }
                }
            }
            for (key, pv) in p {
                if r.contains_key(key) || out.mismatch.is_some() {
                    continue;
                }
                let at = child(&path, key);
                if strict {
                    out.mismatch = Some(Mismatch {
                        path: at,
                        recorded: None,
                        replayed: Some(pv.clone()),
                    });
                } else {
                    out.extra.push(at);
                }
            }
        }
        (Value::Array(r), Value::Array(p)) => {
            for (i, (rv, pv)) in r.iter().zip(p).enumerate() {
                walk(format!("{path}[{i}]"), rv, pv, strict, out);
            }
            if out.mismatch.is_none() && r.len() != p.len() {
                let i = r.len().min(p.len());
                out.mismatch = Some(Mismatch {
                    path: format!("{path}[{i}]"),
                    recorded: r.get(i).cloned(),
                    replayed: p.get(i).cloned(),
                });
            }
        }
        (Value::Number(r), Value::Number(p)) if r == p || r.as_f64() == p.as_f64() => {}
        (r, p) if r == p => {}
        (r, p) => {
            out.mismatch = Some(Mismatch {
                path,
                recorded: Some(r.clone()),
                replayed: Some(p.clone()),
            });
        }
    }
}

/// `path.key`, or `path["key"]` when the key is not an identifier.
fn child(path: &str, key: &str) -> String {
    let ident = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ident {
        format!("{path}.{key}")
    } else {
        format!("{path}[{}]", Value::String(key.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at(d: &Diff) -> Option<&str> {
        d.mismatch.as_ref().map(|m| m.path.as_str())
    }

    #[test]
    fn equal_values_match() {
        let v = json!({"ok": true, "result": {"success": true, "data": {"a": [1, {"b": null}], "c": "x"}}});
        let d = diff(&v, &v, true);
        assert!(d.is_match());
        assert!(d.extra.is_empty());
    }

    #[test]
    fn the_first_differing_path_is_named_with_both_values() {
        let d = diff(
            &json!({"result": {"data": {"emitted": 3, "z": 1}}}),
            &json!({"result": {"data": {"emitted": 4, "z": 2}}}),
            false,
        );
        assert_eq!(
            d.mismatch,
            Some(Mismatch {
                path: "$.result.data.emitted".into(),
                recorded: Some(json!(3)),
                replayed: Some(json!(4)),
            })
        );
    }

    #[test]
    fn a_recorded_field_missing_from_the_replay_is_a_mismatch() {
        let d = diff(&json!({"error": {"code": "tool_failed"}}), &json!({}), false);
        assert_eq!(at(&d), Some("$.error"));
        assert_eq!(d.mismatch.and_then(|m| m.replayed), None);
    }

    #[test]
    fn extra_fields_pass_and_are_listed_unless_strict() {
        let recorded = json!({"data": {"arguments": {"x": 1}}});
        let replayed = json!({"data": {"arguments": {"x": 1}, "changed": true}, "more": 1});
        let lenient = diff(&recorded, &replayed, false);
        assert!(lenient.is_match());
        assert_eq!(lenient.extra, vec!["$.data.changed", "$.more"]);
        let strict = diff(&recorded, &replayed, true);
        assert_eq!(at(&strict), Some("$.data.changed"));
        assert_eq!(strict.mismatch.and_then(|m| m.recorded), None);
    }

    #[test]
    fn arrays_compare_by_length_and_element() {
        assert_eq!(at(&diff(&json!([1, 2]), &json!([1, 3]), false)), Some("$[1]"));
        assert_eq!(at(&diff(&json!([1, 2]), &json!([1]), false)), Some("$[1]"));
        assert_eq!(at(&diff(&json!([1]), &json!([1, 2]), false)), Some("$[1]"));
        // Extra fields inside elements are extras, like anywhere else.
        let d = diff(&json!([{"a": 1}]), &json!([{"a": 1, "b": 2}]), false);
        assert!(d.is_match());
        assert_eq!(d.extra, vec!["$[0].b"]);
    }

    #[test]
    fn numbers_compare_by_value_and_types_must_agree() {
        assert!(diff(&json!({"n": 1}), &json!({"n": 1.0}), true).is_match());
        assert_eq!(
            at(&diff(&json!({"n": 1}), &json!({"n": "1"}), false)),
            Some("$.n")
        );
        assert_eq!(
            at(&diff(&json!({"n": null}), &json!({"n": false}), false)),
            Some("$.n")
        );
        assert_eq!(
            at(&diff(&json!({"n": {}}), &json!({"n": []}), false)),
            Some("$.n")
        );
    }

    #[test]
    fn keys_that_are_not_identifiers_are_quoted() {
        let d = diff(&json!({"a b": {"9": 1}}), &json!({"a b": {"9": 2}}), false);
        assert_eq!(at(&d), Some(r#"$["a b"]["9"]"#));
    }
}
