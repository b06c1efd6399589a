//! FIX 4.4 over TCP: the session layer and the mapping of STE messages to FIX application
//! messages.
//!
//! # Session
//! - Logon (`35=A`) first, with `49` SenderCompID = the participant's BIC, `56` TargetCompID =
//!   `STE`, `108` HeartBtInt, `52` SendingTime within two minutes of the engine's clock, and `554`
//!   Password = hex HMAC-SHA256 under the participant's key of `STE-FIX-LOGON\0` ‖ SendingTime ‖
//!   BIC. A bad password gets a Logout with `58=E_SIG …`, an unknown participant `58=E_AUTH …`.
//!   Sequence numbers go on across connections and across restarts of the engine, which
//!   keeps each participant's session (both numbers and the application messages it sent) in
//!   `DATA_DIR/fix-sessions/BIC.json`, written whenever a connection ends: a participant's next
//!   Logon carries the next MsgSeqNum of its previous session (one above is a gap: the engine
//!   answers the Logon and asks for the missing messages; one below gets a Logout
//!   `58=MsgSeqNum too low`), and the engine's numbers go on too. ResetSeqNumFlag (`141=Y`)
//!   on the Logon starts both at 1 (the engine's answering Logon says `141=Y`), and so does
//!   the first Logon after the daily reset time (`--fix-reset-at HH:MM`, UTC), at which the
//!   engine logs every live session out (`58=E_SESSION_END …`).
//! - Heartbeat (`0`) HeartBtInt seconds after the engine's own last message, whatever the
//!   participant sends meanwhile; TestRequest (`1`) after HeartBtInt + 20% of silence from the
//!   participant, answered by a Heartbeat with its `112`; a participant that stays silent
//!   another HeartBtInt is logged out (`58=E_TIMEOUT`).
//! - A MsgSeqNum above the expected one is a gap: the engine sends a ResendRequest (`2`,
//!   `7`=expected, `16=0`) and sets aside later messages until the gap is filled (messages
//!   resent with `43=Y`, or a SequenceReset). A MsgSeqNum below the expected one without
//!   `43=Y` is fatal: Logout `58=MsgSeqNum too low`. A ResendRequest from the participant is
//!   answered with the engine's application messages of that range again (ACKs, NAKs, pushed
//!   CLS and advices; `43=Y` PossDupFlag, `122` OrigSendingTime, the same MsgSeqNum) and a
//!   SequenceReset-GapFill (`4`, `123=Y`) over every run of session messages; the engine keeps
//!   up to 4 MiB of application messages per participant, and a range older than that is
//!   gap-filled too.
//!   A ResendRequest is acted on whatever its own MsgSeqNum: one that arrives beyond a gap is
//!   answered at once (and not again when the gap is filled), before the engine's own
//!   ResendRequest for the gap.
//! - A Reject (`3`) or BusinessMessageReject (`j`) from the participant is logged (RefSeqNum,
//!   reason, Text) and counted, and never answered with a Reject.
//! - A garbled message (bad BodyLength or CheckSum) is ignored, as FIX prescribes; the gap it
//!   leaves is recovered by the ResendRequest.
//! - Logout (`5`) is answered with a Logout once the answers in flight are sent.
//!
//! # Application messages
//! Each carries `93`/`89` (SignatureLength, Signature): the hex HMAC-SHA256, under the key of
//! the sender (`49`), of the message's bytes from `35=` up to `93=`, header included (a
//! participant signs after its engine has filled the header, and again when it resends). Every
//! byte with meaning must be covered ([`signed_part`]): `35` comes right after `9`, `93` and
//! `89` are the last fields before `10`, and no tag appears twice outside the repeating groups
//! Parties (`453`) and SettlParties (`781`), whose entries are well formed (each starts with
//! its delimiter, no tag twice in one, one sub-ID at most) and name each role once. A message
//! that breaks this gets a session Reject (`35=3` with `373` SessionRejectReason and `371`
//! RefTagID) and is stored as an exception (E_SIG for bytes outside the signed part, E_PARSE
//! for a repeated tag); it is never mapped. One that keeps it has its signature checked, is
//! converted to the canonical XML and signed for the validator. Field order is free outside
//! the groups, so a FIX engine may write fields in its dictionary's order.
//!
//! The messages validate against the FIX 4.4 data dictionary (QuickFIX's stock `FIX44.xml`)
//! both ways; SettlementInstructions needs STE's extension of it ([`T_EXTENSION`], shipped as
//! `bridge/fix-dictionary/`). Field by field, see [`TAGS`] and the participants' guide
//! (`FIX.md`).
//!
//! | STE | FIX message | ACK / NAK |
//! |---|---|---|
//! | NOE | TradeCaptureReport `AE` | TradeCaptureReportAck `AR`: `150` ExecType F / 8, `751` TradeReportRejectReason 0 / 99 |
//! | ALC | AllocationInstruction `J` with `626` AllocType=2 (preliminary) | AllocationInstructionAck `P`: `87` AllocStatus 0 / 1 (with `88=7`) |
//! | NPR | AllocationInstruction `J` with `626` AllocType=1 (calculated) | AllocationInstructionAck `P` |
//! | SET | SettlementInstructions `T` with `160` SettlInstMode=4 | ConfirmationAck `AU`: `940` AffirmStatus 3 (affirmed) / 2 (rejected, with `774=99`) |
//!
//! Every answer names the message by its id (`571`, `70`, `664` = the SET's `777`) and carries
//! `60` TransactTime; P and AU carry the message's `75` TradeDate (AU, which requires one,
//! the engine's UTC date when the message had none). The NAK's `58` Text is the reason code
//! and its detail; an ACK of a duplicate says `58=DUPLICATE`. CLS and status advices are
//! pushed as XMLnonFIX (`35=n`) with the canonical XML in the header's `212`/`213`
//! XmlDataLen/XmlData: a `<Cls>` or an `<Advice>` document.

mod codec;
mod mapping;
mod session;
mod store;

pub use codec::{
    checksum, encode, parse, signed_part, utc_timestamp, FixError, FixMessage, Group,
    StructureError, BEGIN_STRING, BODY_MAX_BYTES, PARTIES, SETTL_PARTIES, SOH,
};
pub use mapping::{from_fix, to_fix, TAGS, T_EXTENSION};
pub use session::{
    fresh_logon, logon_password, serve, sign_fields, FixConfig, ENGINE_COMP_ID, HELD_BYTES_MAX,
    HELD_MESSAGES_MAX, SEQ_NUM_MAX,
};
pub use store::SENT_BYTES_MAX;
