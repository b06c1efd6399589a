//! The `engine` binary over SOAP/HTTP: zeep (a third-party SOAP client that builds itself from
//! the served WSDL) on both SOAP versions, MTOM/XOP, keep-alive, a trade whose messages come over
//! two protocols, and hostile requests.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{connect_as, everyone, key_hex, message, python, refdata, trade_lines, Engine};
use ste_bridge::frame::{Frame, PushClass};
use ste_bridge::soap::{BRIDGE_NS, SOAP11_NS, SOAP12_NS};
use ste_engine::refdata::RefData;
use ste_engine::sign;

/// One HTTP/1.1 exchange on a kept-alive connection: status, headers (lower-case names), body.
struct Http {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Http {
    fn connect(address: SocketAddr) -> Http {
        let stream = TcpStream::connect(address).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        Http {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        }
    }

    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &[u8],
    ) -> (u16, Vec<(String, String)>, String) {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nSOAPAction: \"{BRIDGE_NS}#Submit\"\r\n\r\n",
            body.len()
        );
        self.writer.write_all(head.as_bytes()).expect("writes");
        self.writer.write_all(body).expect("writes");
        self.read_response()
    }

    fn read_response(&mut self) -> (u16, Vec<(String, String)>, String) {
        let mut status_line = String::new();
        self.reader
            .read_line(&mut status_line)
            .expect("a status line");
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).expect("a header");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').expect("name: value");
            headers.push((name.to_ascii_lowercase(), value.trim().to_owned()));
        }
        let length: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .map(|(_, v)| v.parse().expect("a length"))
            .unwrap_or(0);
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("the body");
        (status, headers, String::from_utf8(body).expect("UTF-8"))
    }
}

fn soap_envelope(ns: &str, signer: &str, signature: &[u8], message_element: &str) -> String {
    format!(
        "<?xml version=\"1.0\"?><s:Envelope xmlns:s=\"{ns}\" xmlns:b=\"{BRIDGE_NS}\"><s:Header><b:Auth><b:Participant>{signer}</b:Participant><b:Signature>{}</b:Signature></b:Auth></s:Header><s:Body><b:Submit>{message_element}</b:Submit></s:Body></s:Envelope>",
        hex::encode(signature)
    )
}

/// A SOAP 1.1 request with the message inline (base64), signed by the line's sender.
fn inline_request(refdata: &RefData, line: &[u8]) -> Vec<u8> {
    let signer = sign::claimed_sender(line).expect("a sender");
    let key = refdata.participant_mac(signer).expect("a participant").1;
    let element = format!(
        "<b:Message>{}</b:Message>",
        base64::engine::general_purpose::STANDARD.encode(line)
    );
    soap_envelope(SOAP11_NS, signer, &sign::sign_keyed(key, line), &element).into_bytes()
}

/// A SOAP 1.2 MTOM/XOP request: the message bytes travel as a binary attachment.
fn mtom_request(refdata: &RefData, line: &[u8]) -> (String, Vec<u8>) {
    let signer = sign::claimed_sender(line).expect("a sender");
    let key = refdata.participant_mac(signer).expect("a participant").1;
    let element = "<b:Message><xop:Include xmlns:xop=\"http://www.w3.org/2004/08/xop/include\" href=\"cid:message%40ste\"/></b:Message>";
    let root = soap_envelope(SOAP12_NS, signer, &sign::sign_keyed(key, line), element);
    let boundary = "MIMEBoundary_ste_7f3a";
    let mut body = Vec::new();
    write!(
        body,
        "--{boundary}\r\nContent-Type: application/xop+xml; charset=UTF-8; type=\"application/soap+xml\"\r\nContent-Transfer-Encoding: 8bit\r\nContent-ID: <root@ste>\r\n\r\n{root}\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\nContent-Transfer-Encoding: binary\r\nContent-ID: <message@ste>\r\n\r\n"
    )
    .expect("writes");
    body.extend_from_slice(line);
    write!(body, "\r\n--{boundary}--\r\n").expect("writes");
    let content_type = format!(
        "multipart/related; type=\"application/xop+xml\"; start=\"<root@ste>\"; start-info=\"application/soap+xml\"; boundary=\"{boundary}\""
    );
    (content_type, body)
}

/// Reads pushed CLS on a subscribed connection until `count` distinct ones have come.
fn await_cls(reader: &mut ste_bridge::client::FrameReader, count: usize) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    while ids.len() < count {
        match reader.next_frame().expect("reads").expect("open") {
            Frame::Push {
                class: PushClass::Cls,
                xml,
            } => {
                let text = String::from_utf8(xml).expect("UTF-8");
                let start = text.find("<ClsId>").expect("ClsId") + 7;
                let end = start + text[start..].find("</ClsId>").expect("closed");
                ids.insert(text[start..end].to_owned());
            }
            Frame::Ack { .. } | Frame::Nak { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    ids
}

#[test]
fn zeep_builds_a_client_from_the_wsdl_and_submits_over_both_soap_versions() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (_subscriber_writer, mut subscriber) = connect_as(&engine, &refdata, &bic_refs, true);
    let lines = trade_lines(&refdata, 2, 31);
    let entry = |line: &[u8], signer: &str, forge: bool| {
        serde_json::json!({
            "signer": signer,
            "key_hex": key_hex(&refdata, signer),
            "xml": String::from_utf8(line.to_vec()).expect("UTF-8"),
            "forge": forge,
        })
    };
    let wsdl = format!("http://{}/soap?wsdl", engine.http);
    let dir = tempfile::tempdir().expect("a temporary folder");
    for (binding, trade) in [("STESoap11", &lines[..7]), ("STESoap12", &lines[7..])] {
        let mut batch: Vec<serde_json::Value> = trade
            .iter()
            .map(|line| entry(line, sign::claimed_sender(line).expect("a sender"), false))
            .collect();
        // A forged signature, and a message of the trade's broker signed (validly) by its
        // investment manager, who may not send as the broker.
        let noe = &trade[0];
        let broker = sign::claimed_sender(noe).expect("a sender").to_owned();
        let inv_mgr = trade
            .iter()
            .filter_map(|l| sign::claimed_sender(l))
            .find(|s| *s != broker)
            .expect("another participant")
            .to_owned();
        batch.push(entry(noe, &broker, true));
        batch.push(entry(noe, &inv_mgr, false));
        let path = dir.path().join(format!("{binding}.json"));
        std::fs::write(&path, serde_json::to_vec(&batch).expect("JSON")).expect("writes");
        let output = Command::new(python())
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/clients/soap_zeep.py"
            ))
            .arg(&wsdl)
            .arg(binding)
            .arg(&path)
            .output()
            .expect(
                "python3 runs (with zeep: pip install -r bridge/tests/clients/requirements.txt)",
            );
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let answers: Vec<String> = serde_json::from_slice(&output.stdout).expect("JSON");
        assert_eq!(answers.len(), 9, "{answers:?}");
        assert!(
            answers[..7].iter().all(|a| a == "ACCEPTED"),
            "{binding}: {answers:?}"
        );
        assert!(
            answers[7].starts_with("FAULT E_SIG"),
            "{binding}: {answers:?}"
        );
        assert!(
            answers[8].starts_with("FAULT E_AUTH"),
            "{binding}: {answers:?}"
        );
    }
    // Both trades matched: their CLS are pushed to the subscriber.
    assert_eq!(await_cls(&mut subscriber, 2).len(), 2);
    assert!(engine.stop().success());
}

#[test]
fn wsdl_mtom_keep_alive_and_a_trade_over_two_protocols() {
    let engine = Engine::start(&[]);
    let refdata = refdata();
    let mut http = Http::connect(engine.http);

    let (status, headers, wsdl) = http.exchange("GET", "/soap?wsdl", "text/plain", b"");
    assert_eq!(status, 200);
    assert!(headers
        .iter()
        .any(|(n, v)| n == "content-type" && v.starts_with("text/xml")));
    assert!(wsdl.contains("<definitions") && wsdl.contains("xsd:base64Binary"));
    assert!(
        wsdl.contains("<xsd:element name=\"Msg\">") && wsdl.contains("name=\"SettleAmount\""),
        "the WSDL's XSD describes the carried message too"
    );
    assert!(wsdl.contains("location=\"http://localhost/soap\""));

    // A trade: NOE and NPRs over framed XML, ALCs inline over SOAP 1.1, SETs by MTOM over SOAP
    // 1.2 — all on one kept-alive HTTP connection — and the CLS pushed over framed XML.
    let bics = everyone(&refdata);
    let bic_refs: Vec<&str> = bics.iter().map(String::as_str).collect();
    let (mut writer, mut reader) = connect_as(&engine, &refdata, &bic_refs, true);
    let lines = trade_lines(&refdata, 1, 41);
    let kind = |line: &[u8]| {
        let text = std::str::from_utf8(line).expect("UTF-8");
        let start = text.find("<Type>").expect("Type") + 6;
        text[start..start + 3].to_owned()
    };
    let mut framed = 0;
    for line in &lines {
        match kind(line).as_str() {
            "ALC" => {
                let (status, _, body) = http.exchange(
                    "POST",
                    "/soap",
                    "text/xml; charset=utf-8",
                    &inline_request(&refdata, line),
                );
                assert_eq!(status, 200, "{body}");
                assert!(body.contains("<ste:Status>ACCEPTED</ste:Status>"), "{body}");
            }
            "SET" => {
                let (content_type, request) = mtom_request(&refdata, line);
                let (status, headers, body) =
                    http.exchange("POST", "/soap", &content_type, &request);
                assert_eq!(status, 200, "{body}");
                assert!(body.contains(SOAP12_NS), "answered in SOAP 1.2: {body}");
                assert!(headers
                    .iter()
                    .any(|(n, v)| n == "content-type" && v.starts_with("application/soap+xml")));
            }
            _ => {
                writer
                    .send(&message(&refdata, framed, line.clone()))
                    .expect("sends");
                framed += 1;
            }
        }
    }
    writer.flush().expect("flushes");
    assert_eq!(framed, 3, "NOE and two NPRs over framed XML");
    assert_eq!(await_cls(&mut reader, 1).len(), 1);

    // The same ALC again: a duplicate.
    let alc = lines.iter().find(|l| kind(l) == "ALC").expect("an ALC");
    let (status, _, body) = http.exchange(
        "POST",
        "/soap",
        "text/xml; charset=utf-8",
        &inline_request(&refdata, alc),
    );
    assert_eq!(status, 200);
    assert!(body.contains("DUPLICATE"), "{body}");

    // HTTP/1.1 pipelining: two requests sent before either answer is read.
    let request = inline_request(&refdata, alc);
    let head = format!(
        "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nContent-Length: {}\r\n\r\n",
        request.len()
    );
    let mut both = Vec::new();
    for _ in 0..2 {
        both.extend_from_slice(head.as_bytes());
        both.extend_from_slice(&request);
    }
    http.writer.write_all(&both).expect("writes");
    for _ in 0..2 {
        let (status, _, body) = http.read_response();
        assert_eq!(status, 200);
        assert!(body.contains("DUPLICATE"), "{body}");
    }
    assert!(engine.stop().success());
}

#[test]
fn hostile_requests_get_their_refusal_and_other_connections_keep_working() {
    let engine = Engine::start(&["--frame-timeout-ms", "1500"]);
    let refdata = refdata();
    let lines = trade_lines(&refdata, 1, 51);

    // A 10 MiB body: refused from its Content-Length, before it is read.
    {
        let mut http = Http::connect(engine.http);
        let head = format!(
            "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nContent-Length: {}\r\n\r\n",
            10 * 1024 * 1024
        );
        http.writer.write_all(head.as_bytes()).expect("writes");
        let (status, _, body) = http.read_response();
        assert_eq!(status, 413);
        assert!(body.contains("E_SIZE"), "{body}");
    }
    // A 10 MiB chunked body (no length announced): cut off at the limit.
    {
        let mut http = Http::connect(engine.http);
        http.writer
            .write_all(b"POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nTransfer-Encoding: chunked\r\n\r\n")
            .expect("writes");
        let chunk = vec![b'a'; 64 * 1024];
        for _ in 0..160 {
            let head = format!("{:x}\r\n", chunk.len());
            if http.writer.write_all(head.as_bytes()).is_err()
                || http.writer.write_all(&chunk).is_err()
                || http.writer.write_all(b"\r\n").is_err()
            {
                break;
            }
        }
        let (status, _, body) = http.read_response();
        assert_eq!(status, 413);
        assert!(body.contains("E_SIZE"), "{body}");
    }
    // Meanwhile, slow clients: half a request line then silence (closed by the header
    // timeout), and a body that trickles (answered 408 by the body timeout).
    let http_address = engine.http;
    let slowloris = std::thread::spawn(move || {
        let mut stream = TcpStream::connect(http_address).expect("connects");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        stream.write_all(b"POST /soap HTT").expect("writes");
        let started = Instant::now();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
        started.elapsed()
    });
    let trickle = std::thread::spawn(move || {
        let mut http = Http::connect(http_address);
        http.writer
            .write_all(b"POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nContent-Length: 1000\r\n\r\n<s:Env")
            .expect("writes");
        http.read_response().0
    });
    let mut good = Http::connect(engine.http);
    // A billion-laughs DOCTYPE: a Fault E_PARSE, nothing expanded.
    let laughs = format!(
        "<?xml version=\"1.0\"?><!DOCTYPE lolz [<!ENTITY lol \"lol\"><!ENTITY lol2 \"&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;\"><!ENTITY lol3 \"&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;\">]><s:Envelope xmlns:s=\"{SOAP11_NS}\"><s:Body>&lol3;</s:Body></s:Envelope>"
    );
    let (status, _, body) = good.exchange("POST", "/soap", "text/xml", laughs.as_bytes());
    assert_eq!(status, 500);
    assert!(body.contains("<ste:Code>E_PARSE</ste:Code>"), "{body}");
    assert!(!body.contains("lollol"));
    // A forged signature: E_SIG.
    let noe = &lines[0];
    let broker = sign::claimed_sender(noe).expect("a sender");
    let forged = soap_envelope(
        SOAP11_NS,
        broker,
        &[0x5a; 32],
        &format!(
            "<b:Message>{}</b:Message>",
            base64::engine::general_purpose::STANDARD.encode(noe)
        ),
    );
    let (status, _, body) = good.exchange("POST", "/soap", "text/xml", forged.as_bytes());
    assert_eq!(status, 500);
    assert!(body.contains("<faultstring>E_SIG"), "{body}");
    // Sent as another participant (signed by an investment manager, Sender the broker): E_AUTH.
    let other = lines
        .iter()
        .filter_map(|l| sign::claimed_sender(l))
        .find(|s| *s != broker)
        .expect("another participant");
    let key = refdata.participant_mac(other).expect("a participant").1;
    let impersonating = soap_envelope(
        SOAP12_NS,
        other,
        &sign::sign_keyed(key, noe),
        &format!(
            "<b:Message>{}</b:Message>",
            base64::engine::general_purpose::STANDARD.encode(noe)
        ),
    );
    let (status, _, body) = good.exchange(
        "POST",
        "/soap",
        "application/soap+xml",
        impersonating.as_bytes(),
    );
    assert_eq!(status, 400, "a SOAP 1.2 Sender fault");
    assert!(
        body.contains("<soap:Value>soap:Sender</soap:Value>"),
        "{body}"
    );
    assert!(body.contains("E_AUTH"), "{body}");
    // No signature at all: E_SIG.
    let unsigned = format!(
        "<s:Envelope xmlns:s=\"{SOAP11_NS}\" xmlns:b=\"{BRIDGE_NS}\"><s:Body><b:Submit><b:Message>{}</b:Message></b:Submit></s:Body></s:Envelope>",
        base64::engine::general_purpose::STANDARD.encode(noe)
    );
    let (_, _, body) = good.exchange("POST", "/soap", "text/xml", unsigned.as_bytes());
    assert!(body.contains("<ste:Code>E_SIG</ste:Code>"), "{body}");

    let slow = slowloris.join().expect("the slowloris thread");
    assert!(
        slow >= Duration::from_millis(1000) && slow < Duration::from_secs(5),
        "closed by the header timeout ({slow:?})"
    );
    assert_eq!(trickle.join().expect("the trickle thread"), 408);
    // The well-behaved connection still submits: the genuine NOE is accepted.
    let (status, _, body) =
        good.exchange("POST", "/soap", "text/xml", &inline_request(&refdata, noe));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("ACCEPTED"));
    assert!(engine.stop().success());
}

/// More connections than allowed get 503 and are closed.
#[test]
fn soap_connections_are_bounded() {
    let engine = Engine::start(&["--max-connections", "2"]);
    let mut first = Http::connect(engine.http);
    let mut second = Http::connect(engine.http);
    for http in [&mut first, &mut second] {
        let (status, _, _) = http.exchange("GET", "/soap?wsdl", "text/plain", b"");
        assert_eq!(status, 200);
    }
    let mut third = Http::connect(engine.http);
    let (status, _, _) = third.read_response();
    assert_eq!(status, 503);
    // The two admitted connections are still served.
    let (status, _, _) = first.exchange("GET", "/soap?wsdl", "text/plain", b"");
    assert_eq!(status, 200);
    assert!(engine.stop().success());
}
