//! The headers a request carries about itself: its id (`x-request-id`), priority, session and
//! deadline, read into its [`Traffic`] by [`crate::ServerConfig::traffic`].

use axum::http::HeaderMap;

/// The header that gives a request's priority: a number (lower first) or a class named in
/// `priority_classes`.
pub const PRIORITY: &str = "x-priority";

/// The header that names a request's session (its conversation), for session affinity.
pub const SESSION: &str = "x-session-id";

/// The longest session id taken (header or `user`).
pub const SESSION_MAX: usize = 256;

/// What a request's headers say of its traffic class.
#[derive(Debug, Default)]
pub struct Traffic {
    pub tenant: Option<String>,
    pub priority: Option<i32>,
    pub session: Option<String>,
}

/// The header that sets a request's deadline, in seconds from its arrival.
pub const REQUEST_TIMEOUT: &str = "x-request-timeout";

/// The request's `x-request-id` (the client's, or one [`app`]'s layer generated), if it is
/// usable as ours.
pub fn request_id(headers: &HeaderMap) -> Option<dyn_core::RequestId> {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| request_id_ok(v))
        .map(dyn_core::RequestId::from)
}

pub(crate) const REQUEST_ID: &str = "x-request-id";

/// The longest client request id taken.
pub const REQUEST_ID_MAX: usize = 128;

/// Whether a client's request id is taken as it is: 1 to [`REQUEST_ID_MAX`] letters, digits,
/// `-`, `_`, `.` or `:` (UUIDs, ULIDs, trace ids). Anything else — quotes, `=`, spaces,
/// control characters — could forge fields or lines in the logs that carry the id, so it is
/// replaced by a new one.
pub fn request_id_ok(id: &str) -> bool {
    (1..=REQUEST_ID_MAX).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}
