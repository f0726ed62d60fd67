//! How token ids travel in a JSON payload between processes: as one base64 string of their
//! little-endian bytes, not an array of numbers. A 32k-token prompt is then ~170 KB of text
//! written and read with a table lookup per byte, where an array of numbers is as long and
//! costs a number's formatting and parsing per token (the largest share of a long prompt's
//! cost on the request plane). Either form is read, so a payload whose ids are an array (a
//! test's, a person's) still parses; binary serializers get the plain sequence. (Payloads of
//! an older dyn do not: it kept the request's routing in `sampling`. The processes of a graph
//! run one version.)

use base64::Engine as _;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serialize, Serializer};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// `#[serde(with = "crate::wire::token_ids")]`.
pub mod token_ids {
    use super::*;

    pub fn serialize<S: Serializer>(ids: &[u32], s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return ids.serialize(s);
        }
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        s.serialize_str(&B64.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        // A binary format wrote the plain sequence, and may not describe itself.
        if !d.is_human_readable() {
            return <Vec<u32> as serde::Deserialize>::deserialize(d);
        }
        d.deserialize_any(Ids)
    }
}

struct Ids;

impl<'de> Visitor<'de> for Ids {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("token ids: a list of integers, or base64 of their little-endian bytes")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Vec<u32>, E> {
        let bytes = B64
            .decode(v)
            .map_err(|e| E::custom(format!("token ids: {e}")))?;
        if bytes.len() % 4 != 0 {
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
