//! Reason codes of rejected messages and the matching criteria.

use std::fmt;

/// Why a message was rejected. The order of the variants is the order of the checks: a message
/// with several faults gets the code of the first failing check.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum ReasonCode {
    Size,
    Sig,
    Parse,
    Field,
    Ccy,
    Country,
    Market,
    Isin,
    Party,
    Auth,
    Date,
    DupId,
    Conflict,
    Closed,
    Limit,
}

impl ReasonCode {
    /// Every code, in check order.
    pub const ALL: [ReasonCode; 15] = [
        Self::Size,
        Self::Sig,
        Self::Parse,
        Self::Field,
        Self::Ccy,
        Self::Country,
        Self::Market,
        Self::Isin,
        Self::Party,
        Self::Auth,
        Self::Date,
        Self::DupId,
        Self::Conflict,
        Self::Closed,
        Self::Limit,
    ];

    /// The code as written in NAKs, exception rows and summaries.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Size => "E_SIZE",
            Self::Sig => "E_SIG",
            Self::Parse => "E_PARSE",
            Self::Field => "E_FIELD",
            Self::Ccy => "E_CCY",
            Self::Country => "E_COUNTRY",
            Self::Market => "E_MARKET",
            Self::Isin => "E_ISIN",
            Self::Party => "E_PARTY",
            Self::Auth => "E_AUTH",
            Self::Date => "E_DATE",
            Self::DupId => "E_DUPID",
            Self::Conflict => "E_CONFLICT",
            Self::Closed => "E_CLOSED",
            Self::Limit => "E_LIMIT",
        }
    }

    /// Parses the written form.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|code| code.as_str() == text)
    }
}

impl fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejection: the code and a human-readable detail.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rejection {
    pub code: ReasonCode,
    pub detail: String,
}

impl Rejection {
    /// Builds a rejection.
    pub fn new(code: ReasonCode, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

/// The 17 matching criteria.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum Criterion {
    C01,
    C02,
    C03,
    C04,
    C05,
    C06,
    C07,
    C08,
    C09,
    C10,
    C11,
    C12,
    C13,
    C14,
    C15,
    C16,
    C17,
}

impl Criterion {
    /// Every criterion in order.
    pub const ALL: [Criterion; 17] = [
        Self::C01,
        Self::C02,
        Self::C03,
        Self::C04,
        Self::C05,
        Self::C06,
        Self::C07,
        Self::C08,
        Self::C09,
        Self::C10,
        Self::C11,
        Self::C12,
        Self::C13,
        Self::C14,
        Self::C15,
        Self::C16,
        Self::C17,
    ];

    /// The criterion's identifier, `C01` … `C17`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::C01 => "C01",
            Self::C02 => "C02",
            Self::C03 => "C03",
            Self::C04 => "C04",
            Self::C05 => "C05",
            Self::C06 => "C06",
            Self::C07 => "C07",
            Self::C08 => "C08",
            Self::C09 => "C09",
            Self::C10 => "C10",
            Self::C11 => "C11",
            Self::C12 => "C12",
            Self::C13 => "C13",
            Self::C14 => "C14",
            Self::C15 => "C15",
            Self::C16 => "C16",
            Self::C17 => "C17",
        }
    }

    /// The mismatch reason reported when the criterion fails.
    pub fn reason(self) -> &'static str {
        match self {
            Self::C01 | Self::C02 | Self::C12 => "CMIS",
            Self::C03 => "DEAL",
            Self::C04 => "DELN",
            Self::C05 => "DSEC",
            Self::C06 => "DTRD",
            Self::C07 => "DDAT",
            Self::C08 => "DMKT",
            Self::C09 => "DDEA",
            Self::C10 => "NCRR",
            Self::C11 | Self::C13 => "DQUA",
            Self::C14 | Self::C15 | Self::C17 => "DMON",
            Self::C16 => "DEPT",
        }
    }
}

impl fmt::Display for Criterion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether an exception row with this code sets the verdict of its MsgId: every code given after
/// the signature checked out, except E_DUPID, which answers a MsgId already used.
pub fn code_is_remembered(code: ReasonCode) -> bool {
    code > ReasonCode::Sig && code != ReasonCode::DupId
}
