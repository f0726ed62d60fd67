//! The KV transfer wire: what a prefill worker's offer looks like to the decode worker that
//! pulls it ([`TransferDescriptor`]), and the capability that binds an offer to one puller
//! ([`PullKey`], of which the offer keeps only the [`PullLock`]). The agents that move the
//! bytes live with the kernels (`dyn_compute::transfer`); these types travel in requests and
//! prefill jobs, so they live here, where a router or a frontend can name them without
//! compiling a kernel.

use serde::{Deserialize, Serialize};

/// What the decode side needs to pull an offer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferDescriptor {
    /// The agent holding the blocks: `tcp://HOST:PORT` or `inproc://ID`.
    pub agent: String,
    pub transfer_id: TransferId,
    /// The prefill worker's block ids, in sequence order.
    pub block_ids: Vec<u32>,
    /// Bytes per block (every block has the same size).
    pub block_bytes: u32,
    /// How a block's bytes are laid out.
    pub layout: BlockLayout,
    /// Element type.
    pub dtype: BlockDType,
}

/// An offer's id: 128 random bits, written as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferId(pub u128);

impl TransferId {
    pub fn random() -> Self {
        Self(rand::random())
    }
}

/// The secret that pulls an offer bound to it: 128 random bits, written as 32 hex digits.
/// Only the puller the router chose is sent it; its [`Debug`] does not show it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PullKey(u128);

impl PullKey {
    pub fn random() -> Self {
        Self(rand::random())
    }

    /// What an offer keeps of this key.
    pub fn lock(&self) -> PullLock {
        let d = ring::digest::digest(&ring::digest::SHA256, &self.0.to_le_bytes());
        let mut first = [0u8; 16];
        first.copy_from_slice(&d.as_ref()[..16]);
        PullLock(u128::from_le_bytes(first))
    }
}

impl std::fmt::Debug for PullKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PullKey(..)")
    }
}

/// An offer's binding to one puller: the first 128 bits of its [`PullKey`]'s SHA-256, which
/// may be read by anyone without opening the offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullLock(u128);

impl PullLock {
    /// Whether `key` opens it. Digests are compared, so the time a comparison takes says
    /// nothing about the key.
    pub fn opens(&self, key: Option<PullKey>) -> bool {
        key.is_some_and(|k| k.lock() == *self)
    }
}

/// 128-bit values on the wire as 32 hex digits.
macro_rules! hex128 {
    ($t:ty, $what:literal) => {
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{:032x}", self.0)
            }
        }

        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                u128::from_str_radix(&s, 16)
                    .map(Self)
                    .map_err(|_| serde::de::Error::custom(concat!($what, " is 32 hex digits")))
            }
        }
    };
}

hex128!(TransferId, "a transfer id");
hex128!(PullKey, "a pull key");
hex128!(PullLock, "a pull lock");

/// How the offered blocks are laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockFormat {
    pub block_bytes: u32,
    pub layout: BlockLayout,
    pub dtype: BlockDType,
}

/// The element type of a KV block's bytes: a model dtype, or the mocker's token ids. On the
/// wire and in offload file headers it is the name (`f32`, `bf16`, `f16`, `u32le`), so two
/// workers compare types, not spellings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockDType {
    F32,
    F16,
    Bf16,
    /// The mocker's simulated KV: token ids as little-endian `u32`.
    U32le,
}

impl std::fmt::Display for BlockDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BlockDType::F32 => "f32",
            BlockDType::F16 => "f16",
            BlockDType::Bf16 => "bf16",
            BlockDType::U32le => "u32le",
        })
    }
}

/// The order of a KV block's elements, named once for every backend, engine and agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockLayout {
    /// Model KV: `[layer][k, v][kv_head][slot][dim]`, slot being the token's place in the
    /// block. Every native backend exports and imports this, whatever it keeps inside.
    #[serde(rename = "layer,kv,head,slot,dim")]
    LayerKvHeadSlotDim,
    /// The mocker's simulated KV: the block's token ids.
    #[serde(rename = "token_ids")]
    TokenIds,
}

impl std::fmt::Display for BlockLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BlockLayout::LayerKvHeadSlotDim => "layer,kv,head,slot,dim",
            BlockLayout::TokenIds => "token_ids",
        })
    }
}
