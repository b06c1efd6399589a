//! The load generator: standard trades (1 NOE + 2 ALC + 2 NPR + 2 SET) built from random
//! reference data with a fixed seed, optionally with a fault mix whose outcome it knows.
//!
//! Generation streams: one trade's lines at a time, so a set of any size never has to fit in
//! memory. Every fault is chosen so that its outcome does not depend on arrival order (see
//! ARCHITECTURE.md), except the two that are about order itself (E_CONFLICT and E_CLOSED),
//! whose trades keep the order that produces them.

use std::collections::{BTreeMap, VecDeque};

use compact_str::format_compact;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use time::{Date, Duration, Month};

use crate::codec::{encode_fields, encode_msg, fields_of};
use crate::draw::Draws;
use crate::model::{push_date, Decimal, Function, Msg, MsgType, PaymentType, Side, Text};
use crate::reason::ReasonCode;
use crate::refdata::generate::csd_of_market;
use crate::refdata::{Participant, RefData, Role, Security};

/// The fixed default seed.
pub const DEFAULT_SEED: u64 = 20_021_015;
/// Allocations per standard trade.
pub const ALLOCATIONS_PER_TRADE: usize = 2;
/// Messages per standard trade.
pub const MESSAGES_PER_TRADE: usize = 1 + 3 * ALLOCATIONS_PER_TRADE;
/// A Sender that has no key in participants.csv, so its messages cannot be signed.
const UNKNOWN_SENDER: &str = "ZZZZSG21XXX";
/// An amount error far beyond every tolerance band.
const MISMATCH_UNITS: i128 = 50;

/// Characters of a run id ([`GeneratorConfig::run`]).
pub const RUN_ID_LEN: usize = 5;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GeneratorConfig {
    pub trades: u64,
    pub seed: u64,
    /// Fraction of trades that carry a fault (0 = clean load).
    pub fault_rate: f64,
    /// Shuffle each trade's messages (where the fault allows).
    pub shuffle: bool,
    /// A run's own tag in every TradeRef and MsgId (`T{run}{n:011}`,
    /// `{sender}-{run}{n:012}-{nn}`), so that the trades of two runs against one long-lived
    /// store never meet: empty, or [`RUN_ID_LEN`] characters of `0-9A-Z` ([`is_run_id`]).
    pub run: String,
}

impl GeneratorConfig {
    /// `trades` clean standard trades with the default seed, no run id.
    pub fn clean(trades: u64) -> Self {
        Self {
            trades,
            seed: DEFAULT_SEED,
            fault_rate: 0.0,
            shuffle: false,
            run: String::new(),
        }
    }
}

/// Whether `text` is a run id: [`RUN_ID_LEN`] characters of `0-9A-Z`. Within it, a MsgId of a
/// generated trade is 32 characters and its corrections' 34, under the 35 a MsgId may have.
pub fn is_run_id(text: &str) -> bool {
    text.len() == RUN_ID_LEN
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase())
}

/// A run id drawn at random (by `rand`'s thread generator, seeded from the operating system):
/// one of 60 million, so that two runs meet once in tens of millions of pairs.
pub fn random_run_id() -> String {
    const DIGITS: &[u8; 36] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut rng = rand::rng();
    (0..RUN_ID_LEN)
        .map(|_| char::from(DIGITS[rng.random_range(0..DIGITS.len())]))
        .collect()
}

/// The lowest price generated, in ten-thousandths (1.0000).
const PRICE_MIN_MINOR: i128 = 10_000;
/// The fewest shares an allocation of a generated trade gets: at the lowest price its gross
/// (10.00) exceeds the fees (3.50) and commission, so a SELL's net is never negative (a negative
/// amount is E_FIELD). With one share, six trades in ten million were refused.
const ALLOCATION_QTY_MIN: u64 = 10;
// The smallest gross, less a tenth of a percent of commission, exceeds the fees (3.50, at most
// 4 once rounded to a currency without minor units), in ten-thousandths.
const _: () = assert!(PRICE_MIN_MINOR * ALLOCATION_QTY_MIN as i128 * 999 / 1000 > 40_000);

/// The counts of a run: what a generated set must produce, and what the driver's summary reports.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOutcome {
    pub trades: u64,
    pub messages_in: u64,
    pub accepted: u64,
    pub duplicates: u64,
    pub exceptions: BTreeMap<String, u64>,
    pub cls: u64,
    pub mismatched_trades: u64,
    pub pending_trades: u64,
    pub cancelled_trades: u64,
}

impl RunOutcome {
    /// Adds `other`'s counts to these (the outcome of two runs together).
    pub fn add(&mut self, other: &RunOutcome) {
        self.trades += other.trades;
        self.messages_in += other.messages_in;
        self.accepted += other.accepted;
        self.duplicates += other.duplicates;
        for (code, count) in &other.exceptions {
            *self.exceptions.entry(code.clone()).or_default() += count;
        }
        self.cls += other.cls;
        self.mismatched_trades += other.mismatched_trades;
        self.pending_trades += other.pending_trades;
        self.cancelled_trades += other.cancelled_trades;
    }
}

/// The final state one trade must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalState {
    Matched,
    Mismatched,
    Pending,
    Cancelled,
}

/// A fault applied to one trade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// One message is invalid with this code; `corrected` sends the valid message too (under a
    /// new MsgId when the invalid one was signed, since its MsgId is then spent).
    Invalid { code: ReasonCode, corrected: bool },
    /// An NPR's Net is wrong; an AMD from the broker corrects it.
    MismatchAmended,
    /// An NPR's Net is wrong and stays wrong.
    MismatchLeft,
    /// An NPR's Net is off by less than the tolerance.
    WithinTolerance,
    /// One message is sent twice, byte for byte.
    Duplicate,
    /// One MsgId is sent again with other content.
    DupId,
    /// A mismatched trade whose senders cancel all seven messages.
    CancelAll,
    /// A new message for the trade after it matched.
    Closed,
    /// A second NEW ALC for an account that already has one.
    Conflict,
    /// The last SET never comes.
    Missing,
}

/// The validation codes the generator can provoke, in check order.
pub const INVALID_CODES: [ReasonCode; 11] = [
    ReasonCode::Size,
    ReasonCode::Sig,
    ReasonCode::Parse,
    ReasonCode::Field,
    ReasonCode::Ccy,
    ReasonCode::Country,
    ReasonCode::Market,
    ReasonCode::Isin,
    ReasonCode::Party,
    ReasonCode::Auth,
    ReasonCode::Date,
];

const OTHER_FAULTS: [Fault; 9] = [
    Fault::MismatchAmended,
    Fault::MismatchLeft,
    Fault::WithinTolerance,
    Fault::Duplicate,
    Fault::DupId,
    Fault::CancelAll,
    Fault::Closed,
    Fault::Conflict,
    Fault::Missing,
];

/// One generated trade: its lines in sending order and what they must produce.
#[derive(Debug, Clone)]
pub struct TradeCase {
    pub trade_key: String,
    pub lines: Vec<Vec<u8>>,
    pub fault: Option<Fault>,
    pub final_state: FinalState,
    pub expected: RunOutcome,
    /// Whether the lines may be sent in any order without changing the outcome.
    pub order_independent: bool,
}

/// Streams the lines of a message set.
pub struct Generator<'r> {
    refdata: &'r RefData,
    config: GeneratorConfig,
    rng: ChaCha8Rng,
    brokers: Vec<&'r Participant>,
    inv_mgrs: Vec<&'r Participant>,
    securities: Vec<&'r Security>,
    next_trade: u64,
    queued: VecDeque<Vec<u8>>,
    expected: RunOutcome,
}

/// A piece of a generated identifier.
enum Part<'a> {
    Text(&'a str),
    /// A number zero-padded to at least this many digits (up to 20).
    Number(u64, usize),
}

/// The pieces joined: the generator's identifiers (nine or more a trade), built without the
/// formatting machinery, which was most of what generating a trade cost.
fn ident(parts: &[Part<'_>]) -> Text {
    const ZEROS: &[u8] = b"00000000000000000000";
    // Joined on the stack and made a `Text` once: pushing piece by piece onto a `Text` cost
    // more than the pieces.
    let mut joined = [0_u8; 96];
    let mut length = 0;
    let mut digits = itoa::Buffer::new();
    for part in parts {
        let (zeros, text) = match *part {
            Part::Text(text) => (0, text.as_bytes()),
            Part::Number(value, width) => {
                let text = digits.format(value).as_bytes();
                (width.saturating_sub(text.len()).min(ZEROS.len()), text)
            }
        };
        let Some(piece) = joined.get_mut(length..length + zeros + text.len()) else {
            return ident_long(parts);
        };
        piece[..zeros].copy_from_slice(&ZEROS[..zeros]);
        piece[zeros..].copy_from_slice(text);
        length += zeros + text.len();
    }
    match std::str::from_utf8(&joined[..length]) {
        Ok(text) => Text::new(text),
        Err(_) => ident_long(parts),
    }
}

/// [`ident`] for identifiers longer than its buffer.
fn ident_long(parts: &[Part<'_>]) -> Text {
    let mut out = Text::default();
    for part in parts {
        match *part {
            Part::Text(text) => out.push_str(text),
            Part::Number(value, width) => out.push_str(&format!("{value:0width$}")),
        }
    }
    out
}

fn of_role(refdata: &RefData, role: Role) -> Vec<&Participant> {
    refdata
        .participants()
        .iter()
        .filter(|p| p.role == role)
        .collect()
}

impl<'r> Generator<'r> {
    /// A generator over `refdata` (which must hold participants of every role and securities
    /// whose market has a CSD).
    pub fn new(refdata: &'r RefData, config: GeneratorConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        let securities = refdata
            .securities()
            .iter()
            .filter(|s| {
                csd_of_market(&s.market).is_some() && refdata.currency(&s.currency).is_some()
            })
            .collect();
        Self {
            refdata,
            brokers: of_role(refdata, Role::Broker),
            inv_mgrs: of_role(refdata, Role::InvMgr),
            securities,
            config,
            rng,
            next_trade: 0,
            queued: VecDeque::new(),
            expected: RunOutcome::default(),
        }
    }

    /// The expected outcome of the trades generated so far (of the whole set once exhausted).
    pub fn expected(&self) -> &RunOutcome {
        &self.expected
    }

    /// Generates the next trade, or `None` after the last.
    pub fn next_trade(&mut self) -> Option<TradeCase> {
        if self.next_trade >= self.config.trades {
            return None;
        }
        let index = self.next_trade;
        self.next_trade += 1;
        let fault = if self.config.fault_rate > 0.0
            && self.rng.draw_bool(self.config.fault_rate.min(1.0))
        {
            let choice = self.rng.draw(0..INVALID_CODES.len() + OTHER_FAULTS.len());
            Some(if choice < INVALID_CODES.len() {
                Fault::Invalid {
                    code: INVALID_CODES[choice],
                    corrected: self.rng.draw_bool(0.5),
                }
            } else {
                OTHER_FAULTS[choice - INVALID_CODES.len()]
            })
        } else {
            None
        };
        let case = self.build_trade(index, fault);
        self.expected.add(&case.expected);
        Some(case)
    }

    fn pick<'a, T>(rng: &mut ChaCha8Rng, items: &'a [T]) -> &'a T {
        &items[rng.draw(0..items.len())]
    }

    fn business_day_on_or_after(&self, market: &str, mut date: Date) -> Date {
        while !self.refdata.is_business_day(market, date) {
            date += Duration::days(1);
        }
        date
    }

    /// The seven messages of clean standard trade `index`, in the order NOE, then ALC, NPR and
    /// SET for each allocation.
    pub fn standard_trade(&mut self, index: u64) -> Vec<Msg> {
        let rng = &mut self.rng;
        let broker = Text::new(&Self::pick(rng, &self.brokers).bic);
        let inv_mgr = Text::new(&Self::pick(rng, &self.inv_mgrs).bic);
        // A custodian that acts for the investment manager (custodians.csv).
        let custodians: Vec<&str> = self.refdata.custodians_of(&inv_mgr).collect();
        let custodian = Text::new(Self::pick(rng, &custodians));
        let security = *Self::pick(rng, &self.securities);
        let market = Text::new(&security.market);
        let ccy = Text::new(&security.currency);
        let minor_units = self
            .refdata
            .currency(&ccy)
            .map_or(2, |currency| currency.minor_units);
        let pset = Text::new(csd_of_market(&market).unwrap_or_default());
        let day_of_year = rng.draw(5..340);
        let side = if rng.draw_bool(0.5) {
            Side::Buy
        } else {
            Side::Sell
        };
        let price = Decimal::from_minor(rng.draw(PRICE_MIN_MINOR..5_000_000), 4);
        let qty: u64 = rng.draw(1_000..100_000);
        // Each allocation at least ALLOCATION_QTY_MIN: a SELL's net proceeds (gross less
        // commission and fees) stay positive at the lowest price.
        let first_qty = rng.draw(ALLOCATION_QTY_MIN..=qty - ALLOCATION_QTY_MIN);
        let payment_type = if rng.draw_bool(0.9) {
            PaymentType::Dvp
        } else {
            PaymentType::Fop
        };
        let start = Date::from_calendar_date(2026, Month::January, 1).unwrap_or(Date::MIN)
            + Duration::days(day_of_year);
        let trade_date = self.business_day_on_or_after(&market, start);
        let mut settle_date = trade_date;
        for _ in 0..2 {
            settle_date = self.business_day_on_or_after(&market, settle_date + Duration::days(1));
        }
        let run = self.config.run.clone();
        let trade_ref = ident(&[
            Part::Text("T"),
            Part::Text(&run),
            Part::Number(index + 1, 11),
        ]);
        let mut sent_at = String::with_capacity(24);
        push_date(&mut sent_at, trade_date);
        sent_at.push_str("T09:30:00.000Z");
        let sent_at = Text::from(sent_at);
        let template = Msg {
            msg_id: Text::default(),
            msg_type: MsgType::Noe,
            function: Function::New,
            sender: broker.clone(),
            sent_at,
            related_id: None,
            trade_ref,
            broker: broker.clone(),
            inv_mgr: Some(inv_mgr.clone()),
            side: Some(side),
            isin: Some(Text::new(&security.isin)),
            trade_date: Some(trade_date),
            settle_date: Some(settle_date),
            market: None,
            price: None,
            ccy: Some(ccy),
            qty: Some(qty),
            alloc_count: None,
            account: None,
            pset: None,
            payment_type: None,
            gross: None,
            commission: None,
            fees: None,
            net: None,
            custodian: None,
            safekeeping_account: None,
            settle_amount: None,
        };
        let mut sequence = 0;
        let mut next_id = |sender: &str| {
            sequence += 1;
            ident(&[
                Part::Text(sender),
                Part::Text("-"),
                Part::Text(&run),
                Part::Number(index + 1, 12),
                Part::Text("-"),
                Part::Number(sequence, 2),
            ])
        };
        let mut messages = Vec::with_capacity(MESSAGES_PER_TRADE);
        messages.push(Msg {
            msg_id: next_id(&broker),
            market: Some(market.clone()),
            price: Some(price),
            ..template.clone()
        });
        for (allocation, alloc_qty) in [first_qty, qty - first_qty].into_iter().enumerate() {
            let account_number = index * ALLOCATIONS_PER_TRADE as u64 + allocation as u64 + 1;
            let account = ident(&[Part::Text("ACC"), Part::Number(account_number, 9)]);
            let gross = price.times_quantity(alloc_qty).round_to(minor_units);
            let commission = Decimal(gross.0 / 1000).round_to(minor_units);
            let fees = Decimal::parse("3.50")
                .unwrap_or_default()
                .round_to(minor_units);
            let net = match side {
                Side::Buy => gross + commission + fees,
                Side::Sell => gross - commission - fees,
            };
            messages.push(Msg {
                msg_id: next_id(&inv_mgr),
                msg_type: MsgType::Alc,
                sender: inv_mgr.clone(),
                market: Some(market.clone()),
                price: Some(price),
                qty: Some(alloc_qty),
                alloc_count: Some(ALLOCATIONS_PER_TRADE as u32),
                account: Some(account.clone()),
                pset: Some(pset.clone()),
                payment_type: Some(payment_type),
                ..template.clone()
            });
            messages.push(Msg {
                msg_id: next_id(&broker),
                msg_type: MsgType::Npr,
                price: Some(price),
                qty: Some(alloc_qty),
                account: Some(account.clone()),
                gross: Some(gross),
                commission: Some(commission),
                fees: Some(fees),
                net: Some(net),
                ..template.clone()
            });
            messages.push(Msg {
                msg_id: next_id(&inv_mgr),
                msg_type: MsgType::Set,
                sender: inv_mgr.clone(),
                qty: Some(alloc_qty),
                account: Some(account),
                pset: Some(pset.clone()),
                payment_type: Some(payment_type),
                custodian: Some(custodian.clone()),
                safekeeping_account: Some(ident(&[
                    Part::Text("SK"),
                    Part::Number(account_number, 9),
                ])),
                settle_amount: Some(net),
                ..template.clone()
            });
        }
        messages
    }

    /// Builds trade `index` with an optional fault.
    pub fn build_trade(&mut self, index: u64, fault: Option<Fault>) -> TradeCase {
        let messages = self.standard_trade(index);
        let trade_key = messages[0].trade_key();
        let line = |msg: &Msg| encode_msg(msg).into_bytes();
        let mut lines: Vec<Vec<u8>> = messages.iter().map(line).collect();
        let mut expected = RunOutcome {
            trades: 1,
            messages_in: MESSAGES_PER_TRADE as u64,
            accepted: MESSAGES_PER_TRADE as u64,
            ..RunOutcome::default()
        };
        let mut final_state = FinalState::Matched;
        let mut order_independent = true;
        // Lines appended after the shuffle, in order.
        let mut tail: Vec<Vec<u8>> = Vec::new();
        // The first NPR and its position.
        let npr_index = 2;
        match fault {
            None => {}
            Some(Fault::Invalid { code, corrected }) => {
                let victim = match code {
                    // Only the NOE and the ALCs carry a Market; only the broker may send a NOE.
                    ReasonCode::Market | ReasonCode::Auth => 0,
                    _ => self.rng.draw(0..MESSAGES_PER_TRADE),
                };
                let bad = self.invalid_line(&messages[victim], code);
                *expected
                    .exceptions
                    .entry(code.as_str().to_owned())
                    .or_default() += 1;
                expected.messages_in += 1;
                if corrected {
                    // A MsgId rejected after its signature checked out is spent: the
                    // participant sends the corrected message under a new one.
                    if code > ReasonCode::Sig {
                        let renamed = Msg {
                            msg_id: format_compact!("{}-R", messages[victim].msg_id),
                            ..messages[victim].clone()
                        };
                        lines[victim] = line(&renamed);
                    }
                    lines.insert(victim, bad);
                } else {
                    lines[victim] = bad;
                    expected.messages_in -= 1;
                    expected.accepted -= 1;
                    final_state = FinalState::Pending;
                }
            }
            Some(Fault::MismatchAmended)
            | Some(Fault::MismatchLeft)
            | Some(Fault::WithinTolerance) => {
                let good = messages[npr_index].clone();
                let net = good.net.unwrap_or_default();
                let error = if fault == Some(Fault::WithinTolerance) {
                    Decimal::parse("1.50").unwrap_or_default()
                } else {
                    Decimal::from_units(MISMATCH_UNITS)
                };
                let bad = Msg {
                    net: Some(net + error),
                    ..good.clone()
                };
                lines[npr_index] = line(&bad);
                if fault == Some(Fault::MismatchAmended) {
                    let amend = Msg {
                        msg_id: format_compact!("{}-A", good.msg_id),
                        function: Function::Amd,
                        related_id: Some(good.msg_id.clone()),
                        ..good
                    };
                    lines.push(line(&amend));
                    expected.messages_in += 1;
                    expected.accepted += 1;
                } else if fault == Some(Fault::MismatchLeft) {
                    final_state = FinalState::Mismatched;
                }
            }
            Some(Fault::Duplicate) => {
                let victim = self.rng.draw(0..MESSAGES_PER_TRADE);
                lines.insert(victim + 1, lines[victim].clone());
                expected.messages_in += 1;
                expected.duplicates += 1;
            }
            Some(Fault::DupId) => {
                let victim = self.rng.draw(0..MESSAGES_PER_TRADE);
                let other = Msg {
                    sent_at: messages[victim]
                        .sent_at
                        .replace("09:30:00", "09:31:00")
                        .into(),
                    ..messages[victim].clone()
                };
                lines.insert(victim + 1, line(&other));
                expected.messages_in += 1;
                *expected
                    .exceptions
                    .entry(ReasonCode::DupId.as_str().to_owned())
                    .or_default() += 1;
            }
            Some(Fault::CancelAll) => {
                let good = &messages[npr_index];
                let bad = Msg {
                    net: Some(good.net.unwrap_or_default() + Decimal::from_units(MISMATCH_UNITS)),
                    ..good.clone()
                };
                lines[npr_index] = line(&bad);
                for msg in &messages {
                    lines.push(self.cancel_line(msg));
                }
                expected.messages_in += MESSAGES_PER_TRADE as u64;
                expected.accepted += MESSAGES_PER_TRADE as u64;
                final_state = FinalState::Cancelled;
            }
            Some(Fault::Closed) => {
                let late = Msg {
                    msg_id: format_compact!("{}-L", messages[3].msg_id),
                    ..messages[3].clone()
                };
                tail.push(line(&late));
                expected.messages_in += 1;
                *expected
                    .exceptions
                    .entry(ReasonCode::Closed.as_str().to_owned())
                    .or_default() += 1;
            }
            Some(Fault::Conflict) => {
                let competing = Msg {
                    msg_id: format_compact!("{}-C", messages[1].msg_id),
                    ..messages[1].clone()
                };
                lines.insert(2, line(&competing));
                expected.messages_in += 1;
                *expected
                    .exceptions
                    .entry(ReasonCode::Conflict.as_str().to_owned())
                    .or_default() += 1;
                order_independent = false;
            }
            Some(Fault::Missing) => {
                lines.pop();
                expected.messages_in -= 1;
                expected.accepted -= 1;
                final_state = FinalState::Pending;
            }
        }
        match final_state {
            FinalState::Matched => expected.cls += 1,
            FinalState::Mismatched => expected.mismatched_trades += 1,
            FinalState::Pending => expected.pending_trades += 1,
            FinalState::Cancelled => expected.cancelled_trades += 1,
        }
        if self.config.shuffle && order_independent {
            self.rng.shuffle(&mut lines);
        }
        lines.extend(tail);
        TradeCase {
            trade_key,
            lines,
            fault,
            final_state,
            expected,
            order_independent,
        }
    }

    fn cancel_line(&self, msg: &Msg) -> Vec<u8> {
        let cancel = Msg {
            msg_id: format_compact!("{}-X", msg.msg_id),
            function: Function::Can,
            related_id: Some(msg.msg_id.clone()),
            ..msg.clone()
        };
        // A CAN carries only the header, RelatedId and the trade key.
        let mut fields = fields_of(&cancel);
        fields.keep_only(&crate::validate::CAN_FIELDS);
        encode_fields(&fields).into_bytes()
    }

    /// A version of `msg` that fails validation with exactly `code`.
    fn invalid_line(&mut self, msg: &Msg, code: ReasonCode) -> Vec<u8> {
        let mut bad = msg.clone();
        match code {
            ReasonCode::Size => {
                let text = encode_msg(msg);
                let padding = "x".repeat(crate::validate::MESSAGE_SIZE_MAX_BYTES + 1);
                return text
                    .replace("</Msg>", &format!("<!--{padding}--></Msg>"))
                    .into_bytes();
            }
            ReasonCode::Sig => bad.sender = UNKNOWN_SENDER.into(),
            ReasonCode::Parse => {
                let text = encode_msg(msg);
                return text.as_bytes()[..text.len() - 4].to_vec();
            }
            ReasonCode::Field => {
                return encode_msg(msg).replace("<Qty>", "<Qty>+").into_bytes();
            }
            ReasonCode::Ccy => bad.ccy = Some("ZZZ".into()),
            ReasonCode::Country => {
                let inv_mgr = bad.inv_mgr.clone().unwrap_or_default();
                bad.inv_mgr = Some(format_compact!("{}QQ{}", &inv_mgr[..4], &inv_mgr[6..]));
            }
            ReasonCode::Market => bad.market = Some("XXXX".into()),
            ReasonCode::Isin => {
                let mut isin = bad
                    .isin
                    .clone()
                    .unwrap_or_default()
                    .into_string()
                    .into_bytes();
                if let Some(last) = isin.last_mut() {
                    *last = b'0' + (*last - b'0' + 1) % 10;
                }
                bad.isin = Some(String::from_utf8(isin).unwrap_or_default().into());
            }
            ReasonCode::Party => {
                let broker = Self::pick(&mut self.rng, &self.brokers).bic.clone();
                bad.inv_mgr = Some(broker.into());
            }
            ReasonCode::Auth => bad.sender = bad.inv_mgr.clone().unwrap_or_default(),
            ReasonCode::Date => {
                let mut date = bad.trade_date.unwrap_or(Date::MIN);
                while date.weekday() != time::Weekday::Saturday {
                    date -= Duration::days(1);
                }
                bad.trade_date = Some(date);
            }
            ReasonCode::DupId | ReasonCode::Conflict | ReasonCode::Closed | ReasonCode::Limit => {}
        }
        encode_msg(&bad).into_bytes()
    }
}

impl Iterator for Generator<'_> {
    type Item = Vec<u8>;

    fn next(&mut self) -> Option<Vec<u8>> {
        loop {
            if let Some(line) = self.queued.pop_front() {
                return Some(line);
            }
            let case = self.next_trade()?;
            self.queued.extend(case.lines);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::format_date;

    #[test]
    fn identifiers_are_the_pieces_joined_with_numbers_zero_padded() {
        let refdata = RefData::embedded()
            .expect("reference data")
            .with_generated_keys();
        let mut generator = Generator::new(&refdata, GeneratorConfig::clean(1));
        let run = generator.config.run.clone();
        let trade = generator.standard_trade(41);
        assert_eq!(trade[0].trade_ref, format!("T{run}{:011}", 42));
        for (sequence, msg) in trade.iter().enumerate() {
            let expected = format!("{}-{run}{:012}-{:02}", msg.sender, 42, sequence + 1);
            assert_eq!(msg.msg_id, expected);
        }
        let date = trade[0].trade_date.expect("a trade date");
        assert_eq!(
            trade[0].sent_at,
            format!("{}T09:30:00.000Z", format_date(date))
        );
        assert_eq!(trade[1].account.as_deref(), Some("ACC000000083"));
        assert_eq!(trade[3].safekeeping_account.as_deref(), Some("SK000000083"));
        assert_eq!(
            ident(&[Part::Text("X"), Part::Number(1_234_567, 3)]),
            "X1234567",
            "a number wider than its width is written whole"
        );
        let long = "L".repeat(120);
        assert_eq!(
            ident(&[Part::Text(&long), Part::Number(7, 4)]),
            format!("{long}0007"),
            "an identifier longer than the buffer is joined all the same"
        );
    }
}
