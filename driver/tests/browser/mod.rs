//! Headless Chromium for the dashboard tests (Debian's `chromium`; another binary through
//! `STE_CHROMIUM`), and a plain HTTP GET.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

fn chromium_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("STE_CHROMIUM") {
        return PathBuf::from(path);
    }
    for candidate in [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ] {
        if Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    panic!(
        "no Chromium found: install Debian's chromium package (.ci/run does) or set STE_CHROMIUM"
    );
}

pub fn free_port() -> u16 {
    ste_engine::ports::free_local_port().expect("a free port")
}

pub fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, text.split_once("\r\n\r\n")?.1.to_owned()))
}

/// A headless browser.
pub struct Chromium(PathBuf);

impl Chromium {
    pub fn find() -> Self {
        Self(chromium_binary())
    }

    /// Loads `url`: writes a screenshot of it to `screenshot` and returns its DOM as the
    /// browser built it.
    pub fn load(&self, url: &str, screenshot: &Path) -> String {
        let run = |extra: &[&str]| {
            let output = Command::new(&self.0)
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                ])
                .args(extra)
                .arg(url)
                .output()
                .expect("chromium runs");
            assert!(
                output.status.success(),
                "chromium: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            output.stdout
        };
        run(&[
            "--window-size=1280,2400",
            &format!("--screenshot={}", screenshot.display()),
        ]);
        String::from_utf8_lossy(&run(&["--dump-dom"])).into_owned()
    }
}

/// The screenshot is a real rendering: a PNG of some size.
pub fn assert_rendered(screenshot: &Path) {
    let png = std::fs::read(screenshot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    assert!(png.len() > 20_000, "an empty page: {} bytes", png.len());
    eprintln!("dashboard screenshot: {}", screenshot.display());
}
