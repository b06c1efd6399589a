//! `monitor mva` against published exact-MVA tables, and the bounds against exact MVA.

use ste_monitor::mva::{bounds, closed, demands, open, Kind, Station};

fn station(text: &str) -> Station {
    Station::parse(text, Kind::Queueing).expect("a station")
}

/// Published figures are rounded to three decimals.
fn assert_3dp(computed: f64, published: f64, what: &str) {
    assert!(
        (computed - published).abs() <= 0.0005 + 1e-9,
        "{what}: computed {computed:.6}, published {published:.3}"
    );
}

/// R. Jain, *The Art of Computer Systems Performance Analysis* (Wiley, 1991), Example 34.2 and
/// Table 34.1 ("MVA Results for Example 34.2"): a timesharing system with think time Z = 4 s,
/// a CPU (S = 0.125 s, V = 16), disk A (S = 0.3 s, V = 10) and disk B (S = 0.2 s, V = 5).
/// Columns: n; residence per visit at CPU, A, B; system response time; throughput; queue
/// lengths at CPU, A, B.
#[rustfmt::skip]
const JAIN_TABLE_34_1: [(u32, [f64; 8]); 9] = [
    (1,  [0.125, 0.300, 0.200,  6.000, 0.100, 0.200,  0.300, 0.100]),
    (2,  [0.150, 0.390, 0.220,  7.400, 0.175, 0.421,  0.684, 0.193]),
    (3,  [0.178, 0.505, 0.239,  9.088, 0.229, 0.651,  1.158, 0.273]),
    (4,  [0.206, 0.647, 0.255, 11.051, 0.266, 0.878,  1.721, 0.338]),
    (5,  [0.235, 0.816, 0.268, 13.256, 0.290, 1.088,  2.365, 0.388]),
    (17, [0.370, 3.962, 0.300, 47.045, 0.333, 1.974, 13.195, 0.499]),
    (18, [0.372, 4.259, 0.300, 50.032, 0.333, 1.981, 14.187, 0.499]),
    (19, [0.373, 4.556, 0.300, 53.022, 0.333, 1.987, 15.181, 0.500]),
    (20, [0.373, 4.854, 0.300, 56.016, 0.333, 1.991, 16.177, 0.500]),
];

/// The stations of Jain's Example 34.2.
fn jain_stations() -> Vec<Station> {
    ["cpu=0.125:16", "disk_a=0.3:10", "disk_b=0.2:5"]
        .into_iter()
        .map(station)
        .collect()
}

#[test]
fn closed_network_with_think_time_reproduces_jain_table_34_1() {
    let stations = jain_stations();
    let points = closed(&stations, 4.0, 20).expect("solves");
    assert_eq!(points.len(), 20);
    for (n, row) in JAIN_TABLE_34_1 {
        let point = &points[n as usize - 1];
        assert_eq!(point.n, n);
        for (k, name) in ["cpu", "disk_a", "disk_b"].iter().enumerate() {
            assert_eq!(point.stations[k].station, *name);
            assert_3dp(point.stations[k].R, row[k], &format!("n={n} R {name}"));
            assert_3dp(point.stations[k].Q, row[5 + k], &format!("n={n} Q {name}"));
        }
        assert_3dp(point.R, row[3], &format!("n={n} R"));
        assert_3dp(point.X, row[4], &format!("n={n} X"));
        // The operational laws hold at every population.
        for (figures, s) in point.stations.iter().zip(&stations) {
            assert!((figures.U - point.X * s.demand()).abs() < 1e-12);
            assert!((figures.X - point.X * s.visits).abs() < 1e-12);
        }
        let population: f64 = point.stations.iter().map(|s| s.Q).sum::<f64>() + point.X * 4.0;
        assert!(
            (population - f64::from(n)).abs() < 1e-9,
            "Little's law over the loop"
        );
    }
    // Jain's bottleneck: disk A (D = 3 s), so X tends to 1/3 and N* = (6 + 4) / 3.
    let d = demands(&stations, 4.0).expect("demands");
    assert_eq!(d.bottleneck, "disk_a");
    assert_3dp(d.D, 6.0, "D");
    assert_3dp(d.N_star, 10.0 / 3.0, "N*");
}

#[test]
fn delay_stations_act_as_think_time() {
    // A delay station of demand 4 in a network without think time gives the same throughput
    // as think time 4.
    let mut stations = jain_stations();
    let with_think = closed(&stations, 4.0, 12).expect("solves");
    stations.push(Station::parse("terminals=4", Kind::Delay).expect("a delay station"));
    let with_delay = closed(&stations, 0.0, 12).expect("solves");
    for (a, b) in with_think.iter().zip(&with_delay) {
        assert!((a.X - b.X).abs() < 1e-12);
        assert!((b.R - (a.R + 4.0)).abs() < 1e-9);
        assert!(
            (b.stations[3].R - 4.0).abs() < 1e-12,
            "no queueing at a delay station"
        );
    }
}

#[test]
fn exact_mva_lies_within_its_bounds() {
    // Many networks, with and without think time: the asymptotic and balanced-job bounds must
    // hold the exact solution between them.
    let shapes: [&[f64]; 5] = [
        &[1.0],
        &[0.2, 0.2, 0.2],
        &[2.0, 0.6, 0.6],
        &[0.05, 0.9, 0.3, 0.31],
        &[3.0, 0.001],
    ];
    for demands_of in shapes {
        for think in [0.0, 0.5, 4.0, 40.0] {
            let stations: Vec<Station> = demands_of
                .iter()
                .enumerate()
                .map(|(k, d)| station(&format!("s{k}={d}")))
                .collect();
            let points = closed(&stations, think, 60).expect("solves");
            for point in &points {
                let b = bounds(&stations, think, point.n).expect("bounds");
                let eps = 1e-9;
                assert!(point.X <= b.X_max + eps, "{demands_of:?} Z={think} {b:?}");
                assert!(point.R + eps >= b.R_min, "{demands_of:?} Z={think} {b:?}");
                assert!(
                    b.X_bjb.0 <= point.X + eps && point.X <= b.X_bjb.1 + eps,
                    "X {} outside {:?} ({demands_of:?} Z={think} n={})",
                    point.X,
                    b.X_bjb,
                    point.n
                );
                assert!(
                    b.R_bjb.0 <= point.R + eps && point.R <= b.R_bjb.1 + eps,
                    "R {} outside {:?} ({demands_of:?} Z={think} n={})",
                    point.R,
                    b.R_bjb,
                    point.n
                );
            }
        }
    }
}

#[test]
fn open_network_follows_the_utilization_and_residence_laws() {
    // Jain's stations as an open network at 0.3 jobs/s: U = λD, R = S/(1 − U) per visit.
    let stations = jain_stations();
    let solution = open(&stations, 0.3).expect("solves");
    let expected_u = [0.6, 0.9, 0.3];
    let mut response = 0.0;
    for ((figures, s), u) in solution.stations.iter().zip(&stations).zip(expected_u) {
        assert!((figures.U - u).abs() < 1e-12);
        assert!((figures.R - s.service / (1.0 - u)).abs() < 1e-12);
        assert!((figures.Q - u / (1.0 - u)).abs() < 1e-9);
        response += s.visits * figures.R;
    }
    assert!((solution.R - response).abs() < 1e-9);
    assert!((solution.N - 0.3 * solution.R).abs() < 1e-9, "Little's law");
    // At 1/3 jobs/s disk A is saturated: refused with its name.
    let error = open(&stations, 1.0 / 3.0).expect_err("saturated");
    assert!(error.to_string().contains("disk_a"), "{error}");
}

/// D. A. Menascé, V. A. F. Almeida and L. W. Dowdy, *Performance by Design* (Prentice Hall,
/// 2004), the database server example of sections 12.2–12.3: no think time, CPU (S = 10 s,
/// V = 1), fast disk (S = 15 s, V = 0.5), slow disk (S = 30 s, V = 0.5). At two customers the
/// book's Markov solution gives mean queue lengths 0.5913, 0.4174 and 0.9913.
#[test]
fn closed_network_without_think_time_reproduces_menasce_section_12_2() {
    let stations = [
        station("cpu=10:1"),
        station("fast_disk=15:0.5"),
        station("slow_disk=30:0.5"),
    ];
    let points = closed(&stations, 0.0, 2).expect("solves");
    let two = &points[1];
    for (figures, published) in two.stations.iter().zip([0.5913, 0.4174, 0.9913]) {
        assert!(
            (figures.Q - published).abs() <= 0.00005 + 1e-9,
            "{}: {} against {published}",
            figures.station,
            figures.Q
        );
    }
    // Without think time the population is all at the stations.
    let population: f64 = two.stations.iter().map(|s| s.Q).sum();
    assert!((population - 2.0).abs() < 1e-12);
    assert!((two.X * two.R - 2.0).abs() < 1e-12, "Little's law");
}

/// Per-station figures of an open network as a textbook prints them, rounded to three
/// decimals: (station, U, R per visit, Q, X); `None` where the book does not print one.
type OpenRow = (
    &'static str,
    Option<f64>,
    Option<f64>,
    Option<f64>,
    Option<f64>,
);

fn assert_open(solution: &ste_monitor::mva::OpenSolution, table: &[OpenRow], source: &str) {
    assert_eq!(solution.stations.len(), table.len());
    for (figures, (name, u, r, q, x)) in solution.stations.iter().zip(table) {
        assert_eq!(figures.station, *name);
        let columns = [
            (figures.U, u, "U"),
            (figures.R, r, "R"),
            (figures.Q, q, "Q"),
        ];
        for (computed, published, column) in columns.into_iter().chain([(figures.X, x, "X")]) {
            if let Some(published) = published {
                assert_3dp(computed, *published, &format!("{source}: {column} {name}"));
            }
        }
        // And whatever the book prints, Little's law holds at every station.
        assert!((figures.Q - figures.X * figures.R).abs() < 1e-9, "{name}");
    }
}

/// R. Jain, *The Art of Computer Systems Performance Analysis* (Wiley, 1991), Example 34.1: a
/// file server as an open network at 3 jobs/s, CPU (S = 10 ms, V = 16), disk A (S = 20 ms,
/// V = 7), disk B (S = 30 ms, V = 8). The book's device utilizations 0.48, 0.42, 0.72 and
/// response times per visit 0.0192, 0.0345, 0.107 s; the same example in the Octave `queueing`
/// package (M. Marzolla, `qnos` demonstration) prints R = 1.4062 s and N = 4.2186 for the system.
const JAIN_EXAMPLE_34_1: [OpenRow; 3] = [
    ("cpu", Some(0.48), Some(0.0192), None, None),
    ("disk_a", Some(0.42), Some(0.0345), None, None),
    ("disk_b", Some(0.72), Some(0.107), None, None),
];

fn jain_file_server() -> Vec<Station> {
    ["cpu=0.01:16", "disk_a=0.02:7", "disk_b=0.03:8"]
        .into_iter()
        .map(station)
        .collect()
}

#[test]
fn open_network_reproduces_jain_example_34_1() {
    let solution = open(&jain_file_server(), 3.0).expect("solves");
    assert_open(&solution, &JAIN_EXAMPLE_34_1, "Jain 34.1");
    assert!((solution.R - 1.4062).abs() <= 0.00005, "R = {}", solution.R);
    assert!((solution.N - 4.2186).abs() <= 0.00005, "N = {}", solution.N);
    // Disk B (D = 0.24 s) saturates at 1/0.24 jobs/s.
    let d = demands(&jain_file_server(), 0.0).expect("demands");
    assert_eq!(d.bottleneck, "disk_b");
    assert_3dp(1.0 / d.D_max, 4.167, "X_max");
}

/// E. D. Lazowska, J. Zahorjan, G. S. Graham and K. C. Sevcik, *Quantitative System
/// Performance* (Prentice Hall, 1984), the open model of p. 113: CPU (S = 5 ms, V = 121),
/// disk 1 (S = 30 ms, V = 70), disk 2 (S = 27 ms, V = 50) at 0.3 jobs/s; the book gives the
/// CPU's utilization 0.182, throughput 36.3 visits/s and queue length 0.222.
#[test]
fn open_network_reproduces_lazowska_page_113() {
    let stations = ["cpu=0.005:121", "disk1=0.03:70", "disk2=0.027:50"].map(station);
    let solution = open(&stations, 0.3).expect("solves");
    let table: [OpenRow; 3] = [
        ("cpu", Some(0.182), None, Some(0.222), Some(36.3)),
        ("disk1", None, None, None, None),
        ("disk2", None, None, None, None),
    ];
    assert_open(&solution, &table, "Lazowska p. 113");
}

/// G. Bolch, S. Greiner, H. de Meer and K. S. Trivedi, *Queueing Networks and Markov Chains*
/// (Wiley, 1998), Example 7.4: a Jackson network of four single-server nodes (S = 0.04, 0.03,
/// 0.06, 0.05 s), 4 jobs/s arriving at node 4, routing 4→1, 1→2 and 1→3 half each, 2→1, 3→1
/// with probability 0.6 (else leave). The traffic equations give 20, 10, 10 and 4 jobs/s, i.e.
/// 5, 2.5, 2.5 and 1 visits per job, the visit counts given here. The book's table: X, U,
/// R per visit and Q per node.
#[test]
fn open_network_reproduces_bolch_example_7_4() {
    let stations = ["n1=0.04:5", "n2=0.03:2.5", "n3=0.06:2.5", "n4=0.05:1"].map(station);
    let solution = open(&stations, 4.0).expect("solves");
    let table: [OpenRow; 4] = [
        ("n1", Some(0.8), Some(0.2), Some(4.0), Some(20.0)),
        ("n2", Some(0.3), Some(0.043), Some(0.429), Some(10.0)),
        ("n3", Some(0.6), Some(0.15), Some(1.5), Some(10.0)),
        ("n4", Some(0.2), Some(0.0625), Some(0.25), Some(4.0)),
    ];
    assert_open(&solution, &table, "Bolch 7.4");
}

/// The command line prints the same figures: `monitor mva --open … --json` on Jain's file server.
#[test]
fn monitor_mva_open_command_prints_the_published_figures() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_monitor"))
        .args(["mva", "--open", "--arrival-rate", "3", "--json"])
        .args(["--station", "cpu=0.01:16", "--station", "disk_a=0.02:7"])
        .args(["--station", "disk_b=0.03:8"])
        .output()
        .expect("monitor runs");
    assert!(output.status.success(), "{output:?}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let open = &json["open"];
    assert!((open["R"].as_f64().expect("R") - 1.4062).abs() <= 0.00005);
    assert!((open["N"].as_f64().expect("N") - 4.2186).abs() <= 0.00005);
    let stations = open["stations"].as_array().expect("stations");
    for (row, (name, u, r, _, _)) in stations.iter().zip(JAIN_EXAMPLE_34_1) {
        assert_eq!(row["station"], name);
        assert_3dp(row["U"].as_f64().expect("U"), u.expect("U"), name);
        assert_3dp(row["R"].as_f64().expect("R"), r.expect("R"), name);
    }
    assert_eq!(json["demands"]["bottleneck"], "disk_b");

    // Saturation is refused with the station's name and a non-zero exit.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_monitor"))
        .args(["mva", "--open", "--arrival-rate", "4.2"])
        .args(["--station", "cpu=0.01:16", "--station", "disk_a=0.02:7"])
        .args(["--station", "disk_b=0.03:8"])
        .output()
        .expect("monitor runs");
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("disk_b"),
        "{output:?}"
    );
}
