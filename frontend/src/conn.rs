//! A deadline on a connection's writes, so a client that stops reading cannot hold its
//! connection (and the request behind it) for ever. hyper has a timer for reading a request's
//! headers but none for writing a response: a client that sends a streaming request and never
//! reads keeps the socket unwritable, hyper waits on it, and the connection's slot under
//! `max_connections`, its engine sequence and its KV blocks stay taken. [`WriteDeadline`] wraps
//! the accepted socket: while a write or flush is refused (the socket stays unwritable) a
//! clock runs, any write that goes through stops it, and when it runs out the write fails
//! with `TimedOut`, which ends hyper's connection — the response body is dropped, which
//! cancels the request down the graph, and the slot is freed.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// An IO whose writes fail with `TimedOut` once none has made progress for `limit`.
pub(crate) struct WriteDeadline<T> {
    io: T,
    limit: Duration,
    peer: SocketAddr,
    /// Allocated once per connection and re-armed, rather than one timer per stall: a busy
    /// stream to a slowish reader stalls briefly many times a second.
    timer: Pin<Box<Sleep>>,
    /// Whether `timer` is counting a stall now.
    armed: bool,
    /// Whether the deadline passed (counted and logged once, however often hyper asks again).
    expired: bool,
}

impl<T> WriteDeadline<T> {
    pub(crate) fn new(io: T, limit: Duration, peer: SocketAddr) -> Self {
        Self {
            io,
            limit,
            peer,
            timer: Box::pin(tokio::time::sleep(limit)),
            armed: false,
            expired: false,
        }
    }

    /// What a write (or flush, or shutdown) that `inner` answered becomes: a refused one starts
    /// the clock or keeps it running — its waker registered, so the task is woken when it runs
    /// out even if the socket never becomes writable — and fails once it has run out. A write
    /// that went through (or failed on its own) stops the clock; a flush or shutdown that is
    /// ready does not (`moved` false), as a socket's flush is always ready and moves nothing.
    fn watch<R>(
        &mut self,
        inner: Poll<io::Result<R>>,
        moved: bool,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<R>> {
        if inner.is_ready() {
            if moved {
                self.armed = false;
            }
            return inner;
        }
        if !self.armed {
            self.timer.as_mut().reset(Instant::now() + self.limit);
            self.armed = true;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                if !self.expired {
                    self.expired = true;
                    crate::metrics::FRONTEND.write_timeouts.inc();
                    tracing::info!(
                        peer = %self.peer,
                        timeout_s = self.limit.as_secs_f64(),
                        "Closing a connection whose client stopped reading (write_timeout_s)"
                    );
                }
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no write went through for {:?}: the client stopped reading",
                        self.limit
                    ),
                )))
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let inner = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(inner, true, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let inner = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(inner, true, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let inner = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(inner, false, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let inner = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(inner, false, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn peer() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 1))
    }

    /// A peer that never reads: once the pipe is full the writer fails, on tokio's paused
    /// clock, after the limit and not before.
    #[tokio::test(start_paused = true)]
    async fn a_write_that_makes_no_progress_fails_at_the_limit() {
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(30), peer());
        let started = Instant::now();
        let e = loop {
            if let Err(e) = w.write_all(&[0; 64]).await {
                break e;
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    /// A slow reader that keeps taking some bytes is never cut off, however long it takes
    /// in all.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_never_cut_off() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut w = WriteDeadline::new(ours, Duration::from_secs(10), peer());
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0; 64];
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                match theirs.read(&mut buf).await {
                    Ok(0) | Err(_) => return got.len(),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        // 20 reads of at most 64 bytes, 5 s apart: 100 s in all, ten times the limit.
        w.write_all(&[7; 64 * 20]).await.unwrap();
        w.shutdown().await.unwrap();
        drop(w);
        assert_eq!(reader.await.unwrap(), 64 * 20);
    }
}
