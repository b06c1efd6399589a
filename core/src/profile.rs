//! The matching profile: tolerances that can change without code.

use serde::{Deserialize, Serialize};

use crate::model::Decimal;

/// One tolerance band: amounts up to `amount_max` (inclusive; `None` = no limit) may differ by
/// at most `tolerance` currency units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToleranceBand {
    pub amount_max: Option<String>,
    pub tolerance: String,
}

/// Matching parameters, loadable from a JSON file (`--profile FILE`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchingProfile {
    /// Bands in rising order of `amount_max`; the first band whose limit holds the amount applies.
    pub tolerance_bands: Vec<ToleranceBand>,
}

impl Default for MatchingProfile {
    /// The T2S-style default: 2.00 units up to 100,000.00, 25.00 above.
    fn default() -> Self {
        Self {
            tolerance_bands: vec![
                ToleranceBand {
                    amount_max: Some("100000.00".to_owned()),
                    tolerance: "2.00".to_owned(),
                },
                ToleranceBand {
                    amount_max: None,
                    tolerance: "25.00".to_owned(),
                },
            ],
        }
    }
}

/// Why a profile is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("bad decimal {0:?} in the matching profile")]
    Decimal(String),
    #[error("the matching profile has no tolerance band")]
    Empty,
    #[error("reading the matching profile {0}: {1}")]
    Read(String, std::io::Error),
    #[error("parsing the matching profile {0}: {1}")]
    Json(String, serde_json::Error),
}

/// A profile with its decimals parsed, ready for the matcher.
#[derive(Debug, Clone)]
pub struct Tolerances {
    bands: Vec<(Option<Decimal>, Decimal)>,
}

impl Tolerances {
    /// The tolerances of the profile file at `path` (`--profile FILE`), or of the default
    /// profile when there is none.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, ProfileError> {
        let profile = match path {
            Some(path) => {
                let name = path.display().to_string();
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ProfileError::Read(name.clone(), e))?;
                serde_json::from_str::<MatchingProfile>(&text)
                    .map_err(|e| ProfileError::Json(name, e))?
            }
            None => MatchingProfile::default(),
        };
        Self::from_profile(&profile)
    }

    /// Parses a profile's bands.
    pub fn from_profile(profile: &MatchingProfile) -> Result<Self, ProfileError> {
        let parse =
            |text: &str| Decimal::parse(text).ok_or_else(|| ProfileError::Decimal(text.to_owned()));
        let mut bands = Vec::with_capacity(profile.tolerance_bands.len());
        for band in &profile.tolerance_bands {
            let amount_max = band.amount_max.as_deref().map(parse).transpose()?;
            bands.push((amount_max, parse(&band.tolerance)?));
        }
        if bands.is_empty() {
            return Err(ProfileError::Empty);
        }
        Ok(Self { bands })
    }

    /// The tolerance for an amount of this size.
    pub fn for_amount(&self, amount: Decimal) -> Decimal {
        let magnitude = Decimal(amount.0.abs());
        self.bands
            .iter()
            .find(|(amount_max, _)| amount_max.is_none_or(|max| magnitude <= max))
            .or(self.bands.last())
            .map(|(_, tolerance)| *tolerance)
            .unwrap_or_default()
    }

    /// Whether two amounts agree within the tolerance for the expected amount.
    pub fn within(&self, expected: Decimal, actual: Decimal) -> bool {
        expected.abs_diff(actual) <= self.for_amount(expected)
    }
}

impl Default for Tolerances {
    fn default() -> Self {
        Self::from_profile(&MatchingProfile::default()).expect("the default profile is valid")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(text: &str) -> Decimal {
        Decimal::parse(text).expect("valid decimal")
    }

    #[test]
    fn default_bands() {
        let tolerances = Tolerances::default();
        assert!(tolerances.within(d("100000.00"), d("100002.00")));
        assert!(!tolerances.within(d("100000.00"), d("100002.01")));
        assert!(tolerances.within(d("100000.01"), d("100025.01")));
        assert!(!tolerances.within(d("100000.01"), d("100025.02")));
    }

    #[test]
    fn profile_round_trips_through_json() {
        let json = serde_json::to_string(&MatchingProfile::default()).expect("serializes");
        let back: MatchingProfile = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, MatchingProfile::default());
    }
}
