//! Static reference data: CSV files loaded at start into sorted arrays and searched by binary
//! search, as the STE did with qsort/bsearch.

pub mod generate;
pub mod iso;

use std::path::Path;

use serde::Deserialize;
use time::{Date, Weekday};

use crate::keys::{KeyRing, ParticipantKeys};
use crate::model::parse_date;

/// A participant's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Broker,
    InvMgr,
    Custodian,
    Csd,
}

impl Role {
    /// The spelling used in participants.csv.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Broker => "BROKER",
            Self::InvMgr => "INVMGR",
            Self::Custodian => "CUSTODIAN",
            Self::Csd => "CSD",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        match text {
            "BROKER" => Some(Self::Broker),
            "INVMGR" => Some(Self::InvMgr),
            "CUSTODIAN" => Some(Self::Custodian),
            "CSD" => Some(Self::Csd),
            _ => None,
        }
    }
}

/// A currency and its minor units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Currency {
    pub code: String,
    pub minor_units: u8,
}

/// A market (ISO 10383 MIC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Market {
    pub mic: String,
    pub country: String,
    pub currency: String,
}

/// A security and its home market.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Security {
    pub isin: String,
    pub market: String,
    pub currency: String,
}

/// A participant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Participant {
    pub bic: String,
    pub role: Role,
    pub country: String,
}

/// What the validator needs of a participant, kept beside the sorted BICs in a few bytes so
/// that looking one up reads no more than the keys and this ([`RefData::party`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Party {
    pub role: Role,
    /// Whether the country its BIC names (characters 5 and 6, not the `country` column) is in
    /// countries.csv, found when the tables were loaded.
    pub bic_country_known: bool,
}

/// What the validator needs of a listed security, kept beside the sorted ISINs
/// ([`RefData::listing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listing {
    /// Whether the ISIN carries the right check digit ([`isin_check_digit_ok`]), found when the
    /// tables were loaded.
    pub isin_check_digit_ok: bool,
    /// Where the home market's holidays are among the holiday lists; `None`: it lists none.
    holidays: Option<u32>,
}

/// Why reference data could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum RefDataError {
    #[error("cannot read {file}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("bad row in {file}: {detail}")]
    Row { file: String, detail: String },
    #[error("the key file names {0}, which is not in participants.csv")]
    UnknownKeyOwner(String),
}

/// Packs a key of at most 16 bytes into a big-endian integer: integer order is the same as the
/// byte order of the text, so a sorted array of packed keys is searched with register compares.
/// A text with a NUL byte packs to nothing: zero padding would make it another key's alias
/// (`"ABC\0"` and `"ABC"`), so that only exact keys are found.
///
/// A key of eight bytes or more (a BIC, an ISIN) is read a word at a time: its first eight bytes
/// and its last eight (overlapping when it is shorter than sixteen), each read whole and shifted
/// into place. Built a byte at a time, each step waited on the one before, and packing was a
/// third of a participant's look-up (BENCHMARKS.md). Shorter keys (currencies, countries,
/// markets) are built a byte at a time.
fn pack(text: &str) -> Option<u128> {
    let bytes = text.as_bytes();
    let len = bytes.len();
    match len {
        0..=7 => {
            let mut value: u128 = 0;
            for &byte in bytes {
                if byte == 0 {
                    return None;
                }
                value = (value << 8) | u128::from(byte);
            }
            // Left-aligned, zero-padded; an empty text is 0 (a shift by 128 bits overflows).
            Some(value.checked_shl(8 * (16 - len as u32)).unwrap_or(0))
        }
        8..=16 => {
            let word =
                |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
            let (first, last) = (word(0), word(len - 8));
            // Whether a word has a zero byte (exact: no false positives).
            let has_zero = |word: u64| {
                word.wrapping_sub(0x0101_0101_0101_0101) & !word & 0x8080_8080_8080_8080 != 0
            };
            if has_zero(first) || has_zero(last) {
                return None;
            }
            // The last word's first `16 - len` bytes are the first word's too: shifted out (all
            // eight of them when `len` is 8).
            let low = last.checked_shl(8 * (16 - len as u32)).unwrap_or(0);
            Some(u128::from(first) << 64 | u128::from(low))
        }
        _ => None,
    }
}

/// The markets of `holidays`, sorted, and each one's days as sorted Julian days.
fn holidays_by_market(holidays: &[(String, Date)]) -> (Vec<u128>, Vec<Vec<i32>>) {
    let mut pairs: Vec<(u128, i32)> = holidays
        .iter()
        .map(|(market, date)| (pack(market).unwrap_or(u128::MAX), date.to_julian_day()))
        .collect();
    pairs.sort_unstable();
    let (mut markets, mut days) = (Vec::new(), Vec::<Vec<i32>>::new());
    for (market, day) in pairs {
        match days.last_mut() {
            Some(last) if markets.last() == Some(&market) => last.push(day),
            _ => {
                markets.push(market);
                days.push(vec![day]);
            }
        }
    }
    (markets, days)
}

fn packed_keys<T>(rows: &[T], key: impl Fn(&T) -> &str) -> Vec<u128> {
    rows.iter()
        .map(|row| pack(key(row)).unwrap_or(u128::MAX))
        .collect()
}

/// Binary search of `text` among packed keys.
fn search(keys: &[u128], text: &str) -> Option<usize> {
    keys.binary_search(&pack(text)?).ok()
}

/// The sorted packed keys of each table, parallel to the rows.
#[derive(Debug, Clone, Default)]
struct Keys {
    currencies: Vec<u128>,
    countries: Vec<u128>,
    markets: Vec<u128>,
    securities: Vec<u128>,
    participants: Vec<u128>,
    /// What the validator needs of each participant and security, parallel to their keys.
    parties: Vec<Party>,
    listings: Vec<Listing>,
    /// The markets that have holidays, sorted, and each one's holidays as sorted Julian days
    /// (a search among a few markets, then among one market's days, where one search among
    /// every (market, day) pair compared 128-bit keys eleven times).
    holiday_markets: Vec<u128>,
    holiday_days: Vec<Vec<i32>>,
    /// (investment manager, custodian) pairs.
    custodians: Vec<(u128, u128)>,
}

/// The seven reference-data tables, each sorted by its key.
#[derive(Debug, Clone)]
pub struct RefData {
    keys: Keys,
    currencies: Vec<Currency>,
    countries: Vec<String>,
    markets: Vec<Market>,
    securities: Vec<Security>,
    participants: Vec<Participant>,
    /// The prepared keys of each participant, in the order of `participants`: empty until
    /// [`RefData::with_keys`] installs a key set (keys are secrets, not reference data).
    keys_by_participant: Vec<ParticipantKeys>,
    /// (market, date) pairs, sorted.
    holidays: Vec<(String, Date)>,
    /// (investment manager, custodian) pairs, sorted: the custodians that act for each
    /// investment manager, as its standing settlement instructions name them.
    custodians: Vec<(String, String)>,
}

/// The file names under `core/refdata/`.
pub const FILES: [&str; 7] = [
    "currencies.csv",
    "countries.csv",
    "markets.csv",
    "securities.csv",
    "participants.csv",
    "holidays.csv",
    "custodians.csv",
];

const EMBEDDED: [&str; 7] = [
    include_str!("../../refdata/currencies.csv"),
    include_str!("../../refdata/countries.csv"),
    include_str!("../../refdata/markets.csv"),
    include_str!("../../refdata/securities.csv"),
    include_str!("../../refdata/participants.csv"),
    include_str!("../../refdata/holidays.csv"),
    include_str!("../../refdata/custodians.csv"),
];

#[derive(Deserialize)]
struct CurrencyRow {
    code: String,
    minor_units: u8,
}

#[derive(Deserialize)]
struct CountryRow {
    code: String,
    #[allow(dead_code)]
    name: String,
}

#[derive(Deserialize)]
struct MarketRow {
    mic: String,
    country: String,
    currency: String,
}

#[derive(Deserialize)]
struct SecurityRow {
    isin: String,
    market: String,
    currency: String,
}

#[derive(Deserialize)]
struct ParticipantRow {
    bic: String,
    role: String,
    country: String,
}

#[derive(Deserialize)]
struct HolidayRow {
    market: String,
    date: String,
}

#[derive(Deserialize)]
struct CustodianRow {
    invmgr: String,
    custodian: String,
}

fn read_rows<T: serde::de::DeserializeOwned>(
    file: &str,
    text: &str,
) -> Result<Vec<T>, RefDataError> {
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    reader
        .deserialize()
        .map(|row| {
            row.map_err(|error| RefDataError::Row {
                file: file.to_owned(),
                detail: error.to_string(),
            })
        })
        .collect()
}

/// Refuses a table in which one key names two rows: which of them a search finds would depend on
/// the search, not on the data. `keys` are in sorted order.
fn unique_keys<'a>(
    file: &str,
    keys: impl IntoIterator<Item = &'a str>,
) -> Result<(), RefDataError> {
    let mut previous: Option<&str> = None;
    for key in keys {
        if previous == Some(key) {
            return Err(row_error(
                file,
                format!("{key} is the key of more than one row"),
            ));
        }
        previous = Some(key);
    }
    Ok(())
}

fn row_error(file: &str, detail: String) -> RefDataError {
    RefDataError::Row {
        file: file.to_owned(),
        detail,
    }
}

impl RefData {
    /// The reference data committed under `core/refdata/`, compiled into the binary.
    pub fn embedded() -> Result<Self, RefDataError> {
        Self::from_texts(EMBEDDED)
    }

    /// Loads the CSV files from a folder.
    pub fn load(dir: &Path) -> Result<Self, RefDataError> {
        let mut texts: Vec<String> = Vec::with_capacity(FILES.len());
        for file in FILES {
            let path = dir.join(file);
            let text = std::fs::read_to_string(&path).map_err(|source| RefDataError::Io {
                file: path.display().to_string(),
                source,
            })?;
            texts.push(text);
        }
        Self::from_texts([
            &texts[0], &texts[1], &texts[2], &texts[3], &texts[4], &texts[5], &texts[6],
        ])
    }

    /// Builds the sorted tables from the CSV texts, in [`FILES`] order.
    pub fn from_texts(texts: [&str; 7]) -> Result<Self, RefDataError> {
        let mut currencies: Vec<Currency> = read_rows::<CurrencyRow>(FILES[0], texts[0])?
            .into_iter()
            .map(|row| Currency {
                code: row.code,
                minor_units: row.minor_units,
            })
            .collect();
        currencies.sort_by(|a, b| a.code.cmp(&b.code));
        unique_keys(FILES[0], currencies.iter().map(|c| c.code.as_str()))?;
        let mut countries: Vec<String> = read_rows::<CountryRow>(FILES[1], texts[1])?
            .into_iter()
            .map(|row| row.code)
            .collect();
        countries.sort();
        unique_keys(FILES[1], countries.iter().map(String::as_str))?;
        let mut markets: Vec<Market> = read_rows::<MarketRow>(FILES[2], texts[2])?
            .into_iter()
            .map(|row| Market {
                mic: row.mic,
                country: row.country,
                currency: row.currency,
            })
            .collect();
        markets.sort_by(|a, b| a.mic.cmp(&b.mic));
        unique_keys(FILES[2], markets.iter().map(|m| m.mic.as_str()))?;
        let mut securities: Vec<Security> = read_rows::<SecurityRow>(FILES[3], texts[3])?
            .into_iter()
            .map(|row| Security {
                isin: row.isin,
                market: row.market,
                currency: row.currency,
            })
            .collect();
        securities.sort_by(|a, b| a.isin.cmp(&b.isin));
        unique_keys(FILES[3], securities.iter().map(|s| s.isin.as_str()))?;
        let mut participants = Vec::new();
        for row in read_rows::<ParticipantRow>(FILES[4], texts[4])? {
            let role = Role::parse(&row.role)
                .ok_or_else(|| row_error(FILES[4], format!("unknown role {}", row.role)))?;
            participants.push(Participant {
                bic: row.bic,
                role,
                country: row.country,
            });
        }
        participants.sort_by(|a, b| a.bic.cmp(&b.bic));
        unique_keys(FILES[4], participants.iter().map(|p| p.bic.as_str()))?;
        let mut holidays = Vec::new();
        for row in read_rows::<HolidayRow>(FILES[5], texts[5])? {
            let date = parse_date(&row.date)
                .ok_or_else(|| row_error(FILES[5], format!("bad date {}", row.date)))?;
            holidays.push((row.market, date));
        }
        holidays.sort();
        let mut custodians = Vec::new();
        for row in read_rows::<CustodianRow>(FILES[6], texts[6])? {
            let role_of = |bic: &str| {
                participants
                    .binary_search_by(|p: &Participant| p.bic.as_str().cmp(bic))
                    .ok()
                    .map(|at| participants[at].role)
            };
            if role_of(&row.invmgr) != Some(Role::InvMgr)
                || role_of(&row.custodian) != Some(Role::Custodian)
            {
                return Err(row_error(
                    FILES[6],
                    format!(
                        "{},{} is not an investment manager and a custodian of participants.csv",
                        row.invmgr, row.custodian
                    ),
                ));
            }
            custodians.push((row.invmgr, row.custodian));
        }
        custodians.sort();
        custodians.dedup();
        let keys_by_participant = vec![ParticipantKeys::default(); participants.len()];
        let (holiday_markets, holiday_days) = holidays_by_market(&holidays);
        let country_keys = packed_keys(&countries, |c| c);
        let parties = participants
            .iter()
            .map(|participant| Party {
                role: participant.role,
                bic_country_known: participant
                    .bic
                    .get(4..6)
                    .and_then(|country| search(&country_keys, country))
                    .is_some(),
            })
            .collect();
        let listings = securities
            .iter()
            .map(|security| Listing {
                isin_check_digit_ok: isin_check_digit_ok(&security.isin),
                holidays: search(&holiday_markets, &security.market).map(|at| at as u32),
            })
            .collect();
        let keys = Keys {
            currencies: packed_keys(&currencies, |c| &c.code),
            countries: country_keys,
            markets: packed_keys(&markets, |m| &m.mic),
            securities: packed_keys(&securities, |s| &s.isin),
            participants: packed_keys(&participants, |p| &p.bic),
            parties,
            listings,
            holiday_markets,
            holiday_days,
            custodians: custodians
                .iter()
                .map(|(inv_mgr, custodian)| {
                    (
                        pack(inv_mgr).unwrap_or(u128::MAX),
                        pack(custodian).unwrap_or(u128::MAX),
                    )
                })
                .collect(),
        };
        Ok(Self {
            keys,
            currencies,
            countries,
            markets,
            securities,
            participants,
            keys_by_participant,
            holidays,
            custodians,
        })
    }

    /// Installs the participants' signing keys; a key of a BIC that is not a participant is
    /// refused (a typo in a key file must not go unnoticed).
    pub fn with_keys(mut self, ring: &KeyRing) -> Result<Self, RefDataError> {
        if let Some(stranger) = ring
            .entries()
            .iter()
            .find(|entry| self.participant(&entry.bic).is_none())
        {
            return Err(RefDataError::UnknownKeyOwner(stranger.bic.clone()));
        }
        for (participant, keys) in self.participants.iter().zip(&mut self.keys_by_participant) {
            *keys = ring.keys_of(&participant.bic);
        }
        Ok(self)
    }

    /// Installs a fresh random key set (for tests and self-contained benchmark runs, whose
    /// signer and verifier share this value).
    pub fn with_generated_keys(self) -> Self {
        let ring = KeyRing::generate_for(&self);
        self.with_keys(&ring)
            .expect("a key set drawn for the participants names only participants")
    }

    /// The currency with this code.
    pub fn currency(&self, code: &str) -> Option<&Currency> {
        search(&self.keys.currencies, code).map(|i| &self.currencies[i])
    }

    /// Whether the ISO 3166 country code is known.
    pub fn has_country(&self, code: &str) -> bool {
        search(&self.keys.countries, code).is_some()
    }

    /// The market with this MIC.
    pub fn market(&self, mic: &str) -> Option<&Market> {
        search(&self.keys.markets, mic).map(|i| &self.markets[i])
    }

    /// The security with this ISIN.
    pub fn security(&self, isin: &str) -> Option<&Security> {
        search(&self.keys.securities, isin).map(|i| &self.securities[i])
    }

    /// The participant with this BIC.
    pub fn participant(&self, bic: &str) -> Option<&Participant> {
        search(&self.keys.participants, bic).map(|i| &self.participants[i])
    }

    /// What the validator needs of the participant with this BIC: [`RefData::participant`]
    /// without reading its row.
    pub fn party(&self, bic: &str) -> Option<Party> {
        search(&self.keys.participants, bic).map(|i| self.keys.parties[i])
    }

    /// What the validator needs of the security with this ISIN: [`RefData::security`] without
    /// reading its row.
    pub fn listing(&self, isin: &str) -> Option<Listing> {
        search(&self.keys.securities, isin).map(|i| self.keys.listings[i])
    }

    /// The participant with this BIC and the key it signs with (the newest of its keys), if it
    /// has one.
    pub fn participant_mac(&self, bic: &str) -> Option<(&Participant, &crate::sign::KeyedMac)> {
        let index = search(&self.keys.participants, bic)?;
        let mac = self.keys_by_participant[index].signing()?;
        Some((&self.participants[index], mac))
    }

    /// Whether `signature` over `bytes` checks out under one of `bic`'s valid keys; `None` when
    /// `bic` has no key.
    pub fn verify_signature(&self, bic: &str, bytes: &[u8], signature: &[u8]) -> Option<bool> {
        let keys = &self.keys_by_participant[search(&self.keys.participants, bic)?];
        (!keys.is_empty()).then(|| keys.verify(bytes, signature))
    }

    /// Whether `date` is a holiday of `market` in holidays.csv.
    pub fn is_holiday(&self, market: &str, date: Date) -> bool {
        let Some(market) = pack(market) else {
            return false;
        };
        let Ok(index) = self.keys.holiday_markets.binary_search(&market) else {
            return false;
        };
        self.keys.holiday_days[index]
            .binary_search(&date.to_julian_day())
            .is_ok()
    }

    /// Whether `custodian` acts for `inv_mgr` (custodians.csv): it may send that investment
    /// manager's settlement instructions, and be named in them.
    pub fn acts_for(&self, custodian: &str, inv_mgr: &str) -> bool {
        match (pack(inv_mgr), pack(custodian)) {
            (Some(inv_mgr), Some(custodian)) => self
                .keys
                .custodians
                .binary_search(&(inv_mgr, custodian))
                .is_ok(),
            _ => false,
        }
    }

    /// The custodians that act for `inv_mgr`, sorted.
    pub fn custodians_of<'a>(&'a self, inv_mgr: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        let start = self
            .custodians
            .partition_point(|(owner, _)| owner.as_str() < inv_mgr);
        self.custodians[start..]
            .iter()
            .take_while(move |(owner, _)| owner == inv_mgr)
            .map(|(_, custodian)| custodian.as_str())
    }

    /// Whether `date` is a business day of `market`: not a weekend, not a listed holiday.
    pub fn is_business_day(&self, market: &str, date: Date) -> bool {
        !matches!(date.weekday(), Weekday::Saturday | Weekday::Sunday)
            && !self.is_holiday(market, date)
    }

    /// [`RefData::is_business_day`] in the home market of a listed security, whose holidays
    /// were found when the tables were loaded: one search among that market's days, not two.
    pub fn is_business_day_in(&self, listing: Listing, date: Date) -> bool {
        !matches!(date.weekday(), Weekday::Saturday | Weekday::Sunday)
            && listing
                .holidays
                .and_then(|at| self.keys.holiday_days.get(at as usize))
                .is_none_or(|days| days.binary_search(&date.to_julian_day()).is_err())
    }

    /// All currencies, sorted by code.
    pub fn currencies(&self) -> &[Currency] {
        &self.currencies
    }

    /// All markets, sorted by MIC.
    pub fn markets(&self) -> &[Market] {
        &self.markets
    }

    /// All securities, sorted by ISIN.
    pub fn securities(&self) -> &[Security] {
        &self.securities
    }

    /// All participants, sorted by BIC.
    pub fn participants(&self) -> &[Participant] {
        &self.participants
    }

    /// Number of countries.
    pub fn country_count(&self) -> usize {
        self.countries.len()
    }

    /// Number of holiday rows.
    pub fn holiday_count(&self) -> usize {
        self.holidays.len()
    }
}

/// Whether an ISIN's last character is the right check digit (ISO 6166: letters become two
/// digits A=10 … Z=35, then the Luhn algorithm over the digit string).
pub fn isin_check_digit_ok(isin: &str) -> bool {
    let bytes = isin.as_bytes();
    if bytes.len() != 12 {
        return false;
    }
    match isin.get(..11).and_then(isin_check_digit) {
        Some(digit) => bytes[11] == b'0' + digit,
        None => false,
    }
}

/// Computes the ISIN check digit of the first eleven characters: `None` for a character
/// outside 0-9 and A-Z, or for a body longer than an ISIN's.
pub fn isin_check_digit(body: &str) -> Option<u8> {
    // Two digits a letter at most: on the stack, for every message that names a security.
    let mut digits = [0_u8; 22];
    let mut count = 0;
    for b in body.bytes() {
        let (tens, units) = match b {
            b'0'..=b'9' => (None, b - b'0'),
            b'A'..=b'Z' => {
                let value = b - b'A' + 10;
                (Some(value / 10), value % 10)
            }
            _ => return None,
        };
        for digit in tens.into_iter().chain([units]) {
            *digits.get_mut(count)? = digit;
            count += 1;
        }
    }
    // Luhn: double every second digit from the right, starting with the rightmost.
    let mut sum: u32 = 0;
    for (position, digit) in digits[..count].iter().rev().enumerate() {
        let mut value = u32::from(*digit);
        if position % 2 == 0 {
            value *= 2;
            if value > 9 {
                value -= 9;
            }
        }
        sum += value;
    }
    Some(((10 - sum % 10) % 10) as u8)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `pack` as it is defined: a byte at a time, left-aligned, nothing for a NUL or a text
    /// longer than 16 bytes.
    fn pack_bytewise(text: &str) -> Option<u128> {
        let bytes = text.as_bytes();
        if bytes.len() > 16 || bytes.contains(&0) {
            return None;
        }
        let mut padded = [0_u8; 16];
        padded[..bytes.len()].copy_from_slice(bytes);
        Some(u128::from_be_bytes(padded))
    }

    #[test]
    fn a_key_packed_a_word_at_a_time_is_the_key_packed_a_byte_at_a_time() {
        let alphabet = ['A', 'Z', '0', '9', '\0', '\u{7f}', 'é'];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut texts: Vec<String> = (0..=17).map(|len| "X".repeat(len)).collect();
        for _ in 0..20_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            let len = (state >> 59) as usize % 18;
            let text: String = (0..len)
                .map(|at| alphabet[(state >> (at * 3 % 56)) as usize % alphabet.len()])
                .collect();
            texts.push(text);
        }
        for text in &texts {
            assert_eq!(pack(text), pack_bytewise(text), "{text:?}");
        }
        // And the order of packed keys is the order of the texts, for keys of one table.
        let mut keys: Vec<(u128, &str)> = texts
            .iter()
            .filter_map(|text| Some((pack(text)?, text.as_str())))
            .collect();
        keys.sort();
        assert!(keys.windows(2).all(|pair| pair[0].1 <= pair[1].1));
    }

    #[test]
    fn a_table_with_two_rows_for_one_key_is_refused() {
        let texts = EMBEDDED;
        for (at, file) in FILES.iter().enumerate().take(5) {
            let text = texts[at];
            // The first row after the header, once more at the end.
            let first_row = text.lines().nth(1).expect("a row");
            let doubled = format!("{}\n{first_row}\n", text.trim_end());
            let mut changed = texts;
            changed[at] = &doubled;
            let key = first_row.split(',').next().expect("a key");
            match RefData::from_texts(changed) {
                Err(RefDataError::Row {
                    file: named,
                    detail,
                }) => {
                    assert_eq!(named, *file);
                    assert!(detail.contains(key), "{detail}");
                }
                other => panic!("{file}: {other:?}"),
            }
        }
        assert!(RefData::from_texts(texts).is_ok());
    }

    #[test]
    fn isin_check_digits_of_known_securities() {
        for isin in [
            "US0378331005",
            "GB0002634946",
            "AU0000XVGZA3",
            "DE000BAY0017",
        ] {
            assert!(isin_check_digit_ok(isin), "{isin}");
        }
        // The last: twelve bytes, the eleventh and twelfth one two-byte letter.
        for isin in ["US0378331006", "GB000263494", "us0378331005", "US03783310é"] {
            assert!(!isin_check_digit_ok(isin), "{isin}");
        }
    }

    #[test]
    fn embedded_reference_data_is_searchable() {
        let refdata = RefData::embedded().expect("committed reference data loads");
        assert!(refdata.currencies().len() >= 150);
        assert!(refdata.country_count() >= 240);
        assert!(refdata.markets().len() >= 20);
        assert!(refdata.securities().len() >= 5000);
        assert!(refdata.participants().len() >= 500);
        assert_eq!(refdata.currency("JPY").map(|c| c.minor_units), Some(0));
        assert_eq!(refdata.currency("KWD").map(|c| c.minor_units), Some(3));
        assert!(refdata.currency("ZZZ").is_none());
        assert_eq!(
            refdata.market("XSES").map(|m| m.currency.as_str()),
            Some("SGD")
        );
        for security in refdata.securities() {
            assert!(isin_check_digit_ok(&security.isin), "{}", security.isin);
            assert!(refdata.market(&security.market).is_some());
        }
        let christmas = parse_date("2026-12-25").expect("valid date");
        assert!(!refdata.is_business_day("XLON", christmas));
        let tuesday = parse_date("2026-08-04").expect("valid date");
        assert!(refdata.is_business_day("XSES", tuesday));
        let saturday = parse_date("2026-08-08").expect("valid date");
        assert!(!refdata.is_business_day("XSES", saturday));
    }

    #[test]
    fn every_row_of_holidays_csv_is_a_holiday_and_no_other_day_is() {
        let refdata = RefData::embedded().expect("committed reference data loads");
        let listed: std::collections::HashSet<(&str, Date)> = refdata
            .holidays
            .iter()
            .map(|(market, date)| (market.as_str(), *date))
            .collect();
        assert!(listed.len() > 100);
        for &(market, date) in &listed {
            assert!(refdata.is_holiday(market, date), "{market} {date}");
            for other in [date.previous_day(), date.next_day()].into_iter().flatten() {
                assert_eq!(
                    refdata.is_holiday(market, other),
                    listed.contains(&(market, other)),
                    "{market} {other}"
                );
            }
            for (unlisted, day) in [("XXXX", date), ("", date), ("XLON\0", date)] {
                assert!(!refdata.is_holiday(unlisted, day), "{unlisted:?} {day}");
            }
        }
    }

    /// The embedded tables with a broker whose BIC names a country countries.csv lacks
    /// (`BRKRQQ22XXX`) and a listed security whose ISIN has a wrong check digit (returned).
    pub(crate) fn tables_with_faulty_rows() -> (RefData, String) {
        let mut texts = EMBEDDED.map(str::to_owned);
        let body = "GB000000012";
        let right = isin_check_digit(body).expect("an ISIN body");
        let faulty = format!("{body}{}", (right + 1) % 10);
        for (at, row) in [
            (4, "BRKRQQ22XXX,BROKER,QQ".to_owned()),
            (3, format!("{faulty},XLON,GBP")),
        ] {
            let text = &mut texts[at];
            if !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&row);
            text.push('\n');
        }
        let refdata = RefData::from_texts(texts.each_ref().map(String::as_str))
            .expect("the edited tables load");
        (refdata, faulty)
    }

    #[test]
    fn what_is_kept_beside_the_keys_agrees_with_the_rows() {
        let (refdata, faulty) = tables_with_faulty_rows();
        assert!(!refdata.has_country("QQ"));
        for participant in refdata.participants() {
            let country = participant.bic.get(4..6).unwrap_or_default();
            assert_eq!(
                refdata.party(&participant.bic),
                Some(Party {
                    role: participant.role,
                    bic_country_known: refdata.has_country(country),
                }),
                "{}",
                participant.bic
            );
        }
        assert_eq!(
            refdata.party("BRKRQQ22XXX").map(|p| p.bic_country_known),
            Some(false)
        );
        let mut markets = std::collections::HashSet::new();
        for security in refdata.securities() {
            let listing = refdata.listing(&security.isin).expect("a listed ISIN");
            assert_eq!(
                listing.isin_check_digit_ok,
                isin_check_digit_ok(&security.isin),
                "{}",
                security.isin
            );
            // Each market's business days, through one of its securities, as its name gives them.
            if markets.insert(security.market.as_str()) {
                let first = parse_date("2024-01-01").expect("a date");
                for day in (0..4 * 366).filter_map(|n| first.checked_add(time::Duration::days(n))) {
                    assert_eq!(
                        refdata.is_business_day_in(listing, day),
                        refdata.is_business_day(&security.market, day),
                        "{} {day}",
                        security.market
                    );
                }
            }
        }
        assert!(markets.len() > 10);
        assert!(
            !refdata
                .listing(&faulty)
                .expect("listed")
                .isin_check_digit_ok
        );
        assert!(refdata.listing("US0378331005").is_none());
    }

    #[test]
    fn only_exact_keys_are_found() {
        let refdata = RefData::embedded().expect("committed reference data loads");
        assert!(refdata.participant("BRKAAU21XXX").is_some());
        // Zero padding packs these like the BIC itself: they must not be aliases of it.
        for alias in ["BRKAAU21XXX\0", "BRKAAU21XXX\0\0\0\0\0", "BRKAAU21\0XXX"] {
            assert!(refdata.participant(alias).is_none(), "{alias:?}");
        }
        assert!(refdata.currency("JPY\0").is_none());
    }

    #[test]
    fn custodians_act_for_the_investment_managers_that_name_them() {
        let refdata = RefData::embedded().expect("committed reference data loads");
        assert!(refdata.acts_for("CUSTSG22XXX", "IMGBSG22XXX"));
        let custodians: Vec<&str> = refdata.custodians_of("IMGBSG22XXX").collect();
        assert!(custodians.contains(&"CUSTSG22XXX"), "{custodians:?}");
        for inv_mgr in refdata
            .participants()
            .iter()
            .filter(|p| p.role == Role::InvMgr)
        {
            let of_it: Vec<&str> = refdata.custodians_of(&inv_mgr.bic).collect();
            assert!(of_it.len() >= 3, "{}: {of_it:?}", inv_mgr.bic);
            for custodian in of_it {
                assert!(refdata.acts_for(custodian, &inv_mgr.bic));
                assert_eq!(
                    refdata.participant(custodian).map(|p| p.role),
                    Some(Role::Custodian)
                );
            }
        }
        // Not every custodian acts for every investment manager, and roles do not swap.
        assert!(refdata
            .participants()
            .iter()
            .filter(|p| p.role == Role::Custodian)
            .any(|c| !refdata.acts_for(&c.bic, "IMGBSG22XXX")));
        assert!(!refdata.acts_for("IMGBSG22XXX", "CUSTSG22XXX"));
    }
}
