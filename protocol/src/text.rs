//! Payload types shared by several kinds.

use dyn_core::{Codec, Payload};
use serde::{Deserialize, Serialize};

/// Plain text: what the debugging kinds (`http_text`, `echo`) pass around.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Text(pub String);

impl Payload for Text {
    const NAME: &'static str = "Text";
    fn codec() -> Option<Codec> {
        Some(Codec::json::<Self>())
    }
}
