//! What the benchmark binaries share (and the tests, where they do the same): their
//! `--name value` arguments, a process's resident set, the listener flags of an engine on
//! loopback, and the namespace-flood SOAP body.

/// The value of `--name N` on the command line, or `default`.
pub fn arg(name: &str, default: u64) -> u64 {
    arg_text(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The text after `--name` on the command line, if it is there.
pub fn arg_text(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1).cloned()
}

/// The resident set of process `pid` (`self` for this one) in bytes, from /proc; 0 where there
/// is none.
pub fn rss_bytes(pid: &str) -> u64 {
    ste_engine::cluster_samples::proc_status_kib(pid, "VmRSS").map_or(0, |kib| kib * 1024)
}

/// The listener flags of an `engine` on loopback, each on a port the system picks.
pub const LOOPBACK_LISTENERS: [&str; 6] = [
    "--tcp",
    "127.0.0.1:0",
    "--http",
    "127.0.0.1:0",
    "--fix",
    "127.0.0.1:0",
];

/// The namespace-flood SOAP 1.1 request body: 1 MiB, 25,000 namespace declarations on the
/// envelope, then empty children.
pub fn namespace_flood_body() -> Vec<u8> {
    let mut body = format!("<s:Envelope xmlns:s=\"{}\"", crate::soap::SOAP11_NS);
    for i in 0..25_000 {
        body.push_str(&format!(" xmlns:p{i}=\"u\""));
    }
    body.push_str("><s:Body>");
    while body.len() < 1024 * 1024 - 64 {
        body.push_str("<a/>");
    }
    body.push_str("</s:Body></s:Envelope>");
    body.into_bytes()
}
