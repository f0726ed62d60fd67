//! How token ids travel in a payload between processes. A request crosses the request plane
//! as MessagePack (`PreprocessedRequest`'s codec in `crate::types`), where its ids are one
//! byte string of their little-endian bytes, written and read as a copy. In JSON (captures,
//! the admin endpoint, tests) they are base64 of those bytes, not an array of numbers: a
//! 32k-token prompt is then ~170 KB of text with a table lookup per byte, where an array of
//! numbers is as long and costs a number's formatting and parsing per token. Every form is
//! read (an array too, so a payload a person wrote still parses). A worker refuses a caller
//! of an older dyn, which sent JSON, by name (the call header says its codec): the processes
//! of a graph run one version.

use base64::Engine as _;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// `#[serde(with = "crate::wire::token_ids")]`.
pub mod token_ids {
    use super::*;

    pub fn serialize<S: Serializer>(ids: &[u32], s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return s.serialize_bytes(&le_bytes(ids));
        }
        // JSON is the cold path now (captures, the admin endpoint, tests): one encode.
        s.serialize_str(&B64.encode(le_bytes(ids)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        // Whichever form the payload has: base64 or a list in JSON, bytes (or a list) in a
        // binary format.
        d.deserialize_any(Ids)
    }
}

/// The ids' little-endian bytes: the ids themselves on a little-endian machine.
#[cfg(target_endian = "little")]
fn le_bytes(ids: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(ids))
}

#[cfg(not(target_endian = "little"))]
fn le_bytes(ids: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(ids.iter().flat_map(|t| t.to_le_bytes()).collect())
}

/// Ids from their little-endian bytes.
fn from_le_bytes<E: de::Error>(bytes: &[u8]) -> Result<Vec<u32>, E> {
    if !bytes.len().is_multiple_of(4) {
        return Err(E::custom(format!(
            "token ids: {} bytes is not a whole number of 4-byte ids",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

struct Ids;

impl<'de> Visitor<'de> for Ids {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("token ids: a list of integers, or (base64 of) their little-endian bytes")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u32>, E> {
        let bytes = B64
            .decode(v)
            .map_err(|e| E::custom(format!("token ids: {e}")))?;
        from_le_bytes(&bytes)
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u32>, E> {
        from_le_bytes(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        // The hint is the sender's word: capped, the vector grows past it as ids arrive.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(t) = seq.next_element()? {
            out.push(t);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct P {
        #[serde(with = "super::token_ids")]
        ids: Vec<u32>,
    }

    #[test]
    fn token_ids_travel_as_base64_and_either_form_reads() {
        let p = P {
            ids: vec![0, 1, 49151, u32::MAX],
        };
        let text = serde_json::to_string(&p).unwrap();
        assert_eq!(text, r#"{"ids":"AAAAAAEAAAD/vwAA/////w=="}"#);
        assert_eq!(serde_json::from_str::<P>(&text).unwrap(), p);
        // Across the encoder's chunks, every length's padding as one text would have it.
        for n in [767, 768, 769, 1536, 2000, 2001, 2002] {
            let p = P {
                ids: (0..n).map(|i: u32| i.wrapping_mul(2_654_435_761)).collect(),
            };
            let text = serde_json::to_string(&p).unwrap();
            let bytes: Vec<u8> = p.ids.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(
                text,
                format!(
                    r#"{{"ids":"{}"}}"#,
                    base64::Engine::encode(&super::B64, bytes)
                )
            );
            assert_eq!(serde_json::from_str::<P>(&text).unwrap(), p);
        }
        let array: P = serde_json::from_str(r#"{"ids":[0,1,49151,4294967295]}"#).unwrap();
        assert_eq!(array, p);
        assert!(
            serde_json::from_str::<P>(r#"{"ids":""}"#)
                .unwrap()
                .ids
                .is_empty()
        );
        for bad in [
            r#"{"ids":"AAA"}"#,
            r#"{"ids":"!!!!"}"#,
            r#"{"ids":[-1]}"#,
            r#"{"ids":7}"#,
        ] {
            assert!(serde_json::from_str::<P>(bad).is_err(), "{bad}");
        }
    }
}
