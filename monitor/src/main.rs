//! `monitor analyze samples.csv [--json]`: operational metrics of every sampled station.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

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
        Command::Analyze { file, json } => {
            let samples = ste_monitor::read_samples(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let metrics = ste_monitor::analyze(&samples);
            let bottleneck = ste_monitor::bottleneck(&metrics).map(|m| m.station.clone());
            if json {
                let out = serde_json::json!({ "stations": metrics, "bottleneck": bottleneck });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!(
                    "{:<12} {:>8} {:>10} {:>10} {:>10} {:>10} {:>6} {:>10} {:>8} {:>10}",
                    "station", "T_s", "A", "C", "lambda", "X", "U", "S_ms", "N", "R_ms"
                );
                for m in &metrics {
                    println!(
                        "{:<12} {:>8.3} {:>10} {:>10} {:>10.1} {:>10.1} {:>6.3} {:>10.4} {:>8.2} {:>10.3}",
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
