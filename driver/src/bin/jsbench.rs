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
//! `cargo run --release -p ste-driver --bin jsbench -- --trades 50000`

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
        let port = ste_engine::ports::free_local_port()?;
        let store = std::env::temp_dir().join(format!("jsbench-{}", std::process::id()));
        std::fs::create_dir_all(&store)?;
        let child = Command::new(server_binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(&store)
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
    let receiver = jetstream.receiver::<Envelope>(queue, "bench", false)?;
    let started = Instant::now();
    for _ in 0..count {
        let received = receiver
            .recv_until(Some(Instant::now() + Duration::from_secs(30)))?
            .context("a batch within 30 s")?;
        received.receipt.ack()?;
    }
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
        "jsbench: {} messages of {trades} trades in {} batches of {} ({} bytes a batch in postcard), nats-server {} with file storage",
        envelopes.len(),
        batches.len(),
        INBOUND_BATCH_MESSAGES,
        batch_bytes,
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
