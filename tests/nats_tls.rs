//! TLS on the fleet's NATS connections (issue 13), against a real nats-server in operator mode that requires TLS
//! and verifies client certificates: the `--nats-tls-ca` / `--nats-tls-cert` / `--nats-tls-key` settings of
//! `nats_conn::Connector` (every fleet connection goes through it) connect and work; no TLS, an unknown CA, a
//! missing client certificate or a missing file are refused with one line naming the cause.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fleet::nats_auth::{AuthMaterial, permissions};
use fleet_client::creds::Role;
use fleet_client::nats_conn::{ConnectError, Connector, Tls};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};

/// A CA and the certificates it signed, as PEM files.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn write(path: &Path, text: &str) -> PathBuf {
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// A fresh CA under `dir` (`name` tells two apart), with a server certificate for 127.0.0.1 and a client one.
fn pki(dir: &Path, name: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{name} test CA"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let server_key = KeyPair::generate().unwrap();
    let server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &ca, &ca_key)
        .unwrap();
    let client_key = KeyPair::generate().unwrap();
    let mut client_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    client_params
        .distinguished_name
        .push(DnType::CommonName, "fleet-front");
    let client = client_params.signed_by(&client_key, &ca, &ca_key).unwrap();
    Pki {
        ca: write(&dir.join(format!("{name}-ca.pem")), &ca.pem()),
        server_cert: write(&dir.join(format!("{name}-server.pem")), &server.pem()),
        server_key: write(
            &dir.join(format!("{name}-server-key.pem")),
            &server_key.serialize_pem(),
        ),
        client_cert: write(&dir.join(format!("{name}-client.pem")), &client.pem()),
        client_key: write(
            &dir.join(format!("{name}-client-key.pem")),
            &client_key.serialize_pem(),
        ),
    }
}

/// A nats-server with the production auth configuration plus a `tls` block that requires TLS and verifies client
/// certificates against `pki.ca`.
struct TlsServer {
    child: Child,
    port: u16,
    auth: AuthMaterial,
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn quoted(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

impl TlsServer {
    fn start(dir: &Path, pki: &Pki) -> TlsServer {
        let auth_dir = dir.join("auth");
        let auth = AuthMaterial::load_or_create(&auth_dir, permissions::default_for_role).unwrap();
        let port = fleet::nats_server::free_port().unwrap();
        let conf = dir.join("nats.conf");
        let text = format!(
            "max_control_line: {}\n{}\ntls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: true\n  timeout: 5\n}}\n",
            fleet::nats_server::MAX_CONTROL_LINE,
            auth.server_config(&dir.join("resolver")),
            quoted(&pki.server_cert),
            quoted(&pki.server_key),
            quoted(&pki.ca),
        );
        std::fs::write(&conf, text).unwrap();
        let child = Command::new(fleet::nats_server::find().expect("nats-server (run scripts/test.sh once)"))
            .arg("-c")
            .arg(&conf)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.join("js"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = TlsServer { child, port, auth };
        // Ready when it accepts TCP (the TLS handshake is the client's part).
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server with TLS did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    fn url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.port)
    }

    fn connector(&self, tls: Tls) -> Connector {
        self.connector_at(&self.url(), tls)
    }

    fn connector_at(&self, url: &str, tls: Tls) -> Connector {
        let mut c = Connector::new(url, Some(self.auth.creds_path(Role::Front)));
        c.tls = tls;
        c
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_connects_and_everything_short_of_it_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = pki(dir.path(), "fleet");
    let other = pki(dir.path(), "other");
    let server = TlsServer::start(dir.path(), &good);

    // The CA, a client certificate, the role's credentials: connected, and JetStream answers as that user.
    let client = server
        .connector(Tls {
            ca: Some(good.ca.clone()),
            cert: Some(good.client_cert.clone()),
            key: Some(good.client_key.clone()),
        })
        .connect("tls-front")
        .await
        .expect("mutual TLS");
    let js = async_nats::jetstream::new(client.clone());
    js.query_account().await.expect("JetStream over TLS");
    drop(client);

    let refused = |e: ConnectError| {
        let text = e.to_string();
        assert_eq!(text.lines().count(), 1, "one line: {text}");
        assert!(!text.contains("PRIVATE KEY") && !text.contains("SUAB"), "{text}");
        text
    };
    // No TLS at all (a nats:// URL, no TLS flags): the server requires TLS.
    let plain = format!("nats://127.0.0.1:{}", server.port);
    let e = server
        .connector_at(&plain, Tls::default())
        .connect("plain")
        .await
        .expect_err("no TLS");
    let text = refused(e);
    assert!(text.contains(&plain), "{text}");
    // The server's certificate from an unknown CA.
    let e = server
        .connector(Tls {
            ca: Some(other.ca.clone()),
            cert: Some(good.client_cert.clone()),
            key: Some(good.client_key.clone()),
        })
        .connect("wrong-ca")
        .await
        .expect_err("unknown CA");
    let text = refused(e);
    assert!(
        text.contains("cannot connect to") && text.contains("UnknownIssuer"),
        "{text}"
    );
    // No client certificate: the server verifies clients.
    let e = server
        .connector(Tls {
            ca: Some(good.ca.clone()),
            cert: None,
            key: None,
        })
        .connect("no-client-cert")
        .await
        .expect_err("no client certificate");
    assert!(refused(e).contains("CertificateRequired"));
    // A client certificate another CA signed.
    let e = server
        .connector(Tls {
            ca: Some(good.ca.clone()),
            cert: Some(other.client_cert.clone()),
            key: Some(other.client_key.clone()),
        })
        .connect("foreign-client-cert")
        .await
        .expect_err("foreign client certificate");
    assert!(refused(e).contains("UnknownCA"));
    // A missing file: named, no connection attempt.
    let missing = dir.path().join("missing-ca.pem");
    let e = server
        .connector(Tls {
            ca: Some(missing.clone()),
            cert: None,
            key: None,
        })
        .connect("missing")
        .await
        .expect_err("missing CA file");
    assert!(matches!(e, ConnectError::TlsFile { what: "CA", .. }), "{e:?}");
    let text = refused(e);
    assert!(text.contains(missing.to_str().unwrap()), "{text}");
}
