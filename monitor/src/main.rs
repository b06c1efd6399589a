//! `monitor analyze samples.csv [--json]`: operational metrics of every sampled station.
//! `monitor mva ...`: exact MVA of a closed network, or the open-network solution, with bounds.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// `println!` for the command's output, in place of std's: a reader that has gone
/// (`monitor analyze … | head`) ends the command quietly, as it ends other tools, rather than
/// in a panic.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(error) = writeln!(std::io::stdout(), $($arg)*) {
            if error.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("error: writing the output: {error}");
            std::process::exit(1);
        }
    }};
}

#[derive(Parser)]
#[command(name = "monitor", about = "Operational analysis of STE runs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Buzen-Denning metrics of every station in a samples file.
    Analyze {
        /// A samples.csv written by a run.
        file: PathBuf,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Mean value analysis: exact MVA of a closed network for populations 1..N (or the open
    /// network at an arrival rate), with asymptotic and balanced-job bounds.
    Mva(MvaArgs),
    /// The dashboard on localhost: a run (or sweep) directory's page, live while the run writes
    /// its samples, with Prometheus metrics at /metrics.
    Serve {
        /// The run or sweep directory.
        dir: PathBuf,
        /// Address to listen on: loopback unless told otherwise.
        #[arg(long, default_value = "127.0.0.1:8686")]
        addr: String,
        /// A file holding the token every request must carry (`Authorization: Bearer`, or
        /// `?token=`), readable by its owner only; an address off loopback requires one.
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
    },
    /// Draw a node sweep's charts (DIR/nodes.svg) again from its DIR/sweep.json.
    Redraw {
        /// The directory of a `driver sweep --nodes`.
        dir: PathBuf,
    },
    /// Write a run (or sweep) directory's page as one self-contained HTML file.
    Report {
        /// The run or sweep directory.
        dir: PathBuf,
        /// The file to write (default: DIR/report.html).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct MvaArgs {
    /// A queueing station: NAME=S (service time per visit, seconds) or NAME=S:V (V visits per
    /// job). Repeat for every station.
    #[arg(
        long = "station",
        value_name = "NAME=S[:V]",
        required_unless_present = "multi"
    )]
    stations: Vec<String>,
    /// A delay station (no queueing): NAME=D[:V].
    #[arg(long = "delay", value_name = "NAME=D[:V]")]
    delays: Vec<String>,
    /// A station of C identical servers (a machine's cores): NAME=S[:V]@C.
    #[arg(long = "servers", value_name = "NAME=S[:V]@C")]
    multi: Vec<String>,
    /// Think time Z in seconds (closed network).
    #[arg(long, default_value_t = 0.0, conflicts_with = "open")]
    think: f64,
    /// Population N: the network is solved for every n from 1 to N (closed network).
    #[arg(long, required_unless_present = "open", conflicts_with = "open")]
    population: Option<u32>,
    /// Solve the open network instead, at --arrival-rate jobs per second.
    #[arg(long, requires = "arrival_rate")]
    open: bool,
    /// Arrival rate λ of the open network, jobs per second.
    #[arg(long, value_name = "L")]
    arrival_rate: Option<f64>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

fn main() -> std::process::ExitCode {
    // Errors are printed with their causes, without a backtrace: they are for users.
    match run_cli() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_cli() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Mva(args) => mva(&args)?,
        Command::Serve {
            dir,
            addr,
            token_file,
        } => {
            let token = token_file.as_deref().map(read_token).transpose()?;
            let dashboard = ste_monitor::serve::Dashboard::start_with_token(&dir, &addr, token)?;
            eprintln!(
                "dashboard of {} on http://{}/ (metrics on /metrics); Ctrl-C stops it",
                dir.display(),
                dashboard.address()
            );
            dashboard.wait();
        }
        Command::Redraw { dir } => {
            let json = dir.join("sweep.json");
            let points: serde_json::Value = serde_json::from_slice(
                &std::fs::read(&json).with_context(|| format!("reading {}", json.display()))?,
            )
            .with_context(|| format!("reading {}", json.display()))?;
            let svg = ste_monitor::chart::node_sweep_svg(&points)
                .map_err(|reason| anyhow::anyhow!("drawing the charts: {reason}"))?;
            let out = dir.join("nodes.svg");
            std::fs::write(&out, svg).with_context(|| format!("writing {}", out.display()))?;
            eprintln!("charts written to {}", out.display());
        }
        Command::Report { dir, out } => {
            let html = ste_monitor::report::render(&dir, None)?;
            let out = out.unwrap_or_else(|| dir.join("report.html"));
            std::fs::write(&out, html).with_context(|| format!("writing {}", out.display()))?;
            eprintln!("report written to {}", out.display());
        }
        Command::Analyze { file, json } => {
            let samples = ste_monitor::read_samples(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let metrics = ste_monitor::analyze(&samples);
            let bottleneck = ste_monitor::bottleneck(&metrics).map(|m| m.station.clone());
            if json {
                let out = serde_json::json!({ "stations": metrics, "bottleneck": bottleneck });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                // Wide enough for a cluster's names (`node-1/store.0`, `jetstream/match.2`).
                let width = metrics
                    .iter()
                    .map(|m| m.station.len())
                    .max()
                    .unwrap_or(0)
                    .max(12);
                println!(
                    "{:<width$} {:>8} {:>10} {:>10} {:>10} {:>10} {:>6} {:>10} {:>8} {:>10}",
                    "station", "T_s", "A", "C", "lambda", "X", "U", "S_ms", "N", "R_ms"
                );
                for m in &metrics {
                    println!(
                        "{:<width$} {:>8.3} {:>10} {:>10} {:>10.1} {:>10.1} {:>6.3} {:>10.4} {:>8.2} {:>10.3}",
                        m.station, m.T_s, m.A, m.C, m.lambda, m.X, m.U, m.S_s * 1e3, m.N, m.R_s * 1e3
                    );
                }
                if let Some(name) = bottleneck {
                    println!("bottleneck: {name}");
                }
            }
        }
    }
    Ok(())
}

/// The dashboard's token from `path`, which only its owner may read.
fn read_token(path: &std::path::Path) -> anyhow::Result<String> {
    use std::os::unix::fs::MetadataExt as _;
    let mode = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .mode();
    if mode & 0o077 != 0 {
        anyhow::bail!(
            "{} holds a token but its mode is {:o}: make it readable by its owner only (chmod 600)",
            path.display(),
            mode & 0o777
        );
    }
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_owned())
}

fn mva(args: &MvaArgs) -> anyhow::Result<()> {
    use ste_monitor::mva::{self, Kind, Station};
    let mut stations = Vec::new();
    for text in &args.stations {
        stations.push(Station::parse(text, Kind::Queueing)?);
    }
    for text in &args.delays {
        stations.push(Station::parse(text, Kind::Delay)?);
    }
    for text in &args.multi {
        let (station, servers) = text
            .rsplit_once('@')
            .and_then(|(station, c)| Some((station, c.trim().parse::<u32>().ok()?)))
            .filter(|(_, c)| *c > 0)
            .with_context(|| format!("--servers {text:?}: expected NAME=S[:V]@C with C ≥ 1"))?;
        stations.push(Station::parse(station, Kind::MultiServer(servers))?);
    }
    if args.open {
        let rate = args.arrival_rate.unwrap_or_default();
        let solution = mva::open(&stations, rate)?;
        let demands = mva::demands(&stations, 0.0)?;
        if args.json {
            let out = serde_json::json!({ "open": solution, "demands": demands });
            println!("{}", serde_json::to_string_pretty(&out)?);
            return Ok(());
        }
        println!(
            "open network at {rate} jobs/s: R = {:.6} s, N = {:.6}",
            solution.R, solution.N
        );
        print_station_header();
        for s in &solution.stations {
            print_station(s);
        }
        println!(
            "bounds: X_max = 1/D_max = {:.6} jobs/s ({}), R_min = D = {:.6} s",
            1.0 / demands.D_max,
            demands.bottleneck,
            demands.D
        );
        return Ok(());
    }
    let population = args.population.unwrap_or(1);
    let points = mva::closed(&stations, args.think, population)?;
    let demands = mva::demands(&stations, args.think)?;
    let bounds = (1..=population)
        .map(|n| mva::bounds(&stations, args.think, n))
        .collect::<Result<Vec<_>, _>>()?;
    if args.json {
        let out = serde_json::json!({ "closed": points, "bounds": bounds, "demands": demands });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{:>5} {:>12} {:>12} {:>12} {:>12}   {:>25} {:>25}",
        "n", "X", "R", "X_max", "R_min", "X balanced (low..high)", "R balanced (low..high)"
    );
    for (point, b) in points.iter().zip(&bounds) {
        println!(
            "{:>5} {:>12.6} {:>12.6} {:>12.6} {:>12.6}   {:>12.6}..{:<12.6} {:>12.6}..{:<12.6}",
            point.n, point.X, point.R, b.X_max, b.R_min, b.X_bjb.0, b.X_bjb.1, b.R_bjb.0, b.R_bjb.1
        );
    }
    if let Some(last) = points.last() {
        println!("\nstations at n = {}:", last.n);
        print_station_header();
        for s in &last.stations {
            print_station(s);
        }
    }
    println!(
        "D = {:.6} s, D_max = {:.6} s ({}), Z = {} s, knee N* = (D+Z)/D_max = {:.3}",
        demands.D, demands.D_max, demands.bottleneck, demands.Z, demands.N_star
    );
    Ok(())
}

fn print_station_header() {
    println!(
        "{:<16} {:>10} {:>12} {:>12} {:>12}",
        "station", "U", "Q", "R/visit", "X"
    );
}

fn print_station(s: &ste_monitor::mva::StationFigures) {
    println!(
        "{:<16} {:>10.6} {:>12.6} {:>12.6} {:>12.6}",
        s.station, s.U, s.Q, s.R, s.X
    );
}
