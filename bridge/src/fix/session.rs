//! FIX sessions: logon, sequence numbers, gaps and resends, heartbeats, and the answers to
//! application messages.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ste_engine::pipeline::{AckResult, Envelope};
use ste_engine::reason::{ReasonCode, Rejection};
use ste_engine::sign::{self, KeyedMac};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Semaphore};
use tracing::{debug, warn};

use super::codec::{
    encode, parse, parse_utc_timestamp, read_message, signed_part, utc_timestamp, FixMessage,
};
use super::mapping::{from_fix, is_fix_date};
use super::store::{Kept, Sent, SentStore, SessionBook};
use crate::gateway::{GatewayHandle, Pushed, Reply, Subscriber};
use crate::listener::accept_loop;

/// The engine's CompID.
pub const ENGINE_COMP_ID: &str = "STE";
/// What the logon password covers before SendingTime and the BIC.
const LOGON_CONTEXT: &[u8] = b"STE-FIX-LOGON\0";
/// Bytes of messages a session may hold behind a sequence gap before it is logged out.
pub const HELD_BYTES_MAX: usize = 1024 * 1024;
/// Messages a session may hold behind a sequence gap before it is logged out.
pub const HELD_MESSAGES_MAX: usize = 1024;
/// Largest MsgSeqNum or NewSeqNo accepted (FIX's SeqNum is a 32-bit field in practice).
pub const SEQ_NUM_MAX: u64 = u32::MAX as u64;
/// How far a logon's SendingTime may be from the engine's clock.
const LOGON_CLOCK_SKEW: Duration = Duration::from_secs(120);

/// The logon password: hex HMAC over the context, SendingTime and the BIC.
pub fn logon_password(key: &KeyedMac, sending_time: &str, participant: &str) -> String {
    let mut covered = LOGON_CONTEXT.to_vec();
    covered.extend_from_slice(sending_time.as_bytes());
    covered.extend_from_slice(participant.as_bytes());
    hex::encode(sign::sign_keyed(key, &covered))
}

/// Signs an application message's fields (from `35` on, the session header among them) as a
/// participant does: the HMAC of every `tag=value<SOH>` under `key`, appended as `93`
/// SignatureLength and `89` Signature (hex).
pub fn sign_fields(key: &KeyedMac, fields: &mut Vec<(u32, String)>) {
    let mut covered = Vec::new();
    for (tag, value) in fields.iter() {
        covered.extend_from_slice(format!("{tag}={value}\u{1}").as_bytes());
    }
    let signature = hex::encode(sign::sign_keyed(key, &covered));
    fields.push((93, signature.len().to_string()));
    fields.push((89, signature));
}

/// A whole Logon (`A`) of `participant` at `sending_time`, with MsgSeqNum 1 and
/// ResetSeqNumFlag, HeartBtInt 30 and its password under `key`: what a participant that starts
/// its session afresh sends.
pub fn fresh_logon(key: &KeyedMac, participant: &str, sending_time: &str) -> Vec<u8> {
    super::encode(&[
        (35, "A".into()),
        (49, participant.into()),
        (56, ENGINE_COMP_ID.into()),
        (34, "1".into()),
        (52, sending_time.into()),
        (98, "0".into()),
        (108, "30".into()),
        (141, "Y".into()),
        (554, logon_password(key, sending_time, participant)),
    ])
}

/// Limits and timers of the FIX listener.
#[derive(Debug, Clone)]
pub struct FixConfig {
    /// Connections served at once: in all, from one source, and not yet authenticated.
    pub connections: crate::listener::ConnectionLimits,
    /// TLS for every connection, when set.
    pub tls: Option<crate::tls::Tls>,
    /// Application messages one session may have in flight.
    pub window: usize,
    /// Time allowed from a message's first byte to its last.
    pub message_timeout: Duration,
    /// Time allowed for the Logon after connecting.
    pub logon_timeout: Duration,
    /// Pushes that may wait for a subscriber before it is logged out as too slow.
    pub push_capacity: usize,
    /// The folder keeping each participant's session (sequence numbers, sent messages) across
    /// restarts; in memory only when unset.
    pub session_dir: Option<std::path::PathBuf>,
    /// The UTC time of day at which sessions start again at 1: a live session is logged out
    /// then, and the next Logon of each participant starts both numbers at 1.
    pub daily_reset: Option<time::Time>,
}

impl FixConfig {
    fn accepting(&self) -> crate::listener::Accepting {
        crate::listener::Accepting {
            tls: self.tls.as_ref().map(|tls| tls.0.clone()),
            handshake_timeout: self.message_timeout,
            ..crate::listener::Accepting::plain(self.connections)
        }
    }
}

impl Default for FixConfig {
    fn default() -> Self {
        Self {
            connections: crate::listener::ConnectionLimits::default(),
            tls: None,
            window: 4096,
            message_timeout: Duration::from_secs(10),
            logon_timeout: Duration::from_secs(10),
            push_capacity: 65_536,
            session_dir: None,
            daily_reset: None,
        }
    }
}

/// What an answer must name: the inbound message type and its id.
#[derive(Debug, Clone)]
struct Pending {
    msg_type: String,
    id: String,
    /// The message's TradeDate (`75`), when it is one: ConfirmationAck requires one.
    trade_date: Option<String>,
    detail: Option<String>,
    /// Already answered by a session Reject: the engine's verdict is not sent again.
    rejected_by_session: bool,
}

/// Session-level messages, never resent (a GapFill stands for them).
fn is_admin(msg_type: &str) -> bool {
    matches!(msg_type, "0" | "1" | "2" | "3" | "4" | "5" | "A")
}

/// The engine's side of one session: outbound sequence numbers and header.
struct Outbound {
    output: BufWriter<tokio::io::WriteHalf<crate::listener::Connection>>,
    participant: String,
    next_seq: u64,
    /// When the engine last sent on this session: a Heartbeat is due HeartBtInt after it,
    /// whatever the participant sends meanwhile.
    last_sent: tokio::time::Instant,
    /// Rejects (`3`) and BusinessMessageRejects (`j`) the participant sent: logged, counted,
    /// never answered with a Reject.
    rejected_by_participant: u64,
    /// The application messages sent, for resending.
    sent: SentStore,
    /// What resending may still cost, in [`SentStore`] bytes ([`ResendBudget`]).
    resend_budget: ResendBudget,
}

/// Bytes of kept messages a session may have resent at once: twice the whole store, so that
/// a participant back from an outage can ask for everything, and then again.
const RESEND_BURST_BYTES: f64 = 2.0 * super::store::SENT_BYTES_MAX as f64;
/// How fast the budget comes back: the whole store a minute.
const RESEND_BYTES_PER_S: f64 = super::store::SENT_BYTES_MAX as f64 / 60.0;

/// A token bucket over the bytes that ResendRequests make the engine send again, so that a
/// participant cannot turn small requests into an unbounded stream (a ResendRequest of a few
/// dozen bytes can ask for the whole store).
struct ResendBudget {
    bytes: f64,
    at: std::time::Instant,
}

impl Default for ResendBudget {
    fn default() -> Self {
        Self {
            bytes: RESEND_BURST_BYTES,
            at: std::time::Instant::now(),
        }
    }
}

impl ResendBudget {
    /// Takes `cost` bytes if the budget holds them at `now`; else the seconds until it will.
    fn take(&mut self, cost: usize, now: std::time::Instant) -> Result<(), u64> {
        let now = now.max(self.at);
        let refill = now.duration_since(self.at).as_secs_f64() * RESEND_BYTES_PER_S;
        self.bytes = (self.bytes + refill).min(RESEND_BURST_BYTES);
        self.at = now;
        // The store never holds more than the burst: a larger cost is that of the burst.
        let cost = (cost as f64).min(RESEND_BURST_BYTES);
        if cost <= self.bytes {
            self.bytes -= cost;
            Ok(())
        } else {
            Err(((cost - self.bytes) / RESEND_BYTES_PER_S).ceil() as u64)
        }
    }
}

impl Outbound {
    async fn send(&mut self, mut body: Vec<(u32, String)>) -> std::io::Result<()> {
        let msg_type = body.remove(0);
        let mut fields = vec![
            msg_type.clone(),
            (49, ENGINE_COMP_ID.to_owned()),
            (56, self.participant.clone()),
            (34, self.next_seq.to_string()),
            (52, utc_timestamp()),
        ];
        let sending_time = fields[4].1.clone();
        fields.extend(body.iter().cloned());
        if !is_admin(&msg_type.1) {
            let mut kept = vec![msg_type];
            kept.extend(body);
            self.sent.keep(
                self.next_seq,
                Sent {
                    body: kept,
                    sending_time,
                },
            );
        }
        self.next_seq += 1;
        self.last_sent = tokio::time::Instant::now();
        self.write(&encode(&fields)).await
    }

    /// Answers a ResendRequest for `begin..=end` (`end` 0: up to the last sent): the kept
    /// application messages again, with PossDupFlag and OrigSendingTime, and a GapFill over
    /// every run of session messages (and of messages past the store's bound).
    ///
    /// What it resends is paid from the session's [`ResendBudget`]; a request the budget cannot
    /// pay is refused with a session Reject (`373=99`, `58=E_BUSY …`) naming when to ask again,
    /// and nothing is resent.
    async fn resend(&mut self, request_seq: u64, begin: u64, end: u64) -> std::io::Result<()> {
        let last = self.next_seq - 1;
        let end = if end == 0 || end > last { last } else { end };
        if begin > end {
            return self
                .send_gap_fill(begin.min(self.next_seq), self.next_seq)
                .await;
        }
        let cost: usize = self
            .sent
            .messages
            .range(begin..=end)
            .map(|(_, sent)| sent.size())
            .sum();
        if let Err(wait_s) = self.resend_budget.take(cost, std::time::Instant::now()) {
            let reject = vec![
                (35, "3".into()),
                (45, request_seq.to_string()),
                (372, "2".into()),
                (373, "99".into()),
                (
                    58,
                    format!("E_BUSY resending is limited; ask again in {wait_s} s"),
                ),
            ];
            return self.send(reject).await;
        }
        let mut gap_from: Option<u64> = None;
        for seq in begin..=end {
            let Some(sent) = self.sent.messages.get(&seq).cloned() else {
                gap_from.get_or_insert(seq);
                continue;
            };
            if let Some(from) = gap_from.take() {
                self.send_gap_fill(from, seq).await?;
            }
            let mut fields = vec![
                sent.body[0].clone(),
                (49, ENGINE_COMP_ID.to_owned()),
                (56, self.participant.clone()),
                (34, seq.to_string()),
                (43, "Y".to_owned()),
                (52, utc_timestamp()),
                (122, sent.sending_time.clone()),
            ];
            fields.extend(sent.body[1..].iter().cloned());
            self.last_sent = tokio::time::Instant::now();
            self.write(&encode(&fields)).await?;
        }
        match gap_from {
            Some(from) => self.send_gap_fill(from, end + 1).await,
            None => Ok(()),
        }
    }

    /// Sends what is buffered, within the same time limit as a write.
    async fn flush(&mut self) -> std::io::Result<()> {
        match tokio::time::timeout(crate::tcp::WRITE_TIMEOUT, self.output.flush()).await {
            Ok(result) => result,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// A write that a participant who stops reading cannot hold up for ever.
    async fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match tokio::time::timeout(crate::tcp::WRITE_TIMEOUT, self.output.write_all(bytes)).await {
            Ok(result) => result,
            Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
        }
    }

    /// A SequenceReset-GapFill over `begin..new_seq`: sent with MsgSeqNum `begin` and
    /// PossDupFlag, it does not take a number of its own.
    async fn send_gap_fill(&mut self, begin: u64, new_seq: u64) -> std::io::Result<()> {
        let now = utc_timestamp();
        let fields = vec![
            (35, "4".to_owned()),
            (49, ENGINE_COMP_ID.to_owned()),
            (56, self.participant.clone()),
            (34, begin.to_string()),
            (43, "Y".to_owned()),
            (52, now.clone()),
            (122, now),
            (123, "Y".to_owned()),
            (36, new_seq.to_string()),
        ];
        self.last_sent = tokio::time::Instant::now();
        self.write(&encode(&fields)).await
    }
}

fn answer(pending: &Pending, result: AckResult) -> Vec<(u32, String)> {
    let (accepted, text) = match result {
        AckResult::Accepted => (true, None),
        AckResult::Duplicate => (true, Some("DUPLICATE".to_owned())),
        AckResult::Rejected(code) => (
            false,
            Some(match &pending.detail {
                Some(detail) => format!("{code} {detail}"),
                None => code.as_str().to_owned(),
            }),
        ),
    };
    let id = if pending.id.is_empty() {
        "NONE".to_owned()
    } else {
        pending.id.clone()
    };
    let now = utc_timestamp();
    let mut out = match pending.msg_type.as_str() {
        "AE" => vec![
            (35, "AR".to_owned()),
            (571, id),
            (150, if accepted { "F" } else { "8" }.to_owned()),
            (60, now),
            (751, if accepted { "0" } else { "99" }.to_owned()),
        ],
        "J" => {
            let mut out = vec![(35, "P".to_owned()), (70, id)];
            if let Some(date) = &pending.trade_date {
                out.push((75, date.clone()));
            }
            out.push((60, now));
            out.push((87, if accepted { "0" } else { "1" }.to_owned()));
            if !accepted {
                out.push((88, "7".to_owned()));
            }
            out
        }
        _ => {
            let mut out = vec![
                (35, "AU".to_owned()),
                (664, id),
                (
                    75,
                    pending
                        .trade_date
                        .clone()
                        .unwrap_or_else(|| now[..8].to_owned()),
                ),
                (60, now),
                (940, if accepted { "3" } else { "2" }.to_owned()),
            ];
            if !accepted {
                out.push((774, "99".to_owned()));
            }
            out
        }
    };
    if let Some(text) = text {
        out.push((58, text));
    }
    out
}

/// Serves FIX sessions until `shutdown` turns true, then logs every session out once it has
/// answered what it read.
pub async fn serve(
    listener: TcpListener,
    gateway: GatewayHandle,
    config: FixConfig,
    shutdown: watch::Receiver<bool>,
) {
    let accepting = config.accepting();
    let refusal = |why: &str| {
        encode(&[
            (35, "5".into()),
            (49, ENGINE_COMP_ID.into()),
            (34, "1".into()),
            (52, utc_timestamp()),
            (58, format!("E_BUSY {why}")),
        ])
    };
    let stop = shutdown.clone();
    let refdata = gateway.refdata();
    let book = Arc::new(SessionBook::open(
        config.session_dir.as_deref(),
        config.daily_reset,
        |bic| refdata.participant_mac(bic).is_some(),
    ));
    accept_loop(
        listener,
        "FIX",
        accepting,
        shutdown,
        refusal,
        move |stream, admission| {
            session(
                stream,
                admission,
                gateway.clone(),
                config.clone(),
                book.clone(),
                stop.clone(),
            )
        },
    )
    .await;
}

/// Puts what a session's next connection continues from into the book, writing its file on a
/// blocking thread, not on the async workers.
async fn keep_session(
    book: &Arc<SessionBook>,
    participant: &str,
    outbound: &mut Outbound,
    next_out: u64,
    next_in: u64,
    since: i64,
) {
    let kept = Kept {
        next_out,
        next_in,
        since,
        sent: std::mem::take(&mut outbound.sent),
    };
    let book = book.clone();
    let participant = participant.to_owned();
    if let Err(error) = tokio::task::spawn_blocking(move || book.put(&participant, kept)).await {
        warn!(%error, "FIX session not kept");
    }
}

/// Why a session ends from the engine's side: the Logout's Text.
type Ending = Option<String>;

async fn session(
    stream: crate::listener::Connection,
    admission: crate::listener::Admission,
    gateway: GatewayHandle,
    config: FixConfig,
    book: Arc<SessionBook>,
    mut shutdown: watch::Receiver<bool>,
) {
    let (read, write) = tokio::io::split(stream);
    let mut input = BufReader::with_capacity(64 * 1024, read);
    let mut outbound = Outbound {
        output: BufWriter::with_capacity(64 * 1024, write),
        participant: String::new(),
        next_seq: 1,
        last_sent: tokio::time::Instant::now(),
        rejected_by_participant: 0,
        sent: SentStore::default(),
        resend_budget: ResendBudget::default(),
    };

    // Logon.
    let logon = match read_message(&mut input, config.message_timeout, config.logon_timeout).await {
        Ok(Some(raw)) => raw,
        Ok(None) => return,
        Err((code, detail)) => {
            debug!(code, detail, "no logon");
            return;
        }
    };
    let logon = match parse(&logon) {
        Ok(message) if message.msg_type() == "A" => message,
        Ok(_) | Err(_) => return,
    };
    let participant = logon.get(49).unwrap_or("").to_owned();
    outbound.participant = participant.clone();
    let heartbeat = logon
        .get(108)
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| (1..=3600).contains(s))
        .map_or(Duration::from_secs(30), Duration::from_secs);
    let connection = gateway.connection_id();
    // Its password checked out: whatever the session's fate, the peer holds the key.
    let checked = check_logon(&gateway, &logon, &participant).and_then(|()| {
        admission
            .authenticated_as(&participant)
            .map_err(|why| format!("E_BUSY {why}"))
    });
    let claimed = checked.and_then(|()| {
        gateway.claim_fix_session(
            &participant,
            logon.get(52).unwrap_or(""),
            connection,
            LOGON_CLOCK_SKEW,
        )
    });
    if let Err(text) = claimed {
        // The CompID comes from an unauthenticated peer: Debug-escaped, it cannot forge lines.
        warn!(participant = ?participant, text = ?text, "FIX logon refused");
        let _ = outbound.send(vec![(35, "5".into()), (58, text)]).await;
        let _ = outbound.flush().await;
        return;
    }
    // The sequence numbers go on from the participant's last session unless its Logon resets
    // them (ResetSeqNumFlag), as FIX engines expect.
    let reset = logon.get(141) == Some("Y");
    let now = time::OffsetDateTime::now_utc();
    let kept = book.take(&participant, reset, now);
    let since = kept.since;
    // A live session ends at the daily reset: its next Logon starts at 1.
    let day_ends = book.next_reset(now).map(|at| {
        let left = (at - now).try_into().unwrap_or(Duration::ZERO);
        tokio::time::Instant::now() + left
    });
    let logon_seq: u64 = logon.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
    outbound.next_seq = kept.next_out.max(1);
    outbound.sent = kept.sent;
    let next_in = kept.next_in.max(1);
    if logon_seq < next_in || logon_seq > SEQ_NUM_MAX {
        let text = format!("MsgSeqNum too low, expecting {next_in} but received {logon_seq}");
        warn!(%participant, text = ?text, "FIX logon refused");
        let _ = outbound.send(vec![(35, "5".into()), (58, text)]).await;
        let _ = outbound.flush().await;
        // Only the Logout's number changed: the session goes back into the book, and its file
        // is written when a session of the participant next ends, not now (a flood of refused
        // Logons costs no disk).
        book.put_back(
            &participant,
            Kept {
                next_out: outbound.next_seq,
                next_in,
                since,
                sent: std::mem::take(&mut outbound.sent),
            },
        );
        gateway.release_fix_session(&participant, connection);
        return;
    }
    let mut logon_answer = vec![
        (35, "A".into()),
        (98, "0".into()),
        (108, heartbeat.as_secs().to_string()),
    ];
    if reset {
        logon_answer.push((141, "Y".into()));
    }
    let _ = outbound.send(logon_answer).await;
    // Messages the participant sent while it was away are asked for at once.
    let gap_at_logon = logon_seq > next_in;
    if gap_at_logon {
        let request = vec![(35, "2".into()), (7, next_in.to_string()), (16, "0".into())];
        let _ = outbound.send(request).await;
    }
    let _ = outbound.flush().await;

    // The reader runs on its own, so that a message is never cut by the session's other work;
    // it hands over whole messages (or why it stopped).
    let (raw_tx, mut raw_rx) = mpsc::channel::<Result<Vec<u8>, (&'static str, String)>>(64);
    let message_timeout = config.message_timeout;
    let reader = tokio::spawn(async move {
        loop {
            // Silence is the session's business (TestRequest, then Logout): no idle limit here.
            let next = read_message(&mut input, message_timeout, Duration::from_secs(86_400)).await;
            let stop = !matches!(next, Ok(Some(_)));
            let item = match next {
                Ok(Some(raw)) => Ok(raw),
                Ok(None) => break,
                Err(error) => Err(error),
            };
            if raw_tx.send(item).await.is_err() || stop {
                break;
            }
        }
    });

    let (reply_tx, mut replies) = mpsc::channel::<Reply>(config.window + 1);
    let (push_tx, mut pushes) = mpsc::channel::<Pushed>(config.push_capacity.max(1));
    let (kick_tx, mut kicked) = watch::channel(false);
    let window = Arc::new(Semaphore::new(config.window.max(1)));
    let pending: Arc<Mutex<BTreeMap<u64, Pending>>> = Arc::default();
    gateway.subscribe(
        &participant,
        Subscriber {
            connection,
            push: push_tx,
            kick: kick_tx,
        },
    );
    let idle = heartbeat + heartbeat / 5;
    let mut expected_in: u64 = if gap_at_logon { next_in } else { logon_seq + 1 };
    let mut reading = true;
    let mut ending: Ending = None;
    let mut test_request_sent = false;
    let mut last_in = tokio::time::Instant::now();
    // Messages set aside while a gap is being filled (and in-order ones waiting for the
    // window), by sequence number.
    // Kept raw (parsed again when released): a parsed message costs several times its bytes.
    let mut held: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
    let mut held_bytes: usize = 0;
    let mut resend_requested = gap_at_logon;
    // ResendRequests answered while still behind a gap: not answered again in order.
    let mut answered_early: std::collections::BTreeSet<u64> = Default::default();

    'session: loop {
        tokio::select! {
            biased;
            Ok(()) = kicked.changed() => {
                ending = Some("E_SLOW the subscriber did not read its pushes".into());
                break;
            }
            _ = shutdown.changed(), if reading => {
                ending = Some("E_SHUTDOWN the engine is shutting down".into());
                reading = false;
            }
            () = tokio::time::sleep_until(day_ends.unwrap_or_else(tokio::time::Instant::now)), if reading && day_ends.is_some() => {
                ending = Some("E_SESSION_END the FIX day ends: sequence numbers start again at 1".into());
                reading = false;
            }
            reply = replies.recv() => {
                let Some(reply) = reply else { break };
                window.add_permits(1);
                let item = pending.lock().unwrap_or_else(PoisonError::into_inner).remove(&reply.seq);
                if let Some(item) = item.filter(|item| !item.rejected_by_session) {
                    if outbound.send(answer(&item, reply.result)).await.is_err() { break; }
                }
            }
            Some(pushed) = pushes.recv() => {
                let xml = String::from_utf8_lossy(&pushed.xml).into_owned();
                let body = vec![(35, "n".into()), (212, xml.len().to_string()), (213, xml)];
                if outbound.send(body).await.is_err() { break; }
            }
            // Only while the window has room: a full window stops reading (TCP backpressure).
            raw = raw_rx.recv(), if reading && window.available_permits() > 0 => { 'raw: {
                let raw = match raw {
                    Some(Ok(raw)) => raw,
                    None => { reading = false; break 'raw; }
                    Some(Err((code, detail))) => {
                        ending = Some(format!("{code} {detail}"));
                        reading = false;
                        break 'raw;
                    }
                };
                last_in = tokio::time::Instant::now();
                test_request_sent = false;
                let message = match parse(&raw) {
                    Ok(message) => message,
                    Err(error) => {
                        warn!(%participant, error = ?error.to_string(), "garbled FIX message ignored");
                        break 'raw;
                    }
                };
                let seq: u64 = message.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
                let poss_dup = message.get(43) == Some("Y");
                if seq > SEQ_NUM_MAX {
                    ending = Some(format!("MsgSeqNum {seq} is larger than {SEQ_NUM_MAX}"));
                    reading = false;
                    break 'raw;
                }
                if message.msg_type() == "4" {
                    // SequenceReset (GapFill or Reset) moves the expected number forward, never
                    // back and never past the largest number.
                    let new_seq = message.get(36).and_then(|s| s.parse::<u64>().ok());
                    match new_seq {
                        Some(new_seq) if new_seq <= SEQ_NUM_MAX => {
                            expected_in = expected_in.max(new_seq);
                        }
                        _ => {
                            // A rejected message still takes its sequence number.
                            if seq == expected_in {
                                expected_in += 1;
                            }
                            let reject = vec![
                                (35, "3".into()),
                                (45, seq.to_string()),
                                (371, "36".into()),
                                (372, "4".into()),
                                (373, "5".into()),
                                (58, format!("NewSeqNo must be a number up to {SEQ_NUM_MAX}")),
                            ];
                            if outbound.send(reject).await.is_err() { break 'session; }
                        }
                    }
                } else if seq > expected_in && !held.contains_key(&expected_in) {
                    if message.msg_type() == "2" && answered_early.insert(seq) {
                        // A ResendRequest is acted on whatever its own MsgSeqNum: the
                        // participant is waiting for it, and holding it behind the gap that
                        // it may itself be the cause of would hang both sides.
                        let (begin, end) = resend_range(&message);
                        if outbound.resend(seq, begin, end).await.is_err() { break 'session; }
                    }
                    held_bytes += raw.len();
                    if let Some(old) = held.insert(seq, raw) {
                        held_bytes -= old.len();
                    }
                    if held_bytes > HELD_BYTES_MAX || held.len() > HELD_MESSAGES_MAX {
                        ending = Some(format!(
                            "E_SIZE more than {HELD_BYTES_MAX} bytes or {HELD_MESSAGES_MAX} messages held behind a sequence gap"
                        ));
                        reading = false;
                        break 'raw;
                    }
                    if !resend_requested {
                        resend_requested = true;
                        let request = vec![(35, "2".into()), (7, expected_in.to_string()), (16, "0".into())];
                        if outbound.send(request).await.is_err() { break 'session; }
                    }
                } else if seq < expected_in {
                    if !poss_dup {
                        ending = Some(format!("MsgSeqNum too low, expecting {expected_in} but received {seq}"));
                        reading = false;
                    }
                } else {
                    held_bytes += raw.len();
                    if let Some(old) = held.insert(seq, raw) {
                        held_bytes -= old.len();
                    }
                }
            }}
            _ = tokio::time::sleep_until(last_in + idle), if reading => {
                if test_request_sent {
                    ending = Some("E_TIMEOUT no answer to a TestRequest".into());
                    reading = false;
                } else {
                    test_request_sent = true;
                    last_in = tokio::time::Instant::now();
                    let request = vec![(35, "1".into()), (112, format!("TEST-{}", outbound.next_seq))];
                    if outbound.send(request).await.is_err() { break; }
                }
            }
            _ = tokio::time::sleep_until(outbound.last_sent + heartbeat) => {
                if outbound.send(vec![(35, "0".into())]).await.is_err() { break; }
            }
        }
        // What is now in order, as far as the window allows.
        while reading && window.available_permits() > 0 {
            let Some(entry) = held.first_entry() else {
                break;
            };
            if *entry.key() > expected_in {
                break;
            }
            let (seq, raw) = entry.remove_entry();
            held_bytes -= raw.len();
            if seq < expected_in {
                continue;
            }
            expected_in += 1;
            if answered_early.remove(&seq) {
                continue;
            }
            let Ok(message) = parse(&raw) else {
                continue;
            };
            match handle(
                &gateway,
                &participant,
                &message,
                &raw,
                &window,
                &pending,
                &reply_tx,
                &mut outbound,
            )
            .await
            {
                Ok(Some(end)) => {
                    ending = Some(end);
                    reading = false;
                }
                Ok(None) => {}
                Err(()) => break,
            }
        }
        if held.keys().next().is_none_or(|first| *first <= expected_in) {
            resend_requested = false;
        }
        if !reading
            && pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
        {
            break;
        }
        if replies.is_empty() && pushes.is_empty() && outbound.flush().await.is_err() {
            break;
        }
    }
    reader.abort();
    if outbound.rejected_by_participant > 0 {
        warn!(
            %participant,
            rejects = outbound.rejected_by_participant,
            "FIX session ended; the participant rejected messages of the engine's"
        );
    }
    gateway.unsubscribe(connection);
    // Kept before the session is released, counting the Logout about to be sent.
    let next_out = outbound.next_seq + 1;
    keep_session(
        &book,
        &participant,
        &mut outbound,
        next_out,
        expected_in,
        since,
    )
    .await;
    gateway.release_fix_session(&participant, connection);
    let mut logout = vec![(35, "5".to_owned())];
    if let Some(text) = ending.filter(|text| !text.is_empty()) {
        if !text.starts_with("E_SHUTDOWN") {
            warn!(%participant, text = ?text, "FIX session ended by the engine");
        }
        logout.push((58, text));
    }
    let _ = outbound.send(logout).await;
    let _ = outbound.flush().await;
    let _ = outbound.output.shutdown().await;
}

fn check_logon(
    gateway: &GatewayHandle,
    logon: &FixMessage,
    participant: &str,
) -> Result<(), String> {
    if logon.get(56) != Some(ENGINE_COMP_ID) {
        return Err(format!("E_AUTH TargetCompID must be {ENGINE_COMP_ID}"));
    }
    if gateway.refdata().participant(participant).is_none() {
        return Err(format!("E_AUTH {participant} is not a participant"));
    }
    let sending_time = logon.get(52).unwrap_or("");
    let fresh = parse_utc_timestamp(sending_time).is_some_and(|sent| {
        let skew = (time::OffsetDateTime::now_utc() - sent).abs();
        skew <= LOGON_CLOCK_SKEW
    });
    if !fresh {
        return Err(format!(
            "E_AUTH SendingTime {sending_time:?} is not within {}s of the engine's clock",
            LOGON_CLOCK_SKEW.as_secs()
        ));
    }
    let given = logon.get(554).unwrap_or("");
    let mut covered = LOGON_CONTEXT.to_vec();
    covered.extend_from_slice(sending_time.as_bytes());
    covered.extend_from_slice(participant.as_bytes());
    let given_bytes = hex::decode(given).unwrap_or_default();
    if gateway.signed_by(participant, &covered, &given_bytes) {
        Ok(())
    } else {
        Err(format!(
            "E_SIG the logon password of {participant} is not signed with its key"
        ))
    }
}

/// What a ResendRequest asks for: `7` BeginSeqNo (at least 1) and `16` EndSeqNo (0: up to
/// the last).
fn resend_range(message: &FixMessage) -> (u64, u64) {
    let number = |tag| message.get(tag).and_then(|s| s.parse::<u64>().ok());
    (number(7).unwrap_or(1).max(1), number(16).unwrap_or(0))
}

/// Handles one in-order message; `Ok(Some(text))` ends the session with a Logout, `Err` means
/// the connection failed.
#[allow(clippy::too_many_arguments)]
async fn handle(
    gateway: &GatewayHandle,
    participant: &str,
    message: &FixMessage,
    raw: &[u8],
    window: &Arc<Semaphore>,
    pending: &Arc<Mutex<BTreeMap<u64, Pending>>>,
    reply: &mpsc::Sender<Reply>,
    outbound: &mut Outbound,
) -> Result<Option<String>, ()> {
    match message.msg_type() {
        "0" => Ok(None),
        "1" => {
            let id = message.get(112).unwrap_or("").to_owned();
            outbound
                .send(vec![(35, "0".into()), (112, id)])
                .await
                .map_err(|_| ())?;
            Ok(None)
        }
        "2" => {
            let (begin, end) = resend_range(message);
            let request_seq = message.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
            outbound
                .resend(request_seq, begin, end)
                .await
                .map_err(|_| ())?;
            Ok(None)
        }
        // A Logout from the participant: answered (without Text) once what is in flight is.
        "5" => Ok(Some(String::new())),
        // The participant refused something the engine sent. Answering with a Reject would
        // make the two reject each other's rejects: it is logged and counted.
        "3" | "j" => {
            outbound.rejected_by_participant += 1;
            warn!(
                %participant,
                msg_type = message.msg_type(),
                ref_seq_num = message.get(45).unwrap_or(""),
                ref_msg_type = message.get(372).unwrap_or(""),
                ref_tag = message.get(371).unwrap_or(""),
                reason = message.get(373).or_else(|| message.get(380)).unwrap_or(""),
                text = message.get(58).unwrap_or(""),
                "the participant rejected a message of the engine's"
            );
            Ok(None)
        }
        "A" => Ok(Some("E_FRAME a second Logon".into())),
        "AE" | "J" | "T" => {
            // The session calls this only while the window has room.
            if let Ok(permit) = window.try_acquire() {
                permit.forget();
            }
            let id_tag = match message.msg_type() {
                "AE" => 571,
                "J" => 70,
                _ => 777,
            };
            let id = message.get(id_tag).unwrap_or("").to_owned();
            let seq: u64 = message.get(34).and_then(|s| s.parse().ok()).unwrap_or(0);
            let sender = message.get(49).unwrap_or("");
            let (envelope, detail, rejected_by_session) = match signed_part(raw) {
                Ok(covered) => {
                    let (envelope, detail) =
                        envelope_of(gateway, participant, sender, message, raw, covered);
                    (envelope, detail, false)
                }
                Err(error) => {
                    outbound
                        .send(vec![
                            (35, "3".into()),
                            (45, seq.to_string()),
                            (371, error.tag.to_string()),
                            (372, message.msg_type().to_owned()),
                            (373, error.session_reason.to_string()),
                            (58, format!("{} {}", error.code, error.detail)),
                        ])
                        .await
                        .map_err(|_| ())?;
                    let rejection = Rejection::new(error.code, error.detail);
                    (refused_envelope(raw, participant, rejection), None, true)
                }
            };
            pending
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    seq,
                    Pending {
                        msg_type: message.msg_type().to_owned(),
                        id,
                        trade_date: message
                            .get(75)
                            .filter(|date| is_fix_date(date))
                            .map(str::to_owned),
                        detail,
                        rejected_by_session,
                    },
                );
            // The session's participant goes at its rate.
            gateway.pace(participant).await;
            if gateway.submit(envelope, seq, reply).await.is_err() {
                return Ok(Some("E_SHUTDOWN the engine is shutting down".into()));
            }
            Ok(None)
        }
        other => {
            outbound
                .send(vec![
                    (35, "3".into()),
                    (45, message.get(34).unwrap_or("0").to_owned()),
                    (372, other.to_owned()),
                    (373, "11".into()),
                    (58, format!("MsgType {other} is not supported")),
                ])
                .await
                .map_err(|_| ())?;
            Ok(None)
        }
    }
}

/// A refused message, kept as an exception with its raw FIX bytes.
fn refused_envelope(raw: &[u8], participant: &str, rejection: Rejection) -> Envelope {
    Envelope {
        bytes: raw.to_vec(),
        sender: Some(participant.into()),
        signature: None,
        correlation: 0,
        origin: 0,
        injected_ns: 0,
        refusal: Some(rejection),
    }
}

/// The engine envelope of an application message whose signature covers `covered` (every byte
/// with meaning, [`signed_part`]): converted and re-signed when the signature holds, a refusal
/// otherwise.
fn envelope_of(
    gateway: &GatewayHandle,
    participant: &str,
    sender: &str,
    message: &FixMessage,
    raw: &[u8],
    covered: &[u8],
) -> (Envelope, Option<String>) {
    let refused = |rejection: Rejection| {
        let detail = Some(rejection.detail.clone());
        (refused_envelope(raw, participant, rejection), detail)
    };
    let signature = message
        .get(89)
        .and_then(|hex_text| hex::decode(hex_text).ok())
        .unwrap_or_default();
    let signed = gateway.signed_by(sender, covered, &signature);
    if sender != participant {
        // A message under another CompID than the session's.
        if signed {
            return refused(Rejection::new(
                ReasonCode::Auth,
                format!("the session of {participant} may not send as {sender}"),
            ));
        }
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("signature does not match the key of {sender}"),
        ));
    }
    if !signed {
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("signature (89) does not match the key of {participant}"),
        ));
    }
    let xml = match from_fix(message, participant) {
        Ok(xml) => xml,
        Err(rejection) => return refused(rejection),
    };
    let Some((_, key)) = gateway.refdata().participant_mac(participant) else {
        return refused(Rejection::new(
            ReasonCode::Sig,
            format!("no key for {participant}"),
        ));
    };
    let signature = sign::sign_keyed(key, &xml);
    (
        Envelope {
            bytes: xml,
            sender: Some(participant.into()),
            signature: Some(signature),
            correlation: 0,
            origin: 0,
            injected_ns: 0,
            refusal: None,
        },
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resending_is_paid_from_a_budget_that_comes_back_with_time() {
        let store = super::super::store::SENT_BYTES_MAX;
        let start = std::time::Instant::now();
        let mut budget = ResendBudget {
            bytes: RESEND_BURST_BYTES,
            at: start,
        };
        // The whole store twice at once, then nothing more.
        assert_eq!(budget.take(store, start), Ok(()));
        assert_eq!(budget.take(store, start), Ok(()));
        assert_eq!(budget.take(store, start), Err(60));
        assert_eq!(budget.take(1, start), Err(1));
        // Half a minute later, half the store.
        let later = start + Duration::from_secs(30);
        assert_eq!(budget.take(store / 2 + 1024, later), Err(1));
        assert_eq!(budget.take(store / 2, later), Ok(()));
        // However long the wait, no more than the burst.
        let much_later = later + Duration::from_secs(3600);
        assert_eq!(budget.take(2 * store, much_later), Ok(()));
        assert_eq!(budget.take(1, much_later), Err(1));
    }
}
