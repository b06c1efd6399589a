//! The deterministic reference-data generator behind `driver refdata`.
//!
//! Currencies and countries are the real ISO 4217 and ISO 3166 tables; markets are real MICs
//! with holiday calendars built from each market's rules (fixed dates, Easter-relative days and
//! n-th weekdays); securities, participants and their signing keys are synthetic but
//! deterministic, so the committed files can always be made again byte for byte.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use time::{Date, Duration, Month, Weekday};

use super::iso::{COUNTRIES, CURRENCIES};
use super::{isin_check_digit, FILES};
use crate::draw::Draws;
use crate::model::format_date;

/// Years covered by the holiday calendars.
pub const HOLIDAY_YEARS: std::ops::RangeInclusive<i32> = 2024..=2028;
/// Securities listed per market.
const SECURITIES_PER_MARKET: usize = 160;
const BROKER_COUNT: usize = 200;
const INVMGR_COUNT: usize = 200;
const CUSTODIAN_COUNT: usize = 120;
/// Custodians that act for each investment manager (custodians.csv).
const CUSTODIANS_PER_INVMGR: usize = 3;
const SEED: u64 = 0x5354_455f_5245_4644;

/// A holiday rule of a market's calendar.
#[derive(Clone, Copy)]
enum Rule {
    /// A fixed month and day every year.
    Fixed(u8, u8),
    /// Days relative to Easter Sunday (Good Friday is -2, Easter Monday +1).
    Easter(i64),
    /// The n-th given weekday of a month (n = 1…4).
    Nth(u8, Weekday, u8),
}

use Rule::{Easter, Fixed, Nth};

/// (MIC, country, currency, central securities depository BIC, calendar rules)
type MarketSpec = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static [Rule],
);

const EURONEXT: &[Rule] = &[
    Fixed(1, 1),
    Easter(-2),
    Easter(1),
    Fixed(5, 1),
    Fixed(12, 25),
    Fixed(12, 26),
];

const UNITED_STATES: &[Rule] = &[
    Fixed(1, 1),
    Nth(1, Weekday::Monday, 3),
    Nth(2, Weekday::Monday, 3),
    Easter(-2),
    Fixed(6, 19),
    Fixed(7, 4),
    Nth(9, Weekday::Monday, 1),
    Nth(11, Weekday::Thursday, 4),
    Fixed(12, 25),
];
const INDIA: &[Rule] = &[
    Fixed(1, 26),
    Fixed(5, 1),
    Fixed(8, 15),
    Fixed(10, 2),
    Fixed(12, 25),
];
const CHINA: &[Rule] = &[
    Fixed(1, 1),
    Fixed(5, 1),
    Fixed(5, 2),
    Fixed(10, 1),
    Fixed(10, 2),
    Fixed(10, 3),
    Fixed(10, 6),
    Fixed(10, 7),
];

const MARKETS: &[MarketSpec] = &[
    (
        "XSES",
        "SG",
        "SGD",
        "CDPLSGSGXXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Fixed(5, 1),
            Fixed(8, 9),
            Fixed(12, 25),
        ],
    ),
    ("XNYS", "US", "USD", "DTCYUS33XXX", UNITED_STATES),
    ("XNAS", "US", "USD", "DTCYUS33XXX", UNITED_STATES),
    (
        "XLON",
        "GB",
        "GBP",
        "CRSTGB22XXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Nth(5, Weekday::Monday, 1),
            Nth(8, Weekday::Monday, 4),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    ("XPAR", "FR", "EUR", "SICVFRPPXXX", EURONEXT),
    ("XAMS", "NL", "EUR", "NECINL2AXXX", EURONEXT),
    ("XBRU", "BE", "EUR", "CIKBBEBBXXX", EURONEXT),
    ("XLIS", "PT", "EUR", "IBLSPTPLXXX", EURONEXT),
    ("XDUB", "IE", "EUR", "EUCLIE2DXXX", EURONEXT),
    (
        "XETR",
        "DE",
        "EUR",
        "DAKVDEFFXXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XMIL",
        "IT",
        "EUR",
        "MOTIITMMXXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(8, 15),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XMAD",
        "ES",
        "EUR",
        "IBRCESMMXXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XWBO",
        "AT",
        "EUR",
        "OEKOATWWXXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XHEL",
        "FI",
        "EUR",
        "APKEFIHHXXX",
        &[
            Fixed(1, 1),
            Fixed(1, 6),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(12, 6),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XSWX",
        "CH",
        "CHF",
        "INSECHZZXXX",
        &[
            Fixed(1, 1),
            Fixed(1, 2),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(8, 1),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XSTO",
        "SE",
        "SEK",
        "VPCSSESSXXX",
        &[
            Fixed(1, 1),
            Fixed(1, 6),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(6, 6),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XCSE",
        "DK",
        "DKK",
        "VPDKDKKKXXX",
        &[
            Fixed(1, 1),
            Easter(-3),
            Easter(-2),
            Easter(1),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XOSL",
        "NO",
        "NOK",
        "VPSNNOKKXXX",
        &[
            Fixed(1, 1),
            Easter(-3),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(5, 17),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 26),
            Fixed(12, 31),
        ],
    ),
    (
        "XTKS",
        "JP",
        "JPY",
        "JJSDJPJTXXX",
        &[
            Fixed(1, 1),
            Fixed(1, 2),
            Fixed(1, 3),
            Nth(1, Weekday::Monday, 2),
            Fixed(2, 11),
            Fixed(2, 23),
            Fixed(4, 29),
            Fixed(5, 3),
            Fixed(5, 4),
            Fixed(5, 5),
            Fixed(11, 3),
            Fixed(11, 23),
            Fixed(12, 31),
        ],
    ),
    (
        "XHKG",
        "HK",
        "HKD",
        "XHKCHKH1XXX",
        &[
            Fixed(1, 1),
            Easter(-2),
            Easter(1),
            Fixed(5, 1),
            Fixed(7, 1),
            Fixed(10, 1),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XASX",
        "AU",
        "AUD",
        "CAETAU21XXX",
        &[
            Fixed(1, 1),
            Fixed(1, 26),
            Easter(-2),
            Easter(1),
            Fixed(4, 25),
            Nth(6, Weekday::Monday, 2),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XNZE",
        "NZ",
        "NZD",
        "NZCSNZ22XXX",
        &[
            Fixed(1, 1),
            Fixed(1, 2),
            Fixed(2, 6),
            Easter(-2),
            Easter(1),
            Fixed(4, 25),
            Nth(6, Weekday::Monday, 1),
            Nth(10, Weekday::Monday, 4),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XTSE",
        "CA",
        "CAD",
        "CDSLCATTXXX",
        &[
            Fixed(1, 1),
            Nth(2, Weekday::Monday, 3),
            Easter(-2),
            Fixed(7, 1),
            Nth(8, Weekday::Monday, 1),
            Nth(9, Weekday::Monday, 1),
            Nth(10, Weekday::Monday, 2),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XKRX",
        "KR",
        "KRW",
        "KSDCKRSEXXX",
        &[
            Fixed(1, 1),
            Fixed(3, 1),
            Fixed(5, 5),
            Fixed(6, 6),
            Fixed(8, 15),
            Fixed(10, 3),
            Fixed(10, 9),
            Fixed(12, 25),
            Fixed(12, 31),
        ],
    ),
    ("XNSE", "IN", "INR", "NSDLINBBXXX", INDIA),
    ("XBOM", "IN", "INR", "NSDLINBBXXX", INDIA),
    ("XSHG", "CN", "CNY", "CSDCCNBJXXX", CHINA),
    ("XSHE", "CN", "CNY", "CSDCCNBJXXX", CHINA),
    (
        "XJSE",
        "ZA",
        "ZAR",
        "STRAZAJJXXX",
        &[
            Fixed(1, 1),
            Fixed(3, 21),
            Easter(-2),
            Easter(1),
            Fixed(4, 27),
            Fixed(5, 1),
            Fixed(6, 16),
            Fixed(8, 9),
            Fixed(9, 24),
            Fixed(12, 16),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XBKK",
        "TH",
        "THB",
        "TSDCTHBKXXX",
        &[
            Fixed(1, 1),
            Fixed(4, 6),
            Fixed(4, 13),
            Fixed(4, 14),
            Fixed(4, 15),
            Fixed(5, 1),
            Fixed(7, 28),
            Fixed(8, 12),
            Fixed(10, 13),
            Fixed(10, 23),
            Fixed(12, 5),
            Fixed(12, 10),
            Fixed(12, 31),
        ],
    ),
    (
        "XKLS",
        "MY",
        "MYR",
        "MCDSMYKLXXX",
        &[
            Fixed(1, 1),
            Fixed(5, 1),
            Fixed(8, 31),
            Fixed(9, 16),
            Fixed(12, 25),
        ],
    ),
    (
        "XIDX",
        "ID",
        "IDR",
        "KSEIIDJAXXX",
        &[
            Fixed(1, 1),
            Fixed(5, 1),
            Fixed(6, 1),
            Fixed(8, 17),
            Fixed(12, 25),
            Fixed(12, 26),
        ],
    ),
    (
        "XTAI",
        "TW",
        "TWD",
        "TDCCTWTPXXX",
        &[
            Fixed(1, 1),
            Fixed(2, 28),
            Fixed(4, 4),
            Fixed(4, 5),
            Fixed(5, 1),
            Fixed(10, 10),
        ],
    ),
    (
        "BVMF",
        "BR",
        "BRL",
        "CBLCBRSPXXX",
        &[
            Fixed(1, 1),
            Easter(-48),
            Easter(-47),
            Easter(-2),
            Fixed(4, 21),
            Fixed(5, 1),
            Easter(60),
            Fixed(9, 7),
            Fixed(10, 12),
            Fixed(11, 2),
            Fixed(11, 15),
            Fixed(11, 20),
            Fixed(12, 24),
            Fixed(12, 25),
            Fixed(12, 31),
        ],
    ),
    (
        "XMEX",
        "MX",
        "MXN",
        "INDEMXMMXXX",
        &[
            Fixed(1, 1),
            Nth(2, Weekday::Monday, 1),
            Nth(3, Weekday::Monday, 3),
            Easter(-3),
            Easter(-2),
            Fixed(5, 1),
            Fixed(9, 16),
            Nth(11, Weekday::Monday, 3),
            Fixed(12, 12),
            Fixed(12, 25),
        ],
    ),
];

/// Participants that the documentation examples name, so that those examples validate.
const EXAMPLE_PARTICIPANTS: &[(&str, &str)] = &[
    ("BRKAAU21XXX", "BROKER"),
    ("IMGBSG22XXX", "INVMGR"),
    ("CUSTSG22XXX", "CUSTODIAN"),
];

/// Easter Sunday (anonymous Gregorian algorithm).
fn easter(year: i32) -> Option<Date> {
    let a = year % 19;
    let b = year / 100;
    let c = year % 100;
    let d = b / 4;
    let e = b % 4;
    let f = (b + 8) / 25;
    let g = (b - f + 1) / 3;
    let h = (19 * a + b - d - g + 15) % 30;
    let i = c / 4;
    let k = c % 4;
    let l = (32 + 2 * e + 2 * i - h - k) % 7;
    let m = (a + 11 * h + 22 * l) / 451;
    let month = (h + l - 7 * m + 114) / 31;
    let day = (h + l - 7 * m + 114) % 31 + 1;
    let month = Month::try_from(u8::try_from(month).ok()?).ok()?;
    Date::from_calendar_date(year, month, u8::try_from(day).ok()?).ok()
}

fn rule_date(rule: Rule, year: i32) -> Option<Date> {
    match rule {
        Fixed(month, day) => Date::from_calendar_date(year, Month::try_from(month).ok()?, day).ok(),
        Easter(offset) => easter(year).map(|date| date + Duration::days(offset)),
        Nth(month, weekday, n) => {
            let first = Date::from_calendar_date(year, Month::try_from(month).ok()?, 1).ok()?;
            let shift = (7 + i64::from(weekday.number_days_from_monday())
                - i64::from(first.weekday().number_days_from_monday()))
                % 7;
            Some(first + Duration::days(shift + 7 * (i64::from(n) - 1)))
        }
    }
}

fn letters(mut index: usize, width: usize) -> String {
    let mut out = vec![b'A'; width];
    for slot in out.iter_mut().rev() {
        *slot = b'A' + (index % 26) as u8;
        index /= 26;
    }
    String::from_utf8(out).unwrap_or_default()
}

/// The CSV files as text, in [`FILES`] order.
pub fn generate_texts() -> [String; 7] {
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);

    let mut currencies = String::from("code,minor_units\n");
    for (code, minor) in CURRENCIES {
        let _ = writeln!(currencies, "{code},{minor}");
    }

    let mut countries_writer = csv::Writer::from_writer(Vec::new());
    let _ = countries_writer.write_record(["code", "name"]);
    for (code, name) in COUNTRIES {
        let _ = countries_writer.write_record([*code, *name]);
    }
    let countries = countries_writer
        .into_inner()
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .unwrap_or_default();

    let mut markets = String::from("mic,country,currency\n");
    let mut holidays = String::from("market,date\n");
    let mut securities_rows: BTreeSet<(String, &str, &str)> = BTreeSet::new();
    for (mic, country, currency, _, rules) in MARKETS {
        let _ = writeln!(markets, "{mic},{country},{currency}");
        let mut dates = BTreeSet::new();
        for year in HOLIDAY_YEARS {
            for rule in *rules {
                if let Some(date) = rule_date(*rule, year) {
                    dates.insert(date);
                }
            }
        }
        for date in dates {
            let _ = writeln!(holidays, "{mic},{}", format_date(date));
        }
        let mut listed = 0;
        while listed < SECURITIES_PER_MARKET {
            // A national securities identifying number: nine characters, mostly digits.
            let nsin: String = (0..9)
                .map(|position| {
                    if position == 3 && rng.draw_bool(0.3) {
                        char::from(b'A' + rng.draw(0..26u8))
                    } else {
                        char::from(b'0' + rng.draw(0..10u8))
                    }
                })
                .collect();
            let body = format!("{country}{nsin}");
            let Some(check) = isin_check_digit(&body) else {
                continue;
            };
            if securities_rows.insert((format!("{body}{check}"), mic, currency)) {
                listed += 1;
            }
        }
    }
    let mut securities = String::from("isin,market,currency\n");
    for (isin, mic, currency) in &securities_rows {
        let _ = writeln!(securities, "{isin},{mic},{currency}");
    }

    let market_countries: Vec<&str> = {
        let set: BTreeSet<&str> = MARKETS.iter().map(|m| m.1).collect();
        set.into_iter().collect()
    };
    let mut participants_rows: BTreeSet<(String, &str)> = BTreeSet::new();
    for (bic, role) in EXAMPLE_PARTICIPANTS {
        participants_rows.insert(((*bic).to_owned(), *role));
    }
    for (_, _, _, csd, _) in MARKETS {
        participants_rows.insert(((*csd).to_owned(), "CSD"));
    }
    let roles = [
        ("B", BROKER_COUNT, "BROKER"),
        ("I", INVMGR_COUNT, "INVMGR"),
        ("C", CUSTODIAN_COUNT, "CUSTODIAN"),
    ];
    for (prefix, count, role) in roles {
        for index in 0..count {
            let country = market_countries[rng.draw(0..market_countries.len())];
            let location = rng.draw(1..10u8);
            let bic = format!("{prefix}{}{country}2{location}XXX", letters(index, 3));
            participants_rows.insert((bic, role));
        }
    }
    let mut participants = String::from("bic,role,country\n");
    for (bic, role) in &participants_rows {
        let _ = writeln!(participants, "{bic},{role},{}", &bic[4..6]);
    }

    // Each investment manager's custodians: the example pair, and a few drawn for each
    // (drawn last, so that the other tables do not depend on them).
    let of_role = |wanted: &str| -> Vec<&str> {
        participants_rows
            .iter()
            .filter(|(_, role)| *role == wanted)
            .map(|(bic, _)| bic.as_str())
            .collect()
    };
    let custodian_bics = of_role("CUSTODIAN");
    let mut custodian_rows: BTreeSet<(&str, &str)> = BTreeSet::new();
    custodian_rows.insert((EXAMPLE_PARTICIPANTS[1].0, EXAMPLE_PARTICIPANTS[2].0));
    for inv_mgr in of_role("INVMGR") {
        let mut drawn = 0;
        while drawn < CUSTODIANS_PER_INVMGR {
            let custodian = custodian_bics[rng.draw(0..custodian_bics.len())];
            if custodian_rows.insert((inv_mgr, custodian)) {
                drawn += 1;
            }
        }
    }
    let mut custodians = String::from("invmgr,custodian\n");
    for (inv_mgr, custodian) in &custodian_rows {
        let _ = writeln!(custodians, "{inv_mgr},{custodian}");
    }

    [
        currencies,
        countries,
        markets,
        securities,
        participants,
        holidays,
        custodians,
    ]
}

/// Writes the CSV files into `dir`.
pub fn write_files(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (file, text) in FILES.iter().zip(generate_texts()) {
        std::fs::write(dir.join(file), text)?;
    }
    Ok(())
}

/// The CSD (settlement place) of a market, from the generator's market table.
pub fn csd_of_market(mic: &str) -> Option<&'static str> {
    MARKETS
        .iter()
        .find(|market| market.0 == mic)
        .map(|market| market.3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::parse_date;

    #[test]
    fn easter_dates() {
        assert_eq!(easter(2026), parse_date("2026-04-05"));
        assert_eq!(easter(2025), parse_date("2025-04-20"));
        assert_eq!(easter(2024), parse_date("2024-03-31"));
    }

    #[test]
    fn nth_weekday() {
        let thanksgiving = rule_date(Nth(11, Weekday::Thursday, 4), 2026);
        assert_eq!(thanksgiving, parse_date("2026-11-26"));
    }

    #[test]
    fn committed_files_are_what_the_generator_writes() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("refdata");
        for (file, text) in FILES.iter().zip(generate_texts()) {
            let committed = std::fs::read_to_string(dir.join(file)).expect("committed file");
            assert!(committed == text, "{file} differs: run `driver refdata`");
        }
    }
}
