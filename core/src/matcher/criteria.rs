//! The 17 matching criteria over a complete trade's live messages, and the CLS of a match.

use crate::model::{cls_id, Cls, Decimal, Msg, MsgType, Settlement, Side};
use crate::profile::Tolerances;
use crate::reason::Criterion;
use crate::refdata::RefData;

/// Evaluates a set of live messages: `None` while the trade is incomplete, otherwise the
/// criteria that fail (empty when the trade matches).
pub fn evaluate_trade(
    live: &[&Msg],
    refdata: &RefData,
    tolerances: &Tolerances,
) -> Option<Vec<Criterion>> {
    let mut live = live.to_vec();
    Group::complete(&mut live).map(|group| group.failed_criteria(refdata, tolerances))
}

/// A trade's live messages counted by type (NOE, ALC, NPR, SET), without a vector: six
/// messages of every seven leave a trade incomplete, and are answered without building the
/// groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TypeCounts([usize; 4]);

impl TypeCounts {
    pub(super) fn of<'m>(live: impl IntoIterator<Item = &'m Msg>) -> Self {
        let mut counts = [0_usize; 4];
        for msg in live {
            let slot = match msg.msg_type {
                MsgType::Noe => 0,
                MsgType::Alc => 1,
                MsgType::Npr => 2,
                MsgType::Set => 3,
            };
            counts[slot] += 1;
        }
        Self(counts)
    }

    /// No live message.
    pub(super) fn is_empty(self) -> bool {
        self.0 == [0; 4]
    }

    /// As many of each type as a complete trade's: 1 NOE and as many NPR and SET as ALC.
    pub(super) fn complete(self) -> bool {
        let [noes, alcs, nprs, sets] = self.0;
        noes == 1 && alcs > 0 && nprs == alcs && sets == alcs
    }
}

/// The live messages of a complete trade, by type: slices of the live messages, sorted by type.
pub(super) struct Group<'a> {
    noe: &'a Msg,
    alcs: &'a [&'a Msg],
    nprs: &'a [&'a Msg],
    sets: &'a [&'a Msg],
    all: &'a [&'a Msg],
}

impl<'a> Group<'a> {
    /// A trade is complete when its live messages are 1 NOE and n ALC, n NPR and n SET, where n
    /// is the AllocCount of at least one ALC. Sorts `live` by type (NOE, ALC, NPR, SET; stable,
    /// so each type's messages keep their order), so that the groups are slices of it and not
    /// vectors of their own.
    pub(super) fn complete(live: &'a mut [&'a Msg]) -> Option<Self> {
        let counts = TypeCounts::of(live.iter().copied());
        if !counts.complete() {
            return None;
        }
        live.sort_by_key(|m| m.msg_type);
        let live: &'a [&'a Msg] = live;
        let [_, alcs, nprs, _] = counts.0;
        let (noe, rest) = live.split_first()?;
        let (alcs, rest) = rest.split_at(alcs);
        let (nprs, sets) = rest.split_at(nprs);
        debug_assert!(noe.msg_type == MsgType::Noe);
        debug_assert!(alcs.iter().all(|m| m.msg_type == MsgType::Alc));
        debug_assert!(nprs.iter().all(|m| m.msg_type == MsgType::Npr));
        debug_assert!(sets.iter().all(|m| m.msg_type == MsgType::Set));
        // The counts hold; what is left is an ALC that allocates to as many accounts.
        if !alcs
            .iter()
            .any(|alc| alc.alloc_count == Some(alcs.len() as u32))
        {
            return None;
        }
        Some(Self {
            noe,
            alcs,
            nprs,
            sets,
            all: live,
        })
    }

    pub(super) fn minor_units(&self, refdata: &RefData) -> u8 {
        self.noe
            .ccy
            .as_deref()
            .and_then(|ccy| refdata.currency(ccy))
            .map_or(2, |currency| currency.minor_units)
    }

    pub(super) fn failed_criteria(
        &self,
        refdata: &RefData,
        tolerances: &Tolerances,
    ) -> Vec<Criterion> {
        let mut failed = Vec::new();
        let mut check = |criterion: Criterion, holds: bool| {
            if !holds {
                failed.push(criterion);
            }
        };
        fn all_equal<'m, T: PartialEq + 'm>(
            messages: impl IntoIterator<Item = &'m &'m Msg>,
            field: impl Fn(&'m Msg) -> T,
        ) -> bool {
            let mut values = messages.into_iter().map(|m| field(m));
            match values.next() {
                Some(first) => values.all(|value| value == first),
                None => true,
            }
        }
        let noe_alc = || std::iter::once(&self.noe).chain(self.alcs.iter());
        check(
            Criterion::C01,
            all_equal(self.all, |m| m.trade_ref.as_str()),
        );
        check(Criterion::C02, all_equal(self.all, |m| m.broker.as_str()));
        check(
            Criterion::C03,
            all_equal(self.all, |m| m.inv_mgr.as_deref()),
        );
        check(Criterion::C04, all_equal(self.all, |m| m.side));
        check(Criterion::C05, all_equal(self.all, |m| m.isin.as_deref()));
        check(Criterion::C06, all_equal(self.all, |m| m.trade_date));
        check(Criterion::C07, all_equal(self.all, |m| m.settle_date));
        check(
            Criterion::C08,
            all_equal(noe_alc(), |m| m.market.as_deref()),
        );
        check(
            Criterion::C09,
            all_equal(noe_alc().chain(self.nprs.iter()), |m| m.price),
        );
        check(Criterion::C10, all_equal(self.all, |m| m.ccy.as_deref()));
        let allocated: u64 = self.alcs.iter().filter_map(|alc| alc.qty).sum();
        check(
            Criterion::C11,
            all_equal(self.alcs.iter(), |m| m.alloc_count) && Some(allocated) == self.noe.qty,
        );

        // The one message of `messages` for `account`, if exactly one is: counted in place,
        // without a vector for each account and type.
        let only = |messages: &[&'a Msg], account: Option<&str>| -> Option<&'a Msg> {
            let mut found = messages
                .iter()
                .copied()
                .filter(|m| m.account.as_deref() == account);
            let first = found.next()?;
            found.next().is_none().then_some(first)
        };
        let mut accounts_hold = true;
        let mut per_account: Vec<(&Msg, &Msg, &Msg)> = Vec::with_capacity(self.alcs.len());
        for alc in self.alcs {
            let account = alc.account.as_deref();
            let one = (
                only(self.alcs, account),
                only(self.nprs, account),
                only(self.sets, account),
            );
            if let (Some(_), Some(npr), Some(set)) = one {
                per_account.push((alc, npr, set));
            } else {
                accounts_hold = false;
            }
        }
        check(Criterion::C12, accounts_hold);
        check(
            Criterion::C13,
            per_account
                .iter()
                .all(|(alc, npr, set)| alc.qty == npr.qty && npr.qty == set.qty),
        );
        let minor_units = self.minor_units(refdata);
        let gross_holds = self
            .nprs
            .iter()
            .all(|npr| match (npr.qty, npr.price, npr.gross) {
                (Some(qty), Some(price), Some(gross)) => {
                    let expected = price.times_quantity(qty).round_to(minor_units);
                    tolerances.within(expected, gross)
                }
                _ => false,
            });
        check(Criterion::C14, gross_holds);
        let net_holds = self.nprs.iter().all(|npr| {
            match (npr.gross, npr.commission, npr.fees, npr.net, npr.side) {
                (Some(gross), Some(commission), Some(fees), Some(net), Some(side)) => {
                    let expected = match side {
                        Side::Buy => gross + commission + fees,
                        Side::Sell => gross - commission - fees,
                    };
                    tolerances.within(expected, net)
                }
                _ => false,
            }
        });
        check(Criterion::C15, net_holds);
        check(
            Criterion::C16,
            per_account
                .iter()
                .all(|(alc, _, set)| alc.pset == set.pset && alc.payment_type == set.payment_type),
        );
        check(
            Criterion::C17,
            per_account
                .iter()
                .all(|(_, npr, set)| match (npr.net, set.settle_amount) {
                    (Some(net), Some(amount)) => tolerances.within(net, amount),
                    _ => false,
                }),
        );
        failed
    }

    pub(super) fn cls(&self, refdata: &RefData, now: &str) -> Cls {
        let noe = self.noe;
        let mut settlements: Vec<Settlement> = self
            .alcs
            .iter()
            .map(|alc| {
                let account = alc.account.as_deref();
                let npr = self.nprs.iter().find(|m| m.account.as_deref() == account);
                let set = self.sets.iter().find(|m| m.account.as_deref() == account);
                Settlement {
                    account: alc.account.clone().unwrap_or_default(),
                    qty: alc.qty.unwrap_or_default(),
                    net: npr.and_then(|m| m.net).unwrap_or_default(),
                    custodian: set.and_then(|m| m.custodian.clone()).unwrap_or_default(),
                    safekeeping_account: set
                        .and_then(|m| m.safekeeping_account.clone())
                        .unwrap_or_default(),
                    pset: alc.pset.clone().unwrap_or_default(),
                    payment_type: alc.payment_type.unwrap_or(crate::model::PaymentType::Dvp),
                }
            })
            .collect();
        settlements.sort_by(|a, b| a.account.cmp(&b.account));
        Cls {
            cls_id: cls_id(&noe.broker, &noe.trade_ref),
            trade_ref: noe.trade_ref.clone(),
            broker: noe.broker.clone(),
            inv_mgr: noe.inv_mgr.clone().unwrap_or_default(),
            isin: noe.isin.clone().unwrap_or_default(),
            side: noe.side.unwrap_or(Side::Buy),
            trade_date: noe.trade_date.unwrap_or(time::Date::MIN),
            settle_date: noe.settle_date.unwrap_or(time::Date::MIN),
            ccy: noe.ccy.clone().unwrap_or_default(),
            ccy_minor_units: self.minor_units(refdata),
            price: noe.price.unwrap_or(Decimal(0)),
            qty: noe.qty.unwrap_or_default(),
            matched_at: now.into(),
            settlements,
        }
    }
}
