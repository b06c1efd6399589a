//! Mean value analysis of separable queueing networks (Reiser & Lavenberg, 1980), single class:
//! exact MVA for closed networks of load-independent queueing stations, multi-server stations
//! (load-dependent: `c` identical servers, such as a machine's cores shared by every process on
//! it) and delay stations with a think time, the open-network solution, and asymptotic and
//! balanced-job bounds.
//!
//! Units are whatever the caller uses for time (seconds in the CLI). Per station, `R` is the
//! residence time per visit and `Q` the mean number present; the system `R` excludes think time.

use serde::Serialize;

/// How a station serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// One load-independent server with a queue (FCFS, exponential service, or processor
    /// sharing: MVA gives the same means).
    Queueing,
    /// Infinite servers: no queueing, residence equals service time.
    Delay,
    /// `c` identical servers sharing one queue: a job is served at once while fewer than `c`
    /// are present. Exact MVA keeps the marginal probabilities of the `c − 1` lowest
    /// populations (Reiser & Lavenberg's load-dependent recursion in the form of Bolch et al.,
    /// 2006, §8.2), so a population costs O(c) per station.
    #[serde(rename = "servers")]
    MultiServer(u32),
}

impl Kind {
    /// Servers of the station: `None` for a delay station (as many as there are jobs).
    pub fn servers(self) -> Option<u32> {
        match self {
            Self::Queueing => Some(1),
            Self::MultiServer(servers) => Some(servers.max(1)),
            Self::Delay => None,
        }
    }
}

/// A station of the model: service time per visit and visits per job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Station {
    pub name: String,
    pub kind: Kind,
    pub service: f64,
    pub visits: f64,
}

impl Station {
    /// Service demand per job: `S × V`.
    pub fn demand(&self) -> f64 {
        self.service * self.visits
    }

    /// Demand per job on one of its servers at saturation, `S × V / c`: what bounds the
    /// throughput (`X ≤ c / D`). Zero for a delay station.
    pub fn demand_per_server(&self) -> f64 {
        self.kind
            .servers()
            .map_or(0.0, |servers| self.demand() / f64::from(servers))
    }

    /// Parses `NAME=S` or `NAME=S:V` (visits default to 1).
    pub fn parse(text: &str, kind: Kind) -> Result<Self, MvaError> {
        let bad = || MvaError::Station(text.to_owned());
        let (name, numbers) = text.split_once('=').ok_or_else(bad)?;
        let (service, visits) = match numbers.split_once(':') {
            Some((service, visits)) => (service, visits),
            None => (numbers, "1"),
        };
        let service: f64 = service.trim().parse().map_err(|_| bad())?;
        let visits: f64 = visits.trim().parse().map_err(|_| bad())?;
        let name = name.trim();
        if name.is_empty() || !service.is_finite() || service < 0.0 || !visits.is_finite() {
            return Err(bad());
        }
        if visits < 0.0 {
            return Err(bad());
        }
        Ok(Self {
            name: name.to_owned(),
            kind,
            service,
            visits,
        })
    }
}

/// Why a model cannot be solved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MvaError {
    #[error("station {0:?}: expected NAME=S or NAME=S:V with S ≥ 0 and V ≥ 0")]
    Station(String),
    #[error("the model has no station")]
    NoStation,
    #[error("the model has no demand: every station has S × V = 0")]
    NoDemand,
    #[error("{0} must be a finite number ≥ 0")]
    Negative(&'static str),
    #[error("the open network is saturated: {station} would be {utilization:.3} busy (U must stay below 1)")]
    Saturated { station: String, utilization: f64 },
}

/// One station's figures at one population (or arrival rate).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct StationFigures {
    pub station: String,
    pub U: f64,
    pub Q: f64,
    /// Residence time per visit.
    pub R: f64,
    /// Station throughput: visits per unit of time.
    pub X: f64,
}

/// The solution of a closed network at population `n`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct ClosedPoint {
    pub n: u32,
    pub X: f64,
    pub R: f64,
    pub stations: Vec<StationFigures>,
}

/// The solution of an open network.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct OpenSolution {
    pub arrival_rate: f64,
    pub R: f64,
    /// Mean number of jobs in the system.
    pub N: f64,
    pub stations: Vec<StationFigures>,
}

/// Asymptotic and balanced-job bounds at one population.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct Bounds {
    pub n: u32,
    /// `min(1/D_max, N/(D+Z))`.
    pub X_max: f64,
    /// `max(D, N·D_max − Z)`.
    pub R_min: f64,
    /// Balanced-job bounds on throughput (lower, upper) and response time (lower, upper).
    pub X_bjb: (f64, f64),
    pub R_bjb: (f64, f64),
}

/// The quantities the bounds are made of.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[allow(non_snake_case)]
pub struct Demands {
    /// Total demand `D` (queueing and delay stations).
    pub D: f64,
    /// Largest demand of a queueing station.
    pub D_max: f64,
    /// The station with `D_max`: the bottleneck.
    pub bottleneck: String,
    /// Think time.
    pub Z: f64,
    /// The knee `N* = (D + Z) / D_max`.
    pub N_star: f64,
}

fn check(stations: &[Station]) -> Result<(), MvaError> {
    if stations.is_empty() {
        return Err(MvaError::NoStation);
    }
    if stations.iter().all(|s| s.demand() == 0.0) {
        return Err(MvaError::NoDemand);
    }
    Ok(())
}

fn non_negative(value: f64, what: &'static str) -> Result<(), MvaError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(MvaError::Negative(what))
    }
}

/// Exact MVA for a closed network with think time `think`, for every population 1..=`population`.
pub fn closed(
    stations: &[Station],
    think: f64,
    population: u32,
) -> Result<Vec<ClosedPoint>, MvaError> {
    check(stations)?;
    non_negative(think, "the think time")?;
    let mut queue = vec![0.0_f64; stations.len()];
    // p(j | n − 1) for j = 0..c−1 of each multi-server station (empty for the others): an
    // empty network at n = 0.
    let mut marginals: Vec<Vec<f64>> = stations
        .iter()
        .map(|station| match station.kind {
            Kind::MultiServer(servers) if servers > 1 => {
                let mut p = vec![0.0; servers as usize];
                p[0] = 1.0;
                p
            }
            _ => Vec::new(),
        })
        .collect();
    let mut points = Vec::with_capacity(population as usize);
    for n in 1..=population {
        // Arrival theorem: an arriving job sees the network as it is with one job fewer.
        let residence: Vec<f64> = stations
            .iter()
            .zip(&queue)
            .zip(&marginals)
            .map(|((station, &q), p)| match station.kind {
                Kind::Queueing => station.service * (1.0 + q),
                Kind::Delay => station.service,
                Kind::MultiServer(_) if p.is_empty() => station.service * (1.0 + q),
                Kind::MultiServer(_) => {
                    // R = S/c · (1 + Q(n−1) + Σ_{j<c} (c−1−j) p(j | n−1)): a job that finds
                    // fewer than c present waits for no one.
                    let c = p.len() as f64;
                    let idle: f64 = p
                        .iter()
                        .enumerate()
                        .map(|(j, pj)| (c - 1.0 - j as f64) * pj)
                        .sum();
                    station.service / c * (1.0 + q + idle)
                }
            })
            .collect();
        let response: f64 = stations
            .iter()
            .zip(&residence)
            .map(|(station, r)| station.visits * r)
            .sum();
        let throughput = f64::from(n) / (think + response);
        for ((q, station), r) in queue.iter_mut().zip(stations).zip(&residence) {
            *q = throughput * station.visits * r;
        }
        for (p, station) in marginals.iter_mut().zip(stations) {
            if p.is_empty() {
                continue;
            }
            // p(j | n) = X·D/j · p(j−1 | n−1) for 0 < j < c; p(0 | n) from the busy servers,
            // Σ_{j<c} (c−j) p(j | n) = c − X·D.
            let load = throughput * station.demand();
            let c = p.len();
            for j in (1..c).rev() {
                p[j] = load / j as f64 * p[j - 1];
            }
            let rest: f64 = (1..c).map(|j| (c - j) as f64 * p[j]).sum();
            // Rounding near saturation may take it a hair below zero.
            p[0] = (1.0 - (load + rest) / c as f64).max(0.0);
        }
        points.push(ClosedPoint {
            n,
            X: throughput,
            R: response,
            stations: figures(stations, &residence, &queue, throughput),
        });
    }
    Ok(points)
}

fn figures(
    stations: &[Station],
    residence: &[f64],
    queue: &[f64],
    throughput: f64,
) -> Vec<StationFigures> {
    stations
        .iter()
        .zip(residence.iter().zip(queue))
        .map(|(station, (&r, &q))| StationFigures {
            station: station.name.clone(),
            // Per server: the share of its capacity in use.
            U: throughput * station.demand() / f64::from(station.kind.servers().unwrap_or(1)),
            Q: q,
            R: r,
            X: throughput * station.visits,
        })
        .collect()
}

/// The open network at arrival rate `arrival_rate` (jobs per unit of time).
pub fn open(stations: &[Station], arrival_rate: f64) -> Result<OpenSolution, MvaError> {
    check(stations)?;
    non_negative(arrival_rate, "the arrival rate")?;
    let mut residence = Vec::with_capacity(stations.len());
    let mut queue = Vec::with_capacity(stations.len());
    for station in stations {
        let utilization = arrival_rate * station.demand_per_server();
        let r = match station.kind {
            Kind::Queueing | Kind::MultiServer(_) if utilization >= 1.0 => {
                return Err(MvaError::Saturated {
                    station: station.name.clone(),
                    utilization,
                })
            }
            Kind::Queueing => station.service / (1.0 - utilization),
            Kind::MultiServer(servers) => {
                // M/M/c: a job waits with Erlang's C probability, then S/(c(1−ρ)) on average.
                let c = servers.max(1);
                station.service
                    * (1.0
                        + erlang_c(c, arrival_rate * station.demand())
                            / (f64::from(c) * (1.0 - utilization)))
            }
            Kind::Delay => station.service,
        };
        residence.push(r);
        queue.push(arrival_rate * station.visits * r);
    }
    let response = stations
        .iter()
        .zip(&residence)
        .map(|(station, r)| station.visits * r)
        .sum();
    Ok(OpenSolution {
        arrival_rate,
        R: response,
        N: queue.iter().sum(),
        stations: figures(stations, &residence, &queue, arrival_rate),
    })
}

/// Erlang's C formula: the probability that a job arriving at `c` servers offered `load`
/// (arrival rate × demand, below `c`) has to wait.
fn erlang_c(c: u32, load: f64) -> f64 {
    // Σ_{k<c} a^k/k! and a^c/c! by the terms' ratio, without factorials.
    let (mut term, mut below) = (1.0_f64, 0.0_f64);
    for k in 0..c {
        below += term;
        term *= load / f64::from(k + 1);
    }
    let top = term * f64::from(c) / (f64::from(c) - load);
    top / (below + top)
}

/// Total and largest demand, the bottleneck and the knee.
pub fn demands(stations: &[Station], think: f64) -> Result<Demands, MvaError> {
    check(stations)?;
    non_negative(think, "the think time")?;
    let total: f64 = stations.iter().map(Station::demand).sum();
    let (bottleneck, max) = stations
        .iter()
        .filter(|s| s.kind != Kind::Delay)
        .map(|s| (s.name.clone(), s.demand_per_server()))
        .fold((String::new(), 0.0), |best, next| {
            if next.1 > best.1 {
                next
            } else {
                best
            }
        });
    Ok(Demands {
        D: total,
        D_max: max,
        bottleneck,
        Z: think,
        N_star: if max > 0.0 {
            (total + think) / max
        } else {
            f64::INFINITY
        },
    })
}

/// Asymptotic bounds and balanced-job bounds (Zahorjan, Sevcik, Eager & Galler, 1982) at
/// population `n`. Delay stations count in `D` but not in `D_max` or the balanced average,
/// which is taken over the queueing stations; a station of `c` servers counts as one of
/// demand `D/c` there (its capacity), which keeps the asymptotic bounds exact and makes the
/// balanced ones approximate.
pub fn bounds(stations: &[Station], think: f64, n: u32) -> Result<Bounds, MvaError> {
    let d = demands(stations, think)?;
    let queueing: Vec<f64> = stations
        .iter()
        .filter(|s| s.kind != Kind::Delay)
        .map(Station::demand_per_server)
        .collect();
    let delay: f64 = stations
        .iter()
        .filter(|s| s.kind == Kind::Delay)
        .map(Station::demand)
        .sum();
    let nf = f64::from(n.max(1));
    let x_asymptotic = if d.D_max > 0.0 {
        (1.0 / d.D_max).min(nf / (d.D + think))
    } else {
        nf / (d.D + think)
    };
    let r_asymptotic = d.D.max(nf * d.D_max - think);
    // The balanced bounds hold for queueing stations; delay adds to the think time.
    let z = think + delay;
    let dq: f64 = queueing.iter().sum();
    let (x_bjb, r_bjb) = if queueing.is_empty() || dq == 0.0 {
        ((x_asymptotic, x_asymptotic), (d.D, d.D))
    } else {
        // Balanced bounds of a terminal workload: the optimistic one spreads the other jobs
        // as in a balanced network of the average demand, damped by the think time; the
        // pessimistic one as if every station were the bottleneck.
        let d_avg = dq / queueing.len() as f64;
        let r_low = dq + (nf - 1.0) * d_avg / (1.0 + z / dq);
        let r_high = dq + (nf - 1.0) * d.D_max / (1.0 + z / (nf * dq));
        let x_high = (1.0 / d.D_max).min(nf / (z + r_low));
        let x_low = nf / (z + r_high);
        (
            (x_low, x_high),
            ((r_low + delay).max(nf * d.D_max - think), r_high + delay),
        )
    };
    Ok(Bounds {
        n,
        X_max: x_asymptotic,
        R_min: r_asymptotic,
        X_bjb: x_bjb,
        R_bjb: r_bjb,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queueing(name: &str, service: f64, visits: f64) -> Station {
        Station {
            name: name.to_owned(),
            kind: Kind::Queueing,
            service,
            visits,
        }
    }

    #[test]
    fn stations_parse_with_and_without_visits() {
        assert_eq!(
            Station::parse("cpu=0.125:16", Kind::Queueing),
            Ok(queueing("cpu", 0.125, 16.0))
        );
        assert_eq!(
            Station::parse("disk=0.3", Kind::Queueing),
            Ok(queueing("disk", 0.3, 1.0))
        );
        for bad in [
            "cpu", "=1", "cpu=x", "cpu=1:y", "cpu=-1", "cpu=1:-2", "cpu=NaN",
        ] {
            assert!(Station::parse(bad, Kind::Queueing).is_err(), "{bad}");
        }
    }

    #[test]
    fn one_queue_alone_is_the_machine_repairman_without_repairs() {
        // One station, no think time: every job queues there, X = 1/S from n = 1.
        let points = closed(&[queueing("only", 2.0, 1.0)], 0.0, 3).expect("solves");
        for point in &points {
            assert!((point.X - 0.5).abs() < 1e-12);
            assert!((point.R - 2.0 * f64::from(point.n)).abs() < 1e-12);
        }
    }

    /// The machine-repairman model solved as a birth-death chain: `n` jobs thinking `think` on
    /// average, `c` servers of mean service `service`; returns (X, R).
    fn repairman(n: u32, c: u32, service: f64, think: f64) -> (f64, f64) {
        // π(j+1)/π(j) = ((n−j)/think) / (min(j+1, c)/service).
        let mut weights = vec![1.0_f64];
        for j in 0..n {
            let birth = f64::from(n - j) / think;
            let death = f64::from((j + 1).min(c)) / service;
            weights.push(weights[j as usize] * birth / death);
        }
        let total: f64 = weights.iter().sum();
        let busy: f64 = weights
            .iter()
            .enumerate()
            .map(|(j, w)| w / total * f64::from((j as u32).min(c)))
            .sum();
        let present: f64 = weights
            .iter()
            .enumerate()
            .map(|(j, w)| w / total * j as f64)
            .sum();
        let x = busy / service;
        (x, present / x)
    }

    #[test]
    fn a_station_of_c_servers_is_the_repairman_with_c_repairmen() {
        for (c, service, think) in [
            (2, 1.0, 3.0),
            (2, 0.5, 0.1),
            (4, 2.0, 5.0),
            (3, 1.0, 0.0001),
        ] {
            let station = Station {
                name: "cores".to_owned(),
                kind: Kind::MultiServer(c),
                service,
                visits: 1.0,
            };
            let points = closed(std::slice::from_ref(&station), think, 40).expect("solves");
            for point in &points {
                let (x, r) = repairman(point.n, c, service, think);
                assert!(
                    (point.X - x).abs() < 1e-9 * x,
                    "c={c} n={}: X {} vs {x}",
                    point.n,
                    point.X
                );
                assert!(
                    (point.R - r).abs() < 1e-9 * r,
                    "c={c} n={}: R {} vs {r}",
                    point.n,
                    point.R
                );
            }
        }
    }

    #[test]
    fn one_server_is_a_queueing_station_and_more_servers_than_jobs_a_delay() {
        let with = |kind| {
            vec![
                Station {
                    name: "a".to_owned(),
                    kind,
                    service: 0.3,
                    visits: 2.0,
                },
                queueing("b", 0.2, 1.0),
            ]
        };
        let single = closed(&with(Kind::MultiServer(1)), 1.0, 20).expect("solves");
        let queue = closed(&with(Kind::Queueing), 1.0, 20).expect("solves");
        let wide = closed(&with(Kind::MultiServer(20)), 1.0, 20).expect("solves");
        let delay = closed(&with(Kind::Delay), 1.0, 20).expect("solves");
        for k in 0..20 {
            assert!((single[k].X - queue[k].X).abs() < 1e-12);
            assert!((wide[k].X - delay[k].X).abs() < 1e-9, "n={}", k + 1);
        }
    }

    #[test]
    fn the_open_multi_server_station_is_erlang_c() {
        // M/M/2 with S = 1 at λ = 1: ρ = 0.5, C = 1/3, R = 1 + (1/3)/(2·0.5) = 4/3.
        let station = Station {
            name: "cores".to_owned(),
            kind: Kind::MultiServer(2),
            service: 1.0,
            visits: 1.0,
        };
        let open = open(std::slice::from_ref(&station), 1.0).expect("solves");
        assert!((open.R - 4.0 / 3.0).abs() < 1e-12, "{}", open.R);
        assert!(super::open(std::slice::from_ref(&station), 2.0).is_err());
        let d = demands(std::slice::from_ref(&station), 0.0).expect("demands");
        assert_eq!(d.D_max, 0.5);
    }
}
