//! The `engine` binary over TLS on every listener: zeep over HTTPS and simplefix over TLS
//! complete trades; where client certificates are required, a participant without one is
//! refused whatever key it holds; a node off loopback refuses to serve plain TCP unless told.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{everyone, fix_pairs, key_hex, python, refdata, simplefix, trade_lines, Engine};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use ste_bridge::frame::Frame;
use ste_engine::sign;

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate, made for
/// the test and written as PEM files.
struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn validity(params: &mut CertificateParams) {
    let day = time::Duration::days(1);
    params.not_before = time::OffsetDateTime::now_utc() - day;
    params.not_after = time::OffsetDateTime::now_utc() + day;
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("a temporary folder");
        let write = |name: &str, text: String| -> PathBuf {
            let path = dir.path().join(name);
            std::fs::write(&path, text).expect("writes");
            path
        };
        let mut ca_params = CertificateParams::new(Vec::new()).expect("params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "STE test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut ca_params);
        let ca_key = KeyPair::generate().expect("a key");
        let ca_cert = ca_params.self_signed(&ca_key).expect("the CA");
        let ca = write("ca.pem", ca_cert.pem());
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |names: Vec<String>, purpose: ExtendedKeyUsagePurpose| {
            let mut params = CertificateParams::new(names).expect("params");
            params.distinguished_name.push(DnType::CommonName, "ste");
            params.use_authority_key_identifier_extension = true;
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            params.extended_key_usages = vec![purpose];
            validity(&mut params);
            let key = KeyPair::generate().expect("a key");
            let cert = params.signed_by(&key, &issuer).expect("signed");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf(
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) = leaf(
            vec!["participant".into()],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        Pki {
            ca,
            server_cert: write("server.pem", server_cert),
            server_key: write("server-key.pem", server_key),
            client_cert: write("client.pem", client_cert),
            client_key: write("client-key.pem", client_key),
            _dir: dir,
        }
    }

    fn engine_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.server_cert.display().to_string(),
            "--tls-key".into(),
            self.server_key.display().to_string(),
        ]
    }
}

impl Pki {
    /// What a client trusts, with the client certificate or without.
    fn client(&self, with_certificate: bool) -> ste_bridge::tls::ClientTls {
        ste_bridge::tls::ClientTls {
            ca: self.ca.clone(),
            identity: with_certificate.then(|| (self.client_cert.clone(), self.client_key.clone())),
        }
    }
}

/// The framed-XML client over TLS, logged on as `participant`, checking the engine's
/// certificate for `server_name`.
fn framed_tls(
    engine: &Engine,
    participant: &str,
    server_name: &str,
    tls: ste_bridge::tls::ClientTls,
) -> Result<
    (
        ste_bridge::client::FrameWriter,
        ste_bridge::client::FrameReader,
    ),
    ste_bridge::client::ClientError,
> {
    let refdata = refdata();
    let logons = [ste_bridge::client::Logon {
        participant,
        key: refdata.participant_mac(participant).expect("a key").1,
        subscribe: false,
    }];
    ste_bridge::client::connect_tls(&engine.tcp.to_string(), server_name, &tls, &logons)
}

fn start(args: &[String]) -> Engine {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Engine::start(&args)
}

/// zeep over https: the answers, or the client's failure (its stderr) when it could not talk.
fn zeep(engine: &Engine, lines: &[Vec<u8>], tls: &[&Path]) -> Result<Vec<String>, String> {
    let refdata = refdata();
    let messages: Vec<serde_json::Value> = lines
        .iter()
        .map(|line| {
            let signer = sign::claimed_sender(line).expect("a sender");
            serde_json::json!({
                "signer": signer,
                "key_hex": key_hex(&refdata, signer),
                "xml": String::from_utf8(line.clone()).expect("UTF-8"),
            })
        })
        .collect();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let path = dir.path().join("messages.json");
    std::fs::write(&path, serde_json::to_vec(&messages).expect("JSON")).expect("writes");
    let output = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/soap_zeep.py"
        ))
        .arg(format!(
            "https://localhost:{}/soap?wsdl",
            engine.http.port()
        ))
        .arg("STESoap11")
        .arg(&path)
        .args(tls)
        .output()
        .expect("python3 runs (with zeep: pip install -r bridge/tests/clients/requirements.txt)");
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(serde_json::from_slice(&output.stdout).expect("JSON"))
}

#[test]
fn zeep_over_https_and_simplefix_over_tls_complete_trades() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().expect("a temporary folder");
    let cls_out = dir.path().join("cls.xml");
    let mut args = pki.engine_args();
    args.extend(["--cls-out".into(), cls_out.display().to_string()]);
    let engine = start(&args);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 2, 71);
    let (first, second) = lines.split_at(7);

    // A whole trade over SOAP on HTTPS: seven ACCEPTED, then its CLS in the stream.
    let answers = zeep(&engine, first, &[&pki.ca]).expect("zeep talks HTTPS");
    assert_eq!(answers, vec!["ACCEPTED"; 7]);

    // A whole trade over FIX on TLS, a session per party; the last one hears the CLS.
    common::fix_trade_by_parties(&engine, &refdata, second, serde_json::json!({"ca": pki.ca}));
    // The framed-XML listener speaks TLS too: a plain client gets no challenge, a TLS client
    // logs on and has a message accepted.
    {
        use std::io::Write;
        let mut plain = std::net::TcpStream::connect(engine.tcp).expect("connects");
        plain
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .expect("a timeout");
        plain.write_all(&Frame::Heartbeat.encode()).expect("writes");
        assert!(!matches!(
            Frame::read_from(&mut plain),
            Ok(Some(Frame::Challenge { .. }))
        ));
    }
    // The client the driver uses for tls:// targets: a socket pair to a tunnel thread.
    let third = trade_lines(&refdata, 3, 71).remove(14);
    let sender = sign::claimed_sender(&third).expect("a sender").to_owned();
    let (mut writer, mut reader) =
        framed_tls(&engine, &sender, "localhost", pki.client(false)).expect("logs on over TLS");
    writer
        .send(&common::message(&refdata, 1, third))
        .expect("sends");
    writer.flush().expect("flushes");
    assert!(matches!(
        reader.next_frame(),
        Ok(Some(Frame::Ack {
            seq: 1,
            duplicate: false
        }))
    ));
    // The engine's certificate is checked: another name is refused.
    assert!(framed_tls(
        &engine,
        &sender,
        "not-the-engine.example",
        pki.client(false)
    )
    .is_err());
    assert!(engine.stop().success());
    let stream = std::fs::read_to_string(&cls_out).expect("the CLS stream");
    assert_eq!(stream.lines().count(), 2, "{stream}");
}

#[test]
fn client_certificates_are_required_where_configured() {
    let pki = Pki::new();
    let mut args = pki.engine_args();
    args.extend(["--tls-client-ca".into(), pki.ca.display().to_string()]);
    let engine = start(&args);
    let refdata = refdata();
    let noe = trade_lines(&refdata, 1, 72).remove(0);
    let broker = sign::claimed_sender(&noe).expect("a sender").to_owned();

    // A valid key but no client certificate: SOAP and FIX are refused at the handshake.
    let refused = zeep(&engine, std::slice::from_ref(&noe), &[&pki.ca]);
    assert!(refused.is_err(), "{refused:?}");
    let dir = tempfile::tempdir().expect("a temporary folder");
    let scenario = dir.path().join("scenario.json");
    std::fs::write(
        &scenario,
        serde_json::to_vec(&serde_json::json!({
            "host": "127.0.0.1",
            "port": engine.fix.port(),
            "participant": broker,
            "key_hex": key_hex(&refdata, &broker),
            "mode": "trade",
            "messages": [fix_pairs(&noe)],
            "tls": {"ca": pki.ca},
        }))
        .expect("JSON"),
    )
    .expect("writes");
    let output = Command::new(python())
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/clients/fix_simplefix.py"
        ))
        .arg(&scenario)
        .output()
        .expect("python3 runs");
    assert!(
        !output.status.success(),
        "a FIX session without a certificate"
    );

    // With the client certificate: accepted.
    let answers = zeep(
        &engine,
        std::slice::from_ref(&noe),
        &[&pki.ca, &pki.client_cert, &pki.client_key],
    )
    .expect("zeep with a client certificate");
    assert_eq!(answers, vec!["ACCEPTED"]);
    let result = simplefix(
        &engine,
        serde_json::json!({
            "participant": everyone(&refdata)
                .into_iter()
                .find(|bic| *bic == broker)
                .expect("the broker"),
            "key_hex": key_hex(&refdata, &broker),
            "mode": "trade",
            "messages": [],
            "tls": {"ca": pki.ca, "cert": pki.client_cert, "key": pki.client_key},
        }),
    );
    assert!(result["logout_text"].is_null(), "{result}");
    // And the framed-XML client: refused without the certificate, logged on with it.
    assert!(framed_tls(&engine, &broker, "localhost", pki.client(false)).is_err());
    assert!(framed_tls(&engine, &broker, "localhost", pki.client(true)).is_ok());
    assert!(engine.stop().success());
}

#[test]
fn a_node_off_loopback_needs_tls_or_an_explicit_plaintext() {
    let keys = common::keys_file();
    let output = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args([
            "--tcp",
            "0.0.0.0:0",
            "--http",
            "127.0.0.1:0",
            "--fix",
            "127.0.0.1:0",
        ])
        .args(["--store", "memory", "--sample-ms", "0"])
        .arg("--keys")
        .arg(keys)
        .output()
        .expect("the engine runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--plaintext"), "{stderr}");
    // And throw-away keys are for loopback only.
    let output = Command::new(env!("CARGO_BIN_EXE_engine"))
        .args([
            "--tcp",
            "0.0.0.0:0",
            "--http",
            "127.0.0.1:0",
            "--fix",
            "127.0.0.1:0",
        ])
        .args(["--store", "memory", "--throwaway-keys", "--plaintext"])
        .output()
        .expect("the engine runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("loopback"), "{stderr}");
}

#[test]
fn the_listener_and_its_own_clients_agree_on_a_post_quantum_hybrid_key_exchange() {
    // Traffic recorded today must not be readable by whoever breaks X25519 later: two STE
    // ends offer X25519MLKEM768 first, and a client that lacks it (zeep, simplefix) still
    // gets X25519, as the test above shows.
    let pki = Pki::new();
    let acceptor = ste_bridge::tls::acceptor(&ste_bridge::tls::TlsFiles {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: Some(pki.ca.clone()),
    })
    .expect("the listener's TLS");
    let connector = ste_bridge::tls::connector(&pki.client(true)).expect("the client's TLS");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("a runtime");
    let (server_group, client_group) = runtime.block_on(async {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("a name");
        let (server, client) = tokio::join!(acceptor.0.accept(far), connector.connect(name, near));
        let group = |group: Option<&'static dyn rustls::crypto::SupportedKxGroup>| {
            group.map(|group| group.name())
        };
        (
            group(
                server
                    .expect("the server's handshake")
                    .get_ref()
                    .1
                    .negotiated_key_exchange_group(),
            ),
            group(
                client
                    .expect("the client's handshake")
                    .get_ref()
                    .1
                    .negotiated_key_exchange_group(),
            ),
        )
    });
    assert_eq!(server_group, Some(rustls::NamedGroup::X25519MLKEM768));
    assert_eq!(client_group, server_group);
}
