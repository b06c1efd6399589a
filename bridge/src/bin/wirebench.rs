//! `wirebench`: what each wire format costs, in the spirit of Kohlhoff and Steele (2003).
//!
//! For the same generated messages in framed XML, SOAP 1.1 (inline base64), SOAP 1.2 with
//! MTOM/XOP and FIX 4.4: the mean size of a request on the wire, and the encode and decode
//! cost per message on one core — encode from the canonical message to the signed wire bytes,
//! decode from the wire bytes to what the validator takes (sender, canonical bytes,
//! signature; for FIX that includes checking its signature, mapping back to the canonical XML
//! and signing that). Then the end-to-end rate through the bridge on loopback: an in-process
//! engine (memory store) behind the real listeners, each protocol on a fresh one.
//!
//! `cargo run --release -p ste-bridge --bin wirebench -- [--messages N] [--trades T]`

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use base64::Engine as _;
use ste_bridge::bench::arg;
use ste_bridge::fix;
use ste_bridge::frame::Frame;
use ste_bridge::gateway::{Gateway, GatewayConfig};
use ste_bridge::soap::{self, BRIDGE_NS, SOAP11_NS, SOAP12_NS};
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::{PipelineConfig, StoreConfig};
use ste_engine::profile::{MatchingProfile, Tolerances};
use ste_engine::refdata::RefData;
use ste_engine::sign;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const MTOM_BOUNDARY: &str = "MIMEBoundary_ste_7f3a";

/// One message as each format carries it.
struct Wire {
    framed: Vec<u8>,
    soap: Vec<u8>,
    mtom: Vec<u8>,
    fix: Vec<u8>,
}

fn sender_of(line: &[u8]) -> &str {
    sign::claimed_sender(line).unwrap_or("")
}

fn encode_framed(refdata: &RefData, seq: u64, line: &[u8]) -> Vec<u8> {
    let sender = sender_of(line);
    let key = refdata.participant_mac(sender).expect("a participant").1;
    Frame::Message {
        seq,
        sender: sender.to_owned(),
        signature: sign::sign_keyed(key, line),
        xml: line.to_vec(),
    }
    .encode()
}

fn soap_envelope(ns: &str, signer: &str, signature: &[u8], message_element: &str) -> String {
    format!(
        "<?xml version=\"1.0\" encoding=\"utf-8\"?><soap:Envelope xmlns:soap=\"{ns}\" xmlns:ste=\"{BRIDGE_NS}\"><soap:Header><ste:Auth><ste:Participant>{signer}</ste:Participant><ste:Signature>{}</ste:Signature></ste:Auth></soap:Header><soap:Body><ste:Submit>{message_element}</ste:Submit></soap:Body></soap:Envelope>",
        hex::encode(signature)
    )
}

fn encode_soap(refdata: &RefData, line: &[u8]) -> Vec<u8> {
    let sender = sender_of(line);
    let key = refdata.participant_mac(sender).expect("a participant").1;
    let element = format!(
        "<ste:Message>{}</ste:Message>",
        base64::engine::general_purpose::STANDARD.encode(line)
    );
    soap_envelope(SOAP11_NS, sender, &sign::sign_keyed(key, line), &element).into_bytes()
}

fn encode_mtom(refdata: &RefData, line: &[u8]) -> Vec<u8> {
    let sender = sender_of(line);
    let key = refdata.participant_mac(sender).expect("a participant").1;
    let element = "<ste:Message><xop:Include xmlns:xop=\"http://www.w3.org/2004/08/xop/include\" href=\"cid:message%40ste\"/></ste:Message>";
    let root = soap_envelope(SOAP12_NS, sender, &sign::sign_keyed(key, line), element);
    let mut body = Vec::with_capacity(root.len() + line.len() + 400);
    body.extend_from_slice(
        format!(
            "--{MTOM_BOUNDARY}\r\nContent-Type: application/xop+xml; charset=UTF-8; type=\"application/soap+xml\"\r\nContent-ID: <root@ste>\r\n\r\n{root}\r\n--{MTOM_BOUNDARY}\r\nContent-Type: application/octet-stream\r\nContent-Transfer-Encoding: binary\r\nContent-ID: <message@ste>\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(line);
    body.extend_from_slice(format!("\r\n--{MTOM_BOUNDARY}--\r\n").as_bytes());
    body
}

fn mtom_content_type() -> String {
    format!(
        "multipart/related; type=\"application/xop+xml\"; start=\"<root@ste>\"; start-info=\"application/soap+xml\"; boundary=\"{MTOM_BOUNDARY}\""
    )
}

/// A FIX application message for `line`, with the session header of MsgSeqNum `seq`.
fn encode_fix(refdata: &RefData, seq: u64, line: &[u8]) -> Vec<u8> {
    let sender = sender_of(line);
    let key = refdata.participant_mac(sender).expect("a participant").1;
    let mut pairs = fix::to_fix(line).expect("maps to FIX");
    let msg_type = pairs.remove(0);
    let mut fields = vec![
        msg_type,
        (49, sender.to_owned()),
        (56, fix::ENGINE_COMP_ID.to_owned()),
        (34, seq.to_string()),
        (52, "20261130-12:00:00.000".to_owned()),
    ];
    fields.extend(pairs);
    let mut covered = Vec::with_capacity(512);
    for (tag, value) in &fields {
        covered.extend_from_slice(format!("{tag}={value}\u{1}").as_bytes());
    }
    let signature = hex::encode(sign::sign_keyed(key, &covered));
    fields.push((93, signature.len().to_string()));
    fields.push((89, signature));
    fix::encode(&fields)
}

/// Decodes as the framed-XML listener does.
fn decode_framed(bytes: &[u8]) -> (String, Vec<u8>, [u8; 32]) {
    match Frame::decode(&bytes[4..]).expect("a frame") {
        Frame::Message {
            sender,
            signature,
            xml,
            ..
        } => (sender, xml, signature),
        other => panic!("not a message: {other:?}"),
    }
}

/// Decodes as the SOAP listener does (inline).
fn decode_soap(bytes: &[u8]) -> (String, Vec<u8>, [u8; 32]) {
    let request = soap::parse_envelope(bytes, &HashMap::new()).expect("an envelope");
    (
        request.participant.unwrap_or_default(),
        request.message,
        request.signature.unwrap_or([0; 32]),
    )
}

/// Decodes as the FIX listener does: parse, check the FIX signature, map back, sign.
fn decode_fix(refdata: &RefData, bytes: &[u8]) -> (String, Vec<u8>, [u8; 32]) {
    let message = fix::parse(bytes).expect("a FIX message");
    let sender = message.get(49).unwrap_or("").to_owned();
    let key = refdata.participant_mac(&sender).expect("a participant").1;
    let signature = hex::decode(message.get(89).unwrap_or("")).unwrap_or_default();
    let covered = fix::signed_part(bytes).expect("a well-formed signed message");
    assert!(
        sign::verify_keyed(key, covered, &signature),
        "FIX signature"
    );
    let xml = fix::from_fix(&message, &sender).expect("maps back");
    let signature = sign::sign_keyed(key, &xml);
    (sender, xml, signature)
}

/// Mean ns per call over `items`, best of three passes.
fn time_per<T>(items: &[T], mut f: impl FnMut(&T)) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let started = Instant::now();
        for item in items {
            f(item);
        }
        best = best.min(started.elapsed().as_nanos() as f64 / items.len() as f64);
    }
    best
}

struct Node {
    runtime: tokio::runtime::Runtime,
    gateway: Option<Gateway>,
    stop: tokio::sync::watch::Sender<bool>,
    tcp: SocketAddr,
    http: SocketAddr,
    fix: SocketAddr,
}

impl Node {
    fn start(refdata: Arc<RefData>) -> anyhow::Result<Node> {
        let config = GatewayConfig {
            pipeline: PipelineConfig {
                store: StoreConfig::Memory,
                sample_interval: Duration::ZERO,
                ..PipelineConfig::default()
            },
            tolerances: Tolerances::from_profile(&MatchingProfile::default())?,
            cls_out: None,
            ingress_capacity: 16_384,
            participant_rate: ste_bridge::gateway::PARTICIPANT_RATE_DEFAULT,
        };
        let gateway = Gateway::start(&config, refdata)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let bind = |runtime: &tokio::runtime::Runtime| {
            runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        };
        let (tcp_l, http_l, fix_l) = (bind(&runtime)?, bind(&runtime)?, bind(&runtime)?);
        let (tcp, http, fix) = (
            tcp_l.local_addr()?,
            http_l.local_addr()?,
            fix_l.local_addr()?,
        );
        let handle = gateway.handle();
        runtime.spawn(ste_bridge::tcp::serve(
            tcp_l,
            handle.clone(),
            ste_bridge::tcp::TcpConfig::default(),
            stopped.clone(),
        ));
        runtime.spawn(soap::serve(
            http_l,
            handle.clone(),
            soap::SoapConfig::default(),
            stopped.clone(),
        ));
        runtime.spawn(fix::serve(
            fix_l,
            handle,
            fix::FixConfig::default(),
            stopped,
        ));
        Ok(Node {
            runtime,
            gateway: Some(gateway),
            stop,
            tcp,
            http,
            fix,
        })
    }

    fn finish(mut self) {
        let _ = self.stop.send(true);
        std::thread::sleep(Duration::from_millis(200));
        if let Some(gateway) = self.gateway.take() {
            let _ = gateway.finish();
        }
        self.runtime.shutdown_timeout(Duration::from_secs(5));
    }
}

/// Framed XML: one connection logged on as every participant, 4,096 in flight.
fn run_framed(node: &Node, refdata: &RefData, lines: &[Vec<u8>]) -> anyhow::Result<f64> {
    let participants: Vec<String> = refdata
        .participants()
        .iter()
        .map(|p| p.bic.clone())
        .collect();
    let logons: Vec<ste_bridge::client::Logon<'_>> = participants
        .iter()
        .map(|bic| ste_bridge::client::Logon {
            participant: bic,
            key: refdata.participant_mac(bic).expect("a participant").1,
            subscribe: false,
        })
        .collect();
    let (mut writer, mut reader) = ste_bridge::client::connect(node.tcp, &logons)?;
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let total = lines.len() as u64;
    let counter = answered.clone();
    let reading = std::thread::spawn(move || {
        while counter.load(std::sync::atomic::Ordering::Relaxed) < total {
            match reader.next_frame() {
                Ok(Some(Frame::Ack { .. } | Frame::Nak { .. })) => {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                Ok(Some(_)) => {}
                _ => break,
            }
        }
    });
    let started = Instant::now();
    for (seq, line) in lines.iter().enumerate() {
        while seq as u64 - answered.load(std::sync::atomic::Ordering::Relaxed) >= 4096 {
            writer.flush()?;
            std::thread::sleep(Duration::from_micros(50));
        }
        let sender = sender_of(line);
        let key = refdata.participant_mac(sender).context("a participant")?.1;
        writer.send(&Frame::Message {
            seq: seq as u64,
            sender: sender.to_owned(),
            signature: sign::sign_keyed(key, line),
            xml: line.clone(),
        })?;
    }
    writer.flush()?;
    reading
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

/// SOAP: `connections` kept-alive connections, one request at a time each.
fn run_soap(
    node: &Node,
    refdata: &RefData,
    lines: &[Vec<u8>],
    mtom: bool,
    connections: usize,
) -> anyhow::Result<f64> {
    let queue: Arc<Mutex<VecDeque<Vec<u8>>>> = Arc::new(Mutex::new(
        lines
            .iter()
            .map(|l| {
                if mtom {
                    encode_mtom(refdata, l)
                } else {
                    encode_soap(refdata, l)
                }
            })
            .collect(),
    ));
    let content_type = if mtom {
        mtom_content_type()
    } else {
        "text/xml; charset=utf-8".to_owned()
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..connections)
        .map(|_| {
            let (queue, content_type, address) = (queue.clone(), content_type.clone(), node.http);
            std::thread::spawn(move || -> anyhow::Result<()> {
                let stream = TcpStream::connect(address)?;
                stream.set_nodelay(true)?;
                let mut reader = BufReader::new(stream.try_clone()?);
                let mut writer = stream;
                loop {
                    let Some(body) = queue.lock().unwrap_or_else(PoisonError::into_inner).pop_front() else {
                        return Ok(());
                    };
                    let mut request = format!(
                        "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    request.extend_from_slice(&body);
                    writer.write_all(&request)?;
                    let mut length = 0;
                    loop {
                        let mut line = String::new();
                        reader.read_line(&mut line)?;
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = value.trim().parse()?;
                        }
                    }
                    let mut answer = vec![0; length];
                    reader.read_exact(&mut answer)?;
                }
            })
        })
        .collect();
    join_all(workers)?;
    Ok(lines.len() as f64 / started.elapsed().as_secs_f64())
}

/// Waits for every client thread; the first failure is the run's.
fn join_all(workers: Vec<std::thread::JoinHandle<anyhow::Result<()>>>) -> anyhow::Result<()> {
    for worker in workers {
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("a worker panicked"))??;
    }
    Ok(())
}

/// One participant's messages, for one FIX session.
type SessionLoad = (String, Vec<Vec<u8>>);

/// FIX: a session per participant, `concurrent` sessions at a time, each pipelining its
/// messages and then reading its answers.
fn run_fix(
    node: &Node,
    refdata: &Arc<RefData>,
    lines: &[Vec<u8>],
    concurrent: usize,
) -> anyhow::Result<f64> {
    let mut by_sender: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for line in lines {
        by_sender
            .entry(sender_of(line).to_owned())
            .or_default()
            .push(line.clone());
    }
    let sessions: Arc<Mutex<Vec<SessionLoad>>> =
        Arc::new(Mutex::new(by_sender.into_iter().collect()));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrent)
        .map(|_| {
            let (sessions, refdata, address) = (sessions.clone(), refdata.clone(), node.fix);
            std::thread::spawn(move || -> anyhow::Result<()> {
                loop {
                    let Some((participant, messages)) = sessions
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .pop()
                    else {
                        return Ok(());
                    };
                    let mut stream = TcpStream::connect(address)?;
                    stream.set_nodelay(true)?;
                    let key = refdata
                        .participant_mac(&participant)
                        .context("a participant")?
                        .1;
                    let sending_time = fix::utc_timestamp();
                    let password = fix::logon_password(key, &sending_time, &participant);
                    let mut out = fix::encode(&[
                        (35, "A".into()),
                        (49, participant.clone()),
                        (56, "STE".into()),
                        (34, "1".into()),
                        (52, sending_time),
                        (98, "0".into()),
                        (108, "30".into()),
                        (141, "Y".into()),
                        (554, password),
                    ]);
                    for (index, line) in messages.iter().enumerate() {
                        out.extend_from_slice(&encode_fix(&refdata, index as u64 + 2, line));
                    }
                    stream.write_all(&out)?;
                    // The Logon answer, then one answer per message.
                    let mut expected = messages.len() + 1;
                    let mut buffer = Vec::new();
                    let mut chunk = [0_u8; 65536];
                    while expected > 0 {
                        let n = stream.read(&mut chunk)?;
                        anyhow::ensure!(n > 0, "the engine closed a FIX session");
                        buffer.extend_from_slice(&chunk[..n]);
                        while let Some(end) = sign::find(&buffer, b"\x0110=").map(|at| at + 8) {
                            if buffer.len() < end {
                                break;
                            }
                            let raw: Vec<u8> = buffer.drain(..end).collect();
                            let message = fix::parse(&raw)?;
                            if matches!(message.msg_type(), "A" | "AR" | "P" | "AU") {
                                expected -= 1;
                            }
                        }
                    }
                }
            })
        })
        .collect();
    join_all(workers)?;
    Ok(lines.len() as f64 / started.elapsed().as_secs_f64())
}

fn main() -> anyhow::Result<()> {
    let messages = arg("--messages", 20_000) as usize;
    let trades = arg("--trades", 20_000);
    let refdata = Arc::new(RefData::embedded()?.with_generated_keys());
    let lines: Vec<Vec<u8>> = Generator::new(
        &refdata,
        GeneratorConfig::clean((messages as u64).div_ceil(7)),
    )
    .take(messages)
    .collect();
    eprintln!("encoding {} messages in each format", lines.len());
    let wires: Vec<Wire> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| Wire {
            framed: encode_framed(&refdata, i as u64, l),
            soap: encode_soap(&refdata, l),
            mtom: encode_mtom(&refdata, l),
            fix: encode_fix(&refdata, i as u64 + 2, l),
        })
        .collect();
    let mean =
        |f: fn(&Wire) -> usize| wires.iter().map(f).sum::<usize>() as f64 / wires.len() as f64;
    let canonical = lines.iter().map(Vec::len).sum::<usize>() as f64 / lines.len() as f64;
    // SOAP travels with its HTTP request headers, as the bench's client sends them.
    let http_head = |content_type: &str, length: usize| {
        format!(
            "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
        )
        .len()
    };
    let mtom_type = mtom_content_type();
    let sizes = [
        mean(|w| w.framed.len()),
        wires
            .iter()
            .map(|w| w.soap.len() + http_head("text/xml; charset=utf-8", w.soap.len()))
            .sum::<usize>() as f64
            / wires.len() as f64,
        wires
            .iter()
            .map(|w| w.mtom.len() + http_head(&mtom_type, w.mtom.len()))
            .sum::<usize>() as f64
            / wires.len() as f64,
        mean(|w| w.fix.len()),
    ];
    let encode = [
        time_per(&lines, |l| {
            black_box(encode_framed(&refdata, 1, l));
        }),
        time_per(&lines, |l| {
            black_box(encode_soap(&refdata, l));
        }),
        time_per(&lines, |l| {
            black_box(encode_mtom(&refdata, l));
        }),
        time_per(&lines, |l| {
            black_box(encode_fix(&refdata, 2, l));
        }),
    ];
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let content_type = mtom_content_type();
    let decode = [
        time_per(&wires, |w| {
            black_box(decode_framed(&w.framed));
        }),
        time_per(&wires, |w| {
            black_box(decode_soap(&w.soap));
        }),
        time_per(&wires, |w| {
            let body = bytes::Bytes::from(w.mtom.clone());
            let (root, parts) = runtime
                .block_on(soap::split_multipart(&content_type, body))
                .expect("multipart");
            black_box(soap::parse_envelope(&root, &parts).expect("an envelope"));
        }),
        time_per(&wires, |w| {
            black_box(decode_fix(&refdata, &w.fix));
        }),
    ];

    let e2e_lines: Vec<Vec<u8>> =
        Generator::new(&refdata, GeneratorConfig::clean(trades)).collect();
    eprintln!(
        "end to end: {} messages per protocol through the bridge on loopback",
        e2e_lines.len()
    );
    let mut rates = Vec::new();
    for format in 0..4 {
        let node = Node::start(refdata.clone())?;
        let rate = match format {
            0 => run_framed(&node, &refdata, &e2e_lines)?,
            1 => run_soap(&node, &refdata, &e2e_lines, false, 16)?,
            2 => run_soap(&node, &refdata, &e2e_lines, true, 16)?,
            _ => run_fix(&node, &refdata, &e2e_lines, 16)?,
        };
        node.finish();
        rates.push(rate);
    }

    println!(
        "canonical XML message: {canonical:.0} bytes on average ({} messages)",
        lines.len()
    );
    println!(
        "| format | bytes on the wire per message | vs FIX | encode µs/msg | decode µs/msg | end to end msg/s |"
    );
    println!("|---|---|---|---|---|---|");
    let names = [
        "framed XML (TCP)",
        "SOAP 1.1, base64 inline (HTTP/1.1)",
        "SOAP 1.2, MTOM/XOP (HTTP/1.1)",
        "FIX 4.4 (TCP)",
    ];
    for i in 0..4 {
        println!(
            "| {} | {:.0} | {:.2}× | {:.2} | {:.2} | {:.0} |",
            names[i],
            sizes[i],
            sizes[i] / sizes[3],
            encode[i] / 1000.0,
            decode[i] / 1000.0,
            rates[i]
        );
    }
    Ok(())
}
