//! Mean value analysis of separable queueing networks (Reiser & Lavenberg, 1980), single class:
//! exact MVA for closed networks of load-independent queueing stations and delay stations with a
//! think time, the open-network solution, and asymptotic and balanced-job bounds.
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
    let mut points = Vec::with_capacity(population as usize);
    for n in 1..=population {
        // Arrival theorem: an arriving job sees the network as it is with one job fewer.
        let residence: Vec<f64> = stations
            .iter()
            .zip(&queue)
            .map(|(station, &q)| match station.kind {
                Kind::Queueing => station.service * (1.0 + q),
                Kind::Delay => station.service,
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
            U: throughput * station.demand(),
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
        let utilization = arrival_rate * station.demand();
        let r = match station.kind {
            Kind::Queueing if utilization >= 1.0 => {
                return Err(MvaError::Saturated {
                    station: station.name.clone(),
                    utilization,
                })
            }
            Kind::Queueing => station.service / (1.0 - utilization),
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

/// Total and largest demand, the bottleneck and the knee.
pub fn demands(stations: &[Station], think: f64) -> Result<Demands, MvaError> {
    check(stations)?;
    non_negative(think, "the think time")?;
    let total: f64 = stations.iter().map(Station::demand).sum();
    let (bottleneck, max) = stations
        .iter()
        .filter(|s| s.kind == Kind::Queueing)
        .map(|s| (s.name.clone(), s.demand()))
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
/// which is taken over the queueing stations.
pub fn bounds(stations: &[Station], think: f64, n: u32) -> Result<Bounds, MvaError> {
    let d = demands(stations, think)?;
    let queueing: Vec<f64> = stations
        .iter()
        .filter(|s| s.kind == Kind::Queueing)
        .map(Station::demand)
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
}
