//! The request plane between processes: one request at a time per TCP connection, connections
//! pooled per address, length-delimited frames (tokio-util's codec), payloads in their types'
//! wire codecs.
//!
//! A call takes an idle connection to the instance's address ([`ConnPool`]) or opens one, and
//! writes a header (request id, instance, time left), the input items and an end-of-input
//! mark, while it reads output items back until a done mark. TCP does the flow control: a slow
//! reader stops the writer's socket buffer, and bounded channels carry that back to the
//! operator on either side. A caller that drops the stream before the done mark (its consumer
//! stopped early, or its context was killed) sends a cancel frame and, on a task of its own,
//! reads up to the done mark the server then sends ([`Conn`]); closing the socket cancels too
//! (the serving side kills the request's context when its read returns end of file). After
//! the done mark the connection goes back to the pool: a connect, an accept and two closes per
//! request were a tenth of the multi-process CPU. A pooled connection the other side has
//! closed (a restarted worker) reads end of file without blocking and is dropped, not used.
//! Both sides buffer frames while more are ready and flush when none is: a request is one
//! write, and so are a step's tokens or the last item with the done mark.
//!
//! Calls to an instance served by this same process skip the socket and the codecs. A failed
//! connection marks the instance down in [`InstanceHealth`] so routers stop choosing it before
//! its discovery lease runs out.
//!
//! With a cluster identity ([`dyn_trust::Trust`]) every connection is TLS and a peer that
//! cannot prove the identity is refused before any frame is read. While a request is served
//! and its handler has nothing to send, the server sends a heartbeat frame every
//! `TcpOptions::heartbeat`; a caller that hears nothing for `TcpOptions::silence` fails the
//! call as an instance lost (so it migrates): a frozen process or a host gone dark keeps its TCP connection
//! established, and nothing else would tell.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::task::TaskTracker;

use async_trait::async_trait;
use bytes::Bytes;
use dyn_trust::PlaneStream;
use futures::stream::{self, StreamExt};
use futures::{FutureExt, SinkExt, Stream};
use parking_lot::{Mutex, RwLock};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};

use super::{
    EndpointTypes, Instance, InstanceHealth, InstanceId, PlaneError, RequestPlane, TcpOptions,
    Transport,
};
use dyn_core::ctx::Ctx;
use dyn_core::operator::{DynOperator, ErrorKind, Input, OpError, Output};
use dyn_core::payload::{AnyPayload, Codec};
use frames::*;

/// Why a call's input could not go out: the connection failed (the instance is lost), or
/// the request itself cannot be sent (the caller's fault).
enum SendFailed {
    Lost(String),
    Invalid(String),
}

struct Served {
    handler: Arc<dyn DynOperator>,
    types: EndpointTypes,
}

struct Shared {
    handlers: RwLock<HashMap<InstanceId, Served>>,
    /// One task per request being served, for the drain.
    in_flight: TaskTracker,
    opts: TcpOptions,
}

type Reader = FramedRead<ReadHalf<PlaneStream>, LengthDelimitedCodec>;
type Writer = FramedWrite<WriteHalf<PlaneStream>, LengthDelimitedCodec>;

/// Idle connections to other processes' request planes, by address.
#[derive(Default)]
struct ConnPool {
    idle: Mutex<HashMap<String, Vec<(Reader, Writer)>>>,
}

/// Idle connections kept per address: enough for the concurrency one frontend sends a worker.
const POOL_PER_ADDRESS: usize = 256;

impl ConnPool {
    /// An idle connection to `address` that is still open.
    fn take(&self, address: &str) -> Option<(Reader, Writer)> {
        loop {
            let (r, w) = self.idle.lock().get_mut(address)?.pop()?;
            // Nothing may arrive on an idle connection: end of file (or anything else) means
            // the other side is gone or confused, and the connection is dropped.
            // Unconstrained: with the task's cooperative budget spent, a read would say
            // Pending without looking, and a closed connection would pass.
            let mut r = r;
            if r.read_buffer().is_empty()
                && tokio::task::unconstrained(r.next())
                    .now_or_never()
                    .is_none()
                && r.read_buffer().is_empty()
            {
                return Some((r, w));
            }
        }
    }

    /// Keep a connection whose last request ended with its done mark read; one with part of a
    /// frame still unsent is dropped (the next request would follow a torn frame).
    fn put(&self, address: &str, conn: (Reader, Writer)) {
        if !conn.1.write_buffer().is_empty() {
            return;
        }
        let mut idle = self.idle.lock();
        let list = idle.entry(address.to_owned()).or_default();
        if list.len() < POOL_PER_ADDRESS {
            list.push(conn);
        }
    }
}

/// How long a caller that stopped reading waits for the server to confirm the cancel before it
/// drops the connection instead.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A call's connection. Dropped before the response's done mark (the consumer stopped early,
/// or the context was killed), it sends a cancel and reads up to the done mark on a task of
/// its own, then goes back to the pool; a connection in an unknown state is closed instead
/// (`reader` or `writer` taken), which the server also reads as a cancellation.
struct Conn {
    reader: Option<Reader>,
    writer: Option<Writer>,
    pool: Arc<ConnPool>,
    address: String,
}

impl Conn {
    /// Back to the pool now (the done mark has been read).
    fn recycle(&mut self) {
        if let (Some(r), Some(w)) = (self.reader.take(), self.writer.take()) {
            self.pool.put(&self.address, (r, w));
        }
    }

    /// Never reused (a protocol error).
    fn poison(&mut self) {
        self.reader = None;
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        let (Some(mut r), Some(mut w)) = (self.reader.take(), self.writer.take()) else {
            return;
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pool, address) = (self.pool.clone(), std::mem::take(&mut self.address));
        rt.spawn(async move {
            let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
                w.send(frame(CANCEL, b"")).await.ok()?;
                while let Some(Ok(f)) = r.next().await {
                    if f.first() == Some(&DONE) {
                        return Some(());
                    }
                }
                None
            })
            .await;
            if let Ok(Some(())) = drained {
                pool.put(&address, (r, w));
            }
        });
    }
}

/// The TCP request plane. See the module docs.
pub struct TcpRequestPlane {
    shared: Arc<Shared>,
    pool: Arc<ConnPool>,
    health: Arc<InstanceHealth>,
    /// The address peers use, once the listener is up.
    address: Mutex<Option<String>>,
    listener: tokio::sync::Mutex<Option<tokio_util::task::AbortOnDropHandle<()>>>,
}

impl TcpRequestPlane {
    pub fn new(opts: TcpOptions, health: Arc<InstanceHealth>) -> Self {
        Self {
            shared: Arc::new(Shared {
                handlers: RwLock::default(),
                in_flight: TaskTracker::new(),
                opts,
            }),
            pool: Arc::default(),
            health,
            address: Mutex::new(None),
            listener: tokio::sync::Mutex::new(None),
        }
    }

    /// Bind the listener on first use; every instance of this process shares it.
    async fn ensure_listening(&self) -> Result<String, PlaneError> {
        let mut guard = self.listener.lock().await;
        if guard.is_none() {
            let err = |message: String| PlaneError::Backend {
                plane: "request",
                message,
            };
            let listener = TcpListener::bind(&self.shared.opts.bind)
                .await
                .map_err(|e| err(format!("cannot listen on {}: {e}", self.shared.opts.bind)))?;
            let local = listener
                .local_addr()
                .map_err(|e| err(format!("listener address: {e}")))?;
            let host = self
                .shared
                .opts
                .advertise_host
                .clone()
                .unwrap_or_else(|| local.ip().to_string());
            let address = if host.contains(':') {
                format!("[{host}]:{}", local.port())
            } else {
                format!("{host}:{}", local.port())
            };
            tracing::info!(address = %address, "Request plane listening");
            *self.address.lock() = Some(address);
            let shared = self.shared.clone();
            *guard = Some(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
                accept_loop(listener, shared),
            )));
        }
        self.address
            .lock()
            .clone()
            .ok_or_else(|| PlaneError::Backend {
                plane: "request",
                message: "listener has no address".into(),
            })
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                dyn_trust::tune(&stream);
                let shared = shared.clone();
                tokio::spawn(async move {
                    match shared.opts.trust.accept(stream).await {
                        Ok(stream) => serve_connection(stream, shared).await,
                        Err(e) => tracing::warn!(error = %e, "Request plane: connection refused"),
                    }
                });
            }
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "Request plane accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One request as the connection reader hands it to the writer side.
struct Incoming {
    header: Header,
    input: mpsc::Receiver<Bytes>,
    ctx: Ctx,
    /// Which request of the connection this is (see `current`).
    n: u64,
}

/// Serve requests on one connection, one after another.
async fn serve_connection(stream: PlaneStream, shared: Arc<Shared>) {
    let (r, w) = tokio::io::split(stream);
    let max = shared.opts.max_message_bytes;
    let mut reader = FramedRead::new(r, length_codec(max));
    let mut writer = FramedWrite::new(w, length_codec(max));
    // The request being served, so the reader can kill it when the caller cancels or goes
    // away. The reader sets it as it reads the header — a cancel may follow the header before
    // the request is even started — and the server clears it only if it is still its own (the
    // caller may already have sent the next request on this connection).
    let current: Arc<Mutex<Option<(u64, Ctx)>>> = Arc::default();
    let (req_tx, mut req_rx) = mpsc::channel::<Incoming>(1);
    let reader_current = current.clone();
    let read_task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
        let mut input_tx: Option<mpsc::Sender<Bytes>> = None;
        let mut n = 0u64;
        loop {
            let frame = match reader.next().await {
                Some(Ok(f)) => f,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "Request plane connection read failed");
                    break;
                }
                None => break,
            };
            // The body is the frame past its tag byte, without a copy.
            let Some(&tag) = frame.first() else { break };
            let body = frame.freeze().slice(1..);
            match tag {
                HEADER => {
                    let Ok(header) = serde_json::from_slice::<Header>(&body) else {
                        tracing::warn!("Request plane: bad header; closing the connection");
                        break;
                    };
                    let (tx, rx) = mpsc::channel(16);
                    input_tx = Some(tx);
                    let mut ctx = Ctx::with_id(header.request_id.clone());
                    if let Some(ms) = header.timeout_ms {
                        ctx = ctx.with_timeout(Duration::from_millis(ms));
                    }
                    n += 1;
                    *reader_current.lock() = Some((n, ctx.clone()));
                    let incoming = Incoming {
                        header,
                        input: rx,
                        ctx,
                        n,
                    };
                    if req_tx.send(incoming).await.is_err() {
                        break;
                    }
                }
                ITEM => {
                    // Backpressure: a handler that does not read its input stops this read,
                    // and TCP stops the caller.
                    if let Some(tx) = &input_tx {
                        let _ = tx.send(body).await;
                    }
                }
                END_INPUT => input_tx = None,
                // For the request being served; one that already ended has nothing to stop.
                CANCEL => {
                    if let Some((_, ctx)) = reader_current.lock().as_ref() {
                        ctx.kill();
                    }
                }
                _ => {
                    tracing::warn!(tag, "Request plane: unknown frame; closing the connection");
                    break;
                }
            }
        }
        // The caller closed the connection: whatever it asked for is no longer wanted.
        if let Some((_, ctx)) = reader_current.lock().take() {
            ctx.kill();
        }
    }));

    while let Some(Incoming {
        header,
        input,
        ctx,
        n,
    }) = req_rx.recv().await
    {
        let ok = shared
            .in_flight
            .track_future(serve_one(&shared, &header, ctx.clone(), input, &mut writer))
            .await;
        let mut cur = current.lock();
        if cur.as_ref().is_some_and(|(m, _)| *m == n) {
            *cur = None;
        }
        drop(cur);
        if !ok {
            ctx.kill();
            break;
        }
    }
    drop(read_task);
}

/// Serve one request; false when the connection broke.
async fn serve_one(
    shared: &Shared,
    header: &Header,
    ctx: Ctx,
    input: mpsc::Receiver<Bytes>,
    writer: &mut Writer,
) -> bool {
    let found = shared
        .handlers
        .read()
        .get(&header.instance_id)
        .map(|s| (s.handler.clone(), s.types));
    let Some((handler, types)) = found else {
        let e = OpError::instance_lost(format!(
            "instance {:x} is not served here",
            header.instance_id
        ))
        .with_code(dyn_core::operator::NOT_SERVED);
        return send_error_and_done(writer, &e).await;
    };
    let (in_codec, out_codec) = match (codec_of(types.input), codec_of(types.output)) {
        (Ok(i), Ok(o)) => (i, o),
        (Err(e), _) | (_, Err(e)) => return send_error_and_done(writer, &e).await,
    };
    let sent = header.codec.as_deref().unwrap_or("json");
    if sent != in_codec.format {
        // Not the client's fault: a deployment of mixed versions (another instance of the
        // caller's version may take the request).
        let e = OpError::internal(format!(
            "the caller writes `{}` as {sent} and this worker reads {}: the processes of a graph must run one dyn version",
            types.input.name, in_codec.format
        ));
        return send_error_and_done(writer, &e).await;
    }
    let decode_error: Arc<Mutex<Option<OpError>>> = Arc::default();
    let slot = decode_error.clone();
    let input = tokio_stream::wrappers::ReceiverStream::new(input)
        .map(move |bytes| (in_codec.decode)(&bytes))
        .take_while(move |r| {
            let ok = r.is_ok();
            if let Err(e) = r {
                slot.lock()
                    .get_or_insert(OpError::invalid(format!("cannot decode the request: {e}")));
            }
            futures::future::ready(ok)
        })
        .filter_map(|r| futures::future::ready(r.ok()))
        .boxed();
    let mut out = handler.call(ctx, input);
    // Frames are buffered while the handler has more ready and flushed when it has none: the
    // tokens of a step, and the last item with the done mark, go out in one write (a write per
    // frame was a third of a worker process's CPU).
    loop {
        let item = match out.next().now_or_never() {
            Some(item) => item,
            None => {
                if SinkExt::<Bytes>::flush(writer).await.is_err() {
                    return false;
                }
                // Silent handler: a heartbeat each period, so the caller can tell a slow
                // answer from a dead host.
                loop {
                    match tokio::time::timeout(shared.opts.heartbeat, out.next()).await {
                        Ok(item) => break item,
                        Err(_) => {
                            if writer.send(frame(PING, b"")).await.is_err() {
                                return false;
                            }
                        }
                    }
                }
            }
        };
        let Some(item) = item else { break };
        if room(writer).await.is_err() {
            return false;
        }
        let max = shared.opts.max_message_bytes;
        let failed = match item {
            Ok(v) => match put_frame(writer.write_buffer_mut(), ITEM, out_codec, v.as_ref(), max) {
                Ok(()) => continue,
                Err(Unwritten::TooLarge(n)) => OpError::internal(format!(
                    "response item of {n} bytes exceeds the {max}-byte message limit"
                )),
                Err(Unwritten::Codec(e)) => {
                    OpError::internal(format!("cannot encode a response: {e}"))
                }
            },
            Err(e) => e,
        };
        if writer.feed(error_frame(&failed)).await.is_err() {
            return false;
        }
        break;
    }
    drop(out);
    let failed = decode_error.lock().take();
    if let Some(e) = failed
        && writer.feed(error_frame(&e)).await.is_err()
    {
        return false;
    }
    writer.send(frame(DONE, b"")).await.is_ok()
}

/// Waits, as the codec's own sink would before taking an item, until the write buffer is
/// under its back-pressure boundary (frames are encoded into it in place: [`put_frame`]).
async fn room(writer: &mut Writer) -> std::io::Result<()> {
    if writer.write_buffer().len() >= writer.backpressure_boundary() {
        SinkExt::<Bytes>::flush(writer).await?;
    }
    Ok(())
}

async fn send_error_and_done(writer: &mut Writer, e: &OpError) -> bool {
    writer.send(error_frame(e)).await.is_ok() && writer.send(frame(DONE, b"")).await.is_ok()
}

#[async_trait]
impl RequestPlane for TcpRequestPlane {
    async fn serve(
        &self,
        instance: &Instance,
        types: EndpointTypes,
        handler: Arc<dyn DynOperator>,
    ) -> Result<Transport, PlaneError> {
        let address = self.ensure_listening().await?;
        self.shared
            .handlers
            .write()
            .insert(instance.instance_id, Served { handler, types });
        Ok(Transport::Tcp { address })
    }

    async fn unserve(&self, instance_id: InstanceId) -> Result<(), PlaneError> {
        self.shared.handlers.write().remove(&instance_id);
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.shared.in_flight.len()
    }

    fn drained(&self) -> futures::future::BoxFuture<'static, ()> {
        let tracker = self.shared.in_flight.clone();
        tracker.close();
        Box::pin(async move { tracker.wait().await })
    }

    fn health(&self) -> Option<&InstanceHealth> {
        Some(&self.health)
    }

    fn call(
        &self,
        instance: &Instance,
        types: EndpointTypes,
        ctx: Ctx,
        input: Input<AnyPayload>,
    ) -> Output<AnyPayload> {
        // Served here: no socket, no codec.
        let local = self
            .shared
            .handlers
            .read()
            .get(&instance.instance_id)
            .map(|s| s.handler.clone());
        if let Some(h) = local {
            return h.call(ctx, input);
        }
        let address = match &instance.transport {
            Transport::Tcp { address } => address.clone(),
            Transport::InProcess => {
                return error_stream(OpError::instance_lost(format!(
                    "instance {:x} of '{}' is in another process but has no address",
                    instance.instance_id, instance.component
                )));
            }
        };
        let call = RemoteCall {
            address,
            instance_id: instance.instance_id,
            component: instance.component.clone(),
            types,
            opts: self.shared.opts.clone(),
            health: self.health.clone(),
            pool: self.pool.clone(),
        };
        call.run(ctx, input).boxed()
    }
}

fn error_stream(e: OpError) -> Output<AnyPayload> {
    stream::once(futures::future::ready(Err(e))).boxed()
}

struct RemoteCall {
    address: String,
    instance_id: InstanceId,
    component: String,
    types: EndpointTypes,
    opts: TcpOptions,
    health: Arc<InstanceHealth>,
    pool: Arc<ConnPool>,
}

impl RemoteCall {
    async fn connect(&self) -> Result<(Reader, Writer), OpError> {
        if let Some(conn) = self.pool.take(&self.address) {
            return Ok(conn);
        }
        let connect =
            tokio::time::timeout(self.opts.connect_timeout, TcpStream::connect(&self.address));
        let tcp = match connect.await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                self.health.report_down(self.instance_id);
                return Err(self.lost(format!("cannot connect: {e}")));
            }
            Err(_) => {
                self.health.report_down(self.instance_id);
                return Err(self.lost(format!(
                    "no connection within {:?}",
                    self.opts.connect_timeout
                )));
            }
        };
        dyn_trust::tune(&tcp);
        let stream = match self.opts.trust.connect(tcp, &self.address).await {
            Ok(s) => s,
            Err(e) => {
                self.health.report_down(self.instance_id);
                return Err(self.lost(e));
            }
        };
        let (r, w) = tokio::io::split(stream);
        let max = self.opts.max_message_bytes;
        Ok((
            FramedRead::new(r, length_codec(max)),
            FramedWrite::new(w, length_codec(max)),
        ))
    }

    fn lost(&self, what: impl std::fmt::Display) -> OpError {
        OpError::instance_lost(format!(
            "instance {:x} of '{}' at {}: {what}",
            self.instance_id, self.component, self.address
        ))
    }

    /// The header frame: which instance, which request, and the time left before the
    /// caller's deadline (relative: the two machines' clocks need not agree).
    fn header(&self, ctx: &Ctx, codec: &Codec) -> Bytes {
        let header = Header {
            codec: Some(codec.format.to_string()),
            instance_id: self.instance_id,
            request_id: ctx.id().to_string(),
            timeout_ms: ctx
                .deadline()
                // Rounded up: the callee must not stop before the caller's deadline.
                .map(|d| {
                    let left = d.saturating_duration_since(Instant::now()).as_micros();
                    u64::try_from(left.div_ceil(1000)).unwrap_or(u64::MAX)
                }),
        };
        frame(HEADER, &serde_json::to_vec(&header).unwrap_or_default())
    }

    /// What one frame from the serving side means for the call. The last item comes with the
    /// done mark behind it: that mark is read now, while it is at hand (a consumer stops
    /// polling at the last item, the finish), or the connection could never be reused.
    fn reply(&self, frame: &[u8], out_codec: &Codec, reader: &mut Reader) -> Reply {
        match frame.split_first() {
            Some((&ITEM, body)) => match (out_codec.decode)(body) {
                Ok(v) if reader.read_buffer().as_ref() == DONE_FRAME => {
                    let done = matches!(reader.next().now_or_never(), Some(Some(Ok(_))));
                    Reply::Last(v, done)
                }
                Ok(v) => Reply::Item(v),
                Err(e) => Reply::Broken(OpError::internal(format!(
                    "cannot decode a response from '{}': {e}",
                    self.component
                ))),
            },
            Some((&ERROR, body)) => {
                let e = serde_json::from_slice::<OpError>(body)
                    .unwrap_or_else(|_| OpError::internal("unreadable error from a worker"));
                // The process is there but no longer serves the instance.
                if e.kind == ErrorKind::InstanceLost
                    && e.code.as_deref() == Some(dyn_core::operator::NOT_SERVED)
                {
                    self.health.report_down(self.instance_id);
                }
                Reply::Failed(e)
            }
            Some((&DONE, _)) => Reply::Done,
            Some((&PING, _)) => Reply::Alive,
            _ => Reply::Broken(OpError::internal(format!(
                "unexpected frame from '{}'",
                self.component
            ))),
        }
    }

    /// The connection broke under a call: the instance is reported down and the call lost.
    fn broke(&self, what: impl std::fmt::Display) -> OpError {
        self.health.report_down(self.instance_id);
        self.lost(what)
    }

    fn run(
        self,
        ctx: Ctx,
        input: Input<AnyPayload>,
    ) -> impl Stream<Item = Result<AnyPayload, OpError>> + Send + 'static {
        async_stream::stream! {
            let (in_codec, out_codec) = match (codec_of(self.types.input), codec_of(self.types.output)) {
                (Ok(i), Ok(o)) => (i, o),
                (Err(e), _) | (_, Err(e)) => {
                    yield Err(e);
                    return;
                }
            };
            let mut conn = match self.connect().await {
                Ok((r, w)) => Conn { reader: Some(r), writer: Some(w), pool: self.pool.clone(), address: self.address.clone() },
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            let (Some(reader), Some(writer)) = (conn.reader.as_mut(), conn.writer.as_mut()) else {
                return;
            };
            // Input goes out while outputs come back. The input borrows the writer so that a
            // call whose response ends before its input does (a router keeps its input open
            // until the answer is over) can still hand the connection back.
            let header = self.header(&ctx, &in_codec);
            let max = self.opts.max_message_bytes;
            let mut send_input = Box::pin(send_input(writer, header, input, in_codec, max));
            let mut sent = false;
            let mut got_any = false;
            loop {
                tokio::select! {
                    res = &mut send_input, if !sent => match res {
                        Ok(()) => sent = true,
                        Err(SendFailed::Lost(msg)) => {
                            conn.reader = None;
                            yield Err(if got_any { self.lost(msg) } else { self.broke(msg) });
                            return;
                        }
                        Err(SendFailed::Invalid(msg)) => {
                            yield Err(OpError::invalid(msg));
                            return;
                        }
                    },
                    frame = tokio::time::timeout(self.opts.silence, reader.next()) => {
                        let frame = match frame {
                            Ok(Some(Ok(f))) => f,
                            Err(_) => {
                                drop(send_input);
                                conn.poison();
                                yield Err(self.broke(format!("nothing heard for {:?}: the process or its host stopped", self.opts.silence)));
                                return;
                            }
                            Ok(Some(Err(e))) => {
                                drop(send_input);
                                conn.poison();
                                yield Err(self.broke(format!("connection failed: {e}")));
                                return;
                            }
                            Ok(None) => {
                                drop(send_input);
                                conn.poison();
                                yield Err(self.broke("connection closed mid-response"));
                                return;
                            }
                        };
                        // A heartbeat says the process lives, not that it took the request.
                        got_any |= frame.first() != Some(&PING);
                        match self.reply(&frame, &out_codec, reader) {
                            Reply::Alive => {}
                            Reply::Item(v) => yield Ok(v),
                            Reply::Last(v, done) => {
                                drop(send_input);
                                if done {
                                    conn.recycle();
                                }
                                yield Ok(v);
                                if ctx.is_killed() {
                                    yield Err(OpError::cancelled());
                                }
                                return;
                            }
                            Reply::Done => {
                                // A clean end: the connection is free for the next call once
                                // no part of a frame is left unsent (the serving side ignores
                                // input that was still to come; the next header starts afresh).
                                drop(send_input);
                                conn.recycle();
                                // The serving side saw the deadline first and ended early.
                                if ctx.is_killed() {
                                    yield Err(OpError::cancelled());
                                }
                                return;
                            }
                            Reply::Failed(e) => {
                                yield Err(e);
                                return;
                            }
                            Reply::Broken(e) => {
                                drop(send_input);
                                conn.poison();
                                yield Err(e);
                                return;
                            }
                        }
                    }
                    _ = ctx.killed() => {
                        // Dropping the call sends the other side a cancel (`Conn`).
                        yield Err(OpError::cancelled());
                        return;
                    }
                }
            }
        }
    }
}

/// What one frame from the serving side means for a call ([`RemoteCall::reply`]).
enum Reply {
    /// An output item; more follow.
    Item(AnyPayload),
    /// The last output item; `true` when the done mark behind it was read too, so the
    /// connection can go back to the pool.
    Last(AnyPayload, bool),
    /// The done mark: the call ended cleanly.
    Done,
    /// A heartbeat: the server is there and still serving.
    Alive,
    /// The worker's error; the exchange itself went by the protocol.
    Failed(OpError),
    /// A frame that breaks the protocol: the connection is not reused.
    Broken(OpError),
}

/// Send a call's header and input items, then the end-of-input mark. An item that cannot be
/// encoded, or is over the message limit, fails the call; the write half stays open until
/// the response is done (closing it would read as a cancellation on the other side).
async fn send_input(
    writer: &mut Writer,
    header: Bytes,
    mut input: Input<AnyPayload>,
    in_codec: Codec,
    max: usize,
) -> Result<(), SendFailed> {
    let lost = |e: std::io::Error| SendFailed::Lost(format!("send failed: {e}"));
    // Buffered like the serving side's output: a one-item request is one write.
    writer.feed(header).await.map_err(lost)?;
    loop {
        let item = match input.next().now_or_never() {
            Some(item) => item,
            None => {
                SinkExt::<Bytes>::flush(writer).await.map_err(lost)?;
                input.next().await
            }
        };
        let Some(item) = item else { break };
        room(writer).await.map_err(lost)?;
        put_frame(
            writer.write_buffer_mut(),
            ITEM,
            in_codec,
            item.as_ref(),
            max,
        )
        .map_err(|e| match e {
            Unwritten::Codec(e) => SendFailed::Invalid(format!("cannot encode the request: {e}")),
            Unwritten::TooLarge(n) => SendFailed::Invalid(format!(
                "request item of {n} bytes exceeds the {max}-byte message limit"
            )),
        })?;
    }
    writer.send(frame(END_INPUT, b"")).await.map_err(lost)
}

mod frames;
#[cfg(test)]
mod tests;
