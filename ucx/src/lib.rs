//! One-sided reads of registered memory between processes, through UCX.
//!
//! The data plane's RDMA-capable transport: a process *registers* a region of its memory
//! ([`Agent::register`]) and hands out where it can be read ([`Remote`]: its agent's worker
//! address, the region's address and length, and the packed remote key); another process
//! *reads* a range of it with one `ucp_get_nbx` ([`Agent::get`]), without the owner's code
//! running for it. UCX picks the wire: RDMA reads where there is an RDMA device, cross-memory
//! attach between processes of one machine. Reads UCX *emulates* with messages (over TCP or
//! System V shared memory) are left out unless `UCX_TLS` asks for them: the owner answers
//! those from whatever address they name, registered or not.
//!
//! An [`Agent`] owns one UCX context and one worker, driven by a progress thread of its own, and
//! every UCX call happens on that thread (the worker is single-threaded). Callers hand it
//! commands over a channel. While a read is in flight the thread progresses the worker without
//! pause; after activity it looks for a next command for 50 µs without sleeping (a sleeping
//! thread's wake-up cost a small read more than the read); idle, it waits on the channel for
//! at most [`IDLE_WAIT`], progressing in between —
//! emulated reads, where enabled, complete only while the serving side progresses its worker.
//! The context does not ask for UCX's wake-up events: with them UCX keeps only transports that
//! can raise one, and cross-memory attach (one machine's true one-sided read) cannot.
//!
//! The bindings are `ucx-rs` (NVIDIA's, from ai-dynamo/velo), which builds UCX 1.22 from its
//! release tarball into the binary: nothing to install, no plugin directory at run time.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ucx_rs::sys;

#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    #[error("UCX {op}: {status}")]
    Call {
        op: &'static str,
        status: &'static str,
    },
    #[error("the UCX agent's progress thread is gone")]
    Gone,
    #[error("a UCX read of {len} bytes did not finish within {after:?}")]
    TimedOut { len: usize, after: Duration },
    #[error("an empty region cannot be registered")]
    Empty,
    #[error("{len} bytes at offset {offset} are outside the region of {size} bytes")]
    OutOfRange { offset: u64, len: usize, size: u64 },
}

fn check(op: &'static str, st: sys::ucs_status_t) -> Result<(), UcxError> {
    if st == sys::ucs_status_t_UCS_OK {
        Ok(())
    } else {
        Err(failed(op, st))
    }
}

fn failed(op: &'static str, st: sys::ucs_status_t) -> UcxError {
    UcxError::Call {
        op,
        status: ucx_rs::status_string(st),
    }
}

/// Where a registered region can be read from: what its owner publishes to readers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Remote {
    /// The owning agent's worker address (`ucp_worker_query`).
    pub worker: Vec<u8>,
    /// The region's first byte, in the owner's address space.
    pub addr: u64,
    pub len: u64,
    /// The region's packed remote key (`ucp_rkey_pack`).
    pub rkey: Vec<u8>,
}

/// One line: the four fields, the byte strings in hex (what a test or a log passes along).
impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        write!(
            f,
            "{} {} {} {}",
            hex(&self.worker),
            self.addr,
            self.len,
            hex(&self.rkey)
        )
    }
}

impl std::str::FromStr for Remote {
    type Err = String;

    fn from_str(s: &str) -> Result<Remote, String> {
        fn unhex(s: &str) -> Result<Vec<u8>, String> {
            if !s.len().is_multiple_of(2) {
                return Err("odd hex length".into());
            }
            (0..s.len())
                .step_by(2)
                .map(|i| {
                    s.get(i..i + 2)
                        .and_then(|d| u8::from_str_radix(d, 16).ok())
                        .ok_or_else(|| format!("not hex: {s}"))
                })
                .collect()
        }
        let f: Vec<&str> = s.split_whitespace().collect();
        let [worker, addr, len, rkey] = f[..] else {
            return Err(format!("a remote is four fields, not {}", f.len()));
        };
        Ok(Remote {
            worker: unhex(worker)?,
            addr: addr.parse().map_err(|e| format!("address: {e}"))?,
            len: len.parse().map_err(|e| format!("length: {e}"))?,
            rkey: unhex(rkey)?,
        })
    }
}

/// A memory handle, owned by the progress thread.
struct MemH(sys::ucp_mem_h);

// SAFETY: created and unmapped on the progress thread only; other threads carry it opaquely.
unsafe impl Send for MemH {}

enum Cmd {
    Register {
        /// The region: memory its `Registered` keeps alive until the unmap.
        addr: usize,
        len: usize,
        reply: tokio::sync::oneshot::Sender<Result<(MemH, Vec<u8>), UcxError>>,
    },
    Unmap {
        memh: MemH,
        /// The region's memory, released only once it is unmapped.
        _keep: Vec<Bytes>,
    },
    Get {
        id: u64,
        from: Remote,
        /// The first byte to read, in the peer's address space (inside `from`'s region).
        at: u64,
        /// Empty, with room for `len` bytes.
        buf: Vec<u8>,
        len: usize,
        reply: tokio::sync::oneshot::Sender<Result<Vec<u8>, UcxError>>,
    },
    Cancel {
        id: u64,
    },
}

/// The command channel to the progress thread.
#[derive(Clone)]
struct Commands {
    tx: mpsc::Sender<Cmd>,
}

impl Commands {
    fn send(&self, cmd: Cmd) -> Result<(), UcxError> {
        self.tx.send(cmd).map_err(|_| UcxError::Gone)
    }
}

/// One UCX context and worker with their progress thread (see the module docs).
pub struct Agent {
    cmds: Commands,
    address: Vec<u8>,
    next_id: std::sync::atomic::AtomicU64,
}

impl Agent {
    /// Starts the agent's progress thread, named `name`.
    pub fn new(name: &str) -> Result<Agent, UcxError> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || match Progress::start() {
                Ok(p) => {
                    let _ = ready_tx.send(Ok(p.address.clone()));
                    p.run(rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|_| UcxError::Gone)?;
        let address = ready_rx.recv().map_err(|_| UcxError::Gone)??;
        Ok(Agent {
            cmds: Commands { tx },
            address,
            next_id: Default::default(),
        })
    }

    /// This agent's worker address, as readers connect to it.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Makes `bytes` readable by peers holding the returned region's [`Remote`], until the
    /// region is dropped (one command to the progress thread).
    pub async fn register(&self, bytes: Bytes) -> Result<Registered, UcxError> {
        self.register_blocks(vec![bytes]).await
    }

    /// Makes `blocks` readable as one region, back to back. Blocks that already lie back to
    /// back in memory (slices of one buffer, as an engine's export makes them) are registered
    /// where they are; others are first copied into one buffer, on a blocking thread.
    pub async fn register_blocks(&self, blocks: Vec<Bytes>) -> Result<Registered, UcxError> {
        let blocks = if adjacent(&blocks) {
            blocks
        } else {
            let joined = tokio::task::spawn_blocking(move || Bytes::from(blocks.concat()));
            vec![joined.await.map_err(|_| UcxError::Gone)?]
        };
        let (addr, len) = match (blocks.first(), blocks.iter().map(Bytes::len).sum()) {
            (Some(first), len) if len > 0 => (first.as_ptr() as usize, len),
            _ => return Err(UcxError::Empty),
        };
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.cmds.send(Cmd::Register { addr, len, reply })?;
        let done = rx.await.map_err(|_| UcxError::Gone)?;
        Ok(self.registered(done?, addr, len, blocks))
    }

    fn registered(
        &self,
        (memh, rkey): (MemH, Vec<u8>),
        addr: usize,
        len: usize,
        keep: Vec<Bytes>,
    ) -> Registered {
        Registered {
            remote: Remote {
                worker: self.address.clone(),
                addr: addr as u64,
                len: len as u64,
                rkey,
            },
            memh: Some(memh),
            keep,
            cmds: self.cmds.clone(),
        }
    }

    /// Reads `len` bytes at `offset` of the region `from` describes, within `limit` (a read
    /// past it is cancelled: a peer that went away must not hang its reader).
    pub async fn get(
        &self,
        from: &Remote,
        offset: u64,
        len: usize,
        limit: Duration,
    ) -> Result<Vec<u8>, UcxError> {
        self.get_into(from, offset, Vec::new(), len, limit).await
    }

    /// [`Self::get`] into `buf` (its contents replaced), returned filled: a reader that reuses
    /// its buffer spares the kernel faulting in fresh pages under every read (a fresh 64 MiB
    /// buffer made a read several times slower here).
    pub async fn get_into(
        &self,
        from: &Remote,
        offset: u64,
        mut buf: Vec<u8>,
        len: usize,
        limit: Duration,
    ) -> Result<Vec<u8>, UcxError> {
        // A `Remote` comes from another process: its numbers are checked, not trusted.
        let at = offset
            .checked_add(len as u64)
            .filter(|&end| end <= from.len)
            .and_then(|_| from.addr.checked_add(offset))
            .ok_or(UcxError::OutOfRange {
                offset,
                len,
                size: from.len,
            })?;
        buf.clear();
        buf.reserve(len);
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.cmds.send(Cmd::Get {
            id,
            from: from.clone(),
            at,
            buf,
            len,
            reply,
        })?;
        // A read whose caller stops waiting — past the limit, or its future dropped — is
        // cancelled, not left running.
        let mut pending = CancelOnDrop {
            cmds: &self.cmds,
            id: Some(id),
        };
        let r = match tokio::time::timeout(limit, rx).await {
            Ok(r) => {
                pending.id = None;
                r.map_err(|_| UcxError::Gone)?
            }
            Err(_) => Err(UcxError::TimedOut { len, after: limit }),
        };
        drop(pending);
        r
    }
}

/// Cancels the read `id` when dropped still armed.
struct CancelOnDrop<'a> {
    cmds: &'a Commands,
    id: Option<u64>,
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = self.cmds.send(Cmd::Cancel { id });
        }
    }
}

/// A region registered with an agent (see [`Agent::register`]). Dropping it unmaps the region
/// and then releases its memory: its owner keeps it while readers may still read it (the
/// transfer's offer does, until it is pulled or expires). What a registration exposes: the
/// region to a reader holding its key — and, over cross-memory attach, the transport itself
/// lets a process of the same user read any of this one's memory, key or not, as the kernel
/// already does for such processes.
pub struct Registered {
    remote: Remote,
    memh: Option<MemH>,
    /// The memory it spans (one buffer, or blocks lying back to back).
    keep: Vec<Bytes>,
    cmds: Commands,
}

/// True when each block starts where the one before it ends: together they are one span of
/// memory, every byte of it owned by one of them.
fn adjacent(blocks: &[Bytes]) -> bool {
    blocks
        .windows(2)
        .all(|w| w[0].as_ptr() as usize + w[0].len() == w[1].as_ptr() as usize)
}

impl Registered {
    pub fn remote(&self) -> &Remote {
        &self.remote
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(memh) = self.memh.take() {
            let _ = self.cmds.send(Cmd::Unmap {
                memh,
                _keep: std::mem::take(&mut self.keep),
            });
        }
    }
}

/// A read in flight: the buffer and key stay here until UCX is done with them.
struct Pending {
    req: *mut std::ffi::c_void,
    rkey: sys::ucp_rkey_h,
    buf: Vec<u8>,
    len: usize,
    peer: Vec<u8>,
    reply: tokio::sync::oneshot::Sender<Result<Vec<u8>, UcxError>>,
    /// When it was cancelled: a read that UCX does not end within [`GIVE_UP`] of that no
    /// longer keeps the thread spinning.
    cancelled: Option<Instant>,
}

/// The progress thread's state: everything UCX is touched through.
struct Progress {
    ctx: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    address: Vec<u8>,
    eps: HashMap<Vec<u8>, sys::ucp_ep_h>,
    pending: HashMap<u64, Pending>,
}

/// The longest an idle agent goes without progressing its worker (a command wakes it at
/// once). The wait starts at [`BUSY_WAIT`] after activity and doubles while nothing happens:
/// an emulated read served here waits little, an idle agent wakes ~100 times a second.
pub const IDLE_WAIT: Duration = Duration::from_millis(10);
const BUSY_WAIT: Duration = Duration::from_micros(50);
/// Endpoints an agent keeps open to peers it read from.
const MAX_ENDPOINTS: usize = 1024;

/// How long the thread looks for a next command without sleeping after activity.
const SPIN: Duration = Duration::from_micros(50);
/// How long a cancelled read may take to end before the thread stops waiting for it.
const GIVE_UP: Duration = Duration::from_secs(1);

impl Progress {
    fn start() -> Result<Progress, UcxError> {
        // SAFETY: zeroed parameter structs are UCX's documented starting point (every field
        // is read only when its bit is in `field_mask`); out-pointers are valid locals.
        unsafe {
            let mut p: sys::ucp_params_t = MaybeUninit::zeroed().assume_init();
            p.field_mask = sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64;
            // RMA alone: asking for wake-up events too would leave out cross-memory attach.
            p.features = sys::ucp_feature_UCP_FEATURE_RMA as u64;
            // UCX's TCP transport listens on every network device; unless the environment
            // names devices (`UCX_NET_DEVICES`), only loopback's, as every dyn listener binds
            // to loopback unless told otherwise. Shared-memory and attach transports are not
            // network devices and stay.
            let mut config = null_mut();
            check(
                "config_read",
                sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config),
            )?;
            //
            // And unless the environment names transports (`UCX_TLS`), neither TCP nor System
            // V shared memory: over a transport that carries messages but cannot read memory
            // itself, UCX emulates a read by a message the owner answers by copying from
            // whatever address the message names — registered or not (`rma_sw.c`). TCP would
            // let anyone who reaches the port do that, SysV segments anyone of the group
            // (they are created group-readable); POSIX shared memory is the user's alone, as
            // cross-memory attach is.
            for (var, name, value) in [
                ("UCX_NET_DEVICES", c"NET_DEVICES", c"lo"),
                ("UCX_TLS", c"TLS", c"^tcp,sysv"),
            ] {
                if std::env::var_os(var).is_none() {
                    let st = sys::ucp_config_modify(config, name.as_ptr(), value.as_ptr());
                    if let Err(e) = check("config_modify", st) {
                        sys::ucp_config_release(config);
                        return Err(e);
                    }
                }
            }
            let mut ctx = null_mut();
            let st =
                sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &p, config, &mut ctx);
            sys::ucp_config_release(config);
            check("init", st)?;
            let mut wp: sys::ucp_worker_params_t = MaybeUninit::zeroed().assume_init();
            wp.field_mask = sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wp.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            let mut worker = null_mut();
            if let Err(e) = check(
                "worker_create",
                sys::ucp_worker_create(ctx, &wp, &mut worker),
            ) {
                sys::ucp_cleanup(ctx);
                return Err(e);
            }
            let mut p = Progress {
                ctx,
                worker,
                address: Vec::new(),
                eps: HashMap::new(),
                pending: HashMap::new(),
            };
            // From here on, dropping `p` destroys the worker and context.
            let mut attr: sys::ucp_worker_attr_t = MaybeUninit::zeroed().assume_init();
            attr.field_mask = sys::ucp_worker_attr_field_UCP_WORKER_ATTR_FIELD_ADDRESS as u64;
            check("worker_query", sys::ucp_worker_query(worker, &mut attr))?;
            p.address =
                std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec();
            sys::ucp_worker_release_address(worker, attr.address);
            Ok(p)
        }
    }

    /// Serve commands and progress the worker until every sender is gone and no read is in
    /// flight.
    fn run(mut self, rx: mpsc::Receiver<Cmd>) {
        let mut open = true;
        let mut wait = BUSY_WAIT;
        loop {
            while open {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        // Nobody waits for these any more.
                        let ids: Vec<u64> = self.pending.keys().copied().collect();
                        for id in ids {
                            self.cancel(id);
                        }
                    }
                }
            }
            if !open && !self.active() {
                if !self.pending.is_empty() {
                    // UCX still owns those reads' buffers and would write them: the worker,
                    // the context and the buffers are left as they are, not freed.
                    tracing::warn!(
                        reads = self.pending.len(),
                        "UCX reads never ended; their agent is leaked"
                    );
                    std::mem::forget(self);
                }
                return;
            }
            // SAFETY: the worker is this thread's.
            let progressed = unsafe { sys::ucp_worker_progress(self.worker) };
            self.reap();
            if progressed != 0 || self.active() {
                // Reads in flight: round again at once (yielding the core when UCX had nothing).
                wait = BUSY_WAIT;
                if progressed == 0 {
                    std::thread::yield_now();
                }
                continue;
            }
            if !open {
                continue;
            }
            // Just after activity the next command often follows at once (the blocks of one
            // pull, a reader's next read): look for it a little while before sleeping, as a
            // sleeping thread's wake-up cost a small read more than the read itself.
            if wait == BUSY_WAIT
                && let Some(cmd) = spin_for(&rx, SPIN)
            {
                self.handle(cmd);
                continue;
            }
            match rx.recv_timeout(wait) {
                Ok(cmd) => {
                    wait = BUSY_WAIT;
                    self.handle(cmd);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => wait = (wait * 2).min(IDLE_WAIT),
                Err(mpsc::RecvTimeoutError::Disconnected) => {}
            }
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { addr, len, reply } => {
                // A registration its caller stopped waiting for is undone at once: nothing
                // else would unmap it.
                if let Err(Ok((memh, _))) = reply.send(self.register(addr, len)) {
                    self.unmap(memh);
                }
            }
            Cmd::Unmap { memh, _keep } => self.unmap(memh),
            Cmd::Get {
                id,
                from,
                at,
                buf,
                len,
                reply,
            } => {
                if let Some(done) = self.start_get(id, &from, at, buf, len, reply) {
                    let (reply, r) = done;
                    let _ = reply.send(r);
                }
            }
            Cmd::Cancel { id } => self.cancel(id),
        }
    }

    fn cancel(&mut self, id: u64) {
        if let Some(p) = self.pending.get_mut(&id)
            && p.cancelled.is_none()
        {
            p.cancelled = Some(Instant::now());
            // SAFETY: a live request of this worker; it completes as cancelled.
            unsafe { sys::ucp_request_cancel(self.worker, p.req) };
        }
    }

    /// Whether a read is in flight that may still end soon.
    fn active(&self) -> bool {
        self.pending
            .values()
            .any(|p| p.cancelled.is_none_or(|t| t.elapsed() < GIVE_UP))
    }

    fn unmap(&mut self, memh: MemH) {
        // SAFETY: a handle this context mapped, unmapped once (taken from its region, or from
        // a registration nobody received).
        let st = unsafe { sys::ucp_mem_unmap(self.ctx, memh.0) };
        if let Err(e) = check("mem_unmap", st) {
            tracing::warn!(error = %e, "UCX region not unmapped");
        }
    }

    fn register(&mut self, addr: usize, len: usize) -> Result<(MemH, Vec<u8>), UcxError> {
        // SAFETY: the region is memory its `Registered` keeps alive until the unmap (one
        // buffer, or blocks back to back); UCX reads it for peers and never writes it (peers
        // only get).
        unsafe {
            let mut mp: sys::ucp_mem_map_params_t = MaybeUninit::zeroed().assume_init();
            mp.field_mask = (sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64;
            mp.address = addr as *mut _;
            mp.length = len;
            let mut memh = null_mut();
            check("mem_map", sys::ucp_mem_map(self.ctx, &mp, &mut memh))?;
            let mut packed: *mut std::ffi::c_void = null_mut();
            let mut size = 0usize;
            if let Err(e) = check(
                "rkey_pack",
                sys::ucp_rkey_pack(self.ctx, memh, &mut packed, &mut size),
            ) {
                sys::ucp_mem_unmap(self.ctx, memh);
                return Err(e);
            }
            let rkey = std::slice::from_raw_parts(packed as *const u8, size).to_vec();
            sys::ucp_rkey_buffer_release(packed);
            Ok((MemH(memh), rkey))
        }
    }

    /// The endpoint to `peer`, opened on first use.
    fn endpoint(&mut self, peer: &[u8]) -> Result<sys::ucp_ep_h, UcxError> {
        if let Some(&ep) = self.eps.get(peer) {
            return Ok(ep);
        }
        // Peers come and go (a restarted process has a new address) and an endpoint to one
        // that left without a failed read stays: past the bound, one no read is using is
        // closed first, so the map cannot grow without end.
        if self.eps.len() >= MAX_ENDPOINTS {
            let idle = self
                .eps
                .keys()
                .find(|k| !self.pending.values().any(|p| &p.peer == *k))
                .cloned();
            if let Some(idle) = idle {
                self.forget(&idle);
            }
        }
        // SAFETY: `peer` is a worker address as `ucp_worker_query` wrote it (UCX checks its
        // contents); the zeroed struct is read per `field_mask`.
        //
        // No peer error-handling mode: UCX's `PEER` mode leaves out cross-memory attach (and,
        // in NIXL's experience, RDMA reads) for emulated reads. A read from a peer that went
        // away fails where the transport sees it (attach: the process is gone) or is cancelled
        // at its caller's limit.
        let ep = unsafe {
            let mut p: sys::ucp_ep_params_t = MaybeUninit::zeroed().assume_init();
            p.field_mask = sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
            p.address = peer.as_ptr() as *const _;
            let mut ep = null_mut();
            check("ep_create", sys::ucp_ep_create(self.worker, &p, &mut ep))?;
            ep
        };
        self.eps.insert(peer.to_vec(), ep);
        Ok(ep)
    }

    /// Closes the endpoint to `peer` (after a failed read: it may be broken).
    fn forget(&mut self, peer: &[u8]) {
        let Some(ep) = self.eps.remove(peer) else {
            return;
        };
        // SAFETY: an endpoint of this worker, closed once (removed from the map); a forced
        // close completes at once or returns a request released here after progress.
        unsafe {
            let mut param: sys::ucp_request_param_t = MaybeUninit::zeroed().assume_init();
            param.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
            let st = sys::ucp_ep_close_nbx(ep, &param);
            if let Ok(Some(req)) = ucx_rs::decode_status_ptr(st) {
                for _ in 0..10_000 {
                    if sys::ucp_request_check_status(req) != sys::ucs_status_t_UCS_INPROGRESS {
                        break;
                    }
                    sys::ucp_worker_progress(self.worker);
                }
                sys::ucp_request_free(req);
            }
        }
    }

    /// Posts a read; the answer now when it finished (or failed) at once, else later from
    /// [`Self::reap`].
    #[allow(clippy::type_complexity)]
    fn start_get(
        &mut self,
        id: u64,
        from: &Remote,
        at: u64,
        mut buf: Vec<u8>,
        len: usize,
        reply: tokio::sync::oneshot::Sender<Result<Vec<u8>, UcxError>>,
    ) -> Option<(
        tokio::sync::oneshot::Sender<Result<Vec<u8>, UcxError>>,
        Result<Vec<u8>, UcxError>,
    )> {
        let ep = match self.endpoint(&from.worker) {
            Ok(ep) => ep,
            Err(e) => return Some((reply, Err(e))),
        };
        let mut rkey = null_mut();
        // SAFETY: the packed key is bytes `ucp_rkey_pack` wrote (UCX checks them); the key
        // is destroyed once the read no longer needs it.
        let st = unsafe { sys::ucp_ep_rkey_unpack(ep, from.rkey.as_ptr() as *const _, &mut rkey) };
        if let Err(e) = check("rkey_unpack", st) {
            return Some((reply, Err(e)));
        }
        // SAFETY: `buf` has room for `len` bytes and stays here (in `Pending`) until the read
        // completes; the remote range was checked against the region's length by the caller.
        let posted = unsafe {
            let param: sys::ucp_request_param_t = MaybeUninit::zeroed().assume_init();
            sys::ucp_get_nbx(ep, buf.as_mut_ptr() as *mut _, len, at, rkey, &param)
        };
        match ucx_rs::decode_status_ptr(posted) {
            Ok(None) => {
                // SAFETY: the read completed: all `len` bytes are written; the key is unused.
                unsafe {
                    buf.set_len(len);
                    sys::ucp_rkey_destroy(rkey);
                }
                Some((reply, Ok(buf)))
            }
            Ok(Some(req)) => {
                self.pending.insert(
                    id,
                    Pending {
                        req,
                        rkey,
                        buf,
                        len,
                        peer: from.worker.clone(),
                        reply,
                        cancelled: None,
                    },
                );
                None
            }
            Err(st) => {
                // SAFETY: nothing was posted; the key is unused.
                unsafe { sys::ucp_rkey_destroy(rkey) };
                self.forget(&from.worker);
                Some((reply, Err(failed("get", st))))
            }
        }
    }

    /// Answers the reads that finished.
    fn reap(&mut self) {
        let done: Vec<(u64, sys::ucs_status_t)> = self
            .pending
            .iter()
            .filter_map(|(&id, p)| {
                // SAFETY: a live request of this worker.
                let st = unsafe { sys::ucp_request_check_status(p.req) };
                (st != sys::ucs_status_t_UCS_INPROGRESS).then_some((id, st))
            })
            .collect();
        for (id, st) in done {
            let Some(mut p) = self.pending.remove(&id) else {
                continue;
            };
            // SAFETY: the request finished: freed once, its key destroyed once; on success
            // all of the buffer's bytes are written.
            let r = unsafe {
                sys::ucp_request_free(p.req);
                sys::ucp_rkey_destroy(p.rkey);
                check("get", st).map(|()| {
                    p.buf.set_len(p.len);
                    p.buf
                })
            };
            if r.is_err() {
                self.forget(&p.peer);
            }
            let _ = p.reply.send(r);
        }
    }
}

/// A command arriving within `d`, looked for without sleeping.
fn spin_for(rx: &mpsc::Receiver<Cmd>, d: Duration) -> Option<Cmd> {
    let until = Instant::now() + d;
    loop {
        if let Ok(cmd) = rx.try_recv() {
            return Some(cmd);
        }
        if Instant::now() >= until {
            return None;
        }
        std::hint::spin_loop();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let peers: Vec<Vec<u8>> = self.eps.keys().cloned().collect();
        for peer in peers {
            self.forget(&peer);
        }
        // SAFETY: no endpoint or request is left; the worker and then the context are
        // destroyed once, on the thread that used them.
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_remote_reads_back_from_its_line_and_a_bad_line_is_an_error() {
        let r = Remote {
            worker: vec![0, 1, 0xab],
            addr: 1 << 40,
            len: 4096,
            rkey: vec![0xff],
        };
        assert_eq!(r.to_string(), "0001ab 1099511627776 4096 ff");
        assert_eq!(r.to_string().parse::<Remote>(), Ok(r));
        for bad in [
            "",
            "00 1 2",
            "0 1 2 ff",
            "zz 1 2 ff",
            "00 x 2 ff",
            "00 1 2 ff 9",
        ] {
            assert!(bad.parse::<Remote>().is_err(), "{bad:?}");
        }
    }
}
