//! `jsbench`: the raw rate of NATS JetStream for the engine's own batches, through the queue
//! seam's JetStream carrier — what distribution costs before any station runs.
//!
//! Generates `--trades N` standard trades, signs them as the gateways do, and sends their
//! envelopes in batches of 64 (the inbound batch) through one queue of a `nats-server -js` it
//! starts itself (its own port and store folder, file storage, as a cluster runs): first
//! publish only, then consume only (acknowledging each batch), then both at once. Prints
//! messages and batches per second and the bytes of a batch. Then the answers: the same
//! number of ACKs, in batches of 256 (one commit's), through a JetStream queue (publish,
//! consume, acknowledge) and as plain NATS messages to a subscription, with the server's CPU
//! per ACK for each. The server is `STE_NATS_SERVER` where set (the pinned release a cluster
//! runs on), else the `nats-server` on the PATH.
//!
//! With `--trust ROUNDS`, what TLS and identities cost the inbound hop instead: the same
//! batches published onto `ste.in.0` and consumed by `owner-0` at once, on a server without
//! either, on one that requires identities only, and on one that requires both (certificates
//! and nkeys made by `driver secrets`, published as `load-0`, consumed as `node`, with those
//! roles' permissions), alternated, with each server's CPU per message.
//!
//! `cargo run --release -p ste-driver --bin jsbench -- --trades 50000`
//! `cargo run --release -p ste-driver --bin jsbench -- --trades 50000 --trust 5`

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ste_bridge::bench::arg;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::{sign_line, Ack, AckResult, Envelope, INBOUND_BATCH_MESSAGES};
use ste_engine::queue::jetstream::{JetStream, QueueLimits};
use ste_engine::queue::{BatchReceiver, BatchSender};
use ste_engine::refdata::RefData;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A `nats-server -js` of this run, killed and its store removed at the end.
struct Server {
    child: std::process::Child,
    store: std::path::PathBuf,
    url: String,
}

impl Server {
    fn start() -> anyhow::Result<Self> {
        Self::start_with(None)
    }

    /// A server whose configuration adds `settings` (TLS and authorization) where given.
    fn start_with(settings: Option<&str>) -> anyhow::Result<Self> {
        let port = ste_engine::ports::free_local_port()?;
        let store = std::env::temp_dir().join(format!("jsbench-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&store)?;
        let config = store.with_extension("conf");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\n{}",
                store.display(),
                settings.unwrap_or_default()
            ),
        )?;
        let child = Command::new(server_binary())
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server (Debian's nats-server package)")?;
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(10),
                "nats-server did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Self {
            child,
            store,
            url: format!("nats://127.0.0.1:{port}"),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.store);
        let _ = std::fs::remove_file(self.store.with_extension("conf"));
    }
}

const LIMITS: QueueLimits = QueueLimits {
    batches_max: 1_000_000,
    bytes_max: 8 * 1024 * 1024 * 1024,
};

/// Publishes every batch to `queue`, one after the other, each waiting for its publish
/// acknowledgement (as the carrier does). Returns the seconds it took.
fn publish(jetstream: &JetStream, queue: &str, batches: &[Vec<Envelope>]) -> anyhow::Result<f64> {
    let sender = jetstream.sender::<Envelope>(queue);
    let started = Instant::now();
    for batch in batches {
        sender.send(batch.clone())?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Takes `count` batches off `queue`, acknowledging each. Returns the seconds it took.
fn consume(jetstream: &JetStream, queue: &str, count: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    consume_as(jetstream, queue, "bench", count)?;
    Ok(started.elapsed().as_secs_f64())
}

fn main() -> anyhow::Result<()> {
    let trades = arg("--trades", 50_000);
    let refdata = Arc::new(RefData::embedded()?.with_generated_keys());
    let envelopes: Vec<Envelope> = Generator::new(&refdata, GeneratorConfig::clean(trades))
        .enumerate()
        .map(|(index, line)| sign_line(&refdata, line, index as u64, 0))
        .collect();
    let batches: Vec<Vec<Envelope>> = envelopes
        .chunks(INBOUND_BATCH_MESSAGES)
        .map(<[Envelope]>::to_vec)
        .collect();
    let messages = envelopes.len() as f64;
    let batch_bytes = postcard_bytes(&batches[0]);
    let sent_bytes = ste_engine::queue::jetstream::payload_bytes(&batches[0]);
    let trust_rounds = arg("--trust", 0u64) as usize;
    if trust_rounds > 0 {
        return trust(&batches, envelopes.len(), trust_rounds);
    }
    let server = Server::start()?;
    let jetstream = JetStream::connect(&server.url)?;

    jetstream.ensure_queue("bench.a", LIMITS)?;
    let publish_s = publish(&jetstream, "bench.a", &batches)?;
    let consume_s = consume(&jetstream, "bench.a", batches.len())?;

    jetstream.ensure_queue("bench.b", LIMITS)?;
    let both_s = std::thread::scope(|scope| -> anyhow::Result<f64> {
        let started = Instant::now();
        let consumer = scope.spawn(|| consume(&jetstream, "bench.b", batches.len()));
        publish(&jetstream, "bench.b", &batches)?;
        consumer
            .join()
            .map_err(|_| anyhow::anyhow!("the consumer panicked"))??;
        Ok(started.elapsed().as_secs_f64())
    })?;

    println!(
        "jsbench: {} messages of {trades} trades in {} batches of {} ({} bytes a batch in postcard, {} as sent), nats-server {} with file storage",
        envelopes.len(),
        batches.len(),
        INBOUND_BATCH_MESSAGES,
        batch_bytes,
        sent_bytes,
        server_version()
    );
    for (what, seconds) in [
        ("publish (each batch waits for its ack)", publish_s),
        ("consume (pull, ack each batch)", consume_s),
        ("publish and consume at once", both_s),
    ] {
        println!(
            "  {what:<40} {:>10.0} msg/s {:>9.0} batches/s",
            messages / seconds,
            batches.len() as f64 / seconds
        );
    }
    let [queued, plain] = answers(&server, &jetstream, envelopes.len())?;
    println!(
        "  answers: {} ACKs in batches of 256 (one commit's)",
        envelopes.len()
    );
    for (what, (seconds, server_s, arrived)) in [
        ("through a JetStream queue (publish, pull, ack)", queued),
        ("as plain NATS messages to a subscription", plain),
    ] {
        println!(
            "  {what:<48} {:>10.0} ACKs/s, server CPU {:.3} us an ACK, {arrived} arrived",
            arrived as f64 / seconds,
            server_s * 1e6 / messages
        );
    }
    Ok(())
}

/// The inbound hop on a server without TLS or identities and on one with both, alternated
/// `rounds` times: messages a second and the server's CPU per message of each.
fn trust(batches: &[Vec<Envelope>], messages: usize, rounds: usize) -> anyhow::Result<()> {
    use ste_engine::cluster::roles::Role;
    use ste_engine::queue::jetstream::NatsCredentials;
    let secrets = std::env::temp_dir().join(format!("jsbench-secrets-{}", std::process::id()));
    ste_driver::secrets::ensure(&ste_driver::secrets::SecretsSpec::new(&secrets))?;
    let settings = ste_driver::secrets::nats_server_settings(&secrets)?.top;
    let authorization =
        std::fs::read_to_string(secrets.join(ste_driver::secrets::NATS_AUTHORIZATION))?;
    let as_role =
        |role: Role| NatsCredentials::from_secrets(&secrets, &role.name(), role.inbox_prefix());
    let (load, node) = (as_role(Role::Load(0))?, as_role(Role::Node)?);
    let (load_plain, node_plain) = (load.clone().without_tls(), node.clone().without_tls());
    let none = NatsCredentials::none();
    println!(
        "jsbench --trust: {messages} messages in {} batches ({} bytes each as sent) onto ste.in.0 and off it by owner-0 at once, nats-server {}",
        batches.len(),
        ste_engine::queue::jetstream::payload_bytes(&batches[0]),
        server_version()
    );
    println!("  round  server                         msg/s   server CPU us/msg");
    let mut totals = [(0.0, 0.0); 3];
    for round in 1..=rounds {
        for (index, (what, settings, publisher, consumer)) in [
            ("plain, no identities", None, &none, &none),
            (
                "plain, nkeys, permissions",
                Some(authorization.as_str()),
                &load_plain,
                &node_plain,
            ),
            (
                "TLS, nkeys, permissions",
                Some(settings.as_str()),
                &load,
                &node,
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let server = Server::start_with(settings)?;
            let publishing = JetStream::connect_as(&server.url, publisher)?;
            let consuming = JetStream::connect_as(&server.url, consumer)?;
            publishing.ensure_queue("in.0", LIMITS)?;
            let pid = server.child.id();
            let (cpu, started) = (cpu_s(pid), Instant::now());
            std::thread::scope(|scope| -> anyhow::Result<()> {
                let taker =
                    scope.spawn(|| consume_as(&consuming, "in.0", "owner-0", batches.len()));
                let sender = publishing.sender::<Envelope>("in.0");
                for batch in batches {
                    sender.send(batch.clone())?;
                }
                taker
                    .join()
                    .map_err(|_| anyhow::anyhow!("the consumer panicked"))?
            })?;
            let seconds = started.elapsed().as_secs_f64();
            let server_us = (cpu_s(pid) - cpu) * 1e6 / messages as f64;
            let rate = messages as f64 / seconds;
            totals[index].0 += rate;
            totals[index].1 += server_us;
            println!("  {round:>5}  {what:<28} {rate:>9.0}   {server_us:>8.2}");
        }
    }
    let mean = |index: usize| {
        (
            totals[index].0 / rounds as f64,
            totals[index].1 / rounds as f64,
        )
    };
    let ((plain_rate, plain_us), (auth_rate, auth_us), (trust_rate, trust_us)) =
        (mean(0), mean(1), mean(2));
    println!(
        "  mean: plain {plain_rate:.0} msg/s, {plain_us:.2} us/msg; identities alone {auth_rate:.0} msg/s ({:+.1}%), {auth_us:.2} us/msg; TLS and identities {trust_rate:.0} msg/s ({:+.1}%), {trust_us:.2} us/msg",
        (auth_rate / plain_rate - 1.0) * 100.0,
        (trust_rate / plain_rate - 1.0) * 100.0
    );
    let _ = std::fs::remove_dir_all(&secrets);
    Ok(())
}

/// Takes `count` batches off `queue` through the durable consumer `durable`, acknowledging each.
fn consume_as(
    jetstream: &JetStream,
    queue: &str,
    durable: &str,
    count: usize,
) -> anyhow::Result<()> {
    let receiver = jetstream.receiver::<Envelope>(queue, durable, false)?;
    for _ in 0..count {
        let received = receiver
            .recv_until(Some(Instant::now() + Duration::from_secs(30)))?
            .context("a batch within 30 s")?;
        received.receipt.ack()?;
    }
    Ok(())
}

/// The server this benchmark runs.
fn server_binary() -> std::ffi::OsString {
    std::env::var_os("STE_NATS_SERVER").unwrap_or_else(|| "nats-server".into())
}

/// CPU seconds process `pid` has used (user and system).
fn cpu_s(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split_whitespace().collect();
            let ticks: f64 =
                fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(0.0)
}

/// ACKs in batches of one commit, through a JetStream queue and as plain messages: seconds and
/// server CPU seconds of each, and how many plain ACKs arrived.
fn answers(
    server: &Server,
    jetstream: &JetStream,
    count: usize,
) -> anyhow::Result<[(f64, f64, usize); 2]> {
    const COMMIT: usize = 256;
    let batches: Vec<Vec<Ack>> = (0..count as u64)
        .map(|correlation| Ack {
            correlation,
            origin: 0,
            result: AckResult::Accepted,
        })
        .collect::<Vec<_>>()
        .chunks(COMMIT)
        .map(<[Ack]>::to_vec)
        .collect();
    let pid = server.child.id();

    jetstream.ensure_queue("bench.acks", LIMITS)?;
    let (cpu, started) = (cpu_s(pid), Instant::now());
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let consumer = scope.spawn(|| -> anyhow::Result<()> {
            let receiver = jetstream.receiver::<Ack>("bench.acks", "gateway", false)?;
            for _ in 0..batches.len() {
                let received = receiver
                    .recv_until(Some(Instant::now() + Duration::from_secs(30)))?
                    .context("a batch within 30 s")?;
                received.receipt.ack()?;
            }
            Ok(())
        });
        let sender = jetstream.sender::<Ack>("bench.acks");
        for batch in &batches {
            sender.send(batch.clone())?;
        }
        consumer
            .join()
            .map_err(|_| anyhow::anyhow!("the consumer panicked"))?
    })?;
    let queued = (started.elapsed().as_secs_f64(), cpu_s(pid) - cpu, count);

    let receiver = jetstream.plain_receiver::<Ack>("bench.plain", "gateway")?;
    let (cpu, started) = (cpu_s(pid), Instant::now());
    let heard = std::thread::scope(|scope| -> anyhow::Result<usize> {
        let listener = scope.spawn(|| {
            let mut heard = 0;
            while heard < count {
                match receiver.recv_until(Some(Instant::now() + Duration::from_secs(2))) {
                    Ok(Some(received)) => heard += received.items.len(),
                    _ => break,
                }
            }
            heard
        });
        for batch in &batches {
            jetstream.publish_plain("bench.plain", batch)?;
        }
        listener
            .join()
            .map_err(|_| anyhow::anyhow!("the listener panicked"))
    })?;
    let plain = (started.elapsed().as_secs_f64(), cpu_s(pid) - cpu, heard);
    Ok([queued, plain])
}

fn postcard_bytes(batch: &[Envelope]) -> usize {
    postcard::to_allocvec(batch).map_or(0, |bytes| bytes.len())
}

fn server_version() -> String {
    Command::new(server_binary())
        .arg("--version")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|text| text.trim().trim_start_matches("nats-server: ").to_owned())
        .unwrap_or_default()
}
