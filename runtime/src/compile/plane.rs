//! Plane addresses: where the control plane (etcd) and the event plane (NATS) live, as the
//! `planes:` section (or the CLI's `--control`/`--events`) names them — `embedded`, or a
//! scheme and its endpoints — parsed, checked and printed back.

use crate::diag::{Diagnostic, Diagnostics, Pos};

/// Where a plane lives, parsed from the `planes:` section.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PlaneAddr {
    Embedded,
    Etcd(Vec<String>),
    Nats(Vec<String>),
}

impl std::fmt::Display for PlaneAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PlaneAddr::Embedded => f.write_str("embedded"),
            PlaneAddr::Etcd(eps) => write!(f, "etcd://{}", eps.join(",")),
            PlaneAddr::Nats(eps) => write!(f, "nats://{}", eps.join(",")),
        }
    }
}

pub(super) fn parse_plane(
    addr: &(String, Option<Pos>),
    scheme: &str,
    which: &str,
    diags: &mut Diagnostics,
) -> PlaneAddr {
    let (text, pos) = addr;
    match PlaneAddr::parse(text, scheme) {
        Ok(a) => a,
        Err(message) => {
            diags.push(Diagnostic::error(
                *pos,
                None,
                format!("{which} plane {message}"),
            ));
            PlaneAddr::Embedded
        }
    }
}

impl PlaneAddr {
    /// `embedded`, or `SCHEME://HOST:PORT[,HOST:PORT…]` with `scheme` `etcd` or `nats`.
    pub fn parse(text: &str, scheme: &str) -> Result<PlaneAddr, String> {
        if text == "embedded" {
            return Ok(PlaneAddr::Embedded);
        }
        let endpoints: Option<Vec<String>> = text
            .strip_prefix(&format!("{scheme}://"))
            .map(|rest| rest.split(',').map(str::to_owned).collect());
        match endpoints {
            Some(eps)
                if eps.iter().all(|e| {
                    e.rsplit_once(':')
                        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
                }) =>
            {
                Ok(if scheme == "etcd" {
                    PlaneAddr::Etcd(eps)
                } else {
                    PlaneAddr::Nats(eps)
                })
            }
            _ => Err(format!(
                "`{text}`: expected `embedded` or `{scheme}://HOST:PORT[,HOST:PORT…]`"
            )),
        }
    }
}
