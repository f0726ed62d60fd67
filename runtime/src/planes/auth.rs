//! Credentials and TLS for the etcd and NATS servers, read from the environment variables
//! Dynamo reads, so a deployment's secrets carry over unchanged:
//!
//! - etcd: `ETCD_AUTH_USERNAME` + `ETCD_AUTH_PASSWORD`; TLS with `ETCD_AUTH_CA` (then the
//!   endpoints are dialled with `https://`), and a client certificate with
//!   `ETCD_AUTH_CLIENT_CERT` + `ETCD_AUTH_CLIENT_KEY`. Each names a PEM file (Dynamo's code
//!   also takes the PEM text itself, and so does this).
//! - NATS, first that is set: `NATS_AUTH_USERNAME` + `NATS_AUTH_PASSWORD`, `NATS_AUTH_TOKEN`,
//!   `NATS_AUTH_NKEY`, `NATS_AUTH_CREDENTIALS_FILE`; TLS with `NATS_TLS_CA_CERT_PATH`, and a
//!   client certificate with `NATS_TLS_CLIENT_CERT_PATH` + `NATS_TLS_CLIENT_KEY_PATH`.
//!
//! Secrets live in the environment (readable by the process's user only) and are never
//! logged; errors name the variable, not its value.

use std::ffi::OsString;
use std::path::PathBuf;

use super::PlaneError;

/// How to reach etcd: a user, TLS, or neither.
#[derive(Clone, Default)]
pub struct EtcdCredentials {
    user: Option<(String, String)>,
    tls: Option<EtcdTls>,
}

/// The CA's PEM, and the client's certificate and key PEMs.
#[derive(Clone)]
struct EtcdTls {
    ca: Vec<u8>,
    client: Option<(Vec<u8>, Vec<u8>)>,
}

/// How to reach NATS: at most one way to authenticate, and TLS.
#[derive(Clone, Default)]
pub struct NatsCredentials {
    auth: Option<NatsAuth>,
    ca: Option<PathBuf>,
    client: Option<(PathBuf, PathBuf)>,
}

#[derive(Clone)]
enum NatsAuth {
    User(String, String),
    Token(String),
    Nkey(String),
    CredentialsFile(PathBuf),
}

fn control(message: String) -> PlaneError {
    PlaneError::Backend {
        plane: "control (etcd)",
        message,
    }
}

fn events(message: String) -> PlaneError {
    PlaneError::Backend {
        plane: "event",
        message,
    }
}

/// A variable's value when set and not empty.
fn set(var: &impl Fn(&str) -> Option<OsString>, name: &str) -> Option<String> {
    var(name)
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.is_empty())
}

/// A PEM given as the text itself or as a file's path.
fn pem(var: &impl Fn(&str) -> Option<OsString>, name: &str) -> Result<Option<Vec<u8>>, String> {
    let Some(v) = set(var, name) else {
        return Ok(None);
    };
    if v.trim_start().starts_with("-----BEGIN") {
        return Ok(Some(v.into_bytes()));
    }
    // The value is not echoed: a key given inline but mangled is still a secret.
    std::fs::read(&v)
        .map(Some)
        .map_err(|e| format!("{name}: neither PEM text nor a file that can be read ({e})"))
}

impl EtcdCredentials {
    pub fn from_env() -> Result<Self, PlaneError> {
        Self::from_vars(|k| std::env::var_os(k))
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<Self, PlaneError> {
        let user = match (
            set(&var, "ETCD_AUTH_USERNAME"),
            set(&var, "ETCD_AUTH_PASSWORD"),
        ) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            _ => {
                return Err(control(
                    "ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD go together: set both".into(),
                ));
            }
        };
        let ca = pem(&var, "ETCD_AUTH_CA").map_err(control)?;
        let cert = pem(&var, "ETCD_AUTH_CLIENT_CERT").map_err(control)?;
        let key = pem(&var, "ETCD_AUTH_CLIENT_KEY").map_err(control)?;
        let tls = match (ca, cert, key) {
            (None, None, None) => None,
            (Some(ca), None, None) => Some(EtcdTls { ca, client: None }),
            (Some(ca), Some(c), Some(k)) => Some(EtcdTls {
                ca,
                client: Some((c, k)),
            }),
            _ => {
                return Err(control(
                    "ETCD_AUTH_CLIENT_CERT and ETCD_AUTH_CLIENT_KEY need each other and ETCD_AUTH_CA"
                        .into(),
                ));
            }
        };
        Ok(Self { user, tls })
    }

    /// `scheme://host:port` for each `host:port`: https when TLS is on.
    pub fn urls(&self, endpoints: &[String]) -> Vec<String> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        endpoints
            .iter()
            .map(|e| format!("{scheme}://{e}"))
            .collect()
    }

    /// etcd-client's options with these credentials.
    pub(crate) fn options(&self, timeout: std::time::Duration) -> etcd_client::ConnectOptions {
        let mut o = etcd_client::ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let Some((u, p)) = &self.user {
            // etcd's login tokens expire (5 min by default): log in again when one has.
            o = o.with_user(u, p).with_auto_token_refresh(true);
        }
        if let Some(EtcdTls { ca, client }) = &self.tls {
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(ca));
            if let Some((c, k)) = client {
                tls = tls.identity(etcd_client::Identity::from_pem(c, k));
            }
            o = o.with_tls(tls);
        }
        o
    }

    /// What a failure from etcd means for these credentials, when it says.
    pub(crate) fn explain(&self, message: &str) -> Option<&'static str> {
        let m = message.to_ascii_lowercase();
        let auth = [
            "user name is empty",
            "authentication failed",
            "permission denied",
            "invalid auth token",
            "auth: ",
        ];
        if !auth.iter().any(|a| m.contains(a)) {
            None
        } else if self.user.is_none() {
            Some("etcd has authentication on: set ETCD_AUTH_USERNAME and ETCD_AUTH_PASSWORD")
        } else {
            Some(
                "etcd refused ETCD_AUTH_USERNAME/ETCD_AUTH_PASSWORD, or that user's role lacks access to the keys",
            )
        }
    }
}

impl NatsCredentials {
    pub fn from_env() -> Result<Self, PlaneError> {
        Self::from_vars(|k| std::env::var_os(k))
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Result<Self, PlaneError> {
        let user = set(&var, "NATS_AUTH_USERNAME");
        let pass = set(&var, "NATS_AUTH_PASSWORD");
        let auth = match (user, pass) {
            (Some(u), Some(p)) => Some(NatsAuth::User(u, p)),
            (Some(_), None) | (None, Some(_)) => {
                return Err(events(
                    "NATS_AUTH_USERNAME and NATS_AUTH_PASSWORD go together: set both".into(),
                ));
            }
            (None, None) => set(&var, "NATS_AUTH_TOKEN")
                .map(NatsAuth::Token)
                .or_else(|| set(&var, "NATS_AUTH_NKEY").map(NatsAuth::Nkey))
                .or_else(|| {
                    set(&var, "NATS_AUTH_CREDENTIALS_FILE")
                        .map(|p| NatsAuth::CredentialsFile(p.into()))
                }),
        };
        let ca = set(&var, "NATS_TLS_CA_CERT_PATH").map(PathBuf::from);
        let client = match (
            set(&var, "NATS_TLS_CLIENT_CERT_PATH"),
            set(&var, "NATS_TLS_CLIENT_KEY_PATH"),
        ) {
            (Some(c), Some(k)) => Some((c.into(), k.into())),
            (None, None) => None,
            _ => {
                return Err(events(
                    "NATS_TLS_CLIENT_CERT_PATH and NATS_TLS_CLIENT_KEY_PATH go together: set both"
                        .into(),
                ));
            }
        };
        Ok(Self { auth, ca, client })
    }

    /// async-nats's options with these credentials.
    pub(crate) async fn apply(
        &self,
        mut o: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, PlaneError> {
        match &self.auth {
            Some(NatsAuth::User(u, p)) => o = o.user_and_password(u.clone(), p.clone()),
            Some(NatsAuth::Token(t)) => o = o.token(t.clone()),
            Some(NatsAuth::Nkey(k)) => o = o.nkey(k.clone()),
            Some(NatsAuth::CredentialsFile(f)) => {
                o = o.credentials_file(f).await.map_err(|e| {
                    events(format!("NATS_AUTH_CREDENTIALS_FILE={}: {e}", f.display()))
                })?;
            }
            None => {}
        }
        if let Some(ca) = &self.ca {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((c, k)) = &self.client {
            o = o.add_client_certificate(c.clone(), k.clone());
        }
        Ok(o)
    }

    /// What a refused connection means for these credentials.
    pub(crate) fn explain(&self) -> &'static str {
        if self.auth.is_none() {
            "NATS wants credentials: set NATS_AUTH_USERNAME and NATS_AUTH_PASSWORD (or NATS_AUTH_TOKEN, NATS_AUTH_NKEY, NATS_AUTH_CREDENTIALS_FILE)"
        } else {
            "NATS refused the credentials in NATS_AUTH_*"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<OsString> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.into())
    }

    #[test]
    fn credentials_are_read_by_dynamos_names_with_clear_errors() {
        let e = EtcdCredentials::from_vars(vars(&[("ETCD_AUTH_USERNAME", "u")]));
        assert!(e.err().unwrap().to_string().contains("set both"));
        let c = EtcdCredentials::from_vars(vars(&[
            ("ETCD_AUTH_USERNAME", "u"),
            ("ETCD_AUTH_PASSWORD", "p"),
        ]))
        .unwrap();
        assert_eq!(c.urls(&["h:1".into()]), ["http://h:1"]);
        assert!(
            c.explain("etcdserver: authentication failed")
                .unwrap()
                .contains("refused")
        );
        let tls =
            EtcdCredentials::from_vars(vars(&[("ETCD_AUTH_CA", "-----BEGIN CERTIFICATE-----\n")]))
                .unwrap();
        assert_eq!(tls.urls(&["h:1".into()]), ["https://h:1"]);
        let e = EtcdCredentials::from_vars(vars(&[("ETCD_AUTH_CA", "/no/such/ca.pem")]));
        let e = e.err().unwrap().to_string();
        assert!(
            e.contains("ETCD_AUTH_CA: neither") && !e.contains("/no/such"),
            "{e}"
        );
        let none = EtcdCredentials::default();
        assert!(
            none.explain("etcdserver: user name is empty")
                .unwrap()
                .contains("set ETCD_AUTH_USERNAME")
        );
        assert!(none.explain("connection refused").is_none());

        let n =
            NatsCredentials::from_vars(vars(&[("NATS_AUTH_TOKEN", "t"), ("NATS_AUTH_NKEY", "k")]))
                .unwrap();
        assert!(
            matches!(n.auth, Some(NatsAuth::Token(_))),
            "the token comes first"
        );
        assert!(NatsCredentials::from_vars(vars(&[("NATS_AUTH_PASSWORD", "p")])).is_err());
        assert!(
            NatsCredentials::default()
                .explain()
                .contains("wants credentials")
        );
    }
}
