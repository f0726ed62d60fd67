//! Compiling a constraint, once per content and never on a thread that serves anything else.
//! A grammar takes milliseconds to compile, a large one seconds; compiled inside an engine's
//! step it stalled every sequence on the worker, and compiled on a 2 MiB stack a deep one
//! overflowed it. So a constraint is measured first ([`super::bounds`]), then compiled on a
//! thread of its own whose stack is many times what the bounds allow, at most
//! [`CONCURRENT`] at a time and under a deadline, and the result is kept by content: the
//! frontend's check and the worker's guide (in one process), or the same schema sent again,
//! compile once. Each request's guide starts from a deep copy of the compiled parser.

use std::sync::Arc;
use std::time::Duration;

use llguidance::Matcher;
use parking_lot::Mutex;

use super::Grammars;
use crate::types::Constraint;

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
}

impl std::fmt::Display for CompileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Invalid(e) | Self::Busy(e) => f.write_str(e),
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
    turns: Arc<tokio::sync::Semaphore>,
    /// What each constraint compiled to, failures too: a constraint that failed, or took past
    /// the deadline, is answered from here when it comes again rather than taking a turn.
    cache: Mutex<lru::LruCache<u128, Result<Arc<Compiled>, String>>>,
}

impl Default for Compiler {
    fn default() -> Self {
        Self {
            turns: Arc::new(tokio::sync::Semaphore::new(CONCURRENT)),
            cache: Mutex::new(lru::LruCache::new(CACHED)),
        }
    }
}

/// Seconds a constraint took to compile (cache misses only).
static COMPILE_SECONDS: std::sync::LazyLock<prometheus::HistogramVec> =
    std::sync::LazyLock::new(|| {
        crate::metrics::histogram(
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
        if let Some(hit) = self.compiler.cache.lock().get(&key) {
            return hit.clone().map_err(CompileError::Invalid);
        }
        super::bounds::check(c).map_err(CompileError::Invalid)?;
        let turn = tokio::time::timeout(WAIT, self.compiler.turns.clone().acquire_owned())
            .await
            .map_err(|_| {
                CompileError::Busy(format!(
                    "other requests' output grammars kept the compiler busy for {} s",
                    WAIT.as_secs()
                ))
            })?
            .map_err(|_| CompileError::Busy("the grammar compiler has stopped".into()))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
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
                grammars.compiler.cache.lock().put(key, compiled.clone());
                let _ = tx.send(compiled);
            })
            .map_err(|e| CompileError::Busy(format!("no thread to compile the grammar on: {e}")))?;
        tokio::time::timeout(DEADLINE, rx)
            .await
            .map_err(|_| {
                CompileError::Invalid(format!(
                    "the output grammar did not compile within {} s",
                    DEADLINE.as_secs()
                ))
            })?
            .map_err(|_| CompileError::Invalid("the grammar compiler failed".into()))?
            .map_err(CompileError::Invalid)
    }
}
