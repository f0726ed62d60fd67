//! Compiling a constraint, once per content and never on a thread that serves anything else.
//! A grammar takes milliseconds to compile, a large one seconds; compiled inside an engine's
//! step it stalled every sequence on the worker, and compiled on a 2 MiB stack a deep one
//! overflowed it. So a constraint is measured first ([`super::bounds`]), then compiled on a
//! thread of its own whose stack is many times what the bounds allow, at most
//! [`CONCURRENT`] at a time and under a deadline, and the result is kept by content: the
//! frontend's check and the worker's guide (in one process), or the same schema sent again,
//! compile once — also when they come at the same time: later ones wait for the compile under
//! way rather than start another (the same bomb sent many times takes one turn, not all).
//! Each request's guide starts from a deep copy of the compiled parser.

use std::sync::Arc;
use std::time::Duration;

use llguidance::Matcher;
use parking_lot::Mutex;

use super::Grammars;
use dyn_protocol::types::Constraint;

/// The stack a compile runs on: its bounds allow recursion of some hundreds of frames of a few
/// KiB each; this is tens of times that (reserved, not committed, until used).
const STACK_BYTES: usize = 64 << 20;
/// Compiles at once (each takes a core); more wait for a turn.
const CONCURRENT: usize = 2;
/// How long a request waits for its turn, and then for its compile.
const WAIT: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(10);
/// Compiled grammars kept, by content.
const CACHED: std::num::NonZeroUsize = std::num::NonZeroUsize::new(64).unwrap();

/// Why a constraint did not compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileError {
    /// The constraint itself (a bound, what llguidance rejects, too slow to compile): 400.
    Invalid(String),
    /// Others' grammars take every turn: 503, try again.
    Busy(String),
    /// The compile this request waited on ended without an outcome (its lead was cancelled,
    /// or the compile panicked); never returned by [`Grammars::compile`] as such.
    Abandoned,
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Invalid(e) | Self::Busy(e) => f.write_str(e),
            Self::Abandoned => f.write_str("the grammar's compile was abandoned"),
        }
    }
}

/// A constraint compiled: the parser before any token, copied for each request.
pub struct Compiled {
    matcher: Mutex<Matcher>,
    /// A JSON answer (its guide follows whether the text is inside a string).
    pub(super) json: bool,
}

impl Compiled {
    pub(super) fn new(matcher: Matcher, c: &Constraint) -> Self {
        Self {
            matcher: Mutex::new(matcher),
            json: matches!(c, Constraint::JsonSchema(_) | Constraint::JsonObject),
        }
    }

    /// A parser of its own for one request.
    pub(super) fn start(&self) -> Matcher {
        self.matcher.lock().deep_clone()
    }
}

/// The compile threads' turns and the cache; one per model vocabulary ([`Grammars`]).
pub(super) struct Compiler {
    pub(super) turns: Arc<tokio::sync::Semaphore>,
    /// What each constraint compiled to, failures too: a constraint that failed, or took past
    /// the deadline, is answered from here when it comes again rather than taking a turn.
    cache: Mutex<lru::LruCache<u128, Outcome>>,
    /// The compiles under way, by key: a request for one of them waits for its outcome.
    /// Locked before `cache` where both are.
    inflight: Mutex<std::collections::HashMap<u128, Waiting>>,
}

type Outcome = Result<Arc<Compiled>, String>;
/// The outcome of a compile under way, once it ends (closed without one if it never started).
type Waiting = tokio::sync::watch::Receiver<Option<Outcome>>;

/// A compile this request leads: whatever happens to it, its key leaves `inflight` and its
/// waiters learn the outcome (or, without one, that there will be none).
struct Lead {
    grammars: Arc<Grammars>,
    key: u128,
    tx: tokio::sync::watch::Sender<Option<Outcome>>,
}

impl Lead {
    /// The outcome, announced; kept in the cache if `keep` (what compiled, or failed to: a
    /// constraint refused by its measure is refused as fast the next time, and would only
    /// push compiled ones out).
    fn finish(self, outcome: Outcome, keep: bool) {
        let mut inflight = self.grammars.compiler.inflight.lock();
        if keep {
            self.grammars
                .compiler
                .cache
                .lock()
                .put(self.key, outcome.clone());
        }
        inflight.remove(&self.key);
        self.tx.send_replace(Some(outcome));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        // (After `finish` the key is gone already; a lead that never compiled leaves here.)
        if self.tx.borrow().is_none() {
            self.grammars.compiler.inflight.lock().remove(&self.key);
        }
    }
}

impl Default for Compiler {
    fn default() -> Self {
        Self {
            turns: Arc::new(tokio::sync::Semaphore::new(CONCURRENT)),
            cache: Mutex::new(lru::LruCache::new(CACHED)),
            inflight: Mutex::default(),
        }
    }
}

/// Seconds a constraint took to compile (cache misses only).
static COMPILE_SECONDS: std::sync::LazyLock<prometheus::HistogramVec> =
    std::sync::LazyLock::new(|| {
        dyn_protocol::metrics::histogram(
            "dyn_grammar_compile_seconds",
            "Seconds a structured output's grammar took to compile (not counting cache hits)",
            &[],
        )
    });

fn key(c: &Constraint) -> u128 {
    // Serialising a constraint cannot fail (strings and JSON values); an empty key would
    // only share a slot between constraints that failed to serialise.
    xxhash_rust::xxh3::xxh3_128(&serde_json::to_vec(c).unwrap_or_default())
}

impl Grammars {
    /// `c` compiled: from the cache, or measured and compiled on a compile thread.
    pub async fn compile(self: &Arc<Self>, c: &Constraint) -> Result<Arc<Compiled>, CompileError> {
        let key = key(c);
        // A waiter whose lead went away without an outcome (its request was cancelled while
        // it waited for a turn) tries again, and may lead this time; a few times at most.
        for _ in 0..3 {
            match self.compile_once(c, key).await {
                Err(CompileError::Abandoned) => continue,
                done => return done,
            }
        }
        Err(CompileError::Busy(
            "the same grammar's compile was abandoned again and again".into(),
        ))
    }

    async fn compile_once(
        self: &Arc<Self>,
        c: &Constraint,
        key: u128,
    ) -> Result<Arc<Compiled>, CompileError> {
        let lead = {
            let mut inflight = self.compiler.inflight.lock();
            if let Some(hit) = self.compiler.cache.lock().get(&key) {
                return hit.clone().map_err(CompileError::Invalid);
            }
            match inflight.get(&key) {
                Some(waiting) => Err(waiting.clone()),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    inflight.insert(key, rx);
                    Ok(Lead {
                        grammars: self.clone(),
                        key,
                        tx,
                    })
                }
            }
        };
        match lead {
            // A compile that ends without an outcome panicked: the constraint's fault.
            Ok(lead) => outcome(self.lead(c, lead).await?, DEADLINE)
                .await
                .map_err(|e| match e {
                    CompileError::Abandoned => {
                        CompileError::Invalid("the grammar compiler failed".into())
                    }
                    e => e,
                }),
            // (Its lead may still be waiting for a turn.)
            Err(rx) => outcome(rx, WAIT + DEADLINE).await,
        }
    }

    /// Measures `c`, waits for a turn and starts its compile; the outcome comes on the
    /// returned receiver.
    async fn lead(self: &Arc<Self>, c: &Constraint, lead: Lead) -> Result<Waiting, CompileError> {
        if let Err(e) = super::bounds::check(c) {
            lead.finish(Err(e.clone()), false);
            return Err(CompileError::Invalid(e));
        }
        let turn = tokio::time::timeout(WAIT, self.compiler.turns.clone().acquire_owned())
            .await
            .map_err(|_| {
                CompileError::Busy(format!(
                    "other requests' output grammars kept the compiler busy for {} s",
                    WAIT.as_secs()
                ))
            })?
            .map_err(|_| CompileError::Busy("the grammar compiler has stopped".into()))?;
        let rx = lead.tx.subscribe();
        let grammars = self.clone();
        let constraint = c.clone();
        let started = std::time::Instant::now();
        std::thread::Builder::new()
            .name("dyn-grammar".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                // The turn is held until the compile ends, even if its request gave up, and
                // the result is kept then: the same constraint again is answered at once.
                let _turn = turn;
                let compiled = grammars
                    .parser(&constraint)
                    .map(|m| Arc::new(Compiled::new(m, &constraint)));
                COMPILE_SECONDS
                    .with_label_values::<&str>(&[])
                    .observe(started.elapsed().as_secs_f64());
                lead.finish(compiled, true);
            })
            .map_err(|e| CompileError::Busy(format!("no thread to compile the grammar on: {e}")))?;
        Ok(rx)
    }
}

/// The outcome a compile under way announces, within `bound`.
async fn outcome(mut rx: Waiting, bound: Duration) -> Result<Arc<Compiled>, CompileError> {
    let announced = tokio::time::timeout(bound, rx.wait_for(Option::is_some))
        .await
        .map_err(|_| {
            CompileError::Invalid(format!(
                "the output grammar did not compile within {} s",
                bound.as_secs()
            ))
        })?
        .map_err(|_| CompileError::Abandoned)?
        .clone();
    announced
        .ok_or(CompileError::Abandoned)?
        .map_err(CompileError::Invalid)
}
