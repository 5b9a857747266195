//! HTML → readable text for `web/fetch` (spec §8.9: "extracted main content (Markdown or plain text,
//! navigation/ads stripped)"): a small, allocation-bounded tag walker rather than a DOM — the input is at most
//! 256 KiB and the output at most 8 000 characters, and what a plugin needs is the prose.
//!
//! * `<title>` (else the first `<h1>`) is the title.
//! * Skipped with everything inside: `script`, `style`, `noscript`, `template`, `svg`, `head`, `nav`, `header`,
//!   `footer`, `aside`, `form`, `iframe`, `button`, `select`, comments.
//! * Block elements end a line; in Markdown headings get `#`s, list items `- `, `blockquote` `> `, `pre` keeps
//!   its whitespace; links keep their text only.
//! * Character references: the named ones prose uses and every numeric one.

/// The format of the extracted text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Headings, list items and quotes marked as in Markdown.
    Markdown,
    /// Plain text.
    Text,
}

/// What [`extract`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extracted {
    /// `<title>`, else the first `<h1>`.
    pub title: Option<String>,
    /// The readable text, blank lines between blocks.
    pub text: String,
}

/// Longest title kept, characters.
const MAX_TITLE_CHARS: usize = 300;

/// Elements skipped with their content.
const SKIPPED: &[&str] = &[
    "script", "style", "noscript", "template", "svg", "head", "nav", "header", "footer", "aside", "form",
    "iframe", "button", "select", "object", "canvas",
];

/// Elements that start and end a block.
const BLOCKS: &[&str] = &[
    "p",
    "div",
    "section",
    "article",
    "main",
    "ul",
    "ol",
    "li",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "table",
    "tr",
    "blockquote",
    "pre",
    "dl",
    "dt",
    "dd",
    "figure",
    "figcaption",
    "hr",
    "address",
    "details",
    "summary",
];

/// Extracts the title and the readable text of an HTML document.
pub fn extract(html: &str, format: Format) -> Extracted {
    let mut w = Walker::new(format);
    let mut rest = html;
    while let Some(lt) = rest.find('<') {
        w.text(&rest[..lt]);
        rest = &rest[lt..];
        if let Some(after) = rest.strip_prefix("<!--") {
            rest = after.find("-->").map_or("", |end| &after[end + 3..]);
            continue;
        }
        let Some(gt) = tag_end(rest) else {
            // An unterminated `<`: the rest is text.
            w.text(rest);
            rest = "";
            break;
        };
        let tag = &rest[1..gt];
        rest = &rest[gt + 1..];
        let closing = tag.starts_with('/');
        let name: String = tag
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .map(|c| c.to_ascii_lowercase())
            .collect();
        if name.is_empty() {
            continue;
        }
        if !closing && SKIPPED.contains(&name.as_str()) && !tag.ends_with('/') {
            if name == "head" {
                // The title lives in the head.
                if let Some(t) = title_in(rest) {
                    w.title.get_or_insert(t);
                }
            }
            rest = skip_element(rest, &name);
            continue;
        }
        if name == "title" && !closing {
            let end = find_ci(rest, "</title").unwrap_or(rest.len());
            let t = collapse(&decode(&rest[..end]));
            if !t.is_empty() {
                w.title.get_or_insert(t);
            }
            rest = rest[end..].find('>').map_or("", |gt| &rest[end + gt + 1..]);
            continue;
        }
        w.tag(&name, closing);
    }
    w.text(rest);
    w.finish()
}

/// The `>` ending the tag at the start of `s` (quotes respected), if any.
fn tag_end(s: &str) -> Option<usize> {
    let mut quote = None;
    for (i, c) in s.char_indices().skip(1) {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '>') => return Some(i),
            _ => {}
        }
    }
    None
}

/// Case-insensitive find of an ASCII needle.
fn find_ci(haystack: &str, needle: &str) -> Option<usize> {
    let h = haystack.as_bytes();
    let n = needle.as_bytes();
    if n.is_empty() || h.len() < n.len() {
        return None;
    }
    (0..=h.len() - n.len()).find(|&i| h[i..i + n.len()].eq_ignore_ascii_case(n))
}

/// What follows the end of the element `name` whose start tag was just read (nested same-name elements
/// counted); the rest of the document is dropped when it never ends. Linear: each search resumes where the
/// last match of its kind was consumed, so a page of thousands of unclosed `<nav>`s costs one pass.
fn skip_element<'a>(rest: &'a str, name: &str) -> &'a str {
    let open = format!("<{name}");
    let close = format!("</{name}");
    // Raw-text elements cannot nest.
    let nests = !matches!(name, "script" | "style" | "template");
    let next_open = |from: usize| -> Option<usize> {
        let mut at = from;
        while let Some(o) = find_ci(&rest[at..], &open) {
            let start = at + o;
            let after = start + open.len();
            if rest[after..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_ascii_alphanumeric())
            {
                return Some(start);
            }
            at = after;
        }
        None
    };
    let next_close = |from: usize| find_ci(&rest[from..], &close).map(|c| from + c);
    let mut depth = 1_usize;
    let mut open_at = if nests { next_open(0) } else { None };
    let mut close_at = next_close(0);
    loop {
        let Some(c) = close_at else { return "" };
        match open_at {
            Some(o) if o < c => {
                depth += 1;
                open_at = next_open(o + open.len());
            }
            _ => {
                depth -= 1;
                let after = c + close.len();
                if depth == 0 {
                    return rest[after..].find('>').map_or("", |gt| &rest[after + gt + 1..]);
                }
                close_at = next_close(after);
            }
        }
    }
}

/// The `<title>` within a `<head>` that starts at `rest`.
fn title_in(rest: &str) -> Option<String> {
    let head_end = find_ci(rest, "</head").unwrap_or(rest.len());
    let head = &rest[..head_end];
    let start = find_ci(head, "<title")?;
    let open_end = head[start..].find('>')? + start + 1;
    let end = find_ci(&head[open_end..], "</title").map_or(head.len(), |e| open_end + e);
    let t = collapse(&decode(&head[open_end..end]));
    (!t.is_empty()).then_some(t)
}

/// Runs of whitespace as one space, trimmed.
fn collapse(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Decodes character references.
pub(crate) fn decode(s: &str) -> String {
    if !s.contains('&') {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let end = rest[1..].find(';').map(|e| e + 1).filter(|e| *e <= 12);
        let decoded = end.and_then(|e| reference(&rest[1..e]).map(|c| (c, e)));
        match decoded {
            Some((c, e)) => {
                out.push(c);
                rest = &rest[e + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn reference(name: &str) -> Option<char> {
    if let Some(num) = name.strip_prefix('#') {
        let code = match num.strip_prefix(['x', 'X']) {
            Some(hex) => u32::from_str_radix(hex, 16).ok()?,
            None => num.parse().ok()?,
        };
        return char::from_u32(code).filter(|c| *c != '\0');
    }
    Some(match name {
        "amp" => '&',
        "lt" => '<',
        "gt" => '>',
        "quot" => '"',
        "apos" => '\'',
        "nbsp" => ' ',
        "mdash" => '—',
        "ndash" => '–',
        "hellip" => '…',
        "lsquo" => '‘',
        "rsquo" => '’',
        "ldquo" => '“',
        "rdquo" => '”',
        "laquo" => '«',
        "raquo" => '»',
        "copy" => '©',
        "reg" => '®',
        "trade" => '™',
        "middot" => '·',
        "bull" => '•',
        "deg" => '°',
        "eacute" => 'é',
        "egrave" => 'è',
        "agrave" => 'à',
        "uuml" => 'ü',
        "ouml" => 'ö',
        "auml" => 'ä',
        "szlig" => 'ß',
        "euro" => '€',
        "pound" => '£',
        _ => return None,
    })
}

/// One level deeper at an opening tag, one less at a closing one.
fn nest(depth: &mut usize, closing: bool) {
    *depth = if closing {
        depth.saturating_sub(1)
    } else {
        *depth + 1
    };
}

/// The state of one extraction.
struct Walker {
    format: Format,
    title: Option<String>,
    first_h1: Option<String>,
    in_h1: bool,
    h1_text: String,
    out: String,
    /// The current line, before it is flushed.
    line: String,
    pre: usize,
    quote: usize,
    /// A block is pending: the next text starts a new paragraph.
    prefix: String,
}

impl Walker {
    fn new(format: Format) -> Walker {
        Walker {
            format,
            title: None,
            first_h1: None,
            in_h1: false,
            h1_text: String::new(),
            out: String::new(),
            line: String::new(),
            pre: 0,
            quote: 0,
            prefix: String::new(),
        }
    }

    fn md(&self) -> bool {
        self.format == Format::Markdown
    }

    fn text(&mut self, raw: &str) {
        if raw.is_empty() {
            return;
        }
        let text = decode(raw);
        if self.in_h1 {
            self.h1_text.push_str(&text);
        }
        if self.pre > 0 {
            for (i, part) in text.split('\n').enumerate() {
                if i > 0 {
                    self.flush();
                }
                self.push_raw(part);
            }
            return;
        }
        let starts_space = text.starts_with(char::is_whitespace);
        let ends_space = text.ends_with(char::is_whitespace);
        let words = collapse(&text);
        if words.is_empty() {
            if (starts_space || ends_space) && !self.line.is_empty() && !self.line.ends_with(' ') {
                self.line.push(' ');
            }
            return;
        }
        if starts_space && !self.line.is_empty() && !self.line.ends_with(' ') {
            self.line.push(' ');
        }
        self.push_raw(&words);
        if ends_space {
            self.line.push(' ');
        }
    }

    fn push_raw(&mut self, s: &str) {
        if self.line.is_empty() {
            if self.md() && self.quote > 0 {
                self.line.push_str(&"> ".repeat(self.quote));
            }
            let prefix = std::mem::take(&mut self.prefix);
            self.line.push_str(&prefix);
        }
        self.line.push_str(s);
    }

    /// Ends the current line.
    fn flush(&mut self) {
        let line = std::mem::take(&mut self.line);
        let line = line.trim_end();
        if !line.trim().is_empty() {
            self.out.push_str(line);
            self.out.push('\n');
        }
    }

    /// Ends the current block (a blank line follows).
    fn block(&mut self) {
        self.flush();
        self.prefix.clear();
        if !self.out.is_empty() && !self.out.ends_with("\n\n") {
            self.out.push('\n');
        }
    }

    fn tag(&mut self, name: &str, closing: bool) {
        match name {
            "br" => self.flush(),
            "pre" => {
                self.block();
                nest(&mut self.pre, closing);
            }
            "blockquote" => {
                self.block();
                nest(&mut self.quote, closing);
            }
            "li" if !closing => {
                self.flush();
                if self.md() {
                    self.prefix = "- ".to_owned();
                }
            }
            "li" | "dt" | "dd" | "tr" => self.flush(),
            "td" | "th" if closing => self.line.push(' '),
            h if h.len() == 2 && h.starts_with('h') && h.as_bytes()[1].is_ascii_digit() => {
                self.block();
                if h == "h1" {
                    if closing {
                        if self.in_h1 {
                            let t = collapse(&self.h1_text);
                            if !t.is_empty() {
                                self.first_h1.get_or_insert(t);
                            }
                        }
                        self.in_h1 = false;
                    } else {
                        self.in_h1 = self.first_h1.is_none();
                        self.h1_text.clear();
                    }
                }
                if !closing && self.md() {
                    let level = usize::from(h.as_bytes()[1] - b'0').clamp(1, 6);
                    self.prefix = format!("{} ", "#".repeat(level));
                }
            }
            b if BLOCKS.contains(&b) => self.block(),
            _ => {}
        }
    }

    fn finish(mut self) -> Extracted {
        self.flush();
        let text = self.out.trim().to_owned();
        Extracted {
            title: self.title.or(self.first_h1).map(|t| cut(&t, MAX_TITLE_CHARS).0),
            text,
        }
    }
}

/// The first `max_chars` characters, and whether anything was cut.
pub(crate) fn cut(text: &str, max_chars: usize) -> (String, bool) {
    match text.char_indices().nth(max_chars) {
        Some((at, _)) => (text[..at].to_owned(), true),
        None => (text.to_owned(), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_is_cut_at_max_chars_on_a_character_boundary() {
        assert_eq!(cut("abc", 3), ("abc".to_owned(), false));
        assert_eq!(cut("abcd", 3), ("abc".to_owned(), true));
        assert_eq!(cut("ééé", 2), ("éé".to_owned(), true));
        assert_eq!(cut("", 0), (String::new(), false));
    }

    const PAGE: &str = r#"<!doctype html>
<html><head><meta charset="utf-8"><title> The  Cat &amp; Hat </title>
<style>body { color: red }</style><script>var x = "<p>not text</p>";</script></head>
<body><nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<h1>Cats</h1>
<p>Cats sleep <b>up to</b> 16&nbsp;hours a day.<br>Really&#33;</p>
<!-- a comment <p>hidden</p> -->
<ul><li>Whiskers</li><li>Tail &#x2014; long</li></ul>
<blockquote>To sleep, perchance</blockquote>
<pre>  indented
    code</pre>
<footer>© 2026 cats inc</footer></body></html>"#;

    #[test]
    fn markdown_keeps_structure_and_drops_chrome() {
        let e = extract(PAGE, Format::Markdown);
        assert_eq!(e.title.as_deref(), Some("The Cat & Hat"));
        assert_eq!(
            e.text,
            "# Cats\n\nCats sleep up to 16 hours a day.\nReally!\n\n- Whiskers\n- Tail — long\n\n> To sleep, perchance\n\n  indented\n    code"
        );
    }

    #[test]
    fn text_is_plain() {
        let e = extract(PAGE, Format::Text);
        assert_eq!(
            e.text,
            "Cats\n\nCats sleep up to 16 hours a day.\nReally!\n\nWhiskers\nTail — long\n\nTo sleep, perchance\n\n  indented\n    code"
        );
        for hidden in ["not text", "hidden", "Home", "cats inc", "color"] {
            assert!(!e.text.contains(hidden), "{hidden}");
        }
    }

    #[test]
    fn without_a_title_the_first_h1_is_the_title() {
        let e = extract("<h1>First <i>one</i></h1><h1>Second</h1><p>x</p>", Format::Text);
        assert_eq!(e.title.as_deref(), Some("First one"));
    }

    #[test]
    fn pathological_nesting_is_one_pass() {
        // 256 KiB of unclosed skipped elements, then of closed ones: both finish (quadratic scanning would not,
        // in any reasonable time).
        let unclosed = "<nav>".repeat(52_000);
        assert_eq!(extract(&unclosed, Format::Text).text, "");
        let nested = format!("{}{}after", "<div><nav>".repeat(13_000), "</nav>".repeat(13_000));
        assert_eq!(extract(&nested, Format::Text).text, "after");
        let titles = "<title>".repeat(40_000);
        let title = extract(&titles, Format::Text).title.unwrap_or_default();
        assert_eq!(
            title.chars().count(),
            MAX_TITLE_CHARS,
            "an unclosed title is kept, cut"
        );
    }

    #[test]
    fn broken_markup_never_panics_and_keeps_the_text() {
        for doc in [
            "",
            "<",
            "<p",
            "a < b and c > d",
            "<p>unclosed <b>bold",
            "<script>never closed",
            "<div><div>deep</div>",
            "&#xFFFFFFFF; &#0; &bogus; &amp",
            "<a href='x>y'>link</a>",
            "<ul><li>one<li>two</ul>",
            "<svg><svg></svg>inner</svg>after",
            "é<p>ü</p>",
        ] {
            let _ = extract(doc, Format::Markdown);
            let _ = extract(doc, Format::Text);
        }
        assert_eq!(extract("a < b and c", Format::Text).text, "a < b and c");
        assert_eq!(
            extract("<svg><svg></svg>in</svg>after", Format::Text).text,
            "after"
        );
        assert_eq!(extract("&#xFFFFFFFF;&amp", Format::Text).text, "&#xFFFFFFFF;&amp");
    }
}
