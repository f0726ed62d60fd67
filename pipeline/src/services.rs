//! Process-wide services: one instance per running graph of something many nodes share (the
//! KV transfer agent, the loaded model directories, the introspection registry).
//!
//! The runtime knows none of them. A crate that owns a service implements [`Service`] for its
//! type, and a kind asks for it with [`crate::BuildCx::service`]: the first asker starts it,
//! everyone after shares that instance. Keyed by type, so two crates cannot collide on a name,
//! and a test builds a fresh set with `Services::default()`.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::OnceCell;

use crate::registry::{BuildCx, BuildError};

/// Something one graph run holds once and its nodes share.
pub trait Service: Send + Sync + Sized + 'static {
    /// Start the service; `cx` is the build context of the first node that asked.
    fn start(cx: &BuildCx) -> impl Future<Output = Result<Self, BuildError>> + Send;
}

type Slot = Arc<OnceCell<Arc<dyn Any + Send + Sync>>>;

/// The services started so far, cheap to clone into every build context.
#[derive(Clone, Default)]
pub struct Services {
    slots: Arc<Mutex<HashMap<TypeId, Slot>>>,
}

impl Services {
    /// The running `S`, started by this call if nobody asked before. Concurrent first askers
    /// wait for one start; a failed start is not kept, so the next asker tries again.
    pub async fn get<S: Service>(&self, cx: &BuildCx) -> Result<Arc<S>, BuildError> {
        let slot = self
            .slots
            .lock()
            .entry(TypeId::of::<S>())
            .or_default()
            .clone();
        let any = slot
            .get_or_try_init(|| async {
                Ok::<_, BuildError>(Arc::new(S::start(cx).await?) as Arc<dyn Any + Send + Sync>)
            })
            .await?
            .clone();
        any.downcast::<S>()
            .map_err(|_| BuildError::new("service slot holds another type"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static STARTS: AtomicUsize = AtomicUsize::new(0);

    struct Counter(usize);
    impl Service for Counter {
        async fn start(_cx: &BuildCx) -> Result<Self, BuildError> {
            Ok(Counter(STARTS.fetch_add(1, Ordering::SeqCst)))
        }
    }

    #[tokio::test]
    async fn a_service_starts_once_per_set_and_is_shared() {
        let cx = BuildCx::for_tests("n", crate::planes::Planes::embedded());
        let (a, b) = tokio::join!(cx.service::<Counter>(), cx.service::<Counter>());
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(Arc::ptr_eq(&a, &b));
        let other = BuildCx::for_tests("n", crate::planes::Planes::embedded());
        let c = other.service::<Counter>().await.unwrap();
        assert_ne!(a.0, c.0, "a fresh set starts its own");
    }
}
