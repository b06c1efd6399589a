//! The gateway between the listeners and the engine: the pipeline in this process, or the
//! shards' inbound queues of a cluster.
//!
//! Listeners submit messages through a [`GatewayHandle`]; one ingress thread owns the engine's
//! submitter and batches what the connections send. Every message gets a correlation id that
//! routes its ACK or NAK, after commit, back to the connection that sent it. The outbound
//! thread pushes each CLS and status advice to the connections subscribed for a party of the
//! trade; in process it is also the engine's sink (CLS file, repeats dropped, delivery
//! confirmed), while in a cluster the sink consumes the CLS queue and the gateway pushes copies.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;

use ahash::{AHashMap, AHashSet};
use ste_engine::cluster::Ingress;
use ste_engine::pipeline::{
    Ack, AckResult, Delivery, Envelope, OutboundEvent, Pipeline, PipelineConfig, PipelineError,
    PipelineReport, Submitter,
};
use ste_engine::profile::Tolerances;
use ste_engine::queue::jetstream::StopReceiving;
use ste_engine::queue::Rx;
use ste_engine::reason::{ReasonCode, Rejection};
use ste_engine::refdata::RefData;
use ste_engine::sign::{self, SIGNATURE_LEN};
use ste_engine::station::RunClock;
use ste_sink::{Sink, SinkReport};
use tokio::sync::{mpsc, watch};

use crate::frame::{self, PushClass, NONCE_LEN};

/// Envelopes the ingress thread takes from the channel before it flushes the submitter.
const INGRESS_DRAIN_MAX: usize = 4096;

/// How the gateway runs the engine.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub pipeline: PipelineConfig,
    pub tolerances: Tolerances,
    /// Every CLS, one per line, flushed before its delivery is confirmed.
    pub cls_out: Option<PathBuf>,
    /// Messages that may wait between the listeners and the ingress thread.
    pub ingress_capacity: usize,
    /// Messages a second one participant may submit once it has proved who it is (a burst of
    /// as many); a faster one is slowed, not refused, so that no participant takes the
    /// engine from the others. 0: no bound.
    pub participant_rate: u32,
}

/// Default of [`GatewayConfig::participant_rate`].
pub const PARTICIPANT_RATE_DEFAULT: u32 = 10_000;

/// A token bucket per participant: how long its next message must wait.
#[derive(Default)]
struct Pacing {
    buckets: AHashMap<String, (f64, tokio::time::Instant)>,
}

impl Pacing {
    /// Takes one message of `participant` at `now`, at `rate` a second: how long it waits first.
    fn wait(
        &mut self,
        participant: &str,
        rate: f64,
        now: tokio::time::Instant,
    ) -> std::time::Duration {
        let (tokens, at) = match self.buckets.get_mut(participant) {
            Some(bucket) => bucket,
            None => self
                .buckets
                .entry(participant.to_owned())
                .or_insert((rate, now)),
        };
        if now > *at {
            *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(rate);
            *at = now;
        }
        *tokens -= 1.0;
        if *tokens >= 0.0 {
            std::time::Duration::ZERO
        } else {
            std::time::Duration::from_secs_f64(-*tokens / rate)
        }
    }
}

/// The answer to one message, for the connection that sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// The sequence number the participant gave the message.
    pub seq: u64,
    pub result: AckResult,
    /// Bytes of the message answered, which its connection may now send again.
    pub bytes: u32,
}

/// A CLS or advice on its way to a subscriber.
#[derive(Debug, Clone)]
pub struct Pushed {
    pub class: PushClass,
    pub xml: Arc<[u8]>,
}

/// A connection subscribed for a participant's CLS and advices.
#[derive(Debug, Clone)]
pub struct Subscriber {
    pub connection: u64,
    pub push: mpsc::Sender<Pushed>,
    /// Set when the subscriber falls behind: its connection closes.
    pub kick: watch::Sender<bool>,
}

/// Counts kept by the gateway.
#[derive(Debug, Default)]
pub struct GatewayCounters {
    pub submitted: AtomicU64,
    pub accepted: AtomicU64,
    pub duplicates: AtomicU64,
    pub rejected: AtomicU64,
    /// Answers whose connection had gone (the participant re-sends and gets a duplicate ACK).
    pub unrouted: AtomicU64,
    pub pushed: AtomicU64,
    /// Subscribers closed because they did not read their pushes.
    pub slow_subscribers: AtomicU64,
}

struct Route {
    seq: u64,
    reply: mpsc::Sender<Reply>,
    bytes: u32,
}

/// What listeners share.
pub struct Shared {
    refdata: Arc<RefData>,
    clock: RunClock,
    next_correlation: AtomicU64,
    next_connection: AtomicU64,
    routes: Mutex<AHashMap<u64, Route>>,
    subscribers: RwLock<AHashMap<String, Vec<Subscriber>>>,
    fix_sessions: Mutex<FixSessions>,
    /// Per authenticated participant ([`GatewayConfig::participant_rate`]).
    pacing: Mutex<Pacing>,
    participant_rate: u32,
    pub counters: GatewayCounters,
}

/// FIX logons of one participant remembered so that a password is good once: at most this many
/// inside the window, after which that participant's logons, and no one else's, are refused
/// E_BUSY until the oldest leave the window.
pub const FIX_LOGONS_PER_PARTICIPANT_MAX: usize = 256;

/// The FIX sessions: the live one of each participant, and the logons used lately.
#[derive(Default)]
struct FixSessions {
    /// Per participant (one that signed its logon), the SendingTime of each logon accepted
    /// inside the freshness window to the millisecond, with when, oldest first.
    used: AHashMap<String, std::collections::VecDeque<(String, std::time::Instant)>>,
    /// The connection of each participant's live session.
    live: AHashMap<String, u64>,
}

/// What a listener holds to submit messages and manage subscriptions.
#[derive(Clone)]
pub struct GatewayHandle {
    shared: Arc<Shared>,
    ingress: mpsc::Sender<Envelope>,
}

/// Why a submission did not reach the engine.
#[derive(Debug, thiserror::Error)]
#[error("the engine is shutting down")]
pub struct ShuttingDown;

impl GatewayHandle {
    /// Reference data (participants and their keys).
    pub fn refdata(&self) -> &RefData {
        &self.shared.refdata
    }

    /// A new connection id.
    pub fn connection_id(&self) -> u64 {
        self.shared.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// The counters.
    pub fn counters(&self) -> &GatewayCounters {
        &self.shared.counters
    }

    /// Checks a logon: `participant` must have a key, and `mac` must be the logon MAC over
    /// `nonce` with it.
    pub fn authenticate(
        &self,
        participant: &str,
        nonce: &[u8; NONCE_LEN],
        mac: &[u8; SIGNATURE_LEN],
    ) -> Result<(), Rejection> {
        // Constant time: the MAC's own verification, under each of the participant's keys.
        let covered = frame::logon_covered(nonce, participant);
        let Some(verified) = self
            .shared
            .refdata
            .verify_signature(participant, &covered, mac)
        else {
            return Err(Rejection::new(
                ReasonCode::Auth,
                format!("{participant} is not a participant"),
            ));
        };
        if verified {
            Ok(())
        } else {
            Err(Rejection::new(
                ReasonCode::Sig,
                format!("logon of {participant} is not signed with its key"),
            ))
        }
    }

    /// Whether `signature` is `sender`'s signature of `bytes`.
    pub fn signed_by(&self, sender: &str, bytes: &[u8], signature: &[u8]) -> bool {
        self.shared
            .refdata
            .verify_signature(sender, bytes, signature)
            .unwrap_or(false)
    }

    /// E_AUTH for a message correctly signed by `signer` that names another participant as its
    /// Sender: a participant may only send as itself. (A wrong signature is left to the
    /// validator's E_SIG, which comes first in the order of checks.)
    pub fn impersonation(&self, signer: &str, bytes: &[u8], signature: &[u8]) -> Option<Rejection> {
        let claimed = sign::claimed_sender(bytes)?;
        (claimed != signer && self.signed_by(signer, bytes, signature)).then(|| {
            Rejection::new(
                ReasonCode::Auth,
                format!("{signer} may not send as {claimed}"),
            )
        })
    }

    /// Waits until `participant` — one whose key this connection has seen checked: a logon, a
    /// FIX session, a verified SOAP signature — may submit its next message at its rate. The
    /// connection waits with it; nothing is refused or lost.
    pub async fn pace(&self, participant: &str) {
        if self.shared.participant_rate == 0 {
            return;
        }
        let wait = self
            .shared
            .pacing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .wait(
                participant,
                f64::from(self.shared.participant_rate),
                tokio::time::Instant::now(),
            );
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Submits one message; its answer goes to `reply` tagged with `seq`. Waits while the
    /// engine's inbound side is full.
    pub async fn submit(
        &self,
        mut envelope: Envelope,
        seq: u64,
        reply: &mpsc::Sender<Reply>,
    ) -> Result<(), ShuttingDown> {
        let correlation = self.shared.next_correlation.fetch_add(1, Ordering::Relaxed);
        envelope.correlation = correlation;
        envelope.injected_ns = self.shared.clock.now_ns();
        self.shared
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                correlation,
                Route {
                    seq,
                    reply: reply.clone(),
                    bytes: u32::try_from(envelope.bytes.len()).unwrap_or(u32::MAX),
                },
            );
        if self.ingress.send(envelope).await.is_err() {
            self.shared
                .routes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&correlation);
            return Err(ShuttingDown);
        }
        self.shared
            .counters
            .submitted
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Subscribes a connection for the CLS and advices of `participant`.
    pub fn subscribe(&self, participant: &str, subscriber: Subscriber) {
        let mut subscribers = self
            .shared
            .subscribers
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let list = subscribers.entry(participant.to_owned()).or_default();
        // Once per connection and participant, however often it logs on.
        if list.iter().all(|s| s.connection != subscriber.connection) {
            list.push(subscriber);
        }
    }

    /// Claims `participant`'s FIX session for `connection` with a logon whose password was
    /// checked (`Err`: the Logout's text): refused when that logon (participant and SendingTime) was already used — a
    /// password is good once — or when another session of the participant is live. Logons are
    /// remembered for `freshness` (how old a SendingTime may be, on either side of the clock).
    pub fn claim_fix_session(
        &self,
        participant: &str,
        sending_time: &str,
        connection: u64,
        freshness: std::time::Duration,
    ) -> Result<(), String> {
        let now = std::time::Instant::now();
        let mut sessions = self
            .shared
            .fix_sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let sending_time = to_millisecond(sending_time);
        let sessions = &mut *sessions;
        let used = sessions.used.entry(participant.to_owned()).or_default();
        while used
            .front()
            .is_some_and(|(_, used_at)| now.duration_since(*used_at) > freshness * 2)
        {
            used.pop_front();
        }
        if used.iter().any(|(time, _)| *time == sending_time) {
            return Err(format!(
                "E_AUTH the logon of {participant} at {sending_time} was already used"
            ));
        }
        if sessions.live.contains_key(participant) {
            return Err(format!(
                "E_AUTH {participant} already has a live FIX session"
            ));
        }
        if used.len() >= FIX_LOGONS_PER_PARTICIPANT_MAX {
            return Err(format!(
                "E_BUSY too many FIX logons of {participant} lately; try again in a few minutes"
            ));
        }
        used.push_back((sending_time, now));
        sessions.live.insert(participant.to_owned(), connection);
        Ok(())
    }

    /// Ends `connection`'s claim on `participant`'s FIX session.
    pub fn release_fix_session(&self, participant: &str, connection: u64) {
        let mut sessions = self
            .shared
            .fix_sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if sessions.live.get(participant) == Some(&connection) {
            sessions.live.remove(participant);
        }
    }

    /// Ends every subscription of a connection.
    pub fn unsubscribe(&self, connection: u64) {
        unsubscribe(&self.shared, &AHashSet::from_iter([connection]));
    }
}

/// A FIX SendingTime to the millisecond: further digits are cut and missing ones are zeros, so
/// that one instant is one logon however many sub-second digits spell it.
fn to_millisecond(sending_time: &str) -> String {
    let (whole, fraction) = sending_time.split_once('.').unwrap_or((sending_time, ""));
    let mut millis: String = fraction.chars().take(3).collect();
    while millis.len() < 3 {
        millis.push('0');
    }
    format!("{whole}.{millis}")
}

fn unsubscribe(shared: &Shared, connections: &AHashSet<u64>) {
    if connections.is_empty() {
        return;
    }
    let mut subscribers = shared
        .subscribers
        .write()
        .unwrap_or_else(PoisonError::into_inner);
    subscribers.retain(|_, list| {
        list.retain(|s| !connections.contains(&s.connection));
        !list.is_empty()
    });
}

/// The engine behind the listeners.
pub struct Gateway {
    shared: Arc<Shared>,
    ingress: Option<mpsc::Sender<Envelope>>,
    engine: Option<Engine>,
    ingress_thread: Option<JoinHandle<Result<(), PipelineError>>>,
    ack_thread: Option<JoinHandle<()>>,
    outbound_thread: Option<JoinHandle<std::io::Result<SinkReport>>>,
}

/// What the listeners put messages into.
enum Engine {
    /// The whole queue network, in this process.
    InProcess(Box<Pipeline>),
    /// A cluster's inbound queues, through a gateway number whose subject answers; the
    /// copies of the cluster's CLS it pushes end when `pushes_stop` is used.
    Cluster {
        ingress: Box<Ingress>,
        pushes_stop: StopReceiving,
    },
}

/// How long a gateway in front of a cluster waits, when it stops, for the answers to what it
/// submitted.
const CLUSTER_ANSWERS_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// What a stopped gateway reports.
#[derive(Debug)]
pub struct GatewayReport {
    /// The pipeline's report, in process (a cluster's shards report on their nodes).
    pub pipeline: Option<PipelineReport>,
    pub sink: SinkReport,
    pub submitted: u64,
    pub accepted: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub unrouted: u64,
    pub pushed: u64,
    pub slow_subscribers: u64,
}

/// Why the gateway could not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error("CLS output: {0}")]
    Sink(#[from] std::io::Error),
    #[error("a gateway thread panicked")]
    Panicked,
}

impl Gateway {
    /// Starts the pipeline and the gateway's threads.
    pub fn start(config: &GatewayConfig, refdata: Arc<RefData>) -> Result<Self, GatewayError> {
        let pipeline =
            Pipeline::start(&config.pipeline, refdata.clone(), config.tolerances.clone())?;
        let clock = pipeline.clock();
        let submitter = pipeline.submitter();
        let acks = pipeline.acks();
        let events = pipeline.outbound();
        let delivery = Some(pipeline.delivery());
        Self::start_on(
            Engine::InProcess(Box::new(pipeline)),
            Parts {
                clock,
                submitter,
                acks,
                events,
                delivery,
            },
            config,
            refdata,
        )
    }

    /// Starts the gateway's threads in front of a cluster: messages go to its inbound
    /// partitions stamped with `ingress`'s gateway number, answers come back on that number's
    /// ACK queue, and `pushes` (copies of the CLS queue) go to the subscribed connections.
    ///
    /// With `delivery`, `pushes` is the CLS queue itself and this gateway is the cluster's
    /// sink: every CLS is pushed to the connections subscribed for its parties, written to
    /// `cls_out` and then confirmed, so that a CLS published while this gateway's NATS
    /// connection was down reaches them when it is back (the queue keeps it). Without, `pushes`
    /// are copies, and what is published while the connection is down is not pushed.
    pub fn start_cluster(
        mut ingress: Ingress,
        pushes: Rx<OutboundEvent>,
        pushes_stop: StopReceiving,
        delivery: Option<Delivery>,
        config: &GatewayConfig,
        refdata: Arc<RefData>,
    ) -> Result<Self, GatewayError> {
        let clock = RunClock::start();
        let submitter = ingress.submitter(clock);
        let acks = ingress.take_acks().ok_or_else(|| {
            GatewayError::Pipeline(PipelineError::Config(
                "the gateway's ACK queue was taken already".to_owned(),
            ))
        })?;
        Self::start_on(
            Engine::Cluster {
                ingress: Box::new(ingress),
                pushes_stop,
            },
            Parts {
                clock,
                submitter,
                acks,
                events: pushes,
                delivery,
            },
            config,
            refdata,
        )
    }

    fn start_on(
        engine: Engine,
        parts: Parts,
        config: &GatewayConfig,
        refdata: Arc<RefData>,
    ) -> Result<Self, GatewayError> {
        let Parts {
            clock,
            submitter,
            acks,
            events,
            delivery,
        } = parts;
        let shared = Arc::new(Shared {
            refdata,
            clock,
            next_correlation: AtomicU64::new(0),
            next_connection: AtomicU64::new(0),
            routes: Mutex::new(AHashMap::new()),
            subscribers: RwLock::new(AHashMap::new()),
            fix_sessions: Mutex::new(FixSessions::default()),
            pacing: Mutex::new(Pacing::default()),
            participant_rate: config.participant_rate,
            counters: GatewayCounters::default(),
        });
        let (ingress_tx, ingress_rx) = mpsc::channel(config.ingress_capacity.max(1));
        let ingress_thread = spawn("gateway-ingress", move || {
            run_ingress(ingress_rx, submitter)
        });
        let ack_thread = {
            let shared = shared.clone();
            spawn("gateway-acks", move || loop {
                match ste_engine::queue::receive(&acks) {
                    Ok(Some(received)) => route_acks(&shared, &received.items),
                    Ok(None) => break,
                    Err(error) => {
                        tracing::error!(%error, "the ack queue failed; no more ACKs are routed");
                        break;
                    }
                }
            })
        };
        // In process, and on a cluster node that also runs the sink, the gateway is the sink
        // and writes the CLS file; otherwise it only pushes copies (the cluster's sink writes
        // and confirms).
        let sink = Sink::new(
            config.cls_out.as_deref().filter(|_| delivery.is_some()),
            true,
        )?;
        let outbound_thread = {
            let shared = shared.clone();
            spawn("gateway-outbound", move || {
                let result =
                    ste_sink::run_with(events, sink, clock, delivery, |event| push(&shared, event));
                // Nothing more will be pushed: the subscribers' connections may close.
                shared
                    .subscribers
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
                result
            })
        };
        Ok(Self {
            shared,
            ingress: Some(ingress_tx),
            engine: Some(engine),
            ingress_thread: Some(ingress_thread),
            ack_thread: Some(ack_thread),
            outbound_thread: Some(outbound_thread),
        })
    }

    /// A handle for a listener.
    pub fn handle(&self) -> GatewayHandle {
        GatewayHandle {
            shared: self.shared.clone(),
            ingress: self
                .ingress
                .clone()
                .expect("the ingress lives until finish"),
        }
    }

    /// The pipeline's run clock.
    pub fn clock(&self) -> RunClock {
        self.shared.clock
    }

    /// Drains and stops: once every handle is dropped (the listeners have stopped reading),
    /// what was submitted is committed and answered, outbound is drained, and the pipeline
    /// reports. Blocks.
    pub fn finish(mut self) -> Result<GatewayReport, GatewayError> {
        self.ingress = None;
        let ingress = join(self.ingress_thread.take());
        let pipeline = match self.engine.take() {
            Some(Engine::InProcess(pipeline)) => Some(pipeline.finish()),
            Some(Engine::Cluster {
                ingress,
                pushes_stop,
            }) => {
                // The cluster answers what was submitted; the connections waiting for those
                // answers are owed them.
                let since = std::time::Instant::now();
                while self.unanswered() > 0 && since.elapsed() < CLUSTER_ANSWERS_WAIT {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let unanswered = self.unanswered();
                if unanswered > 0 {
                    tracing::warn!(
                        unanswered,
                        "stopping with messages the cluster did not answer in time"
                    );
                }
                ingress.stop();
                pushes_stop.stop();
                None
            }
            None => return Err(GatewayError::Panicked),
        };
        join(self.ack_thread.take()).map_err(|_| GatewayError::Panicked)?;
        let sink = join(self.outbound_thread.take()).map_err(|_| GatewayError::Panicked)??;
        ingress.map_err(|_| GatewayError::Panicked)??;
        let pipeline = pipeline.transpose()?;
        let counters = &self.shared.counters;
        Ok(GatewayReport {
            pipeline,
            sink,
            submitted: counters.submitted.load(Ordering::Relaxed),
            accepted: counters.accepted.load(Ordering::Relaxed),
            duplicates: counters.duplicates.load(Ordering::Relaxed),
            rejected: counters.rejected.load(Ordering::Relaxed),
            unrouted: counters.unrouted.load(Ordering::Relaxed),
            pushed: counters.pushed.load(Ordering::Relaxed),
            slow_subscribers: counters.slow_subscribers.load(Ordering::Relaxed),
        })
    }

    /// Messages submitted whose answer has not come back.
    fn unanswered(&self) -> usize {
        self.shared
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// The queues a gateway works with, whatever engine is behind them.
struct Parts {
    clock: RunClock,
    submitter: Submitter,
    acks: Rx<Ack>,
    events: Rx<OutboundEvent>,
    delivery: Option<Delivery>,
}

fn spawn<T: Send + 'static>(
    name: &str,
    body: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(body)
        .expect("the operating system can start a thread")
}

fn join<T>(handle: Option<JoinHandle<T>>) -> Result<T, GatewayError> {
    handle
        .ok_or(GatewayError::Panicked)?
        .join()
        .map_err(|_| GatewayError::Panicked)
}

/// Takes envelopes from the listeners and submits them, flushing whenever the channel runs dry.
fn run_ingress(
    mut rx: mpsc::Receiver<Envelope>,
    mut submitter: Submitter,
) -> Result<(), PipelineError> {
    while let Some(envelope) = rx.blocking_recv() {
        submitter.submit(envelope)?;
        for _ in 0..INGRESS_DRAIN_MAX {
            match rx.try_recv() {
                Ok(envelope) => submitter.submit(envelope)?,
                Err(_) => break,
            }
        }
        submitter.flush()?;
    }
    submitter.flush()
}

fn route_acks(shared: &Shared, batch: &[ste_engine::pipeline::Ack]) {
    let counters = &shared.counters;
    let mut routes = shared.routes.lock().unwrap_or_else(PoisonError::into_inner);
    for ack in batch {
        match ack.result {
            AckResult::Accepted => counters.accepted.fetch_add(1, Ordering::Relaxed),
            AckResult::Duplicate => counters.duplicates.fetch_add(1, Ordering::Relaxed),
            AckResult::Rejected(_) => counters.rejected.fetch_add(1, Ordering::Relaxed),
        };
        let Some(route) = routes.remove(&ack.correlation) else {
            counters.unrouted.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        // The connection's reply channel holds its whole window, so this only fails when the
        // connection has gone.
        if route
            .reply
            .try_send(Reply {
                seq: route.seq,
                result: ack.result,
                bytes: route.bytes,
            })
            .is_err()
        {
            counters.unrouted.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The text of every `<tag>…</tag>` in `xml`.
fn texts_of<'a>(xml: &'a str, tag: &str) -> Vec<&'a str> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let mut found = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(&close) else { break };
        found.push(&after[..end]);
        rest = &after[end + close.len()..];
    }
    found
}

/// The status advice of a mismatched trade, as pushed to its broker.
pub fn advice_xml(advice: &ste_engine::matcher::Advice) -> String {
    status_advice_xml("MISMATCHED", &advice.trade_key, &advice.failed)
}

/// The advice to the sender of a message that a trade released: it was accepted before the
/// trade's NOE named the investment manager, and its sender is not a party of the trade.
pub fn released_xml(released: &ste_engine::matcher::Released) -> String {
    let mut xml = status_advice_xml("RELEASED", &released.trade_key, &[]);
    let end = xml.len() - "</Advice>".len();
    let mut tail = String::new();
    ste_engine::codec::push_element(&mut tail, "MsgId", &released.msg_id);
    ste_engine::codec::push_element(&mut tail, "Reason", ReasonCode::Auth.as_str());
    xml.insert_str(end, &tail);
    xml
}

/// A status advice: the trade's status, its key and, for MISMATCHED, the failed criteria.
fn status_advice_xml(
    status: &str,
    trade_key: &str,
    failed: &[ste_engine::reason::Criterion],
) -> String {
    let (broker, trade_ref) = trade_key.split_once('/').unwrap_or((trade_key, ""));
    use ste_engine::codec::push_element;
    let mut xml = format!(
        "<Advice xmlns=\"{}\"><Status>{status}</Status>",
        ste_engine::codec::NAMESPACE
    );
    // Identifiers are printable ASCII, which includes '<' and '&': every text is escaped.
    push_element(&mut xml, "Broker", broker);
    push_element(&mut xml, "TradeRef", trade_ref);
    for criterion in failed {
        xml.push_str("<Failed>");
        push_element(&mut xml, "Criterion", &criterion.to_string());
        push_element(&mut xml, "Reason", criterion.reason());
        xml.push_str("</Failed>");
    }
    xml.push_str("</Advice>");
    xml
}

/// Pushes an outbound event to the connections subscribed for its parties, once per connection;
/// a subscriber whose queue is full is closed.
fn push(shared: &Shared, event: &OutboundEvent) {
    // The sink calls this for every event: with nobody subscribed there is nothing to build.
    if shared
        .subscribers
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .is_empty()
    {
        return;
    }
    let (class, xml, parties): (PushClass, Arc<[u8]>, Vec<String>) = match event {
        OutboundEvent::Cls { body, .. } => {
            let mut parties: Vec<String> = ["Broker", "InvMgr", "Custodian"]
                .iter()
                .flat_map(|tag| texts_of(body, tag))
                .map(str::to_owned)
                .collect();
            parties.sort_unstable();
            parties.dedup();
            (PushClass::Cls, Arc::from(body.as_bytes()), parties)
        }
        OutboundEvent::Mismatched(advice) => {
            let broker = advice
                .trade_key
                .split_once('/')
                .map_or(advice.trade_key.as_str(), |(broker, _)| broker);
            (
                PushClass::Advice,
                Arc::from(advice_xml(advice).into_bytes()),
                vec![broker.to_owned()],
            )
        }
        OutboundEvent::Released(released) => (
            PushClass::Advice,
            Arc::from(released_xml(released).into_bytes()),
            vec![released.sender.clone()],
        ),
        OutboundEvent::Aged(aged) => (
            PushClass::Advice,
            Arc::from(status_advice_xml("AGED", &aged.trade_key, &[]).into_bytes()),
            aged.parties.clone(),
        ),
    };
    let mut sent_to = AHashSet::new();
    let mut slow = AHashSet::new();
    {
        let subscribers = shared
            .subscribers
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        for party in &parties {
            for subscriber in subscribers.get(party).into_iter().flatten() {
                if !sent_to.insert(subscriber.connection) {
                    continue;
                }
                let pushed = Pushed {
                    class,
                    xml: xml.clone(),
                };
                match subscriber.push.try_send(pushed) {
                    Ok(()) => {
                        shared.counters.pushed.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        let _ = subscriber.kick.send(true);
                        slow.insert(subscriber.connection);
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        slow.insert(subscriber.connection);
                    }
                }
            }
        }
    }
    shared
        .counters
        .slow_subscribers
        .fetch_add(slow.len() as u64, Ordering::Relaxed);
    unsubscribe(shared, &slow);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_participant_is_paced_at_its_rate_and_others_are_not() {
        let mut pacing = Pacing::default();
        let start = tokio::time::Instant::now();
        let rate = 1000.0;
        // A burst of its rate goes at once; then each waits its share of a second.
        for _ in 0..1000 {
            assert!(pacing.wait("A", rate, start).is_zero());
        }
        let wait = pacing.wait("A", rate, start);
        assert!((wait.as_secs_f64() - 0.001).abs() < 1e-9, "{wait:?}");
        let wait = pacing.wait("A", rate, start);
        assert!((wait.as_secs_f64() - 0.002).abs() < 1e-9, "{wait:?}");
        // Another participant has its own bucket.
        assert!(pacing.wait("B", rate, start).is_zero());
        // A second later the debt is paid and the bucket refilled.
        let later = start + std::time::Duration::from_secs(2);
        assert!(pacing.wait("A", rate, later).is_zero());
    }

    #[test]
    fn advices_escape_their_text() {
        let advice = ste_engine::matcher::Advice {
            trade_key: "BRK<&>/T<1>".to_owned(),
            failed: vec![ste_engine::reason::Criterion::C09],
        };
        let xml = advice_xml(&advice);
        assert!(xml.contains("<Broker>BRK&lt;&amp;&gt;</Broker>"), "{xml}");
        assert!(xml.contains("<TradeRef>T&lt;1&gt;</TradeRef>"), "{xml}");
        assert!(xml.contains("<Criterion>C09</Criterion>"), "{xml}");
    }

    #[test]
    fn parties_are_read_from_the_cls() {
        let cls = "<Cls><Broker>B1</Broker><InvMgr>I1</InvMgr><Settlement><Custodian>C1</Custodian></Settlement><Settlement><Custodian>C2</Custodian></Settlement></Cls>";
        assert_eq!(texts_of(cls, "Custodian"), vec!["C1", "C2"]);
        assert_eq!(texts_of(cls, "Broker"), vec!["B1"]);
        assert!(texts_of(cls, "Pset").is_empty());
    }
}
