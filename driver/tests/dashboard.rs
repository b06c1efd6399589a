//! The dashboard in a real browser: a run serves its live page, headless Chromium (Debian's
//! `chromium`; another binary through `STE_CHROMIUM`) loads it mid-run, and the page must show
//! the run's stations and their charts. The screenshot stays in the run directory, under
//! Cargo's target folder (`dashboard-run/dashboard.png`).

mod browser;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use browser::{free_port, get, Chromium};

/// Kills the driver if the test fails before it ends.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn headless_chromium_shows_the_live_dashboard_of_a_run() {
    let run_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-run");
    let _ = std::fs::remove_dir_all(&run_dir);
    let port = free_port();
    let driver = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args([
            "--trades", "20000", "--store", "memory", "--quiet", "--rate", "8000",
        ])
        .args(["--dashboard", &format!("127.0.0.1:{port}"), "--run-dir"])
        .arg(&run_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the driver starts");
    let mut driver = Running(driver);

    // The rate keeps the run going for about 17 s (longer on a slow machine), so that the browser
    // sees it in progress. Wait until the page shows stations: the run has written samples.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((200, body)) = get(port, "/") {
            if body.contains("<td>store.0</td>") {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the dashboard never showed the run"
        );
        assert!(
            driver.0.try_wait().expect("driver status").is_none(),
            "the run ended too soon"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Let some seconds of the run accumulate, then load the page in the browser.
    std::thread::sleep(Duration::from_secs(2));
    let screenshot = run_dir.join("dashboard.png");
    let url = format!("http://127.0.0.1:{port}/report");
    let dom = Chromium::find().load(&url, &screenshot);
    assert!(
        driver.0.try_wait().expect("driver status").is_none(),
        "the browser saw a finished run"
    );

    // The browser's DOM: the metrics table of this run's stations, with completions counted,
    // and the execution graph drawn from them (one line per station and the throughput line;
    // the legend names the stations).
    for station in ["inbound.0", "inbound.1", "match.0", "store.0", "outbound"] {
        assert!(
            dom.contains(&format!("<td>{station}</td>")),
            "no row for {station}"
        );
    }
    let completions: Vec<u64> = dom
        .split("<td>store.0</td>")
        .nth(1)
        .map(|row| {
            row.split("</tr>")
                .next()
                .unwrap_or("")
                .split("<td>")
                .filter_map(|cell| cell.split("</td>").next()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        completions.iter().any(|c| *c > 1000),
        "store.0 completed nothing: {completions:?}"
    );
    let timeline = dom
        .split("id=\"timeline\"")
        .nth(1)
        .expect("the execution graph is on the page");
    assert!(timeline.contains("<svg"));
    assert!(
        timeline.matches("<polyline").count() >= 6,
        "too few lines drawn"
    );
    let legend: Vec<&str> = timeline
        .split("<text")
        .skip(1)
        .filter_map(|text| text.split_once('>')?.1.split("</text>").next())
        .map(str::trim)
        .collect();
    for station in ["store.0", "inbound.0", "match.1"] {
        assert!(
            legend.contains(&station),
            "{station} not in the legend: {legend:?}"
        );
    }
    assert!(dom.contains("Run in progress"));

    // The screenshot is a real rendering, kept with the run.
    browser::assert_rendered(&screenshot);

    let status = driver.0.wait().expect("the driver ends");
    assert!(status.success());
    assert!(run_dir.join("summary.json").exists());
}
