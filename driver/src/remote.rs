//! Load against a running engine node over framed XML (`driver --target tcp://HOST:PORT`).
//!
//! The driver acts as a service bureau: each of its connections logs on as every participant,
//! a trade's messages always go over the same connection (so they keep their order), and each
//! connection keeps up to `window` messages in flight. The first connection subscribes, so
//! every CLS is pushed to the driver once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ahash::{AHashMap, AHashSet};
use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use serde::Serialize;
use ste_bridge::client::{self, FrameWriter, Logon};
use ste_bridge::frame::{Frame, PushClass};
use ste_engine::generator::{FinalState, Generator, RunOutcome};
use ste_engine::pipeline::{inbound_index, sign_line};
use ste_engine::refdata::RefData;

use crate::{LatencySummary, MessageSetReader, Progress, Source, Tally};

/// How long the driver waits, once every message is answered, for a CLS still due before it
/// gives up on the rest ([`RemoteConfig::cls_wait`]'s default).
pub const CLS_WAIT_DEFAULT: Duration = Duration::from_secs(30);
/// How long the driver waits, once it said bye, for the engine to close its connections.
const BYE_WAIT: Duration = Duration::from_secs(10);
/// Missing CLS a report names one by one; the rest are counted.
const MISSING_NAMED_MAX: usize = 20;

/// A run against an engine node.
#[derive(Debug, Clone)]
pub struct RemoteConfig {
    /// `tcp://HOST:PORT` or `tls://HOST:PORT` of the engine's framed-XML listener.
    pub address: String,
    /// What a `tls://` target is verified with (and the client certificate, if any).
    pub tls: Option<ste_bridge::tls::ClientTls>,
    pub connections: usize,
    /// Messages in flight per connection.
    pub window: u64,
    pub source: Source,
    pub progress: bool,
    /// How long, once every message is answered, the driver goes on waiting for CLS that are
    /// due while none comes; then it reports the trades that did not complete. Also how long it
    /// waits for answers while none comes: past it, the messages still unanswered are counted
    /// ([`RemoteSummary::unanswered`]) and the run ends.
    pub cls_wait: Duration,
    /// Counts every answer as it comes (an observer's view of progress, e.g. the nemesis's).
    pub answers: Arc<AtomicU64>,
    /// How long a connection goes without any answer before its unanswered messages are sent
    /// again: a cluster's answers travel on plain NATS and one may be lost on its way; the
    /// shard answers a message it holds as a duplicate.
    pub resend_after: Duration,
}

/// What a run against an engine node measured.
#[derive(Debug, Clone, Serialize)]
pub struct RemoteSummary {
    pub target: String,
    pub connections: usize,
    pub window: u64,
    pub trades: Option<u64>,
    pub messages_in: u64,
    pub accepted: u64,
    pub duplicates: u64,
    pub exceptions: BTreeMap<String, u64>,
    /// Distinct CLS of this run's trades pushed to the driver.
    pub cls: u64,
    /// CLS of other runs' trades pushed meanwhile (a run with a run id tells them apart).
    pub other_runs_cls: u64,
    pub mismatched_advices: u64,
    pub elapsed_s: f64,
    pub throughput_msg_s: f64,
    /// From sending a message to its ACK or NAK (after the engine's commit).
    pub ack_latency_ms: LatencySummary,
    /// messages_in = accepted + duplicates + exceptions.
    pub conserved: bool,
    pub expected: Option<RunOutcome>,
    /// Messages, ACKs, NAKs by code and CLS as the generator expected.
    pub matches_expected: Option<bool>,
    /// Trades the generator expected to match whose CLS did not come within the wait: how many,
    /// and the ClsIds of the first of them.
    pub missing_cls: u64,
    pub missing_cls_ids: Vec<String>,
    /// Messages sent that had no answer when the driver stopped waiting (no answer came for
    /// the wait of [`RemoteConfig::cls_wait`]).
    pub unanswered: u64,
    /// Messages sent again after [`RemoteConfig::resend_after`] without an answer, and
    /// answers to a message already answered (a late answer of a message sent again).
    pub resent: u64,
    pub repeat_answers: u64,
}

/// What the reader of one connection counts.
#[derive(Default)]
struct Counts {
    repeat_answers: u64,
    /// CLS of trades of other runs (a subscriber gets every CLS still owed to it, and one the
    /// cluster was not sure it had delivered comes again).
    other_runs_cls: u64,
    duplicates: u64,
    exceptions: BTreeMap<String, u64>,
    cls: AHashSet<u128>,
    advices: u64,
    refused: Option<String>,
}

/// One connection's shared state.
struct Link {
    /// Messages answered (the first answer of each).
    answered: AtomicU64,
    cls: AtomicU64,
    /// When the last answer came (ns since the run's start).
    last_answer_ns: AtomicU64,
    in_flight: Mutex<InFlight>,
}

/// A connection's unanswered messages, kept to be sent again.
#[derive(Default)]
struct InFlight {
    /// The sequence number of every sending of an unanswered message → its number.
    by_seq: AHashMap<u64, u64>,
    /// Unanswered messages by number.
    unanswered: BTreeMap<u64, Unanswered>,
}

struct Unanswered {
    last_sent_ns: u64,
    seqs: Vec<u64>,
    sender: String,
    signature: [u8; 32],
    xml: Vec<u8>,
}

impl InFlight {
    /// The answer of sequence number `seq`: true when it is its message's first.
    fn answer(&mut self, seq: u64) -> bool {
        let Some(number) = self.by_seq.remove(&seq) else {
            return false;
        };
        if let Some(message) = self.unanswered.remove(&number) {
            for other in message.seqs {
                self.by_seq.remove(&other);
            }
        }
        true
    }
}

/// Runs the source against the engine at `config.address`.
pub fn run_remote(config: &RemoteConfig, refdata: Arc<RefData>) -> anyhow::Result<RemoteSummary> {
    let (address, tls) = match (
        config.address.strip_prefix("tcp://"),
        config.address.strip_prefix("tls://"),
    ) {
        (Some(address), _) => (address.to_owned(), None),
        (_, Some(address)) => {
            let tls = config.tls.clone().context(
                "a tls:// target needs the CA that signed its certificate (--tls-ca FILE)",
            )?;
            (address.to_owned(), Some(tls))
        }
        _ => anyhow::bail!(
            "--target {} is neither tcp://HOST:PORT nor tls://HOST:PORT",
            config.address
        ),
    };
    // The name the engine's certificate must carry: the target's host.
    let host = address
        .rsplit_once(':')
        .map_or(address.as_str(), |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let connections = config.connections.max(1);
    let window = config.window.max(1);
    let participants: Vec<String> = refdata
        .participants()
        .iter()
        .map(|p| p.bic.clone())
        .collect();
    let started = Instant::now();
    let tally = Arc::new(Tally::default());
    let mut writers = Vec::with_capacity(connections);
    let mut readers = Vec::with_capacity(connections);
    let mut links = Vec::with_capacity(connections);
    let mut closers = Vec::with_capacity(connections);
    for index in 0..connections {
        let logons: Vec<Logon<'_>> = participants
            .iter()
            .filter_map(|bic| {
                refdata.participant_mac(bic).map(|(_, key)| Logon {
                    participant: bic,
                    key,
                    subscribe: index == 0,
                })
            })
            .collect();
        let connected = match &tls {
            Some(tls) => client::connect_tls(&address, &host, tls, &logons),
            None => client::connect(address.as_str(), &logons),
        };
        let (writer, mut reader) =
            connected.with_context(|| format!("connecting to {}", config.address))?;
        closers.push(reader.closer().context("a connection's handle")?);
        let link = Arc::new(Link {
            answered: AtomicU64::new(0),
            cls: AtomicU64::new(0),
            last_answer_ns: AtomicU64::new(0),
            in_flight: Mutex::default(),
        });
        let (tally, link_for_reader) = (tally.clone(), link.clone());
        let answers = config.answers.clone();
        // A generated run with a run id knows its own CLS by the TradeRefs in their ids.
        let own_run: Option<Vec<u8>> = match &config.source {
            Source::Generated(generator) if !generator.run.is_empty() => {
                Some(format!("-T{}", generator.run).into_bytes())
            }
            _ => None,
        };
        readers.push(std::thread::spawn(move || {
            let mut counts = Counts::default();
            let mut latency =
                Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("a histogram");
            loop {
                let frame = match reader.next_frame() {
                    Ok(Some(frame)) => frame,
                    Ok(None) => break,
                    Err(error) => {
                        counts.refused = Some(format!("reading: {error}"));
                        break;
                    }
                };
                let first = |seq: u64| {
                    link_for_reader
                        .in_flight
                        .lock()
                        .map(|mut in_flight| in_flight.answer(seq))
                        .unwrap_or(false)
                };
                let seq = match &frame {
                    Frame::Ack { seq, .. } | Frame::Nak { seq, .. } if !first(*seq) => {
                        counts.repeat_answers += 1;
                        continue;
                    }
                    Frame::Ack { seq, duplicate } => {
                        if *duplicate {
                            counts.duplicates += 1;
                            tally.duplicates.fetch_add(1, Ordering::Relaxed);
                        } else {
                            tally.accepted.fetch_add(1, Ordering::Relaxed);
                        }
                        *seq
                    }
                    Frame::Nak { seq, code, .. } => {
                        *counts
                            .exceptions
                            .entry(code.as_str().to_owned())
                            .or_default() += 1;
                        *seq
                    }
                    Frame::Push {
                        class: PushClass::Cls,
                        xml,
                    } => {
                        let id = cls_id(xml);
                        if own_run
                            .as_ref()
                            .is_some_and(|tag| ste_engine::sign::find(id, tag).is_none())
                        {
                            counts.other_runs_cls += 1;
                            continue;
                        }
                        if counts.cls.insert(xxhash_rust::xxh3::xxh3_128(id)) {
                            link_for_reader.cls.fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    Frame::Push {
                        class: PushClass::Advice,
                        ..
                    } => {
                        counts.advices += 1;
                        continue;
                    }
                    Frame::Heartbeat => continue,
                    Frame::Error { code, detail } => {
                        counts.refused = Some(format!("{code} {detail}"));
                        break;
                    }
                    other => {
                        counts.refused = Some(format!("unexpected frame {other:?}"));
                        break;
                    }
                };
                // The sequence number of a message is its send time (see `Sender::send`).
                let now_ns = started.elapsed().as_nanos() as u64;
                latency.saturating_record((now_ns.saturating_sub(seq) / 1000).max(1));
                link_for_reader
                    .last_answer_ns
                    .store(now_ns, Ordering::Relaxed);
                link_for_reader.answered.fetch_add(1, Ordering::Relaxed);
                answers.fetch_add(1, Ordering::Relaxed);
                tally.acked.fetch_add(1, Ordering::Relaxed);
                tally.last_ack_ns.store(now_ns, Ordering::Relaxed);
            }
            (counts, latency)
        }));
        writers.push(writer);
        links.push(link);
    }

    let progress = Progress::start(&tally, &config.source, config.progress);

    let mut sender = Sender {
        refdata: &refdata,
        writers: &mut writers,
        links: &links,
        sent: vec![0; connections],
        window,
        started,
        submitted: &progress.submitted,
        patience: config.cls_wait,
        resend_after: config.resend_after,
        last_resend_check: Instant::now(),
        resent: 0,
    };
    let sent = match &config.source {
        Source::Generated(generator_config) => {
            let mut generator = Generator::new(&refdata, generator_config.clone());
            generator
                .by_ref()
                .try_for_each(|line| sender.send(line))
                .and_then(|()| sender.finish())
                .map(|count| (count, Some(generator.expected().clone())))
        }
        Source::File(path) => MessageSetReader::open(path)?
            .try_for_each(|line| sender.send(line.context("reading the message set")?))
            .and_then(|()| sender.finish())
            .map(|count| (count, None)),
    };
    let (messages_in, expected) = match sent {
        Ok(sent) => sent,
        Err(error) => {
            // A connection the engine closed says why on its reader.
            std::thread::sleep(Duration::from_millis(100));
            for reader in readers.into_iter().filter(|r| r.is_finished()) {
                if let Ok((
                    Counts {
                        refused: Some(why), ..
                    },
                    _,
                )) = reader.join()
                {
                    return Err(error.context(format!("the engine closed a connection: {why}")));
                }
            }
            return Err(error);
        }
    };

    // Every message answered; the last CLS may still be on their way.
    let answered = || {
        links
            .iter()
            .map(|l| l.answered.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let cls_seen = || {
        links
            .iter()
            .map(|l| l.cls.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    let readers_done = || readers.iter().all(|r| r.is_finished());
    // Answers may stop coming (a node lost what it owed): the wait ends once none has come for
    // the patience, and what is missing is counted.
    let mut last_answer = (answered(), Instant::now());
    while answered() < messages_in && !readers_done() {
        if answered() != last_answer.0 {
            last_answer = (answered(), Instant::now());
        } else if last_answer.1.elapsed() > config.cls_wait {
            break;
        }
        sender.resend_due()?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let resent = sender.resent;
    let unanswered = messages_in.saturating_sub(answered());
    let elapsed_s = match tally.last_ack_ns.load(Ordering::Relaxed) {
        0 => started.elapsed().as_secs_f64(),
        last => last as f64 / 1e9,
    };
    let cls_due = expected.as_ref().map(|e| e.cls);
    let mut last_progress = (cls_seen(), Instant::now());
    loop {
        let seen = cls_seen();
        if Some(seen) == cls_due || readers_done() {
            break;
        }
        if seen != last_progress.0 {
            last_progress = (seen, Instant::now());
        }
        let quiet = last_progress.1.elapsed();
        if quiet > config.cls_wait || (cls_due.is_none() && quiet > Duration::from_secs(2)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for writer in writers {
        let _ = writer.bye();
    }
    // The engine answers what is in flight and closes; one that owes answers it will never
    // give keeps the connection open, and the driver closes it after a while.
    let bye_at = Instant::now();
    while !readers_done() && bye_at.elapsed() < config.cls_wait.min(BYE_WAIT) {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !readers_done() {
        closers.iter().for_each(client::Closer::close);
    }
    progress.finish();

    let mut latency = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("a histogram");
    let mut exceptions = BTreeMap::new();
    let (mut duplicates, mut advices, mut other_runs_cls, mut repeat_answers) = (0, 0, 0, 0);
    let mut cls = AHashSet::new();
    for reader in readers {
        let (counts, histogram) = reader
            .join()
            .map_err(|_| anyhow::anyhow!("a reader thread panicked"))?;
        if let Some(refused) = counts.refused {
            bail!("the engine closed a connection: {refused}");
        }
        latency.add(&histogram).context("merging latencies")?;
        for (code, count) in counts.exceptions {
            *exceptions.entry(code).or_default() += count;
        }
        duplicates += counts.duplicates;
        advices += counts.advices;
        other_runs_cls += counts.other_runs_cls;
        repeat_answers += counts.repeat_answers;
        cls.extend(counts.cls);
    }
    let accepted = tally.accepted.load(Ordering::Relaxed);
    let exceptions_total: u64 = exceptions.values().sum();
    let matches_expected = expected.as_ref().map(|e| {
        e.messages_in == messages_in
            && e.accepted == accepted
            && e.duplicates == duplicates
            && e.exceptions == exceptions
            && e.cls == cls.len() as u64
    });
    let (missing_cls, missing_cls_ids) = match (&config.source, expected.as_ref()) {
        (Source::Generated(generator), Some(expected)) if (cls.len() as u64) < expected.cls => {
            missing(&refdata, generator, &cls)
        }
        _ => (0, Vec::new()),
    };
    let ms = |us: u64| us as f64 / 1000.0;
    Ok(RemoteSummary {
        target: config.address.clone(),
        connections,
        window,
        trades: expected.as_ref().map(|e| e.trades),
        messages_in,
        accepted,
        duplicates,
        exceptions,
        cls: cls.len() as u64,
        other_runs_cls,
        mismatched_advices: advices,
        elapsed_s,
        throughput_msg_s: messages_in as f64 / elapsed_s.max(1e-9),
        ack_latency_ms: LatencySummary {
            p50: ms(latency.value_at_quantile(0.50)),
            p99: ms(latency.value_at_quantile(0.99)),
            p999: ms(latency.value_at_quantile(0.999)),
            max: ms(latency.max()),
            mean: latency.mean() / 1000.0,
        },
        conserved: messages_in == accepted + duplicates + exceptions_total,
        expected,
        matches_expected,
        missing_cls,
        missing_cls_ids,
        unanswered,
        resent,
        repeat_answers,
    })
}

/// The trades of `generator`'s set that should have matched and whose CLS is not among `seen`
/// (hashes of ClsIds): how many, and the ClsIds of the first [`MISSING_NAMED_MAX`]. The set is
/// generated again rather than kept, so that a run holds no list of its trades.
fn missing(
    refdata: &RefData,
    generator: &ste_engine::generator::GeneratorConfig,
    seen: &AHashSet<u128>,
) -> (u64, Vec<String>) {
    let mut trades = Generator::new(refdata, generator.clone());
    let (mut count, mut named) = (0, Vec::new());
    while let Some(case) = trades.next_trade() {
        if case.final_state != FinalState::Matched {
            continue;
        }
        let Some((broker, trade_ref)) = case.trade_key.split_once('/') else {
            continue;
        };
        let cls_id = ste_engine::model::cls_id(broker, trade_ref);
        if !seen.contains(&xxhash_rust::xxh3::xxh3_128(cls_id.as_bytes())) {
            count += 1;
            if named.len() < MISSING_NAMED_MAX {
                named.push(cls_id);
            }
        }
    }
    (count, named)
}

/// The ClsId of a pushed CLS (the whole push when it names none).
fn cls_id(xml: &[u8]) -> &[u8] {
    static CLS_ID: std::sync::LazyLock<ste_engine::sign::Element> =
        std::sync::LazyLock::new(|| ste_engine::sign::Element::new("ClsId"));
    CLS_ID.text(xml).unwrap_or(xml)
}

/// Sends messages over the connections, a trade's messages always over the same one.
struct Sender<'a> {
    refdata: &'a RefData,
    writers: &'a mut Vec<FrameWriter>,
    links: &'a [Arc<Link>],
    sent: Vec<u64>,
    window: u64,
    started: Instant,
    submitted: &'a AtomicU64,
    /// How long a full window waits for an answer before the run gives up.
    patience: Duration,
    resend_after: Duration,
    last_resend_check: Instant,
    resent: u64,
}

impl Sender<'_> {
    fn send(&mut self, line: Vec<u8>) -> anyhow::Result<()> {
        let index = inbound_index(&line, self.writers.len());
        let link = &self.links[index];
        let sent = self.sent[index];
        if sent.saturating_sub(link.answered.load(Ordering::Relaxed)) >= self.window {
            // The window is full: what is buffered must go, or its answers never come.
            self.writers[index].flush().context("sending")?;
            let mut last = (link.answered.load(Ordering::Relaxed), Instant::now());
            while sent.saturating_sub(link.answered.load(Ordering::Relaxed)) >= self.window {
                let answered = link.answered.load(Ordering::Relaxed);
                if answered != last.0 {
                    last = (answered, Instant::now());
                } else if last.1.elapsed() > self.patience {
                    bail!(
                        "no answer for {:.0} s with {} messages in flight on connection {index}",
                        self.patience.as_secs_f64(),
                        sent.saturating_sub(answered)
                    );
                }
                self.resend_due()?;
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        // The engine only echoes the sequence number, so it carries the send time: the answer
        // then tells its own latency, whatever order answers come in.
        let seq = self.started.elapsed().as_nanos() as u64;
        let envelope = sign_line(self.refdata, line, seq, 0);
        // An unsigned line (no sender, or one without a key) goes with what it has and a zero
        // signature: the engine rejects it with E_SIG, as in process.
        let frame = Frame::Message {
            seq,
            sender: envelope.sender.unwrap_or_default().into_string(),
            signature: envelope.signature.unwrap_or([0; 32]),
            xml: envelope.bytes,
        };
        if let Frame::Message {
            sender,
            signature,
            xml,
            ..
        } = &frame
        {
            // Kept until answered, to be sent again if its answer is lost.
            let mut in_flight = link.in_flight.lock().expect("in flight");
            in_flight.by_seq.insert(seq, sent);
            in_flight.unanswered.insert(
                sent,
                Unanswered {
                    last_sent_ns: seq,
                    seqs: vec![seq],
                    sender: sender.clone(),
                    signature: *signature,
                    xml: xml.clone(),
                },
            );
        }
        self.writers[index].send(&frame).context("sending")?;
        self.sent[index] += 1;
        self.resend_due()?;
        self.submitted.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Sends again, on a connection that has had no answer for the resend time, the messages
    /// it has not had answered for as long (looked at every 100 ms).
    fn resend_due(&mut self) -> anyhow::Result<()> {
        if self.last_resend_check.elapsed() < Duration::from_millis(100) {
            return Ok(());
        }
        self.last_resend_check = Instant::now();
        let after_ns = self.resend_after.as_nanos() as u64;
        for (index, link) in self.links.iter().enumerate() {
            let now_ns = self.started.elapsed().as_nanos() as u64;
            if now_ns.saturating_sub(link.last_answer_ns.load(Ordering::Relaxed)) < after_ns {
                continue;
            }
            let mut frames = Vec::new();
            {
                let mut in_flight = link.in_flight.lock().expect("in flight");
                let InFlight { by_seq, unanswered } = &mut *in_flight;
                for (number, message) in unanswered.iter_mut() {
                    if now_ns.saturating_sub(message.last_sent_ns) < after_ns {
                        continue;
                    }
                    // A sequence number of its own, after every other of this connection.
                    let seq = (now_ns + frames.len() as u64).max(message.last_sent_ns + 1);
                    message.last_sent_ns = seq;
                    message.seqs.push(seq);
                    by_seq.insert(seq, *number);
                    frames.push(Frame::Message {
                        seq,
                        sender: message.sender.clone(),
                        signature: message.signature,
                        xml: message.xml.clone(),
                    });
                }
            }
            if frames.is_empty() {
                continue;
            }
            self.resent += frames.len() as u64;
            for frame in &frames {
                self.writers[index].send(frame).context("sending again")?;
            }
            self.writers[index].flush().context("sending again")?;
        }
        Ok(())
    }

    /// Flushes every connection; the number of messages sent.
    fn finish(&mut self) -> anyhow::Result<u64> {
        for writer in self.writers.iter_mut() {
            writer.flush().context("sending")?;
        }
        Ok(self.sent.iter().sum())
    }
}
