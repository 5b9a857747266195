//! The media types of user content: the one parser of every `Content-Type` a plugin gives the fleet
//! (`files/upload_begin`'s `content_type`, `host/uploadFile`'s `mime_type`) or a client sends on the PUT of a
//! signed link, and the one decision of how a type is served (`inline` or `attachment`).
//!
//! Accepted: `type/subtype` with optional `;name=value` parameters, where the type, the subtype and each
//! parameter name are RFC 6838 restricted names (ASCII letters and digits first, then `!#$&-^_.+`) and each
//! value is an HTTP token without quotes (letters, digits and `!#$%&*+-.^_|~`). At most
//! [`limits::FILES_CONTENT_TYPE_MAX_CHARS`] characters. Refused: commas (a header with a list of types is read
//! by browsers as its last one), quotes (quoted parameter values are read differently by different parsers),
//! whitespace other than around the input and around `;`, control and non-ASCII characters, empty parts and
//! repeated parameter names.
//!
//! Normalised: the surrounding spaces and tabs and those around `;` are dropped, the type, the subtype and the
//! parameter names are lowercased (parameter values are kept as given). The normalised value ([`MediaType::as_str`])
//! is what the fleet stores, signs, answers with and serves: nothing else ever reaches a `Content-Type` header.

use fleet_proto::limits;

/// Raster images a browser displays without running anything.
const INLINE_IMAGES: [&str; 6] = [
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "image/avif",
    "image/bmp",
];

/// Other exact types served inline.
const INLINE_OTHER: [&str; 2] = ["application/pdf", "text/plain"];

/// Top-level types served inline whatever their subtype.
const INLINE_TOP_LEVEL: [&str; 2] = ["audio", "video"];

/// The type of content whose type is not known or no longer valid.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// Why a media type was refused. The messages never repeat the refused text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MediaTypeError {
    /// Nothing but whitespace.
    #[error("the media type is empty")]
    Empty,
    /// Longer than the limit.
    #[error("the media type is longer than {0} characters")]
    TooLong(usize),
    /// A comma: a list of types.
    #[error("the media type holds a comma (one type only, no list)")]
    Comma,
    /// A quote.
    #[error("the media type holds a quote (parameter values are unquoted tokens)")]
    Quote,
    /// A control character or a character outside ASCII.
    #[error("the media type holds a control or non-ASCII character")]
    Control,
    /// No `/`, or an empty or malformed type or subtype.
    #[error(
        "the media type is not of the form type/subtype (letters, digits and !#$&-^_.+, a letter or digit first)"
    )]
    Essence,
    /// A parameter that is not `name=value` of tokens (whitespace inside, empty name or value).
    #[error("a media type parameter is not name=value (unquoted tokens without whitespace)")]
    Parameter,
    /// One parameter name twice.
    #[error("a media type parameter is repeated")]
    RepeatedParameter,
}

/// How a file is served: `Content-Disposition`'s type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Displayed by the browser (only types a browser does not run).
    Inline,
    /// Downloaded.
    Attachment,
}

impl Disposition {
    /// `inline` or `attachment`.
    pub fn as_str(self) -> &'static str {
        match self {
            Disposition::Inline => "inline",
            Disposition::Attachment => "attachment",
        }
    }

    /// Inline only when both `self` and `other` are (a link's signed disposition and the served type's).
    pub fn narrowest(self, other: Disposition) -> Disposition {
        if self == Disposition::Inline && other == Disposition::Inline {
            Disposition::Inline
        } else {
            Disposition::Attachment
        }
    }
}

/// A validated, normalised media type (only [`MediaType::parse`] makes one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaType {
    value: String,
    /// The length of `type/subtype` in `value`.
    essence_len: usize,
}

/// RFC 6838 `restricted-name`: a letter or digit, then letters, digits and `!#$&-^_.+`.
fn restricted_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphanumeric())
        && bytes.all(|b| b.is_ascii_alphanumeric() || b"!#$&-^_.+".contains(&b))
}

/// An HTTP token without quote characters.
fn token_value(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&*+-.^_|~".contains(&b))
}

/// HTTP optional whitespace.
fn ows(c: char) -> bool {
    c == ' ' || c == '\t'
}

/// The character-level refusals, which hold anywhere in the text (a tab is optional whitespace: the structure
/// decides where it may stand).
fn check_characters(s: &str) -> Result<(), MediaTypeError> {
    for c in s.chars() {
        match c {
            ',' => return Err(MediaTypeError::Comma),
            '"' | '\'' | '`' => return Err(MediaTypeError::Quote),
            c if (c.is_control() && !ows(c)) || !c.is_ascii() => return Err(MediaTypeError::Control),
            _ => {}
        }
    }
    Ok(())
}

impl MediaType {
    /// Validates and normalises `raw` (see the module's text).
    pub fn parse(raw: &str) -> Result<MediaType, MediaTypeError> {
        let s = raw.trim_matches(ows);
        if s.is_empty() {
            return Err(MediaTypeError::Empty);
        }
        let max = limits::FILES_CONTENT_TYPE_MAX_CHARS;
        if s.chars().count() > max {
            return Err(MediaTypeError::TooLong(max));
        }
        check_characters(s)?;
        let mut parts = s.split(';');
        let essence = parts.next().unwrap_or_default().trim_end_matches(ows);
        let (kind, subtype) = essence.split_once('/').ok_or(MediaTypeError::Essence)?;
        if !restricted_name(kind) || !restricted_name(subtype) {
            return Err(MediaTypeError::Essence);
        }
        let mut value = essence.to_ascii_lowercase();
        let essence_len = value.len();
        let mut names: Vec<String> = Vec::new();
        for param in parts {
            let (name, val) = param
                .trim_matches(ows)
                .split_once('=')
                .ok_or(MediaTypeError::Parameter)?;
            if !restricted_name(name) || !token_value(val) {
                return Err(MediaTypeError::Parameter);
            }
            let name = name.to_ascii_lowercase();
            if names.contains(&name) {
                return Err(MediaTypeError::RepeatedParameter);
            }
            value.push(';');
            value.push_str(&name);
            value.push('=');
            value.push_str(val);
            names.push(name);
        }
        Ok(MediaType { value, essence_len })
    }

    /// `application/octet-stream`: what is served for content whose stored type does not parse.
    pub fn octet_stream() -> MediaType {
        MediaType {
            value: OCTET_STREAM.to_owned(),
            essence_len: OCTET_STREAM.len(),
        }
    }

    /// The stored type `raw` if it parses, else `application/octet-stream` (objects stored before types were
    /// validated, or by a version that validated less).
    pub fn parse_or_octet_stream(raw: Option<&str>) -> MediaType {
        raw.and_then(|r| MediaType::parse(r).ok())
            .unwrap_or_else(MediaType::octet_stream)
    }

    /// The normalised type with its parameters: what is stored and served.
    pub fn as_str(&self) -> &str {
        &self.value
    }

    /// `type/subtype`, lowercase.
    pub fn essence(&self) -> &str {
        &self.value[..self.essence_len]
    }

    /// The type without its parameters.
    pub fn without_parameters(&self) -> MediaType {
        MediaType {
            value: self.essence().to_owned(),
            essence_len: self.essence_len,
        }
    }

    /// `inline` for raster images (PNG, JPEG, GIF, WebP, AVIF, BMP), `audio/*`, `video/*`, PDF and plain text;
    /// everything else — HTML, SVG, XML, anything unknown — is an `attachment`.
    pub fn disposition(&self) -> Disposition {
        let essence = self.essence();
        let top = essence.split('/').next().unwrap_or_default();
        if INLINE_IMAGES.contains(&essence)
            || INLINE_OTHER.contains(&essence)
            || INLINE_TOP_LEVEL.contains(&top)
        {
            Disposition::Inline
        } else {
            Disposition::Attachment
        }
    }
}

impl std::fmt::Display for MediaType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(raw: &str) -> String {
        match MediaType::parse(raw) {
            Ok(m) => m.as_str().to_owned(),
            Err(e) => panic!("{raw:?} refused: {e}"),
        }
    }

    fn refused(raw: &str) -> MediaTypeError {
        match MediaType::parse(raw) {
            Ok(m) => panic!("{raw:?} accepted as {m}"),
            Err(e) => e,
        }
    }

    #[test]
    fn valid_types_with_token_parameters_are_kept() {
        assert_eq!(ok("image/png"), "image/png");
        assert_eq!(ok("text/plain;charset=utf-8"), "text/plain;charset=utf-8");
        assert_eq!(ok("application/vnd.api+json"), "application/vnd.api+json");
        assert_eq!(ok("a/b;x=1;y=Z%7e"), "a/b;x=1;y=Z%7e");
        assert_eq!(
            ok("multipart/form-data;boundary=--a.b_c"),
            "multipart/form-data;boundary=--a.b_c"
        );
    }

    #[test]
    fn case_and_optional_whitespace_are_normalised() {
        assert_eq!(ok("Image/PNG"), "image/png");
        assert_eq!(ok("  text/plain\t"), "text/plain");
        assert_eq!(ok("Text/Plain ; Charset=UTF-8"), "text/plain;charset=UTF-8");
        assert_eq!(
            ok("text/plain;\tcharset=utf-8 ;format=flowed"),
            "text/plain;charset=utf-8;format=flowed"
        );
        let m = MediaType::parse("TEXT/Plain; a=B").expect("valid");
        assert_eq!(
            (m.essence(), m.without_parameters().as_str()),
            ("text/plain", "text/plain")
        );
    }

    #[test]
    fn lists_quotes_and_controls_are_refused() {
        assert_eq!(refused("image/png;x=1,text/html"), MediaTypeError::Comma);
        assert_eq!(refused("image/png,text/html"), MediaTypeError::Comma);
        assert_eq!(refused("text/plain;charset=\"utf-8\""), MediaTypeError::Quote);
        assert_eq!(refused("text/plain;charset='utf-8'"), MediaTypeError::Quote);
        assert_eq!(refused("text/plain\n"), MediaTypeError::Control);
        assert_eq!(refused("text/plain;a=\tb"), MediaTypeError::Parameter);
        assert_eq!(refused("text/pl\u{0}ain"), MediaTypeError::Control);
        assert_eq!(refused("text/html\r\nX-A: b"), MediaTypeError::Control);
        assert_eq!(refused("text/plaín"), MediaTypeError::Control);
        assert_eq!(refused("text/plain\u{a0}"), MediaTypeError::Control);
    }

    #[test]
    fn malformed_essences_are_refused() {
        for raw in ["", "   ", "\t"] {
            assert_eq!(refused(raw), MediaTypeError::Empty, "{raw:?}");
        }
        for raw in [
            "png",
            "image/",
            "/png",
            "image/png/x",
            "image / png",
            "image/ png",
            "*/*",
            "image/*",
            "-a/b",
            "a/.b",
            "a b/c",
            ";x=1",
        ] {
            assert_eq!(refused(raw), MediaTypeError::Essence, "{raw:?}");
        }
    }

    #[test]
    fn malformed_parameters_are_refused() {
        for raw in [
            "a/b;",
            "a/b;;x=1",
            "a/b;x",
            "a/b;x=",
            "a/b;=1",
            "a/b;x = 1",
            "a/b;x=1 2",
            "a/b;x=a/b",
            "a/b;x=1=2",
            "a/b;x=(1)",
        ] {
            assert_eq!(refused(raw), MediaTypeError::Parameter, "{raw:?}");
        }
        assert_eq!(refused("a/b;x=1;X=2"), MediaTypeError::RepeatedParameter);
    }

    #[test]
    fn the_length_limit_counts_the_trimmed_text() {
        let max = limits::FILES_CONTENT_TYPE_MAX_CHARS;
        let at = format!("a/{}", "b".repeat(max - 2));
        assert_eq!(ok(&at), at);
        assert_eq!(ok(&format!("  {at}  ")), at);
        assert_eq!(refused(&format!("{at}b")), MediaTypeError::TooLong(max));
    }

    #[test]
    fn refusals_never_repeat_the_text() {
        let raw = "image/png;x=1,<script>";
        let message = refused(raw).to_string();
        assert!(
            !message.contains("script") && !message.contains("png"),
            "{message}"
        );
    }

    #[test]
    fn only_types_a_browser_does_not_run_are_inline() {
        for raw in [
            "image/png",
            "IMAGE/JPEG; q=1",
            "image/gif",
            "image/webp",
            "image/avif",
            "image/bmp",
            "audio/mpeg",
            "video/mp4",
            "application/pdf",
            "text/plain;charset=utf-8",
        ] {
            let m = MediaType::parse(raw).expect("valid");
            assert_eq!(m.disposition(), Disposition::Inline, "{raw}");
        }
        for raw in [
            "text/html",
            "image/svg+xml",
            "text/xml",
            "application/xml",
            "application/xhtml+xml",
            "text/javascript",
            "application/json",
            "image/x-icon",
            "image/tiff",
            "application/octet-stream",
            "x-unknown/whatever",
        ] {
            let m = MediaType::parse(raw).expect("valid");
            assert_eq!(m.disposition(), Disposition::Attachment, "{raw}");
        }
    }

    #[test]
    fn a_stored_type_that_does_not_parse_is_served_as_octet_stream() {
        let m = MediaType::parse_or_octet_stream(Some("image/png;x=1,text/html"));
        assert_eq!(
            (m.as_str(), m.disposition()),
            (OCTET_STREAM, Disposition::Attachment)
        );
        assert_eq!(MediaType::parse_or_octet_stream(None).as_str(), OCTET_STREAM);
        assert_eq!(
            MediaType::parse_or_octet_stream(Some("Image/PNG")).as_str(),
            "image/png"
        );
    }

    #[test]
    fn a_disposition_narrows_to_attachment() {
        use Disposition::{Attachment, Inline};
        assert_eq!(Inline.narrowest(Inline), Inline);
        assert_eq!(Inline.narrowest(Attachment), Attachment);
        assert_eq!(Attachment.narrowest(Inline), Attachment);
    }
}
