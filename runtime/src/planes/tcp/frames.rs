//! The request plane's frames: each a tag byte and a body, in tokio-util's length-delimited
//! codec. What the tags mean, the header a call opens with, and how a payload becomes a frame.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio_util::codec::LengthDelimitedCodec;

use super::InstanceId;
use dyn_core::operator::OpError;
use dyn_core::payload::{Codec, CodecError, ErasedPayload, PayloadType};

/// Frame tags (first byte of every frame).
pub(super) const HEADER: u8 = b'H';
pub(super) const ITEM: u8 = b'I';
pub(super) const END_INPUT: u8 = b'E';
pub(super) const ERROR: u8 = b'X';
pub(super) const DONE: u8 = b'D';
/// Caller to server: the caller no longer wants the current request's output (its consumer
/// stopped early); the server kills it and ends with a done mark, keeping the connection.
pub(super) const CANCEL: u8 = b'C';
/// Server to caller: still serving, nothing to send yet.
pub(super) const PING: u8 = b'P';
/// A done mark on the wire: the length-delimited codec's 4-byte length, then the tag.
pub(super) const DONE_FRAME: &[u8] = &[0, 0, 0, 1, DONE];

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Header {
    pub(super) instance_id: InstanceId,
    pub(super) request_id: String,
    /// Milliseconds left before the caller's deadline.
    pub(super) timeout_ms: Option<u64>,
    /// The input's codec, as the caller writes it (`None`: a caller older than the field,
    /// which wrote JSON): a worker of another version refuses the call by name rather than
    /// failing to decode it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) codec: Option<String>,
}

/// Why a payload's frame was not written.
pub(super) enum Unwritten {
    Codec(CodecError),
    /// The body's size (without its tag) over the message limit.
    TooLarge(usize),
}

/// Appends a frame of `tag` and the value's encoding to `buf` — the connection's write
/// buffer, as tokio-util's length-delimited codec frames it (a 4-byte big-endian length, then
/// the tag and body). Encoded in place: a long prompt is not built in a buffer of its own and
/// then copied into the connection's. A frame over `max` bytes (with its tag) or that fails to
/// encode is taken back out.
pub(super) fn put_frame(
    buf: &mut BytesMut,
    tag: u8,
    codec: Codec,
    v: &dyn ErasedPayload,
    max: usize,
) -> Result<(), Unwritten> {
    let start = buf.len();
    buf.put_u32(0);
    buf.put_u8(tag);
    let written = (codec.encode)(v, buf);
    let len = buf.len() - start - 4;
    let failed = match written {
        Err(e) => Unwritten::Codec(e),
        Ok(()) => match u32::try_from(len) {
            Ok(n) if len <= max => {
                buf[start..start + 4].copy_from_slice(&n.to_be_bytes());
                return Ok(());
            }
            _ => Unwritten::TooLarge(len - 1),
        },
    };
    buf.truncate(start);
    Err(failed)
}

pub(super) fn frame(tag: u8, body: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(body.len() + 1);
    b.put_u8(tag);
    b.put_slice(body);
    b.freeze()
}

pub(super) fn codec_of(ty: PayloadType) -> Result<Codec, OpError> {
    ty.codec.ok_or_else(|| {
        OpError::internal(format!(
            "payload `{}` has no wire codec and cannot leave its process",
            ty.name
        ))
    })
}

pub(super) fn length_codec(max: usize) -> LengthDelimitedCodec {
    // Items are checked against `max` before they are sent, with a clear error; the frame
    // limit adds the tag byte and leaves room for headers and errors under tiny limits.
    LengthDelimitedCodec::builder()
        .max_frame_length(max.max(4096) + 1)
        .new_codec()
}

pub(super) fn error_frame(e: &OpError) -> Bytes {
    frame(ERROR, &serde_json::to_vec(e).unwrap_or_default())
}
