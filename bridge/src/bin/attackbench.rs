//! `attackbench`: what hostile clients cost the others, against the `engine` binary on loopback.
//!
//! 1. Slowdown: a framed-XML run of whole trades alone, then while two clients keep posting
//!    namespace-flood SOAP bodies (1 MiB: 25,000 `xmlns` declarations and 157,000 empty
//!    children), alternated; the ratio of the medians.
//! 2. Memory: the engine's resident set before and after each memory attack — 600 frames of a
//!    1 MiB message on one connection, FIX sessions holding large messages past a sequence gap,
//!    1,100 sockets that never log on — and the disk the exceptions of 135 unauthenticated 1 MiB
//!    SOAP requests take.
//! 3. Participants with valid keys against the others, each attack on a fresh node beside a
//!    framed-XML run of whole trades, against the same run alone on a fresh node, alternated:
//!    a chain of 10,000 AMDs of one ALC (stopped at the trade's bound, E_LIMIT); 600,000 NOEs
//!    that never match (stopped at the participant's quota, E_LIMIT), spread over the shards as
//!    routing puts them and again with every TradeRef chosen to route to one shard; FIX logons
//!    of one key, logged on and dropped as fast as it can (stopped at its own bound, E_BUSY,
//!    while another participant still logs on); 671 ResendRequests for the whole of a full FIX resend store
//!    (paid from the session's budget, E_BUSY beyond it); and wrongly signed SOAP requests
//!    (kept within the exception writer's budget). For each: the run's slowdown, what the
//!    attack got, and the node's resident set and disk growth.
//!
//! `cargo build --release -p ste-bridge && target/release/attackbench [--trades 2000] [--rounds 3]
//! [--only TEXT]` (the `engine` binary is taken from beside this one; `--only` runs only the
//! participants' attacks whose name holds TEXT).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ste_bridge::bench::{arg, arg_text, namespace_flood_body, LOOPBACK_LISTENERS};
use ste_bridge::client::{self, Logon};
use ste_bridge::fix;
use ste_bridge::frame::{Frame, PushClass};
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::keys::KeyRing;
use ste_engine::pipeline::sign_line;
use ste_engine::refdata::RefData;

/// A running engine node.
struct Node {
    child: Child,
    tcp: SocketAddr,
    http: SocketAddr,
    fix: SocketAddr,
}

impl Node {
    fn start(data_dir: &Path, keys: &Path, extra: &[&str]) -> anyhow::Result<Node> {
        std::fs::create_dir_all(data_dir)?;
        let engine = std::env::current_exe()?
            .parent()
            .context("a folder")?
            .join("engine");
        let mut child = Command::new(&engine)
            .args(LOOPBACK_LISTENERS)
            .args(["--sample-ms", "0"])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--keys")
            .arg(keys)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(data_dir.with_extension("log"))?)
            .spawn()
            .with_context(|| format!("starting {}", engine.display()))?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?);
        let mut address = |label: &str| -> anyhow::Result<SocketAddr> {
            let mut line = String::new();
            lines.read_line(&mut line)?;
            line.trim()
                .strip_prefix(label)
                .and_then(|rest| rest.trim().parse().ok())
                .with_context(|| format!("expected {label} ADDRESS, got {line:?}"))
        };
        let (tcp, http, fix) = (address("tcp")?, address("http")?, address("fix")?);
        Ok(Node {
            child,
            tcp,
            http,
            fix,
        })
    }

    fn rss_mib(&self) -> f64 {
        ste_bridge::bench::rss_bytes(&self.child.id().to_string()) as f64 / (1024.0 * 1024.0)
    }

    /// MiB the node has written to storage so far (`write_bytes` of /proc/PID/io).
    fn written_mib(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/io", self.child.id()))
            .ok()
            .and_then(|io| {
                io.lines()
                    .find_map(|line| line.strip_prefix("write_bytes:"))
                    .and_then(|value| value.trim().parse::<u64>().ok())
            })
            .unwrap_or(0) as f64
            / (1024.0 * 1024.0)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One framed-XML run: every line sent on one connection logged on as everyone, then every
/// answer and CLS awaited. Its duration.
fn framed_run(
    node: &Node,
    refdata: &RefData,
    lines: &[Vec<u8>],
    trades: usize,
) -> anyhow::Result<f64> {
    let bics: Vec<String> = refdata
        .participants()
        .iter()
        .map(|p| p.bic.clone())
        .collect();
    let logons: Vec<Logon<'_>> = bics
        .iter()
        .map(|bic| Logon {
            participant: bic,
            key: refdata.participant_mac(bic).expect("a key").1,
            subscribe: true,
        })
        .collect();
    let (mut writer, mut reader) = client::connect(node.tcp, &logons)?;
    let frames: Vec<Frame> = lines
        .iter()
        .enumerate()
        .map(|(seq, line)| {
            let envelope = sign_line(refdata, line.clone(), seq as u64, 0);
            Frame::Message {
                seq: seq as u64,
                sender: envelope.sender.unwrap_or_default().into_string(),
                signature: envelope.signature.unwrap_or([0; 32]),
                xml: envelope.bytes,
            }
        })
        .collect();
    let started = Instant::now();
    let expected = frames.len();
    let sender = std::thread::spawn(move || -> anyhow::Result<()> {
        for frame in &frames {
            writer.send(frame)?;
        }
        writer.flush()?;
        Ok(())
    });
    let (mut answers, mut cls) = (0, 0);
    reader.set_read_timeout(Some(Duration::from_secs(30)))?;
    while answers < expected || cls < trades {
        let frame = reader
            .next_frame()
            .with_context(|| format!("waiting after {answers} answers and {cls} CLS"))?;
        match frame {
            Some(Frame::Ack { .. }) => answers += 1,
            Some(Frame::Nak { .. }) => answers += 1,
            Some(Frame::Push {
                class: PushClass::Cls,
                ..
            }) => cls += 1,
            Some(_) => {}
            None => anyhow::bail!("the engine closed the run's connection"),
        }
    }
    sender
        .join()
        .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
    Ok(started.elapsed().as_secs_f64())
}

fn post(address: SocketAddr, body: &[u8]) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        stream,
        "POST /soap HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/xml\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    Ok(())
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> anyhow::Result<()> {
    let trades = arg("--trades", 2000) as usize;
    let rounds = arg("--rounds", 3) as usize;
    let refdata = RefData::embedded()?;
    let ring = KeyRing::generate_for(&refdata);
    let dir = std::env::temp_dir().join(format!("attackbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let keys = dir.join("keys.csv");
    ring.write(&keys)?;
    let refdata = refdata.with_keys(&ring)?;
    // `--only TEXT`: only the attacks of participants whose name holds TEXT, nothing else.
    let only = arg_text("--only");
    if only.is_none() {
        client_attacks(&dir, &keys, &refdata, trades, rounds)?;
    }
    participant_attacks(&dir, &keys, &refdata, trades, rounds, only.as_deref())?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Sections 1 and 2 of the account above: the slowdown beside namespace-flood SOAP clients, and
/// the node's memory under each memory attack.
fn client_attacks(
    dir: &Path,
    keys: &Path,
    refdata: &RefData,
    trades: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    // 1. Slowdown of a framed-XML run by two namespace-flood SOAP clients, each run on a fresh
    // node (generated MsgIds repeat across seeds, and a node never accepts one twice).
    let body = Arc::new(namespace_flood_body());
    let (mut alone, mut flooded) = (Vec::new(), Vec::new());
    let mut floods_answered = 0_u64;
    let lines_of = |seed: u64| -> Vec<Vec<u8>> {
        Generator::new(
            refdata,
            GeneratorConfig {
                seed,
                ..GeneratorConfig::clean(trades as u64)
            },
        )
        .collect()
    };
    for round in 0..rounds {
        let lines = lines_of(1000 + round as u64 * 2);
        let node = Node::start(
            &dir.join(format!("alone-{round}")),
            keys,
            &["--store", "memory"],
        )?;
        alone.push(framed_run(&node, refdata, &lines, trades)?);
        drop(node);
        let node = Node::start(
            &dir.join(format!("flooded-{round}")),
            keys,
            &["--store", "memory"],
        )?;
        let stop = Arc::new(AtomicBool::new(false));
        let flooders: Vec<_> = (0..2)
            .map(|_| {
                let (stop, body, address) = (stop.clone(), body.clone(), node.http);
                std::thread::spawn(move || {
                    let mut answered = 0_u64;
                    while !stop.load(Ordering::Relaxed) {
                        if post(address, &body).is_ok() {
                            answered += 1;
                        }
                    }
                    answered
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let lines = lines_of(1001 + round as u64 * 2);
        flooded.push(framed_run(&node, refdata, &lines, trades)?);
        stop.store(true, Ordering::Relaxed);
        for flooder in flooders {
            floods_answered += flooder.join().unwrap_or(0);
        }
        drop(node);
    }
    let (alone_s, flooded_s) = (median(alone.clone()), median(flooded.clone()));
    println!(
        "attackbench ({trades} trades of 7 messages over framed XML, {rounds} rounds alternated)"
    );
    println!("  run alone                 {alone_s:>8.3} s  (runs: {alone:.3?})");
    println!("  run beside 2 SOAP floods  {flooded_s:>8.3} s  (runs: {flooded:.3?}; {floods_answered} flood requests answered)");
    println!(
        "  slowdown                  {:>8.2}x  (target < 1.5x)",
        flooded_s / alone_s
    );

    // 2. Memory under each attack, on a fresh node each (embedded store, for the disk figure).
    println!("  memory of the engine (resident set, MiB):");
    let node = Node::start(&dir.join("frames"), keys, &["--store", "memory"])?;
    let before = node.rss_mib();
    {
        let bic = &refdata.participants()[0].bic;
        let logons = [Logon {
            participant: bic,
            key: refdata.participant_mac(bic).expect("a key").1,
            subscribe: false,
        }];
        let (mut writer, mut reader) = client::connect(node.tcp, &logons)?;
        let line = Generator::new(refdata, GeneratorConfig::clean(1))
            .next()
            .context("a line")?;
        let padding = "x".repeat(1024 * 1024 - 1024);
        let huge = String::from_utf8(line)?.replace("</Msg>", &format!("<!--{padding}--></Msg>"));
        let sender = std::thread::spawn(move || -> anyhow::Result<()> {
            for seq in 0..600 {
                writer.send(&Frame::Message {
                    seq,
                    sender: bic_owned(&huge),
                    signature: [0; 32],
                    xml: huge.clone().into_bytes(),
                })?;
            }
            writer.flush()?;
            Ok(())
        });
        for _ in 0..600 {
            reader.next_frame()?;
        }
        sender
            .join()
            .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
    }
    println!(
        "    600 frames of a 1 MiB message     {before:>7.1} -> {:>7.1}",
        node.rss_mib()
    );
    drop(node);

    let node = Node::start(&dir.join("fixgap"), keys, &["--store", "memory"])?;
    let before = node.rss_mib();
    let filler = "x".repeat(60 * 1024);
    for session in 0..20 {
        let bic = &refdata.participants()[session].bic;
        let mut stream = TcpStream::connect(node.fix)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let key = refdata.participant_mac(bic).expect("a key").1;
        stream.write_all(&fix::fresh_logon(key, bic, &fix::utc_timestamp()))?;
        for seq in 10..40_u64 {
            let message = fix::encode(&[
                (35, "1".into()),
                (49, bic.clone()),
                (56, "STE".into()),
                (34, seq.to_string()),
                (52, fix::utc_timestamp()),
                (112, filler.clone()),
            ]);
            if stream.write_all(&message).is_err() {
                break;
            }
        }
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    }
    println!(
        "    20 FIX sessions, 30 x 60 KiB past a gap {before:>5.1} -> {:>7.1}",
        node.rss_mib()
    );
    drop(node);

    let node = Node::start(&dir.join("idle"), keys, &["--store", "memory"])?;
    let before = node.rss_mib();
    let mut idle = Vec::new();
    let mut challenged = 0;
    // From one address of the loopback range other than the participant's.
    let source: std::net::IpAddr = "127.0.0.2".parse()?;
    for _ in 0..1_100 {
        idle.push(socket_from(source, node.tcp)?);
    }
    for socket in &mut idle {
        socket.set_read_timeout(Some(Duration::from_millis(200)))?;
        if matches!(Frame::read_from(socket), Ok(Some(Frame::Challenge { .. }))) {
            challenged += 1;
        }
    }
    let good = {
        let bic = &refdata.participants()[1].bic;
        let logons = [Logon {
            participant: bic,
            key: refdata.participant_mac(bic).expect("a key").1,
            subscribe: false,
        }];
        client::connect(node.tcp, &logons).is_ok()
    };
    println!(
        "    1,100 idle sockets from one address  {before:>6.1} -> {:>7.1}  ({challenged} served, the rest refused; a participant from another address logs on: {good})",
        node.rss_mib()
    );
    drop(idle);
    drop(node);

    let data = dir.join("garbage");
    let node = Node::start(&data, keys, &["--store", "embedded"])?;
    let garbage = vec![b'x'; 1024 * 1024 - 1024];
    for _ in 0..135 {
        post(node.http, &garbage)?;
    }
    let exceptions = std::fs::metadata(data.join("store").join("exceptions.sqlite"))
        .map(|m| m.len())
        .unwrap_or(0);
    let wal = std::fs::metadata(data.join("store").join("exceptions.sqlite-wal"))
        .map(|m| m.len())
        .unwrap_or(0);
    println!(
        "    135 unauthenticated 1 MiB SOAP requests: exceptions store {:.2} MiB on disk",
        (exceptions + wal) as f64 / (1024.0 * 1024.0)
    );
    drop(node);
    Ok(())
}

/// What one attack did while the well-behaved run went on.
struct Attacked {
    /// Messages or requests the attacker got accepted, and refused (with the code that bounds it).
    accepted: u64,
    refused: u64,
    /// Its own rate while it lasted.
    per_s: f64,
    /// A line about anything else it showed.
    note: String,
}

/// An attack, given the node, run in a thread of its own beside the run.
type Attack = fn(&Node, &RefData) -> anyhow::Result<Attacked>;

/// A framed connection logged on as `bic`.
fn logged_on(
    node: &Node,
    refdata: &RefData,
    bic: &str,
) -> anyhow::Result<(client::FrameWriter, client::FrameReader)> {
    let logons = [Logon {
        participant: bic,
        key: refdata.participant_mac(bic).context("a key")?.1,
        subscribe: false,
    }];
    Ok(client::connect(node.tcp, &logons)?)
}

/// Sends `messages` (built on demand) on one connection while reading the answers; counts ACKs
/// and the NAKs of `bound`.
fn send_counting(
    node: &Node,
    refdata: &RefData,
    sender: &str,
    count: u64,
    message: impl Fn(u64) -> Vec<u8> + Send + 'static,
) -> anyhow::Result<Attacked> {
    let (mut writer, mut reader) = logged_on(node, refdata, sender)?;
    let key = refdata.participant_mac(sender).context("a key")?.1.clone();
    let bic = sender.to_owned();
    let started = Instant::now();
    let feeder = std::thread::spawn(move || -> anyhow::Result<u64> {
        let mut sent = 0;
        for seq in 0..count {
            let xml = message(seq);
            writer.send(&Frame::Message {
                seq,
                sender: bic.clone(),
                signature: ste_engine::sign::sign_keyed(&key, &xml),
                xml,
            })?;
            sent += 1;
        }
        writer.flush()?;
        Ok(sent)
    });
    let (mut accepted, mut refused, mut answered) = (0, 0, 0);
    reader.set_read_timeout(Some(Duration::from_secs(60)))?;
    // Every answer is read, whenever the run beside it ends: an unread connection would hold
    // the engine's window and the feeder.
    while answered < count {
        match reader.next_frame()? {
            Some(Frame::Ack { .. }) => {
                accepted += 1;
                answered += 1;
            }
            Some(Frame::Nak { .. }) => {
                refused += 1;
                answered += 1;
            }
            Some(_) => {}
            None => break,
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    drop(reader);
    let _ = feeder.join();
    Ok(Attacked {
        accepted,
        refused,
        per_s: answered as f64 / elapsed,
        note: String::new(),
    })
}

/// A line of a generated trade of an unrelated seed, with a field replaced.
fn template_line(refdata: &RefData, index: usize) -> anyhow::Result<String> {
    let line = Generator::new(
        refdata,
        GeneratorConfig {
            seed: 0xA77AC,
            ..GeneratorConfig::clean(1)
        },
    )
    .nth(index)
    .context("a line")?;
    Ok(String::from_utf8(line)?)
}

fn element(line: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    line.split_once(&open)
        .and_then(|(_, rest)| rest.split_once('<'))
        .map(|(text, _)| text.to_owned())
        .unwrap_or_default()
}

fn replace_element(line: &str, tag: &str, value: &str) -> String {
    let old = format!("<{tag}>{}</{tag}>", element(line, tag));
    line.replacen(&old, &format!("<{tag}>{value}</{tag}>"), 1)
}

/// An investment manager amends its own ALC 10,000 times, each AMD naming the one before.
fn amd_chain(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    let alc = template_line(refdata, 1)?;
    let inv_mgr = element(&alc, "Sender");
    let alc = replace_element(&alc, "TradeRef", "ZCHAIN000001");
    let first = element(&alc, "MsgId");
    let message = move |seq: u64| -> Vec<u8> {
        if seq == 0 {
            return alc.clone().into_bytes();
        }
        let named = if seq == 1 {
            first.clone()
        } else {
            format!("ZC-{:08}", seq - 1)
        };
        let amend = replace_element(&alc, "MsgId", &format!("ZC-{seq:08}"))
            .replace("<Function>NEW</Function>", "<Function>AMD</Function>")
            .replace(
                "<Sender>",
                &format!("<RelatedId>{named}</RelatedId><Sender>"),
            );
        amend.into_bytes()
    };
    let mut attacked = send_counting(node, refdata, &inv_mgr, 10_000, message)?;
    attacked.note = format!(
        "the trade's bound is {}",
        ste_engine::matcher::TRADE_MESSAGES_MAX
    );
    Ok(attacked)
}

/// A broker sends 600,000 NOEs of trades that never get another message.
fn noe_flood(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    noe_flood_on(node, refdata, None)
}

/// The same broker's 600,000 NOEs, every TradeRef chosen so that its trade routes to shard 0:
/// routing is FNV-1a and jump hash of `Broker/TradeRef` (the contract's), which anyone can
/// compute, so a participant can aim all of its rate and open trades at one shard.
fn noe_flood_one_shard(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    noe_flood_on(node, refdata, Some(0))
}

/// 600,000 NOEs of one broker that never match: TradeRefs `ZF0000000000`, `ZF0000000001`, …,
/// or only those of them whose trades route to `shard` of the node's shards (it runs with the
/// default number).
fn noe_flood_on(node: &Node, refdata: &RefData, shard: Option<u32>) -> anyhow::Result<Attacked> {
    const COUNT: u64 = 600_000;
    let trade_ref = |n: u64| format!("ZF{n:010}");
    let noe = template_line(refdata, 0)?;
    let broker = element(&noe, "Sender");
    let shards = ste_engine::options::SHARDS_DEFAULT;
    // The numbers of the TradeRefs that route to `shard`, chosen before the flood starts.
    let chosen: Option<Vec<u64>> = shard.map(|shard| {
        (0_u64..)
            .filter(|&n| {
                ste_engine::routing::shard_of_parts(&broker, &trade_ref(n), shards) == shard
            })
            .take(COUNT as usize)
            .collect()
    });
    let message = move |seq: u64| -> Vec<u8> {
        let n = chosen.as_ref().map_or(seq, |chosen| chosen[seq as usize]);
        let line = replace_element(&noe, "TradeRef", &trade_ref(n));
        replace_element(&line, "MsgId", &format!("ZF-{seq:010}")).into_bytes()
    };
    let mut attacked = send_counting(node, refdata, &broker, COUNT, message)?;
    let quota = ste_engine::matcher::PARTICIPANT_HELD_BYTES_DEFAULT >> 20;
    attacked.note = match shard {
        None => format!("the quota is {quota} MiB a shard"),
        Some(shard) => {
            format!("every trade on shard {shard} of {shards}; the quota is {quota} MiB a shard")
        }
    };
    Ok(attacked)
}

/// One key logs on over FIX and drops the connection, again and again, until told it is busy;
/// then another participant logs on.
fn logon_flood(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    let bics: Vec<&str> = refdata
        .participants()
        .iter()
        .map(|p| p.bic.as_str())
        .collect();
    let logon = |bic: &str| -> anyhow::Result<String> {
        let mut stream = TcpStream::connect(node.fix)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let key = refdata.participant_mac(bic).context("a key")?.1;
        stream.write_all(&fix::fresh_logon(key, bic, &fix::utc_timestamp()))?;
        let mut answer = vec![0_u8; 512];
        let read = stream.read(&mut answer)?;
        Ok(String::from_utf8_lossy(&answer[..read]).into_owned())
    };
    let started = Instant::now();
    let (mut accepted, mut refused, mut attempts) = (0, 0, 0_u64);
    while refused == 0 && started.elapsed() < Duration::from_secs(30) {
        let answer = logon(bics[11])?;
        attempts += 1;
        if answer.contains("\u{1}35=A\u{1}") {
            accepted += 1;
        } else if answer.contains("E_BUSY") {
            refused += 1;
        } else {
            // Its last connection is not seen closed yet.
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let other = logon(bics[12])?;
    Ok(Attacked {
        accepted,
        refused,
        per_s: attempts as f64 / started.elapsed().as_secs_f64(),
        note: format!(
            "another participant's logon then: {}",
            if other.contains("\u{1}35=A\u{1}") {
                "accepted"
            } else {
                "REFUSED"
            }
        ),
    })
}

/// A FIX session fills the engine's store of its answers (6,000 NOEs, each answered), then
/// sends 671 ResendRequests for everything (`7=1 16=0`) at once and reads for 15 s.
fn resend_flood(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    resend_flood_session(node, refdata, 671)
}

/// [`resend_flood`] with `requests` ResendRequests (none: the session only fills the store, and
/// logs out).
fn resend_flood_session(
    node: &Node,
    refdata: &RefData,
    requests_count: u64,
) -> anyhow::Result<Attacked> {
    let noe = template_line(refdata, 0)?;
    let broker = element(&noe, "Sender");
    let key = refdata.participant_mac(&broker).context("a key")?.1;
    let mut stream = TcpStream::connect(node.fix)?;
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    stream.write_all(&fix::fresh_logon(key, &broker, &fix::utc_timestamp()))?;
    let mut seq = 2_u64;
    let header = |msg_type: &str, seq: u64| {
        vec![
            (35, msg_type.to_owned()),
            (49, broker.clone()),
            (56, "STE".to_owned()),
            (34, seq.to_string()),
            (52, fix::utc_timestamp()),
        ]
    };
    let mut out = Vec::new();
    for n in 0..6_000_u64 {
        let line = replace_element(&noe, "TradeRef", &format!("ZR{n:010}"));
        let line = replace_element(&line, "MsgId", &format!("ZR-{n:010}"));
        let mut pairs = fix::to_fix(line.as_bytes()).map_err(|r| anyhow::anyhow!("{r}"))?;
        let msg_type = pairs.remove(0).1;
        let mut fields = header(&msg_type, seq);
        fields.extend(pairs);
        fix::sign_fields(key, &mut fields);
        out.extend_from_slice(&fix::encode(&fields));
        seq += 1;
    }
    stream.write_all(&out)?;
    // Read the answers until the engine falls quiet.
    let mut chunk = vec![0_u8; 1 << 16];
    let mut quiet = 0;
    while quiet < 10 {
        match stream.read(&mut chunk) {
            Ok(0) => anyhow::bail!("the engine closed the session"),
            Ok(_) => quiet = 0,
            Err(_) => quiet += 1,
        }
    }
    if requests_count == 0 {
        stream.write_all(&fix::encode(&header("5", seq)))?;
        let _ = stream.read(&mut chunk);
        return Ok(Attacked {
            accepted: 0,
            refused: 0,
            per_s: 0.0,
            note: String::new(),
        });
    }
    let mut requests = Vec::new();
    for _ in 0..requests_count {
        let mut fields = header("2", seq);
        fields.extend([(7, "1".to_owned()), (16, "0".to_owned())]);
        requests.extend_from_slice(&fix::encode(&fields));
        seq += 1;
    }
    stream.write_all(&requests)?;
    let started = Instant::now();
    let (mut bytes, mut resent, mut busy) = (0_u64, 0_u64, 0_u64);
    let count = |haystack: &[u8], needle: &[u8]| {
        haystack
            .windows(needle.len())
            .filter(|w| *w == needle)
            .count() as u64
    };
    while started.elapsed() < Duration::from_secs(15) {
        if let Ok(read) = stream.read(&mut chunk) {
            if read == 0 {
                break;
            }
            bytes += read as u64;
            resent += count(&chunk[..read], b"\x0143=Y\x01");
            busy += count(&chunk[..read], b"E_BUSY resending");
        }
    }
    Ok(Attacked {
        accepted: resent,
        refused: busy,
        per_s: requests_count as f64 / started.elapsed().as_secs_f64(),
        note: format!(
            "{:.1} MiB sent back in 15 s for {requests_count} ResendRequests (counted: messages resent, requests refused E_BUSY)",
            bytes as f64 / (1024.0 * 1024.0)
        ),
    })
}

/// An investment manager that is a party of a trade flips its SET between two mismatches 5,000
/// times; the victim broker's connection counts the MISMATCHED advices it is pushed.
fn advice_flood(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    let lines: Vec<String> = Generator::new(
        refdata,
        GeneratorConfig {
            seed: 0xADF,
            ..GeneratorConfig::clean(1)
        },
    )
    .map(|line| {
        // MsgIds of its own: the run beside it has trades of the same index.
        let line = String::from_utf8(line)
            .unwrap_or_default()
            .replace("-000000000001-", "-ZA000000001-");
        replace_element(&line, "TradeRef", "ZADVICE00001")
    })
    .collect();
    let broker = element(&lines[0], "Sender");
    let inv_mgr = element(&lines[1], "Sender");
    // The broker's side, and its subscription for what it is pushed.
    let (mut broker_writer, mut broker_reader) = {
        let logons = [Logon {
            participant: &broker,
            key: refdata.participant_mac(&broker).context("a key")?.1,
            subscribe: true,
        }];
        client::connect(node.tcp, &logons)?
    };
    let broker_key = refdata.participant_mac(&broker).context("a key")?.1.clone();
    for (seq, line) in lines
        .iter()
        .filter(|l| element(l, "Sender") == broker)
        .enumerate()
    {
        broker_writer.send(&Frame::Message {
            seq: seq as u64,
            sender: broker.clone(),
            signature: ste_engine::sign::sign_keyed(&broker_key, line.as_bytes()),
            xml: line.clone().into_bytes(),
        })?;
    }
    broker_writer.flush()?;
    let set = lines
        .iter()
        .rfind(|l| element(l, "Type") == "SET")
        .context("a SET")?
        .clone();
    let first_id = element(&set, "MsgId");
    let others: Vec<String> = lines
        .iter()
        .filter(|l| element(l, "Sender") == inv_mgr && **l != set)
        .cloned()
        .collect();
    let flips = 5_000_u64;
    let message = move |seq: u64| -> Vec<u8> {
        let seq = seq as usize;
        if seq < others.len() {
            return others[seq].clone().into_bytes();
        }
        let n = seq - others.len();
        let bad = if n.is_multiple_of(2) {
            replace_element(&set, "SettleAmount", "1.00")
        } else {
            replace_element(&set, "PaymentType", "FOP")
        };
        if n == 0 {
            return bad.into_bytes();
        }
        let named = if n == 1 {
            first_id.clone()
        } else {
            format!("ZV-{:08}", n - 1)
        };
        replace_element(&bad, "MsgId", &format!("ZV-{n:08}"))
            .replace("<Function>NEW</Function>", "<Function>AMD</Function>")
            .replace(
                "<Sender>",
                &format!("<RelatedId>{named}</RelatedId><Sender>"),
            )
            .into_bytes()
    };
    let mut attacked = send_counting(node, refdata, &inv_mgr, 3 + flips, message)?;
    broker_reader.set_read_timeout(Some(Duration::from_millis(500)))?;
    let mut advices = 0;
    while let Ok(Some(frame)) = broker_reader.next_frame() {
        if let Frame::Push {
            class: PushClass::Advice,
            xml,
        } = frame
        {
            advices += u64::from(String::from_utf8_lossy(&xml).contains("MISMATCHED"));
        }
    }
    attacked.note = format!(
        "{advices} MISMATCHED advices pushed to the broker for {flips} flips (at most {} a trade)",
        ste_engine::matcher::ADVICES_PER_TRADE_MAX
    );
    Ok(attacked)
}

/// 64 sockets from each of 16 loopback addresses that never log on, held through the run.
fn idle_sockets(node: &Node, _refdata: &RefData) -> anyhow::Result<Attacked> {
    let mut held = Vec::new();
    let mut refused = 0;
    let started = Instant::now();
    for source in 2..18_u8 {
        let address = std::net::IpAddr::from([127, 0, 0, source]);
        for _ in 0..64 {
            let mut socket = socket_from(address, node.tcp)?;
            socket.set_read_timeout(Some(Duration::from_millis(500)))?;
            match Frame::read_from(&mut socket) {
                Ok(Some(Frame::Challenge { .. })) => held.push(socket),
                _ => refused += 1,
            }
        }
    }
    let per_s = 1024.0 / started.elapsed().as_secs_f64();
    // Held until the engine's logon timeout closes them.
    std::thread::sleep(Duration::from_secs(3));
    Ok(Attacked {
        accepted: held.len() as u64,
        refused,
        per_s,
        note: "sockets served (counted as accepted) until the logon timeout, and refused"
            .to_owned(),
    })
}

/// A participant whose FIX store is full logs on 500 times with a MsgSeqNum below the
/// expected one, each refused: the node must not write its session file for each.
fn refused_logons(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    // Fill the store first, as the ResendRequest flood does, then leave.
    let _ = resend_flood_session(node, refdata, 0)?;
    let noe = template_line(refdata, 0)?;
    let broker = element(&noe, "Sender");
    let key = refdata.participant_mac(&broker).context("a key")?.1;
    let written_before = node.written_mib();
    let started = Instant::now();
    let mut refused = 0;
    for _ in 0..500 {
        let mut stream = TcpStream::connect(node.fix)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let sending_time = fix::utc_timestamp();
        stream.write_all(&fix::encode(&[
            (35, "A".into()),
            (49, broker.clone()),
            (56, "STE".into()),
            (34, "1".into()),
            (52, sending_time.clone()),
            (98, "0".into()),
            (108, "30".into()),
            (554, fix::logon_password(key, &sending_time, &broker)),
        ]))?;
        let mut answer = vec![0_u8; 512];
        let read = stream.read(&mut answer).unwrap_or(0);
        refused += u64::from(String::from_utf8_lossy(&answer[..read]).contains("too low"));
        // One logon of this participant at a time: the refused one is over once closed.
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(Attacked {
        accepted: 0,
        refused,
        per_s: 500.0 / started.elapsed().as_secs_f64(),
        note: format!(
            "the node wrote {:.1} MiB meanwhile",
            node.written_mib() - written_before
        ),
    })
}

/// Wrongly signed SOAP requests of a real message, as fast as one client can post them.
fn bad_signature_soap(node: &Node, refdata: &RefData) -> anyhow::Result<Attacked> {
    use base64::Engine as _;
    let line = template_line(refdata, 0)?;
    let sender = element(&line, "Sender");
    let body = format!(
        "<s:Envelope xmlns:s=\"{}\" xmlns:b=\"{}\"><s:Header><b:Auth><b:Participant>{sender}</b:Participant><b:Signature>{}</b:Signature></b:Auth></s:Header><s:Body><b:Submit><b:Message>{}</b:Message></b:Submit></s:Body></s:Envelope>",
        ste_bridge::soap::SOAP11_NS,
        ste_bridge::soap::BRIDGE_NS,
        "00".repeat(32),
        base64::engine::general_purpose::STANDARD.encode(line.as_bytes())
    );
    let started = Instant::now();
    let mut answered = 0_u64;
    // Ten seconds, whenever the run beside it ends.
    while started.elapsed() < Duration::from_secs(10) {
        if post(node.http, body.as_bytes()).is_ok() {
            answered += 1;
        }
    }
    Ok(Attacked {
        accepted: 0,
        refused: answered,
        per_s: answered as f64 / started.elapsed().as_secs_f64(),
        note: String::new(),
    })
}

/// Bytes of a node's store folder on disk.
fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir.join("store"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.metadata().ok())
        .map(|metadata| metadata.len())
        .sum()
}

fn participant_attacks(
    dir: &Path,
    keys: &Path,
    refdata: &RefData,
    trades: usize,
    rounds: usize,
    only: Option<&str>,
) -> anyhow::Result<()> {
    let attacks: [(&str, Attack); 9] = [
        ("a chain of 10,000 AMDs of one ALC", amd_chain),
        ("600,000 NOEs that never match", noe_flood),
        (
            "600,000 NOEs that never match, every one routed to shard 0",
            noe_flood_one_shard,
        ),
        ("FIX logons of one key, as fast as it can", logon_flood),
        ("671 FIX ResendRequests for a full store", resend_flood),
        (
            "500 refused FIX logons of a participant with a full store",
            refused_logons,
        ),
        (
            "5,000 flips of a party's SET between two mismatches",
            advice_flood,
        ),
        ("64 idle sockets from each of 16 addresses", idle_sockets),
        ("wrongly signed SOAP requests for 10 s", bad_signature_soap),
    ];
    let attackers = [
        element(&template_line(refdata, 0)?, "Sender"),
        element(&template_line(refdata, 1)?, "Sender"),
        refdata.participants()[11].bic.clone(),
    ];
    println!("  participants with valid keys against the others ({trades} trades beside each attack, embedded store, {rounds} rounds alternated):");
    for (index, (name, attack)) in attacks.into_iter().enumerate() {
        if only.is_some_and(|only| !name.contains(only)) {
            continue;
        }
        let (mut alone, mut beside) = (Vec::new(), Vec::new());
        let mut report = None;
        let mut alone_grew = (0.0, 0.0, 0.0);
        for round in 0..rounds {
            // The others' trades: an attacker's quota and bounds are its own, so the trades it
            // is a party of are left out of the run.
            let lines: Vec<Vec<u8>> = Generator::new(
                refdata,
                GeneratorConfig {
                    seed: 2000 + round as u64,
                    ..GeneratorConfig::clean(trades as u64)
                },
            )
            .collect::<Vec<_>>()
            .chunks(7)
            .filter(|trade| {
                !trade.iter().any(|line| {
                    let text = String::from_utf8_lossy(line);
                    attackers.iter().any(|bic| text.contains(bic.as_str()))
                })
            })
            .flatten()
            .cloned()
            .collect();
            let trades = lines.len() / 7;
            // A fresh folder for every node: a node never accepts a MsgId twice.
            let data = dir.join(format!("p{index}-alone-{round}"));
            let _ = std::fs::remove_dir_all(&data);
            let node = Node::start(&data, keys, &["--store", "embedded"])?;
            let (rss_before, disk_before) = (node.rss_mib(), disk_bytes(&data));
            let written_before = node.written_mib();
            alone.push(framed_run(&node, refdata, &lines, trades)?);
            alone_grew = (
                node.rss_mib() - rss_before,
                (disk_bytes(&data) as f64 - disk_before as f64) / (1024.0 * 1024.0),
                node.written_mib() - written_before,
            );
            drop(node);
            let data = dir.join(format!("p{index}-{round}"));
            let _ = std::fs::remove_dir_all(&data);
            let node = Node::start(&data, keys, &["--store", "embedded"])?;
            let (rss_before, disk_before) = (node.rss_mib(), disk_bytes(&data));
            let written_before = node.written_mib();
            let (run, attacked) = std::thread::scope(|scope| {
                let attacker = scope.spawn(|| attack(&node, refdata));
                std::thread::sleep(Duration::from_millis(200));
                let run = framed_run(&node, refdata, &lines, trades);
                (run, attacker.join())
            });
            beside.push(run?);
            let attacked = attacked.map_err(|_| anyhow::anyhow!("the attacker panicked"))??;
            let grown = (
                node.rss_mib() - rss_before,
                (disk_bytes(&data) as f64 - disk_before as f64) / (1024.0 * 1024.0),
                node.written_mib() - written_before,
            );
            report = Some((attacked, grown));
            drop(node);
        }
        let (attacked, (rss, disk, written)) = report.context("at least one round")?;
        let (alone_s, beside_s) = (median(alone), median(beside));
        println!("    {name}:");
        println!(
            "      run alone {alone_s:.3} s, beside it {beside_s:.3} s: slowdown {:.2}x (target < 1.5x)",
            beside_s / alone_s
        );
        println!(
            "      the attacker: {} accepted, {} refused, {:.0}/s; {}",
            attacked.accepted, attacked.refused, attacked.per_s, attacked.note
        );
        println!(
            "      the node grew by {rss:.1} MiB resident and {disk:.1} MiB on disk, and wrote {written:.1} MiB; by {:.1}, {:.1} and {:.1} with the run alone (last round)",
            alone_grew.0, alone_grew.1, alone_grew.2
        );
    }
    Ok(())
}

/// The first `<Sender>` of a message.
fn bic_owned(xml: &str) -> String {
    ste_engine::sign::claimed_sender(xml.as_bytes())
        .unwrap_or("")
        .to_owned()
}

/// A connection from `source` (an address of this machine's loopback range).
fn socket_from(source: std::net::IpAddr, target: SocketAddr) -> anyhow::Result<TcpStream> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(source, 0))?;
        socket.connect(target).await
    })?;
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}
