//! Finds the top-level `id` in the head of an oversized frame without parsing the rest.
//!
//! JSON-RPC SDKs write `{"jsonrpc":"2.0","id":7,"result":…}`: the id comes before the payload. Knowing it lets
//! the host fail exactly the request that the discarded frame answered (spec §2 HR-TX-05) instead of letting it
//! run into its timeout. The scan is bounded by the head it is given and gives up on anything unexpected.

use serde_json::value::RawValue;

use crate::jsonrpc::Id;

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn ws(&mut self) {
        while self.i < self.b.len() && self.b[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn next(&mut self) -> Option<u8> {
        let c = *self.b.get(self.i)?;
        self.i += 1;
        Some(c)
    }

    /// Skips a string whose opening quote has been consumed.
    fn skip_string_body(&mut self) -> Option<()> {
        loop {
            match self.next()? {
                b'"' => return Some(()),
                b'\\' => {
                    self.next()?;
                }
                _ => {}
            }
        }
    }

    fn skip_value(&mut self) -> Option<()> {
        match *self.b.get(self.i)? {
            b'"' => {
                self.i += 1;
                self.skip_string_body()
            }
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match self.next()? {
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                return Some(());
                            }
                        }
                        b'"' => self.skip_string_body()?,
                        _ => {}
                    }
                }
            }
            _ => {
                let start = self.i;
                while self.i < self.b.len() && !matches!(self.b[self.i], b',' | b'}' | b']') {
                    if self.b[self.i].is_ascii_whitespace() {
                        break;
                    }
                    self.i += 1;
                }
                // A scalar that runs to the end of the head may be cut short.
                (self.i > start && self.i < self.b.len()).then_some(())
            }
        }
    }
}

/// The top-level `"id"` member of the JSON object that `head` starts, if it is complete within `head`.
pub(crate) fn top_level_id(head: &[u8]) -> Option<Id> {
    let mut c = Cursor { b: head, i: 0 };
    c.ws();
    if c.next()? != b'{' {
        return None;
    }
    loop {
        c.ws();
        if c.next()? != b'"' {
            return None;
        }
        let key_start = c.i;
        c.skip_string_body()?;
        let key = &head[key_start..c.i - 1];
        c.ws();
        if c.next()? != b':' {
            return None;
        }
        c.ws();
        let value_start = c.i;
        c.skip_value()?;
        if key == b"id" {
            let text = std::str::from_utf8(&head[value_start..c.i]).ok()?;
            let raw: &RawValue = serde_json::from_str(text).ok()?;
            return Id::from_raw(raw).ok();
        }
        c.ws();
        if c.next()? != b',' {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::top_level_id;
    use crate::jsonrpc::Id;

    #[test]
    fn finds_ids_before_the_payload() {
        assert_eq!(
            top_level_id(br#"{"jsonrpc":"2.0","id":7,"result":{"x":"#),
            Some(Id::number(7))
        );
        assert_eq!(
            top_level_id(br#"{ "jsonrpc" : "2.0" , "id" : "a\"b", "result""#),
            Some(Id::string("a\"b"))
        );
        assert_eq!(
            top_level_id(br#"{"result":{"id":1},"id":2,"#),
            Some(Id::number(2))
        );
    }

    #[test]
    fn gives_up_when_the_id_is_not_in_the_head() {
        assert_eq!(top_level_id(br#"{"jsonrpc":"2.0","result":"xxxxxxxx"#), None);
        assert_eq!(top_level_id(br#"{"jsonrpc":"2.0","id":12"#), None);
        assert_eq!(top_level_id(br#"[1,2]"#), None);
        assert_eq!(top_level_id(br#"{"id":{"a":1}}"#), None);
        assert_eq!(top_level_id(b""), None);
    }
}
