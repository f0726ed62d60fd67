//! Real sockets on loopback: who gets through, who is refused, and that what gets through is
//! a working stream.

use super::*;
use tokio::net::TcpListener;

fn token(t: &str) -> Trust {
    Trust::from_secrets(Secrets {
        token: Some(t.as_bytes().to_vec()),
        ca: None,
    })
    .unwrap()
}

const A: &str = "0123456789abcdef-cluster-a";
const B: &str = "0123456789abcdef-cluster-b";

/// Serves one connection with `server`, echoing a line back; returns what `accept` said.
async fn one_exchange(
    server: Trust,
    client: Trust,
    host: &str,
) -> (Result<(), TrustError>, Result<Vec<u8>, TrustError>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let serving = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut s = server.accept(s).await?;
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(&buf).await.unwrap();
        s.flush().await.unwrap();
        Ok(())
    });
    let calling = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut s = client.connect(tcp, host).await?;
        s.write_all(b"hello").await.unwrap();
        s.flush().await.unwrap();
        let mut buf = vec![0u8; 5];
        s.read_exact(&mut buf).await.map_err(|e| TrustError::Io {
            peer: "server".into(),
            source: e,
        })?;
        Ok(buf)
    };
    let called = calling.await;
    (serving.await.unwrap(), called)
}

#[tokio::test]
async fn the_same_token_gets_through_and_the_stream_works() {
    let (served, called) = one_exchange(token(A), token(A), "127.0.0.1").await;
    served.unwrap();
    assert_eq!(called.unwrap(), b"hello");
    assert_eq!(token(A).describe(), "TLS, shared token");
}

#[tokio::test]
async fn another_token_or_none_is_refused_before_anything_is_read() {
    let (served, called) = one_exchange(token(A), token(B), "127.0.0.1").await;
    assert!(
        matches!(served, Err(TrustError::Refused { .. })),
        "{served:?}"
    );
    assert!(
        matches!(called, Err(TrustError::Refused { .. })),
        "{called:?}"
    );
    // A plain client speaks no TLS: the server refuses it in the handshake.
    let (served, _) = one_exchange(token(A), Trust::plain(), "127.0.0.1").await;
    let e = served.unwrap_err();
    assert!(e.to_string().contains("not of this cluster"), "{e}");
    // And a client with the identity does not talk to a server without it.
    let (_, called) = one_exchange(Trust::plain(), token(A), "127.0.0.1").await;
    assert!(called.is_err());
}

#[tokio::test]
async fn a_silent_peer_is_dropped_after_the_handshake_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let _idle = TcpStream::connect(addr).await.unwrap();
    let (s, _) = l.accept().await.unwrap();
    tokio::time::pause();
    let e = token(A).accept(s).await.err().unwrap();
    assert!(e.to_string().contains("no handshake within 5 s"), "{e}");
}

/// A cluster CA and a certificate it signs for `name`.
struct Ca {
    dir: PathBuf,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    ca_pem: String,
}

impl Ca {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dyn-trust-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self {
            dir,
            ca_pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// Files for a process whose certificate names `name`.
    fn secrets(&self, who: &str, name: &str) -> Secrets {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        let f = |n: &str, body: &str| {
            let p = self.dir.join(format!("{who}-{n}"));
            std::fs::write(&p, body).unwrap();
            p
        };
        Secrets {
            token: None,
            ca: Some((
                f("ca.pem", &self.ca_pem),
                f("cert.pem", &cert.pem()),
                f("key.pem", &key.serialize_pem()),
            )),
        }
    }
}

#[tokio::test]
async fn a_cluster_ca_authenticates_both_ends_and_checks_the_server_name() {
    let ca = Ca::new("ca");
    let server = Trust::from_secrets(ca.secrets("server", "127.0.0.1")).unwrap();
    let client = Trust::from_secrets(ca.secrets("client", "client.example")).unwrap();
    assert_eq!(server.describe(), "TLS, cluster CA");
    let (served, called) = one_exchange(server.clone(), client.clone(), "127.0.0.1").await;
    served.unwrap();
    assert_eq!(called.unwrap(), b"hello");
    // The server's certificate does not name the host dialled.
    let (_, called) = one_exchange(server.clone(), client, "localhost").await;
    assert!(called.is_err());
    // A client certificate from another CA is refused.
    let other = Ca::new("other");
    let stranger = Trust::from_secrets(other.secrets("stranger", "x.example")).unwrap();
    let (served, called) = one_exchange(server, stranger, "127.0.0.1").await;
    assert!(matches!(served, Err(TrustError::Refused { .. })));
    assert!(called.is_err());
    let _ = std::fs::remove_dir_all(&ca.dir);
    let _ = std::fs::remove_dir_all(&other.dir);
}

#[test]
fn the_environment_is_read_with_clear_errors() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| std::ffi::OsString::from(v))
        }
    };
    let none = secrets_from(env(&[])).unwrap();
    assert!(!Trust::from_secrets(none).unwrap().is_secure());
    let short = secrets_from(env(&[(TOKEN_ENV, "short")])).unwrap();
    let e = Trust::from_secrets(short).err().unwrap().to_string();
    assert!(e.contains("at least 16"), "{e}");
    let e = secrets_from(env(&[(TOKEN_ENV, A), (TOKEN_FILE_ENV, "/x")]))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("set one"), "{e}");
    let e = secrets_from(env(&[(CA_ENV, "/ca.pem")]))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("go together"), "{e}");
    let e = secrets_from(env(&[(TOKEN_FILE_ENV, "/nonexistent/token")]))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/nonexistent/token"), "{e}");
    // A token file's trailing newline is not part of the token.
    let f = std::env::temp_dir().join(format!("dyn-trust-token-{}", std::process::id()));
    std::fs::write(&f, format!("{A}\n")).unwrap();
    let path: &'static str = Box::leak(f.display().to_string().into_boxed_str());
    let pairs: &'static [(&str, &str)] = Box::leak(Box::new([(TOKEN_FILE_ENV, path)]));
    let s = secrets_from(env(pairs)).unwrap();
    assert_eq!(s.token.as_deref(), Some(A.as_bytes()));
    let _ = std::fs::remove_file(f);
}

/// Every plane socket keeps alive (a host gone dark is noticed on an idle pooled connection
/// within about a minute) and sends frames without Nagle's delay.
#[tokio::test]
async fn plane_sockets_keep_alive_and_do_not_wait_to_send() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    tune(&s);
    let r = socket2::SockRef::from(&s);
    assert!(r.keepalive().unwrap());
    assert_eq!(r.tcp_keepalive_time().unwrap(), Duration::from_secs(30));
    assert_eq!(r.tcp_keepalive_interval().unwrap(), Duration::from_secs(10));
    assert_eq!(r.tcp_keepalive_retries().unwrap(), 3);
    assert!(s.nodelay().unwrap());
}
