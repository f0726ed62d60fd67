//! The cluster identity: who may talk to a dyn process's request plane and KV transfer agent.
//!
//! Without an identity the planes are plain TCP, which is what one machine (everything on
//! loopback) needs. With one, every connection between dyn processes is TLS 1.3 and both ends
//! prove they belong to the cluster before a single frame is read:
//!
//! - **A shared token** (`DYN_CLUSTER_TOKEN`, or a file named by `DYN_CLUSTER_TOKEN_FILE`):
//!   each process makes a throwaway certificate at start; after the handshake each side sends
//!   an HMAC of the token over the session's exported keying material (RFC 5705/8446 §7.5),
//!   the client first. A peer without the token cannot produce it, and a man in the middle
//!   holds two sessions with two different exports, so neither proof it relays is valid. This
//!   is the zero-setup mode: one secret in every machine's environment.
//! - **A cluster CA** (`DYN_CLUSTER_CA`, `DYN_CLUSTER_CERT`, `DYN_CLUSTER_KEY`, PEM files):
//!   ordinary mutual TLS; the server's certificate must name the host peers dial (the request
//!   host), and clients must present a certificate the same CA signed. With a token as well,
//!   both checks apply.
//!
//! A peer that fails is refused: its connection is closed after the handshake, before any of
//! its bytes reach a frame decoder.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use ring::hmac;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// The shared token, in the environment.
pub const TOKEN_ENV: &str = "DYN_CLUSTER_TOKEN";
/// A file holding the shared token (trailing white space ignored).
pub const TOKEN_FILE_ENV: &str = "DYN_CLUSTER_TOKEN_FILE";
/// The cluster CA's certificate (PEM).
pub const CA_ENV: &str = "DYN_CLUSTER_CA";
/// This process's certificate chain (PEM), signed by the cluster CA.
pub const CERT_ENV: &str = "DYN_CLUSTER_CERT";
/// This process's private key (PEM).
pub const KEY_ENV: &str = "DYN_CLUSTER_KEY";

/// Shortest token accepted: 128 bits of a random base64 string.
const MIN_TOKEN: usize = 16;
/// A peer gets this long for the handshake and its proof; a silent one is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The proof's preamble: names the protocol, so a later change is refused by name.
const PROOF_MAGIC: &[u8; 4] = b"dyn1";
const EXPORT_LABEL: &[u8] = b"EXPORTER-dyn-cluster-token";
/// The name a client asks for under the token identity (certificates are not checked by name).
const TOKEN_SERVER_NAME: &str = "dyn.cluster";

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    /// The identity cannot be set up from what the environment names.
    #[error("cluster identity: {0}")]
    Config(String),
    /// The peer did not prove the cluster identity (or refused ours).
    #[error("{peer} is not of this cluster: {message}")]
    Refused { peer: String, message: String },
    #[error("{peer}: {source}")]
    Io { peer: String, source: io::Error },
}

/// This process's cluster identity, or none (plain TCP). Cheap to clone.
#[derive(Clone, Default)]
pub struct Trust(Option<Arc<Cluster>>);

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

struct Cluster {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
    /// The shared token's HMAC key.
    token: Option<hmac::Key>,
    /// Certificates are checked against the cluster CA, server names included.
    ca: bool,
}

/// The secrets an identity is made from, wherever they were read.
#[derive(Default)]
pub struct Secrets {
    pub token: Option<Vec<u8>>,
    /// CA certificate, certificate chain and key files (all three or none).
    pub ca: Option<(PathBuf, PathBuf, PathBuf)>,
}

impl Trust {
    /// No identity: plain TCP, anyone who reaches the port is served.
    pub fn plain() -> Self {
        Self(None)
    }

    /// The identity the environment names (see the crate docs), or none.
    pub fn from_env() -> Result<Self, TrustError> {
        Self::from_secrets(secrets_from(|k| std::env::var_os(k))?)
    }

    pub fn from_secrets(s: Secrets) -> Result<Self, TrustError> {
        if s.token.is_none() && s.ca.is_none() {
            return Ok(Self::plain());
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let token = match s.token {
            Some(t) if t.len() < MIN_TOKEN => {
                return Err(TrustError::Config(format!(
                    "the cluster token has {} bytes; at least {MIN_TOKEN} are needed (for example \
                     `head -c 32 /dev/urandom | base64`)",
                    t.len()
                )));
            }
            Some(t) => Some(hmac::Key::new(hmac::HMAC_SHA256, &t)),
            None => None,
        };
        let versions = &[&rustls::version::TLS13];
        let cfg = |e: rustls::Error| TrustError::Config(format!("TLS: {e}"));
        let (client, server) = match &s.ca {
            Some((ca, cert, key)) => {
                let mut roots = RootCertStore::empty();
                for c in read_certs(ca)? {
                    roots
                        .add(c)
                        .map_err(|e| TrustError::Config(format!("{}: {e}", ca.display())))?;
                }
                let roots = Arc::new(roots);
                let chain = read_certs(cert)?;
                let key = read_key(key)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                        .build()
                        .map_err(|e| TrustError::Config(format!("client verifier: {e}")))?;
                let server = ServerConfig::builder_with_provider(provider.clone())
                    .with_protocol_versions(versions)
                    .map_err(cfg)?
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(chain.clone(), key.clone_key())
                    .map_err(cfg)?;
                let client = ClientConfig::builder_with_provider(provider)
                    .with_protocol_versions(versions)
                    .map_err(cfg)?
                    .with_root_certificates(roots)
                    .with_client_auth_cert(chain, key)
                    .map_err(cfg)?;
                (client, server)
            }
            None => {
                // A throwaway certificate: under the token identity it proves nothing, the
                // token's HMAC over the session does.
                let made = rcgen::generate_simple_self_signed(vec![TOKEN_SERVER_NAME.to_owned()])
                    .map_err(|e| {
                    TrustError::Config(format!("cannot make a certificate: {e}"))
                })?;
                let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
                let server = ServerConfig::builder_with_provider(provider.clone())
                    .with_protocol_versions(versions)
                    .map_err(cfg)?
                    .with_no_client_auth()
                    .with_single_cert(vec![made.cert.der().clone()], key)
                    .map_err(cfg)?;
                let client = ClientConfig::builder_with_provider(provider.clone())
                    .with_protocol_versions(versions)
                    .map_err(cfg)?
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyCertificate(
                        provider.signature_verification_algorithms,
                    )))
                    .with_no_client_auth();
                (client, server)
            }
        };
        Ok(Self(Some(Arc::new(Cluster {
            client: Arc::new(client),
            server: Arc::new(server),
            token,
            ca: s.ca.is_some(),
        }))))
    }

    /// True when connections are authenticated and encrypted.
    pub fn is_secure(&self) -> bool {
        self.0.is_some()
    }

    /// What guards the planes, for logs and errors.
    pub fn describe(&self) -> &'static str {
        match &self.0 {
            None => "none (plain TCP)",
            Some(c) if c.ca && c.token.is_some() => "TLS, cluster CA and shared token",
            Some(c) if c.ca => "TLS, cluster CA",
            Some(_) => "TLS, shared token",
        }
    }

    /// The serving side of a new connection: the peer proves the identity or is refused.
    pub async fn accept(&self, tcp: TcpStream) -> Result<PlaneStream, TrustError> {
        let Some(c) = &self.0 else {
            return Ok(PlaneStream::Plain(tcp));
        };
        let peer = Peer::of(&tcp);
        let (io, refused) = (|e| peer.io(e), |m| peer.refused(m));
        let handshake = async {
            let mut tls = tokio_rustls::TlsAcceptor::from(c.server.clone())
                .accept(tcp)
                .await
                .map_err(|e| refused(format!("TLS handshake: {e}")))?;
            if let Some(key) = &c.token {
                let export = exported(tls.get_ref().1).map_err(io)?;
                let mut got = [0u8; PROOF_MAGIC.len() + 32];
                tls.read_exact(&mut got).await.map_err(io)?;
                if &got[..4] != PROOF_MAGIC
                    || hmac::verify(key, &proof_message(b"client", &export), &got[4..]).is_err()
                {
                    return Err(refused("it does not hold the cluster token".into()));
                }
                tls.write_all(&proof(key, b"server", &export))
                    .await
                    .map_err(io)?;
                tls.flush().await.map_err(io)?;
            }
            Ok(PlaneStream::Tls(Box::new(tls.into())))
        };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .unwrap_or_else(|_| Err(peer.refused("no handshake within 5 s".into())))
    }

    /// The calling side of a new connection to `address` (`HOST:PORT`, `[v6]:PORT`, or a bare
    /// host): this side proves the identity first, and sends nothing else until the server
    /// has proved it back.
    pub async fn connect(&self, tcp: TcpStream, address: &str) -> Result<PlaneStream, TrustError> {
        let Some(c) = &self.0 else {
            return Ok(PlaneStream::Plain(tcp));
        };
        let peer = Peer::of(&tcp);
        let (io, refused) = (|e| peer.io(e), |m| peer.refused(m));
        let name = if c.ca {
            let host = host_of(address);
            ServerName::try_from(host.to_owned())
                .map_err(|e| TrustError::Config(format!("`{host}` is not a server name: {e}")))?
        } else {
            ServerName::try_from(TOKEN_SERVER_NAME)
                .map_err(|e| TrustError::Config(e.to_string()))?
        };
        let handshake = async {
            let mut tls = tokio_rustls::TlsConnector::from(c.client.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| refused(format!("TLS handshake: {e}")))?;
            if let Some(key) = &c.token {
                let export = exported(tls.get_ref().1).map_err(io)?;
                let mut mine = PROOF_MAGIC.to_vec();
                mine.extend_from_slice(&proof(key, b"client", &export));
                tls.write_all(&mine).await.map_err(io)?;
                tls.flush().await.map_err(io)?;
                let mut theirs = [0u8; 32];
                tls.read_exact(&mut theirs).await.map_err(|e| {
                    // A server that refused us closes the connection instead of answering.
                    refused(format!("no proof of the cluster token ({e})"))
                })?;
                if hmac::verify(key, &proof_message(b"server", &export), &theirs).is_err() {
                    return Err(refused("it does not hold the cluster token".into()));
                }
            }
            Ok(PlaneStream::Tls(Box::new(tls.into())))
        };
        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .unwrap_or_else(|_| Err(peer.refused("no handshake within 5 s".into())))
    }
}

/// The host of an address as peers dial it: `HOST:PORT` → HOST, `[v6]:PORT` → v6 (no
/// brackets), a bare host as it is.
pub fn host_of(address: &str) -> &str {
    let host = match address.rsplit_once(':') {
        // A bare IPv6 address has colons but no port.
        Some((h, port))
            if (!h.contains(':') || h.ends_with(']'))
                && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            h
        }
        _ => address,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

/// Reads the identity's secrets through `var` (the environment, or a test's map).
pub fn secrets_from(
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> Result<Secrets, TrustError> {
    let path = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let token = match (
        var(TOKEN_ENV).filter(|v| !v.is_empty()),
        path(TOKEN_FILE_ENV),
    ) {
        (Some(_), Some(_)) => {
            return Err(TrustError::Config(format!(
                "both {TOKEN_ENV} and {TOKEN_FILE_ENV} are set; set one"
            )));
        }
        (Some(t), None) => Some(t.into_encoded_bytes()),
        (None, Some(f)) => {
            let bytes = std::fs::read(&f).map_err(|e| {
                TrustError::Config(format!("{TOKEN_FILE_ENV}={}: {e}", f.display()))
            })?;
            Some(bytes.trim_ascii_end().to_vec())
        }
        (None, None) => None,
    };
    let ca = match (path(CA_ENV), path(CERT_ENV), path(KEY_ENV)) {
        (Some(ca), Some(cert), Some(key)) => Some((ca, cert, key)),
        (None, None, None) => None,
        _ => {
            return Err(TrustError::Config(format!(
                "{CA_ENV}, {CERT_ENV} and {KEY_ENV} go together: set all three or none"
            )));
        }
    };
    Ok(Secrets { token, ca })
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TrustError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TrustError::Config(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TrustError::Config(format!(
            "{}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TrustError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| TrustError::Config(format!("{}: no PEM private key ({e})", path.display())))
}

/// The other end of a connection, for errors.
struct Peer(String);

impl Peer {
    fn of(tcp: &TcpStream) -> Self {
        Self(
            tcp.peer_addr()
                .map_or_else(|_| "a peer".to_owned(), |a| a.to_string()),
        )
    }

    fn io(&self, source: io::Error) -> TrustError {
        TrustError::Io {
            peer: self.0.clone(),
            source,
        }
    }

    fn refused(&self, message: String) -> TrustError {
        TrustError::Refused {
            peer: self.0.clone(),
            message,
        }
    }
}

/// The session's exported keying material: equal on both ends of one TLS session only.
fn exported<D>(conn: &rustls::ConnectionCommon<D>) -> io::Result<[u8; 32]> {
    conn.export_keying_material([0u8; 32], EXPORT_LABEL, None)
        .map_err(io::Error::other)
}

fn proof_message(role: &[u8], export: &[u8; 32]) -> Vec<u8> {
    [role, b":".as_slice(), export.as_slice()].concat()
}

fn proof(key: &hmac::Key, role: &[u8], export: &[u8; 32]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(hmac::sign(key, &proof_message(role, export)).as_ref());
    out
}

/// Under the token identity any certificate will do, but the handshake's signature must still
/// be made by its key: the session keys are then the server's, and the token's HMAC over
/// them is what authenticates it.
#[derive(Debug)]
struct AnyCertificate(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// Socket options for every plane connection, both ends: no Nagle delay (frames are written
/// whole), and TCP keepalive, so a peer whose host vanished (power, cable) is noticed by the
/// kernel within about a minute even on a connection nobody writes to.
pub fn tune(tcp: &TcpStream) {
    let _ = tcp.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
}

/// A plane connection: plain TCP, or TLS over it.
pub enum PlaneStream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl PlaneStream {
    /// The socket underneath (for its options and addresses).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            PlaneStream::Plain(s) => s,
            PlaneStream::Tls(t) => t.get_ref().0,
        }
    }
}

impl AsyncRead for PlaneStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            PlaneStream::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for PlaneStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            PlaneStream::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            PlaneStream::Tls(t) => Pin::new(t.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            PlaneStream::Plain(s) => s.is_write_vectored(),
            PlaneStream::Tls(t) => t.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_flush(cx),
            PlaneStream::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            PlaneStream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            PlaneStream::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests;
