//! One streaming request against an OpenAI-compatible server, timed.
//!
//! The request body is serialized before the run starts, so the send path does no formatting.
//! Response bytes go through [`SseParser`]; every network read is stamped once with the
//! monotonic clock and every content-bearing chunk in it gets that stamp. Output tokens come
//! from the server's `usage` when it sends one (`stream_options.include_usage`), else from the
//! tokenizer over the streamed text, else from the number of content chunks.
//!
//! Failures become error classes (`connect`, `timeout`, `http 503 worker_busy`,
//! `stream error …`, `incomplete stream`, `bad response`) rather than Rust errors: a
//! benchmark counts them and goes on.
//!
//! A pooled keep-alive connection the server closes just as a request goes out on it fails that
//! request with nothing answered (llama.cpp's server closes connections idle for 5 s). That is
//! the load generator's doing, not the server's failure: idle connections are dropped after
//! [`POOL_IDLE`], below the keep-alive timeouts servers commonly send, and a request that fails
//! before any answer is sent once more on a fresh connection, counted as a retry
//! ([`Record::retried`]), not as an error.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::metrics::Record;
use crate::sse::{Event, SseParser};

/// How long an idle pooled connection is kept: under the 5 s keep-alive timeout of llama.cpp's
/// server (and uvicorn's, and Node's), so the server never closes one the pool still offers.
const POOL_IDLE: Duration = Duration::from_secs(4);

/// Sends requests to one endpoint URL.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    /// Without a pool: a request's one retry goes out on a connection of its own.
    fresh: reqwest::Client,
    url: String,
    api_key: Option<String>,
    /// The header a request's tenant goes in (`--tenants`).
    tenant_header: String,
    /// Counts output tokens when the server sends no usage.
    tokenizer: Option<Arc<Tokenizer>>,
    timeout: Duration,
}

/// One request to send: its pre-serialized body and what the dataset knows of it.
pub struct Job {
    pub index: usize,
    pub body: Bytes,
    pub input_tokens: Option<usize>,
    /// Intended send time (offset from `t0`); `None` in a closed loop, where it is the send
    /// time.
    pub intended: Option<Duration>,
    /// The `priority` its body carries (`--priority-mix`), for the per-class figures.
    pub priority: Option<i32>,
    /// The tenant it is sent for (`--tenants`).
    pub tenant: Option<Arc<str>>,
    /// The conversation it is a turn of (a trace's `session_id`), sent as `x-session-id`.
    pub session: Option<Arc<str>>,
}

/// A request's tenant and session, for its headers.
type Who<'a> = (Option<&'a str>, Option<&'a str>);

/// Counters shared with the progress display.
#[derive(Default)]
pub struct Live {
    pub tokens: AtomicU64,
    pub done: AtomicU64,
    pub errors: AtomicU64,
    pub retries: AtomicU64,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<ErrorBody>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    /// Completions put the text here.
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    /// Reasoning models stream thoughts here before `content`; they are output tokens too.
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<usize>,
    #[serde(default)]
    completion_tokens: Option<usize>,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorBody,
}

impl ErrorBody {
    /// `code` when it is a string or number, else `type`.
    fn label(&self) -> Option<String> {
        match &self.code {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            _ => self.kind.clone(),
        }
    }
}

impl Client {
    pub fn new(
        url: String,
        api_key: Option<String>,
        tenant_header: String,
        tokenizer: Option<Arc<Tokenizer>>,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_idle_timeout(POOL_IDLE)
            .build()?;
        let fresh = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(0)
            .build()?;
        Ok(Self {
            http,
            fresh,
            url,
            api_key,
            tenant_header,
            tokenizer,
            timeout,
        })
    }

    /// Send `job` now and follow its stream to the end.
    pub async fn send(&self, job: Job, t0: Instant, live: &Live) -> Record {
        let sent = t0.elapsed();
        let mut rec = Record {
            index: job.index,
            intended: job.intended.unwrap_or(sent),
            sent,
            input_tokens: job.input_tokens,
            priority: job.priority,
            tenant: job.tenant.as_deref().map(str::to_owned),
            ..Default::default()
        };
        let outcome = tokio::time::timeout(
            self.timeout,
            self.stream(
                job.body,
                (job.tenant.as_deref(), job.session.as_deref()),
                t0,
                &mut rec,
                live,
            ),
        )
        .await
        .unwrap_or_else(|_| Err("timeout".into()));
        rec.end = t0
            .elapsed()
            .max(rec.chunks.last().copied().unwrap_or_default());
        if let Err(class) = outcome {
            rec.error = Some(class);
            live.errors.fetch_add(1, Ordering::Relaxed);
        }
        live.done.fetch_add(1, Ordering::Relaxed);
        rec
    }

    async fn stream(
        &self,
        body: Bytes,
        who: Who<'_>,
        t0: Instant,
        rec: &mut Record,
        live: &Live,
    ) -> Result<(), String> {
        let resp = match self.post(&self.http, body.clone(), who).send().await {
            Ok(resp) => resp,
            // Nothing answered: most likely a pooled connection the server had just closed.
            // Once more, on a connection of its own.
            Err(e) if !e.is_connect() && !e.is_timeout() => {
                tracing::debug!(error = %error_chain(&e), "Resending a request on a fresh connection");
                rec.retried = true;
                live.retries.fetch_add(1, Ordering::Relaxed);
                self.post(&self.fresh, body, who)
                    .send()
                    .await
                    .map_err(error_class)?
            }
            Err(e) => return Err(error_class(e)),
        };
        let status = resp.status();
        if !status.is_success() {
            let code = resp
                .bytes()
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<ErrorEnvelope>(&b).ok())
                .and_then(|e| e.error.label());
            return Err(match code {
                Some(code) => format!("http {} {code}", status.as_u16()),
                None => format!("http {}", status.as_u16()),
            });
        }
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        let mut text = String::new();
        let mut usage_tokens = None;
        let mut done = false;
        let mut body = resp.bytes_stream();
        loop {
            let next = body.next().await;
            let now = t0.elapsed();
            let end = match next {
                Some(Ok(bytes)) => {
                    parser.push(&bytes, &mut events);
                    false
                }
                Some(Err(_)) => return Err("stream interrupted".into()),
                None => {
                    parser.finish(&mut events);
                    true
                }
            };
            for ev in events.drain(..) {
                let seen = self.event(&ev, &mut text)?;
                done |= seen.done;
                if seen.content {
                    rec.chunks.push(now);
                    live.tokens.fetch_add(1, Ordering::Relaxed);
                }
                usage_tokens = seen.completion.or(usage_tokens);
                rec.input_tokens = rec.input_tokens.or(seen.prompt);
            }
            if done || end {
                break;
            }
        }
        if !done {
            return Err("incomplete stream".into());
        }
        rec.output_tokens = self.output_tokens(usage_tokens, &text, rec.chunks.len());
        // The live counter assumed one token per chunk; settle the difference.
        let counted = rec.chunks.len() as u64;
        let real = rec.output_tokens as u64;
        if real > counted {
            live.tokens.fetch_add(real - counted, Ordering::Relaxed);
        }
        Ok(())
    }

    fn post(
        &self,
        http: &reqwest::Client,
        body: Bytes,
        (tenant, session): Who<'_>,
    ) -> reqwest::RequestBuilder {
        let mut req = http
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body);
        if let Some(t) = tenant {
            req = req.header(self.tenant_header.as_str(), t);
        }
        if let Some(s) = session {
            req = req.header("x-session-id", s);
        }
        match &self.api_key {
            Some(key) => req.bearer_auth(key),
            None => req,
        }
    }

    /// The server's count, else the tokenizer's over the streamed text, else one per chunk.
    fn output_tokens(&self, usage: Option<usize>, text: &str, chunks: usize) -> usize {
        usage
            .or_else(|| {
                let tok = self.tokenizer.as_ref()?;
                tok.encode_fast(text, false).ok().map(|e| e.len())
            })
            .unwrap_or(chunks)
    }

    fn event(&self, ev: &Event, text: &mut String) -> Result<Seen, String> {
        let mut seen = Seen::default();
        if ev.data == "[DONE]" {
            seen.done = true;
            return Ok(seen);
        }
        let chunk: Chunk<'_> = match serde_json::from_str(&ev.data) {
            Ok(c) => c,
            Err(_) if ev.event.as_deref() == Some("error") => {
                return Err("stream error".into());
            }
            Err(_) => return Err("bad response".into()),
        };
        if let Some(e) = chunk.error {
            return Err(match e.label() {
                Some(code) => format!("stream error {code}"),
                None => "stream error".into(),
            });
        }
        if ev.event.as_deref() == Some("error") {
            return Err("stream error".into());
        }
        for c in &chunk.choices {
            let parts = [
                c.text.as_deref(),
                c.delta
                    .as_ref()
                    .and_then(|d| d.reasoning_content.as_deref()),
                c.delta.as_ref().and_then(|d| d.content.as_deref()),
            ];
            for s in parts.into_iter().flatten().filter(|s| !s.is_empty()) {
                seen.content = true;
                if self.tokenizer.is_some() {
                    text.push_str(s);
                }
            }
        }
        if let Some(u) = chunk.usage {
            seen.prompt = u.prompt_tokens;
            seen.completion = u.completion_tokens;
        }
        Ok(seen)
    }
}

/// What one event carried.
#[derive(Default)]
struct Seen {
    done: bool,
    content: bool,
    prompt: Option<usize>,
    completion: Option<usize>,
}

/// A failed send as an error class.
fn error_class(e: reqwest::Error) -> String {
    if e.is_connect() {
        "connect".to_owned()
    } else if e.is_timeout() {
        "timeout".to_owned()
    } else {
        "request failed".to_owned()
    }
}

/// An error and its causes, for the log.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out += &format!(": {c}");
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(with_tokenizer: bool) -> Client {
        let tok = with_tokenizer.then(|| {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny/tokenizer.json");
            Arc::new(Tokenizer::from_file(path).unwrap())
        });
        Client::new(
            "http://127.0.0.1:1".into(),
            None,
            "x-tenant-id".into(),
            tok,
            Duration::from_secs(1),
        )
        .unwrap()
    }

    fn ev(event: Option<&str>, data: &str) -> Event {
        Event {
            event: event.map(str::to_owned),
            data: data.into(),
        }
    }

    fn seen(
        c: &Client,
        e: Event,
        text: &mut String,
    ) -> Result<(bool, bool, Option<usize>), String> {
        c.event(&e, text).map(|s| (s.done, s.content, s.completion))
    }

    #[test]
    fn chunk_shapes() {
        let c = client(true);
        let mut text = String::new();
        let chat = r#"{"choices":[{"index":0,"delta":{"content":"Hel"}}]}"#;
        assert_eq!(seen(&c, ev(None, chat), &mut text), Ok((false, true, None)));
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(
            seen(&c, ev(None, role), &mut text),
            Ok((false, false, None))
        );
        let completion = r#"{"choices":[{"index":0,"text":"lo","finish_reason":null}]}"#;
        assert_eq!(
            seen(&c, ev(None, completion), &mut text),
            Ok((false, true, None))
        );
        let reasoning = r#"{"choices":[{"delta":{"reasoning_content":" th"}}]}"#;
        assert_eq!(
            seen(&c, ev(None, reasoning), &mut text),
            Ok((false, true, None))
        );
        assert_eq!(text, "Hello th");
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}"#;
        assert_eq!(
            seen(&c, ev(None, usage), &mut text),
            Ok((false, false, Some(3)))
        );
        assert_eq!(
            seen(&c, ev(None, "[DONE]"), &mut text),
            Ok((true, false, None))
        );
    }

    #[test]
    fn errors_become_classes() {
        let c = client(false);
        let mut text = String::new();
        let err =
            r#"{"error":{"message":"busy","type":"service_unavailable","code":"worker_busy"}}"#;
        assert_eq!(
            seen(&c, ev(None, err), &mut text),
            Err("stream error worker_busy".into())
        );
        let typed = r#"{"error":{"message":"x","type":"internal_error"}}"#;
        assert_eq!(
            seen(&c, ev(None, typed), &mut text),
            Err("stream error internal_error".into())
        );
        assert_eq!(
            seen(&c, ev(Some("error"), "boom"), &mut text),
            Err("stream error".into())
        );
        assert_eq!(
            seen(&c, ev(None, "{not json"), &mut text),
            Err("bad response".into())
        );
    }

    /// Reads one HTTP request (headers, then a `content-length` body); false at EOF.
    async fn read_request(c: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        let mut byte = [0u8; 1];
        while !buf.ends_with(b"\r\n\r\n") {
            if c.read(&mut byte).await.unwrap_or(0) == 0 {
                return false;
            }
            buf.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        c.read_exact(&mut body).await.is_ok()
    }

    #[tokio::test]
    async fn a_pooled_connection_the_server_closed_is_retried_once_on_a_fresh_one() {
        use tokio::io::AsyncWriteExt;
        let body = "data: {\"choices\":[{\"text\":\"hi\"}]}\n\ndata: [DONE]\n\n";
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            // The first connection answers one request, then closes as the next arrives (what
            // a keep-alive timeout does when it races a request); every later one answers.
            let (mut first, _) = listener.accept().await.unwrap();
            read_request(&mut first).await;
            first.write_all(answer.as_bytes()).await.unwrap();
            read_request(&mut first).await;
            drop(first);
            loop {
                let (mut c, _) = listener.accept().await.unwrap();
                while read_request(&mut c).await {
                    c.write_all(answer.as_bytes()).await.unwrap();
                }
            }
        });
        let c = Client::new(
            format!("http://{addr}/v1/completions"),
            None,
            "x-tenant-id".into(),
            None,
            Duration::from_secs(5),
        )
        .unwrap();
        let live = Live::default();
        let t0 = Instant::now();
        let job = |index| Job {
            index,
            body: Bytes::from_static(b"{}"),
            input_tokens: None,
            intended: None,
            priority: None,
            tenant: None,
            session: None,
        };
        let first = c.send(job(0), t0, &live).await;
        assert_eq!((first.error.as_deref(), first.retried), (None, false));
        let second = c.send(job(1), t0, &live).await;
        assert_eq!((second.error.as_deref(), second.retried), (None, true));
        assert_eq!(second.output_tokens, 1);
        assert_eq!(live.retries.load(Ordering::Relaxed), 1);
        assert_eq!(live.errors.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn output_tokens_prefer_usage_then_tokenizer_then_chunks() {
        let with = client(true);
        assert_eq!(with.output_tokens(Some(7), "whatever", 2), 7);
        let text = "the cat sat";
        let want = with
            .tokenizer
            .as_ref()
            .unwrap()
            .encode(text, false)
            .unwrap()
            .len();
        assert_eq!(with.output_tokens(None, text, 1), want);
        assert_eq!(client(false).output_tokens(None, text, 2), 2);
    }
}
