//! Turning arbitrary strings (user ids, tool ids, session names, worker ids) into safe file and cgroup names.
//!
//! Every function here is total: any input, including empty strings, `/`, `..`, NUL, spaces and unicode, maps to
//! a non-empty name made only of `[A-Za-z0-9_.-]` that does not start with `.` (so it is never `.`, `..` or a
//! hidden file) and is at most 73 bytes long (64 of text, `-`, 8 of hash). Where two different inputs could sanitize to the same
//! text, a short hash of the *original* input keeps them apart.

use sha2::{Digest, Sha256};

/// Longest sanitized text kept before the hash suffix (cgroup and file names may be up to 255 bytes).
const MAX_TEXT: usize = 64;

/// Hex digits of the short hash suffix (32 bits: enough to keep the few names that sanitize alike apart).
const SHORT_HASH_HEX: usize = 8;

/// Lower-case hex of the first `hex_digits` nibbles of sha256(`input`).
fn sha256_hex(input: &[u8], hex_digits: usize) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(input);
    let mut out = String::with_capacity(hex_digits);
    for byte in digest.iter() {
        for nibble in [byte >> 4, byte & 0x0f] {
            if out.len() == hex_digits {
                return out;
            }
            out.push(char::from(HEX[usize::from(nibble)]));
        }
    }
    out
}

/// The characters of `input` with everything outside `[A-Za-z0-9_.-]` replaced by `_`, a leading `.` replaced
/// by `_`, cut to [`MAX_TEXT`] bytes, and `_` if that leaves nothing.
fn sanitize_text(input: &str) -> String {
    let mut out = String::with_capacity(input.len().min(MAX_TEXT));
    for c in input.chars() {
        if out.len() == MAX_TEXT {
            break;
        }
        let keep = c.is_ascii_alphanumeric() || c == '_' || c == '-' || (c == '.' && !out.is_empty());
        out.push(if keep { c } else { '_' });
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// `sanitized(input)-<8 hex of sha256(input)>`: unique per input (up to the 32-bit hash), safe as a file or
/// cgroup name. Used for session cgroups and tool keys.
pub(crate) fn unique_name(input: &str) -> String {
    let mut out = sanitize_text(input);
    out.push('-');
    out.push_str(&sha256_hex(input.as_bytes(), SHORT_HASH_HEX));
    out
}

/// `input` itself when it is already a safe name (kept readable for operators), else [`unique_name`].
pub(crate) fn readable_name(input: &str) -> String {
    let clean = !input.is_empty()
        && input.len() <= MAX_TEXT
        && !input.starts_with('.')
        && input
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if clean {
        input.to_owned()
    } else {
        unique_name(input)
    }
}

pub(crate) use fleet_proto::api::user_key;

#[cfg(test)]
mod tests {
    use super::*;

    /// Upper bound of every name produced here (text + `-` + hash).
    const MAX_LEN: usize = MAX_TEXT + 1 + SHORT_HASH_HEX;

    fn is_safe(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= MAX_LEN
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    }

    #[test]
    fn hostile_inputs_map_to_safe_distinct_names() {
        let inputs = [
            "",
            ".",
            "..",
            "../../etc",
            "a/b",
            "a_b",
            "a b",
            "naïve ☃",
            "\0",
            ".hidden",
            "x".repeat(1000).as_str(),
        ]
        .map(str::to_owned);
        let names: Vec<String> = inputs.iter().map(|s| unique_name(s)).collect();
        for (input, name) in inputs.iter().zip(&names) {
            assert!(is_safe(name), "{input:?} -> {name:?}");
        }
        let mut dedup = names.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), names.len(), "{names:?}");
        assert_eq!(unique_name("a/b"), unique_name("a/b"), "deterministic");
    }

    #[test]
    fn readable_name_keeps_clean_ids() {
        assert_eq!(readable_name("worker-0"), "worker-0");
        assert_eq!(readable_name("w.1_x"), "w.1_x");
        for hostile in ["", "..", "a/b", "é", ".x"] {
            let n = readable_name(hostile);
            assert!(is_safe(&n), "{hostile:?} -> {n:?}");
            assert_ne!(n, hostile);
        }
    }

    #[test]
    fn user_key_is_32_hex() {
        let k = user_key("alice/../bob ☃");
        assert_eq!(k.len(), 32);
        assert!(
            k.bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert_ne!(k, user_key("alice"));
        // sha256("abc") = ba7816bf 8f01cfea 414140de 5dae2223 ...
        assert_eq!(user_key("abc"), "ba7816bf8f01cfea414140de5dae2223");
    }
}
