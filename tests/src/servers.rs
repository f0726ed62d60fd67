//! Private etcd and NATS servers for tests that stop and restart them: loopback only, free
//! ports, a temporary data directory, killed on drop. Tests that only need a server running
//! use the shared ones `scripts/test` starts (`DYN_TEST_ETCD`, `DYN_TEST_NATS`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A free loopback port (racy in principle, fine on a test machine).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// The value of a test-server variable, or `None` after saying the test skips (a failure
/// under the test command: [`crate::skip`]).
pub fn test_server(var: &str) -> Option<String> {
    let v = std::env::var(var).ok();
    if v.is_none() {
        crate::skip(&format!(
            "{var} is not set (scripts/test starts etcd and NATS and sets it)"
        ));
    }
    v
}

/// One server process that can be killed and started again on the same port and data.
pub struct Server {
    child: Option<Child>,
    command: Box<dyn Fn() -> Command + Send>,
    port: u16,
    scheme: &'static str,
    dir: PathBuf,
}

impl Server {
    /// etcd with one member; `None` when the binary is missing.
    pub fn etcd() -> Option<Server> {
        Self::etcd_with(&[])
    }

    fn etcd_with(extra: &[&str]) -> Option<Server> {
        Self::etcd_with_scheme("http", extra)
    }

    /// etcd serving clients over `scheme` (http, or https with the TLS flags in `extra`).
    fn etcd_with_scheme(scheme: &'static str, extra: &[&str]) -> Option<Server> {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let (port, peer) = (free_port(), free_port());
        let dir = crate::scratch_dir(&format!("etcd-{port}"));
        let data = dir.join("data");
        Self::start_new(scheme, port, dir, move || {
            let client = format!("{scheme}://127.0.0.1:{port}");
            let peer = format!("http://127.0.0.1:{peer}");
            let mut c = Command::new("etcd");
            c.args(["--name", "p", "--data-dir"]).arg(&data);
            c.args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ]);
            c.args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ]);
            c.args(["--initial-cluster", &format!("p={peer}")]);
            c.args(&extra);
            c
        })
    }

    /// nats-server with JetStream; `None` when the binary is missing.
    pub fn nats() -> Option<Server> {
        Self::nats_with(&[])
    }

    /// nats-server that admits `user` with `password` only.
    pub fn nats_with_user(user: &str, password: &str) -> Option<Server> {
        Self::nats_with(&["--user", user, "--pass", password])
    }

    fn nats_with(extra: &[&str]) -> Option<Server> {
        let port = free_port();
        let dir = crate::scratch_dir(&format!("nats-{port}"));
        let data = dir.join("data");
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        Self::start_new("nats", port, dir, move || {
            let mut c = Command::new("nats-server");
            c.args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
                .arg(&data)
                .args(&extra);
            c
        })
    }

    /// etcd serving clients over TLS (https) with `pki`'s server certificate, asking each
    /// client for a certificate its CA signed.
    pub fn etcd_tls(pki: &Pki) -> Option<Server> {
        let path = |p: &Path| p.display().to_string();
        Self::etcd_with_scheme(
            "https",
            &[
                "--cert-file",
                &path(&pki.server_cert),
                "--key-file",
                &path(&pki.server_key),
                "--trusted-ca-file",
                &path(&pki.ca),
                "--client-cert-auth",
            ],
        )
    }

    /// nats-server over TLS with `pki`'s server certificate, asking each client for a
    /// certificate its CA signed.
    pub fn nats_tls(pki: &Pki) -> Option<Server> {
        let port = free_port();
        let dir = crate::scratch_dir(&format!("nats-tls-{port}"));
        let pki = pki.clone();
        Self::start_new("nats", port, dir, move || {
            let mut c = Command::new("nats-server");
            c.args([
                "-a",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "--tls",
                "--tlsverify",
            ]);
            c.arg("--tlscert").arg(&pki.server_cert);
            c.arg("--tlskey").arg(&pki.server_key);
            c.arg("--tlscacert").arg(&pki.ca);
            c
        })
    }

    /// etcd with authentication on: user `user` (granted the root role) with `password`.
    pub fn etcd_with_auth(user: &str, password: &str) -> Option<Server> {
        Self::etcd_with_auth_ttl(user, password, 300)
    }

    /// [`Server::etcd_with_auth`] whose login tokens expire after `ttl_s` seconds.
    pub fn etcd_with_auth_ttl(user: &str, password: &str, ttl_s: u32) -> Option<Server> {
        let server = Self::etcd_with(&["--auth-token-ttl", &ttl_s.to_string()])?;
        let url = server.url();
        let (user, password) = (user.to_owned(), password.to_owned());
        let enabled = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                let mut c = etcd_client::Client::connect([url], None).await.ok()?;
                c.user_add(user.as_str(), password.as_str(), None)
                    .await
                    .ok()?;
                if user != "root" {
                    c.user_add("root", password.as_str(), None).await.ok()?;
                }
                c.role_add("root").await.ok();
                c.user_grant_role(user.as_str(), "root").await.ok()?;
                c.user_grant_role("root", "root").await.ok();
                c.auth_enable().await.ok()
            })
        })
        .join()
        .ok()
        .flatten();
        enabled.map(|_| server)
    }

    fn start_new(
        scheme: &'static str,
        port: u16,
        dir: PathBuf,
        command: impl Fn() -> Command + Send + 'static,
    ) -> Option<Server> {
        let mut s = Server {
            child: None,
            command: Box::new(command),
            port,
            scheme,
            dir,
        };
        s.start().then_some(s)
    }

    /// `scheme://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }

    /// `127.0.0.1:port`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Start it (again) and wait until it accepts connections; false if it cannot start.
    pub fn start(&mut self) -> bool {
        let child = (self.command)()
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(child) = child else { return false };
        self.child = Some(child);
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        false
    }

    /// SIGKILL it, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kill it and start it again on the same port and data.
    pub fn restart(&mut self) -> bool {
        self.kill();
        self.start()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A test CA, and PEM files it signed: a server certificate for 127.0.0.1 and a client's.
#[derive(Clone)]
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// Make a [`Pki`] in `dir`.
pub fn pki(dir: &Path) -> Option<Pki> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).ok()?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().ok()?;
    let ca_cert = ca.self_signed(&ca_key).ok()?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let write = |name: &str, body: String| {
        let p = dir.join(name);
        std::fs::write(&p, body).ok().map(|()| p)
    };
    let signed = |names: Vec<String>, client: bool| {
        let key = rcgen::KeyPair::generate().ok()?;
        let mut params = rcgen::CertificateParams::new(names).ok()?;
        params.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let cert = params.signed_by(&key, &issuer).ok()?;
        Some((cert.pem(), key.serialize_pem()))
    };
    let (server_cert, server_key) = signed(vec!["127.0.0.1".into(), "localhost".into()], false)?;
    let (client_cert, client_key) = signed(vec!["dyn-client".into()], true)?;
    Some(Pki {
        ca: write("ca.pem", ca_cert.pem())?,
        server_cert: write("server.pem", server_cert)?,
        server_key: write("server.key", server_key)?,
        client_cert: write("client.pem", client_cert)?,
        client_key: write("client.key", client_key)?,
    })
}
