//! An incremental parser for `text/event-stream` (the WHATWG server-sent events format), fed
//! with whatever byte slices the network hands over.
//!
//! Servers and proxies split frames anywhere — inside a line, between `\r` and `\n`, inside a
//! UTF-8 character — so the parser keeps the unfinished line in a buffer and only decodes whole
//! lines. Comments (`:` lines, used as keep-alives) are dropped; `event:` names are kept so an
//! `event: error` frame can be told apart from data; several `data:` lines join with `\n`.

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event:` field; `None` for the default `message` type.
    pub event: Option<String>,
    pub data: String,
}

/// Feed bytes with [`SseParser::push`]; take complete events as they appear.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of the line not yet terminated.
    line: Vec<u8>,
    /// The previous chunk ended with `\r`: a `\n` at the start of the next one belongs to it.
    after_cr: bool,
    event: Option<String>,
    data: String,
    /// At least one `data:` line since the last dispatch (an empty `data:` still counts).
    has_data: bool,
    /// The stream's first line may start with a UTF-8 byte order mark, which is ignored.
    started: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parse `bytes`, appending every event it completes to `out`.
    pub fn push(&mut self, bytes: &[u8], out: &mut Vec<Event>) {
        let mut rest = bytes;
        if self.after_cr {
            self.after_cr = false;
            if let Some(b'\n') = rest.first() {
                rest = &rest[1..];
            }
        }
        while let Some(i) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&rest[..i]);
            let cr = rest[i] == b'\r';
            rest = &rest[i + 1..];
            if cr {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    None => self.after_cr = true,
                    Some(_) => {}
                }
            }
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, out);
            self.line = line;
            self.line.clear();
        }
        self.line.extend_from_slice(rest);
    }

    /// The stream ended: an event whose blank line never came is dropped, as the standard says
    /// ("incomplete event"), but a final unterminated `data:` line is kept because some servers
    /// close right after `data: [DONE]` without the blank line.
    pub fn finish(&mut self, out: &mut Vec<Event>) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, out);
        }
        self.dispatch(out);
    }

    fn line_done(&mut self, line: &[u8], out: &mut Vec<Event>) {
        let mut line = line;
        if !self.started {
            self.started = true;
            line = line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line);
        }
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line[0] == b':' {
            return; // comment
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        let value = String::from_utf8_lossy(value);
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => self.event = Some(value.into_owned()),
            _ => {} // id, retry and unknown fields do not matter to a benchmark
        }
    }

    fn dispatch(&mut self, out: &mut Vec<Event>) {
        let event = self.event.take();
        if !self.has_data {
            return;
        }
        self.has_data = false;
        out.push(Event {
            event,
            data: std::mem::take(&mut self.data),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_chunks(chunks: &[&[u8]]) -> Vec<Event> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out);
        }
        p.finish(&mut out);
        out
    }

    fn data(d: &str) -> Event {
        Event {
            event: None,
            data: d.into(),
        }
    }

    #[test]
    fn frames_split_anywhere() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n";
        let want = vec![data("{\"a\":1}"), data("{\"b\":2}"), data("[DONE]")];
        for i in 0..stream.len() {
            for j in i..stream.len() {
                let got = parse_chunks(&[&stream[..i], &stream[i..j], &stream[j..]]);
                assert_eq!(got, want, "split at {i} and {j}");
            }
        }
    }

    #[test]
    fn crlf_cr_and_lf_line_endings() {
        let got = parse_chunks(&[b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"]);
        assert_eq!(got, vec![data("a"), data("b"), data("c")]);
        // CRLF split between two reads is one line ending, not two.
        let got = parse_chunks(&[b"data: a\r", b"\n", b"\r", b"\ndata: b\n\n"]);
        assert_eq!(got, vec![data("a"), data("b")]);
    }

    #[test]
    fn comments_keepalives_and_unknown_fields_are_ignored() {
        let got = parse_chunks(&[b": ping\n\nid: 7\nretry: 10\ndata: x\nfoo\n\n:\n\n"]);
        assert_eq!(got, vec![data("x")]);
    }

    #[test]
    fn multi_line_data_and_event_names() {
        let got =
            parse_chunks(&[b"event: error\ndata: {\"error\":\ndata: 1}\n\ndata:no-space\n\n"]);
        assert_eq!(
            got,
            vec![
                Event {
                    event: Some("error".into()),
                    data: "{\"error\":\n1}".into()
                },
                data("no-space")
            ]
        );
    }

    #[test]
    fn split_utf8_characters_survive() {
        let s = "data: héllo 世界\n\n".as_bytes();
        let got = parse_chunks(&[&s[..8], &s[8..15], &s[15..]]);
        assert_eq!(got, vec![data("héllo 世界")]);
    }

    #[test]
    fn bom_and_final_line_without_blank() {
        let got = parse_chunks(&[b"\xEF\xBB\xBFdata: a\n\ndata: [DONE]"]);
        assert_eq!(got, vec![data("a"), data("[DONE]")]);
    }

    #[test]
    fn event_name_without_data_is_not_dispatched() {
        let got = parse_chunks(&[b"event: ping\n\ndata: a\n\n"]);
        assert_eq!(got, vec![data("a")]);
    }

    proptest! {
        /// Any split of any well-formed stream yields the same events as one read.
        #[test]
        fn any_split_equals_one_read(
            payloads in proptest::collection::vec("[a-z0-9 {}\":é]{0,12}", 1..6),
            cuts in proptest::collection::vec(0usize..200, 0..6),
            crlf in any::<bool>(),
        ) {
            let nl = if crlf { "\r\n" } else { "\n" };
            let stream: String = payloads.iter().map(|p| format!("data: {p}{nl}{nl}")).collect();
            let bytes = stream.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut prev = 0;
            for c in cuts {
                chunks.push(&bytes[prev..c]);
                prev = c;
            }
            chunks.push(&bytes[prev..]);
            let got = parse_chunks(&chunks);
            let want: Vec<Event> = payloads.iter().map(|p| data(p)).collect();
            prop_assert_eq!(got, want);
        }
    }
}
