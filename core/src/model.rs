//! The message model: the four inbound types, their functions and the typed fields.

use std::fmt::{self, Write as _};

use time::{Date, Month};

/// The four inbound message types.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum MsgType {
    Noe,
    Alc,
    Npr,
    Set,
}

impl MsgType {
    /// Parses the wire spelling.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "NOE" => Some(Self::Noe),
            "ALC" => Some(Self::Alc),
            "NPR" => Some(Self::Npr),
            "SET" => Some(Self::Set),
            _ => None,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Noe => "NOE",
            Self::Alc => "ALC",
            Self::Npr => "NPR",
            Self::Set => "SET",
        }
    }
}

/// NEW, CAN (cancel) or AMD (amend and replace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Function {
    New,
    Can,
    Amd,
}

impl Function {
    /// Parses the wire spelling.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "NEW" => Some(Self::New),
            "CAN" => Some(Self::Can),
            "AMD" => Some(Self::Amd),
            _ => None,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "NEW",
            Self::Can => "CAN",
            Self::Amd => "AMD",
        }
    }
}

/// BUY or SELL, from the investment manager's view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Side {
    Buy,
    Sell,
}

impl Side {
    /// Parses the wire spelling.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "BUY" => Some(Self::Buy),
            "SELL" => Some(Self::Sell),
            _ => None,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Buy => "BUY",
            Self::Sell => "SELL",
        }
    }
}

/// Delivery versus payment or free of payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PaymentType {
    Dvp,
    Fop,
}

impl PaymentType {
    /// Parses the wire spelling.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "DVP" => Some(Self::Dvp),
            "FOP" => Some(Self::Fop),
            _ => None,
        }
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Dvp => "DVP",
            Self::Fop => "FOP",
        }
    }
}

/// A non-negative fixed-point decimal with six fraction digits, held as millionths.
///
/// Money and prices are never floating point: `Qty × Price` of the largest allowed values still
/// fits in the `i128` mantissa.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Decimal(pub i128);

/// Fraction digits held by [`Decimal`].
pub const DECIMAL_SCALE_DIGITS: u32 = 6;
const DECIMAL_ONE: i128 = 1_000_000;
/// Integer digits accepted before the decimal point; bounds every amount well inside `i128`.
const DECIMAL_INTEGER_DIGITS_MAX: usize = 15;
const _: () = assert!(
    DECIMAL_INTEGER_DIGITS_MAX <= 19,
    "the integer digits must fit a u64"
);

impl Decimal {
    /// Parses `digits[.digits]` with at most six fraction digits and no sign.
    pub fn parse(text: &str) -> Option<Self> {
        let (integer, fraction) = match text.split_once('.') {
            Some((integer, fraction)) => (integer, fraction),
            None => (text, ""),
        };
        if integer.is_empty()
            || integer.len() > DECIMAL_INTEGER_DIGITS_MAX
            || fraction.len() > DECIMAL_SCALE_DIGITS as usize
            || (text.contains('.') && fraction.is_empty())
            || !integer.bytes().all(|b| b.is_ascii_digit())
            || !fraction.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        // Fifteen digits and six fit in a u64 each: one 128-bit multiplication at the end
        // instead of one a digit.
        let digits = |text: &str| {
            text.bytes()
                .fold(0_u64, |value, b| value * 10 + u64::from(b - b'0'))
        };
        let mut fraction_value = digits(fraction);
        for _ in fraction.len()..DECIMAL_SCALE_DIGITS as usize {
            fraction_value *= 10;
        }
        Some(Self(
            i128::from(digits(integer)) * DECIMAL_ONE + i128::from(fraction_value),
        ))
    }

    /// A whole number of units.
    pub fn from_units(units: i128) -> Self {
        Self(units * DECIMAL_ONE)
    }

    /// Builds a decimal from an integer count of 10^-digits units (e.g. cents for digits = 2).
    pub fn from_minor(minor: i128, digits: u8) -> Self {
        Self(minor * 10_i128.pow(DECIMAL_SCALE_DIGITS - u32::from(digits)))
    }

    /// `quantity × self`, exact.
    pub fn times_quantity(self, quantity: u64) -> Self {
        Self(self.0 * i128::from(quantity))
    }

    /// Rounds half away from zero to `digits` fraction digits.
    pub fn round_to(self, digits: u8) -> Self {
        let unit = 10_i128.pow(DECIMAL_SCALE_DIGITS - u32::from(digits.min(6)));
        let half = unit / 2;
        let magnitude = (self.0.abs() + half) / unit * unit;
        Self(if self.0 < 0 { -magnitude } else { magnitude })
    }

    /// The absolute difference.
    pub fn abs_diff(self, other: Self) -> Self {
        Self((self.0 - other.0).abs())
    }

    /// Formats with exactly `digits` fraction digits (truncating any finer digits).
    pub fn format_fixed(self, digits: u8) -> String {
        let mut out = String::new();
        self.push_fixed(digits, &mut out);
        out
    }

    /// Appends the text [`Decimal::format_fixed`] gives.
    pub fn push_fixed(self, digits: u8, out: &mut String) {
        let digits = u32::from(digits.min(DECIMAL_SCALE_DIGITS as u8));
        let mut integer_digits = itoa::Buffer::new();
        let (integer, fraction) = self.split(&mut integer_digits);
        if self.0 < 0 {
            out.push('-');
        }
        out.push_str(integer);
        if digits > 0 {
            out.push('.');
            // Writing to a String cannot fail.
            let _ = write_zero_padded(
                out,
                fraction / 10_u64.pow(DECIMAL_SCALE_DIGITS - digits),
                digits as usize,
            );
        }
    }

    /// The digits of the magnitude's integer part, written into `buffer`, and its fraction in
    /// millionths: 64-bit arithmetic for every amount parsing accepts, 128-bit beyond.
    fn split(self, buffer: &mut itoa::Buffer) -> (&str, u64) {
        const ONE: u64 = DECIMAL_ONE as u64;
        let magnitude = self.0.unsigned_abs();
        match u64::try_from(magnitude) {
            Ok(magnitude) => (buffer.format(magnitude / ONE), magnitude % ONE),
            Err(_) => (
                buffer.format(magnitude / u128::from(ONE)),
                (magnitude % u128::from(ONE)) as u64,
            ),
        }
    }
}

impl std::ops::Add for Decimal {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self(self.0 + other.0)
    }
}

impl std::ops::Sub for Decimal {
    type Output = Self;
    fn sub(self, other: Self) -> Self {
        Self(self.0 - other.0)
    }
}

impl Decimal {
    /// Appends the text [`Display`](fmt::Display) writes: the encoder writes up to six amounts
    /// a message straight into its line.
    pub fn push_to(self, out: &mut String) {
        // Writing to a String cannot fail.
        let _ = self.write_to(out);
    }

    /// The shortest exact form, trailing zero fraction digits dropped, its digits written by
    /// `itoa` rather than the formatting machinery (most of what encoding a message cost).
    fn write_to(self, out: &mut impl fmt::Write) -> fmt::Result {
        if self.0 < 0 {
            out.write_char('-')?;
        }
        let mut integer_digits = itoa::Buffer::new();
        let (integer, mut fraction) = self.split(&mut integer_digits);
        out.write_str(integer)?;
        if fraction == 0 {
            return Ok(());
        }
        let mut width = DECIMAL_SCALE_DIGITS as usize;
        while fraction.is_multiple_of(10) {
            fraction /= 10;
            width -= 1;
        }
        out.write_char('.')?;
        write_zero_padded(out, fraction, width)
    }
}

/// Writes `value` in at least `width` digits, zeros in front.
fn write_zero_padded(out: &mut impl fmt::Write, value: u64, width: usize) -> fmt::Result {
    let mut digits = itoa::Buffer::new();
    let text = digits.format(value);
    for _ in text.len()..width {
        out.write_char('0')?;
    }
    out.write_str(text)
}

impl fmt::Display for Decimal {
    /// The shortest exact form: trailing zero fraction digits are dropped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_to(f)
    }
}

/// Parses a strict `YYYY-MM-DD` calendar date.
pub fn parse_date(text: &str) -> Option<Date> {
    let bytes = text.as_bytes();
    if bytes.len() != 10 || bytes[4] != b'-' || bytes[7] != b'-' {
        return None;
    }
    let number = |range: std::ops::Range<usize>| -> Option<u32> {
        let slice = &bytes[range];
        if !slice.iter().all(u8::is_ascii_digit) {
            return None;
        }
        Some(
            slice
                .iter()
                .fold(0, |acc, b| acc * 10 + u32::from(b - b'0')),
        )
    };
    let year = i32::try_from(number(0..4)?).ok()?;
    let month = Month::try_from(u8::try_from(number(5..7)?).ok()?).ok()?;
    let day = u8::try_from(number(8..10)?).ok()?;
    Date::from_calendar_date(year, month, day).ok()
}

/// Appends `date` as `YYYY-MM-DD`, a four-digit year by hand (the encoder writes two dates a
/// message), any other year through the formatting machinery.
pub fn push_date(out: &mut String, date: Date) {
    let (month, day) = (u8::from(date.month()), date.day());
    let year = match u16::try_from(date.year()) {
        Ok(year) if year <= 9999 => year,
        _ => {
            let _ = write!(out, "{:04}-{month:02}-{day:02}", date.year());
            return;
        }
    };
    let digit = |value: u16| b'0' + (value % 10) as u8;
    let (month, day) = (u16::from(month), u16::from(day));
    let text = [
        digit(year / 1000),
        digit(year / 100),
        digit(year / 10),
        digit(year),
        b'-',
        digit(month / 10),
        digit(month),
        b'-',
        digit(day / 10),
        digit(day),
    ];
    // Digits and dashes only: always UTF-8.
    out.push_str(std::str::from_utf8(&text).unwrap_or_default());
}

/// Formats a date as `YYYY-MM-DD`.
pub fn format_date(date: Date) -> String {
    let mut out = String::with_capacity(10);
    push_date(&mut out, date);
    out
}

/// A field's text: up to 24 bytes inline, longer on the heap. Every field of a standard message
/// fits but the identifiers (a generated MsgId is 32 bytes), so that a message is parsed into one
/// value with one or two heap strings instead of one per field, and copied likewise.
pub type Text = compact_str::CompactString;

/// One validated inbound message. Fields that a type or function does not carry are `None`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Msg {
    pub msg_id: Text,
    pub msg_type: MsgType,
    pub function: Function,
    pub sender: Text,
    pub sent_at: Text,
    pub related_id: Option<Text>,
    pub trade_ref: Text,
    pub broker: Text,
    pub inv_mgr: Option<Text>,
    pub side: Option<Side>,
    pub isin: Option<Text>,
    pub trade_date: Option<Date>,
    pub settle_date: Option<Date>,
    pub market: Option<Text>,
    pub price: Option<Decimal>,
    pub ccy: Option<Text>,
    pub qty: Option<u64>,
    pub alloc_count: Option<u32>,
    pub account: Option<Text>,
    pub pset: Option<Text>,
    pub payment_type: Option<PaymentType>,
    pub gross: Option<Decimal>,
    pub commission: Option<Decimal>,
    pub fees: Option<Decimal>,
    pub net: Option<Decimal>,
    pub custodian: Option<Text>,
    pub safekeeping_account: Option<Text>,
    pub settle_amount: Option<Decimal>,
}

impl Msg {
    /// The grouping and routing key `Broker/TradeRef`.
    pub fn trade_key(&self) -> String {
        trade_key(&self.broker, &self.trade_ref)
    }
}

/// Whether `key` is `msg`'s trade key ([`Msg::trade_key`]), compared in place.
pub fn is_trade_key_of(key: &str, msg: &Msg) -> bool {
    key.strip_prefix(msg.broker.as_str())
        .and_then(|rest| rest.strip_prefix('/'))
        .is_some_and(|trade_ref| trade_ref == msg.trade_ref.as_str())
}

/// The grouping and routing key of a trade: `Broker + "/" + TradeRef`.
pub fn trade_key(broker: &str, trade_ref: &str) -> String {
    let mut key = String::with_capacity(broker.len() + 1 + trade_ref.len());
    push_trade_key(&mut key, broker, trade_ref);
    key
}

/// Appends the trade key of `broker` and `trade_ref` to `out` ([`trade_key`] into a buffer).
pub fn push_trade_key(out: &mut String, broker: &str, trade_ref: &str) {
    out.push_str(broker);
    out.push('/');
    out.push_str(trade_ref);
}

/// One allocation's settlement line in a CLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub account: Text,
    pub qty: u64,
    pub net: Decimal,
    pub custodian: Text,
    pub safekeeping_account: Text,
    pub pset: Text,
    pub payment_type: PaymentType,
}

/// The clearing and settlement message emitted once per matched trade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cls {
    pub cls_id: String,
    pub trade_ref: Text,
    pub broker: Text,
    pub inv_mgr: Text,
    pub isin: Text,
    pub side: Side,
    pub trade_date: Date,
    pub settle_date: Date,
    pub ccy: Text,
    pub ccy_minor_units: u8,
    pub price: Decimal,
    pub qty: u64,
    pub matched_at: Text,
    pub settlements: Vec<Settlement>,
}

/// The stable ClsId of a trade, so that a re-emitted CLS is recognisable.
pub fn cls_id(broker: &str, trade_ref: &str) -> String {
    format!("CLS-{broker}-{trade_ref}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_parse_and_format() {
        let cases = [
            ("0", Some("0")),
            ("12.345", Some("12.345")),
            ("47.6582", Some("47.6582")),
            ("1.000000", Some("1")),
            ("1.0000001", None),
            ("-1", None),
            ("+1", None),
            (".5", None),
            ("5.", None),
            ("1e5", None),
            ("", None),
            ("1234567890123456", None),
        ];
        for (input, expected) in cases {
            let parsed = Decimal::parse(input).map(|d| d.to_string());
            assert_eq!(parsed.as_deref(), expected, "input {input:?}");
        }
    }

    #[test]
    fn rounding_is_half_away_from_zero() {
        let value = Decimal::parse("2.345").expect("valid decimal");
        assert_eq!(value.round_to(2).format_fixed(2), "2.35");
        let value = Decimal::parse("2.344999").expect("valid decimal");
        assert_eq!(value.round_to(2).format_fixed(2), "2.34");
        let negative = Decimal(-2_345_000);
        assert_eq!(negative.round_to(2).format_fixed(2), "-2.35");
        let yen = Decimal::parse("1234.5").expect("valid decimal");
        assert_eq!(yen.round_to(0).format_fixed(0), "1235");
    }

    #[test]
    fn gross_of_the_example_trade() {
        let price = Decimal::parse("47.6582").expect("valid decimal");
        assert_eq!(
            price.times_quantity(15475).round_to(2).format_fixed(2),
            "737510.65"
        );
    }

    #[test]
    fn dates_are_strict() {
        assert!(parse_date("2026-08-04").is_some());
        assert!(parse_date("2026-02-30").is_none());
        assert!(parse_date("2026-8-04").is_none());
        assert!(parse_date("20260804").is_none());
        assert_eq!(
            format_date(parse_date("2002-10-15").expect("valid date")),
            "2002-10-15"
        );
    }

    /// A decimal's shortest exact form through `write!`, as it was written before `itoa`.
    fn shortest_form(value: Decimal) -> String {
        let sign = if value.0 < 0 { "-" } else { "" };
        let magnitude = value.0.abs();
        let integer = magnitude / DECIMAL_ONE;
        let mut fraction = magnitude % DECIMAL_ONE;
        if fraction == 0 {
            return format!("{sign}{integer}");
        }
        let mut digits = DECIMAL_SCALE_DIGITS as usize;
        while fraction % 10 == 0 {
            fraction /= 10;
            digits -= 1;
        }
        format!("{sign}{integer}.{fraction:0digits$}")
    }

    /// A decimal with a fixed number of fraction digits through `format!`, as it was written
    /// before `itoa`.
    fn fixed_form(value: Decimal, digits: u8) -> String {
        let digits = u32::from(digits.min(6));
        let sign = if value.0 < 0 { "-" } else { "" };
        let magnitude = value.0.abs();
        let integer = magnitude / DECIMAL_ONE;
        if digits == 0 {
            return format!("{sign}{integer}");
        }
        let fraction = (magnitude % DECIMAL_ONE) / 10_i128.pow(DECIMAL_SCALE_DIGITS - digits);
        format!(
            "{sign}{integer}.{fraction:0width$}",
            width = digits as usize
        )
    }

    proptest::proptest! {
        #[test]
        fn an_amount_is_fixed_as_format_writes_it(units in proptest::num::i128::ANY, digits in 0_u8..9) {
            let value = Decimal(units / 1_000);
            let mut out = String::from("x");
            value.push_fixed(digits, &mut out);
            proptest::prop_assert_eq!(&out, &format!("x{}", fixed_form(value, digits)));
            proptest::prop_assert_eq!(value.format_fixed(digits), fixed_form(value, digits));
        }

        #[test]
        fn an_amount_is_appended_as_it_is_displayed(units in proptest::num::i128::ANY) {
            // Every magnitude: the fast path (within u64) and the general one beyond it, against
            // the shortest form written through the formatting machinery.
            let value = Decimal(units / 1_000);
            let mut out = String::from("x");
            value.push_to(&mut out);
            proptest::prop_assert_eq!(&out, &format!("x{}", shortest_form(value)));
            proptest::prop_assert_eq!(out, format!("x{value}"));
        }

        #[test]
        fn an_amount_reads_back_as_it_is_written(units in 0_i128..1_000_000_000_000_000_000_000) {
            // Every amount of up to fifteen integer digits and six fraction digits.
            let value = Decimal(units);
            proptest::prop_assert_eq!(Decimal::parse(&value.to_string()), Some(value));
        }

        #[test]
        fn a_date_is_appended_as_it_is_formatted(day in -800_000_i32..3_000_000) {
            let date = Date::from_julian_day(day).expect("in range");
            let mut out = String::new();
            push_date(&mut out, date);
            let formatted = format!(
                "{:04}-{:02}-{:02}",
                date.year(),
                u8::from(date.month()),
                date.day()
            );
            proptest::prop_assert_eq!(&out, &formatted);
            proptest::prop_assert_eq!(format_date(date), formatted);
        }
    }
}
