//! Private etcd and NATS servers for tests that stop and restart them: loopback only, free
//! ports, a temporary data directory, killed on drop. Tests that only need a server running
//! use the shared ones `scripts/test` starts (`DYN_TEST_ETCD`, `DYN_TEST_NATS`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// How long a server may take to open its port. etcd has taken more than 5 s on a loaded
/// 2-core machine (the test build running beside it); this bound only ends a hang.
const START_WITHIN: Duration = Duration::from_secs(60);

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

/// One server process that can be killed and started again on the same port and data; what it
/// prints goes to `server.log` in its directory.
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

    /// [`Server::etcd_with_auth`] whose login tokens expire after `ttl_s` seconds. `None`
    /// only when etcd is not installed: a server that runs but cannot be set up is a failure
    /// that says which step failed.
    pub fn etcd_with_auth_ttl(user: &str, password: &str, ttl_s: u32) -> Option<Server> {
        let server = Self::etcd_with(&["--auth-token-ttl", &ttl_s.to_string()])?;
        let url = server.url();
        let (user, password) = (user.to_owned(), password.to_owned());
        let enabled = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("a runtime: {e}"))?;
            rt.block_on(async {
                let step = |what: &'static str| move |e: etcd_client::Error| format!("{what}: {e}");
                let mut c = etcd_client::Client::connect([url], None)
                    .await
                    .map_err(step("connecting"))?;
                c.user_add(user.as_str(), password.as_str(), None)
                    .await
                    .map_err(step("adding the user"))?;
                if user != "root" {
                    c.user_add("root", password.as_str(), None)
                        .await
                        .map_err(step("adding root"))?;
                }
                c.role_add("root").await.ok();
                c.user_grant_role(user.as_str(), "root")
                    .await
                    .map_err(step("granting the root role"))?;
                c.user_grant_role("root", "root").await.ok();
                c.auth_enable()
                    .await
                    .map_err(step("enabling authentication"))
            })
        })
        .join()
        .unwrap_or_else(|_| Err("the set-up thread panicked".to_owned()));
        if let Err(e) = enabled {
            panic!(
                "etcd at {} runs, but setting up authentication failed ({e}); its log:\n{}",
                server.url(),
                server.log()
            );
        }
        Some(server)
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

    /// Start it (again) and wait until it accepts connections. False only when its binary is
    /// not installed (the caller skips); one that exits, or does not open its port within
    /// [`START_WITHIN`], is a panic that shows its log — a slow start is not a missing binary.
    pub fn start(&mut self) -> bool {
        let mut command = (self.command)();
        let program = command.get_program().to_string_lossy().into_owned();
        // Appended to across restarts, so a failed restart shows what the first run said too.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let spawned = command.stdout(log.try_clone().unwrap()).stderr(log).spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            Err(e) => panic!("cannot start {program}: {e}"),
        };
        let started = Instant::now();
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                self.child = Some(child);
                return true;
            }
            let failed = match child.try_wait() {
                Ok(Some(status)) => Some(format!("exited ({status})")),
                Ok(None) if started.elapsed() > START_WITHIN => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Some(format!("was still starting after {START_WITHIN:?}"))
                }
                Ok(None) => None,
                Err(e) => Some(format!("could not be waited for: {e}")),
            };
            if let Some(failed) = failed {
                panic!(
                    "{program} {failed} before accepting connections on 127.0.0.1:{}; its log:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    /// The end of what the server printed (all its runs), for failure messages.
    pub fn log(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let start = text.len().saturating_sub(8000);
        let start = (start..text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(0);
        text[start..].to_owned()
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
