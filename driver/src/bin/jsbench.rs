//! `jsbench`: the raw rate of NATS JetStream for the engine's own batches, through the queue
//! seam's JetStream carrier — what distribution costs before any station runs.
//!
//! Generates `--trades N` standard trades, signs them as the gateways do, and sends their
//! envelopes in batches of 64 (the inbound batch) through one queue of a `nats-server -js` it
//! starts itself (its own port and store folder, file storage, as a cluster runs): first
//! publish only, then consume only (acknowledging each batch), then both at once. Prints
//! messages and batches per second and the bytes of a batch.
//!
//! `cargo run --release -p ste-driver --bin jsbench -- --trades 50000`

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ste_bridge::bench::arg;
use ste_engine::generator::{Generator, GeneratorConfig};
use ste_engine::pipeline::{sign_line, Envelope, INBOUND_BATCH_MESSAGES};
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
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let store = std::env::temp_dir().join(format!("jsbench-{}", std::process::id()));
        std::fs::create_dir_all(&store)?;
        let child = Command::new("nats-server")
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
    Ok(())
}

fn postcard_bytes(batch: &[Envelope]) -> usize {
    postcard::to_allocvec(batch).map_or(0, |bytes| bytes.len())
}

fn server_version() -> String {
    Command::new("nats-server")
        .arg("--version")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|text| text.trim().trim_start_matches("nats-server: ").to_owned())
        .unwrap_or_default()
}
