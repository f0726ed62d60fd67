//! Payload types: what flows along an edge, and whether it can leave the process.
//!
//! Operators are generic over their input and output types; the compiler compares those types
//! by [`PayloadType`] and, once a graph has type-checked, the runtime moves values around as
//! [`AnyPayload`] boxes (erasing the type once, as axum does at its router). A payload that has
//! a [`Codec`] may cross a process boundary; one without must stay in the process that made it,
//! and the planner says so when a placement would need it to travel.

use std::any::{Any, TypeId};
use std::fmt;

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A value that travels along an edge of a graph.
pub trait Payload: Send + 'static {
    /// Short type name used in diagnostics and plans, e.g. `Text` or `ChatRequest`.
    const NAME: &'static str;

    /// How the value crosses a process boundary; `None` keeps it in-process.
    fn codec() -> Option<Codec> {
        None
    }

    /// About how many bytes the value's wire form takes, where it is large: the encoder sizes
    /// its buffer for it instead of doubling it from nothing (a 32k-token prompt's frame grew
    /// through a dozen copies into freshly faulted pages).
    fn wire_size_hint(&self) -> usize {
        0
    }

    /// The replica that must serve this value, when an upstream operator (a router) chose one.
    fn target_instance(&self) -> Option<crate::ctx::InstanceId> {
        None
    }

    /// The model this request is for, where an ingress serves several: the runtime sends it
    /// down the request path serving that model (graphs with `models:`).
    fn model_name(&self) -> Option<&str> {
        None
    }

    /// How to resend this request after the replica serving it was lost (request migration);
    /// `None`: it cannot be resent. Implement [`Resumable`] and return [`Resume::of`].
    fn resume() -> Option<Resume> {
        None
    }
}

/// A request that can continue on another replica after part of its response was delivered:
/// the runtime keeps a copy, folds every delivered output into it, and on losing the replica
/// sends the copy again (through the router, when the path has one).
pub trait Resumable: Payload + Clone {
    /// What the replica streams back.
    type Output: Payload;
    /// The copy the runtime keeps to resend (a clone; a request may make room in it for
    /// what [`absorb`](Self::absorb) will add).
    fn keep(&self) -> Self {
        self.clone()
    }
    /// Account for an output the caller received, so a resent request continues after it.
    fn absorb(&mut self, output: &Self::Output);
    /// True for outputs a resent request repeats and the caller already has (a header).
    fn is_repeat(output: &Self::Output) -> bool;
    /// Forget the replica a router chose, so the resent request is routed afresh.
    fn clear_target(&mut self);
}

/// The type-erased face of [`Resumable`] the runtime uses.
#[derive(Clone, Copy)]
pub struct Resume {
    pub copy: fn(&dyn ErasedPayload) -> Option<AnyPayload>,
    pub absorb: fn(&mut dyn ErasedPayload, &dyn ErasedPayload),
    pub is_repeat: fn(&dyn ErasedPayload) -> bool,
    pub clear_target: fn(&mut dyn ErasedPayload),
}

impl Resume {
    pub fn of<T: Resumable>() -> Resume {
        Resume {
            copy: |v| {
                v.as_any()
                    .downcast_ref::<T>()
                    .map(|t| Box::new(t.keep()) as AnyPayload)
            },
            absorb: |req, out| {
                if let (Some(r), Some(o)) = (
                    req.as_any_mut().downcast_mut::<T>(),
                    out.as_any().downcast_ref::<T::Output>(),
                ) {
                    r.absorb(o);
                }
            },
            is_repeat: |out| {
                out.as_any()
                    .downcast_ref::<T::Output>()
                    .is_some_and(T::is_repeat)
            },
            clear_target: |req| {
                if let Some(r) = req.as_any_mut().downcast_mut::<T>() {
                    r.clear_target();
                }
            },
        }
    }
}

/// The type-erased form the runtime moves between operators.
pub type AnyPayload = Box<dyn ErasedPayload>;

/// Object-safe face of [`Payload`].
pub trait ErasedPayload: Any + Send {
    fn type_name(&self) -> &'static str;
    fn target_instance(&self) -> Option<crate::ctx::InstanceId>;
    fn model_name(&self) -> Option<&str>;
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Payload> ErasedPayload for T {
    fn type_name(&self) -> &'static str {
        T::NAME
    }
    fn target_instance(&self) -> Option<crate::ctx::InstanceId> {
        Payload::target_instance(self)
    }
    fn model_name(&self) -> Option<&str> {
        Payload::model_name(self)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl fmt::Debug for dyn ErasedPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{}>", self.type_name())
    }
}

/// Recover the concrete value; `Err` gives the box back when the type is not `T`.
pub fn downcast<T: Payload>(value: AnyPayload) -> Result<T, AnyPayload> {
    if value.as_any().is::<T>() {
        match value.into_any().downcast::<T>() {
            Ok(v) => Ok(*v),
            // Unreachable after the `is` check; there is no way back into an `AnyPayload`.
            Err(_) => unreachable_mismatch::<T>(),
        }
    } else {
        Err(value)
    }
}

#[cold]
fn unreachable_mismatch<T: Payload>() -> Result<T, AnyPayload> {
    unreachable!("type id of {} changed between checks", T::NAME)
}

/// Encoding of a payload for the wire.
#[derive(Clone, Copy)]
pub struct Codec {
    pub format: &'static str,
    /// Appends the value's wire form to the buffer (a frame's header may be in it already:
    /// the request plane encodes into its connection's write buffer, so a long prompt is not
    /// copied again).
    pub encode: fn(&dyn ErasedPayload, &mut BytesMut) -> Result<(), CodecError>,
    pub decode: fn(&[u8]) -> Result<AnyPayload, CodecError>,
}

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("cannot encode `{found}` with the codec of `{expected}`")]
    WrongType {
        expected: &'static str,
        found: &'static str,
    },
    #[error("{type_name}: {source}")]
    Json {
        type_name: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// Another format's error, as its text.
    #[error("{type_name}: {message}")]
    Other {
        type_name: &'static str,
        message: String,
    },
}

impl Codec {
    /// The value an encoder of `T` was handed, as a `T` (a codec's first step).
    pub fn typed<T: Payload>(value: &dyn ErasedPayload) -> Result<&T, CodecError> {
        value
            .as_any()
            .downcast_ref::<T>()
            .ok_or(CodecError::WrongType {
                expected: T::NAME,
                found: value.type_name(),
            })
    }

    /// JSON through serde: the default codec, readable on the wire and in captures.
    pub fn json<T: Payload + Serialize + DeserializeOwned>() -> Codec {
        Codec {
            format: "json",
            encode: |value, out| {
                let v = Codec::typed::<T>(value)?;
                out.reserve(v.wire_size_hint());
                serde_json::to_writer(out.writer(), v).map_err(|source| CodecError::Json {
                    type_name: T::NAME,
                    source,
                })
            },
            decode: |bytes| {
                serde_json::from_slice::<T>(bytes)
                    .map(|v| Box::new(v) as AnyPayload)
                    .map_err(|source| CodecError::Json {
                        type_name: T::NAME,
                        source,
                    })
            },
        }
    }
}

/// A payload type as the compiler sees it.
#[derive(Clone, Copy)]
pub struct PayloadType {
    pub name: &'static str,
    pub id: TypeId,
    pub codec: Option<Codec>,
    pub resume: Option<Resume>,
}

impl PayloadType {
    pub fn of<T: Payload>() -> Self {
        Self {
            name: T::NAME,
            id: TypeId::of::<T>(),
            codec: T::codec(),
            resume: T::resume(),
        }
    }
}

impl PartialEq for PayloadType {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl fmt::Debug for PayloadType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl fmt::Display for PayloadType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Wired(String);
    impl Payload for Wired {
        const NAME: &'static str = "Wired";
        fn codec() -> Option<Codec> {
            Some(Codec::json::<Self>())
        }
    }

    #[derive(Debug)]
    struct Local;
    impl Payload for Local {
        const NAME: &'static str = "Local";
    }

    #[test]
    fn downcast_roundtrip_and_mismatch() {
        let any: AnyPayload = Box::new(Wired("x".into()));
        assert_eq!(any.type_name(), "Wired");
        let back = downcast::<Local>(any).expect_err("not a Local");
        assert_eq!(downcast::<Wired>(back).unwrap(), Wired("x".into()));
    }

    #[test]
    fn json_codec_roundtrip_and_wrong_type() {
        let codec = PayloadType::of::<Wired>().codec.unwrap();
        let mut bytes = BytesMut::new();
        (codec.encode)(&Wired("hé".into()), &mut bytes).unwrap();
        let back = downcast::<Wired>((codec.decode)(&bytes).unwrap()).unwrap();
        assert_eq!(back, Wired("hé".into()));
        assert!(matches!(
            (codec.encode)(&Local, &mut BytesMut::new()),
            Err(CodecError::WrongType { .. })
        ));
        assert!((codec.decode)(b"{not json").is_err());
        assert!(PayloadType::of::<Local>().codec.is_none());
    }
}
