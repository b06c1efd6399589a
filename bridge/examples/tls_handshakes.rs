//! What a TLS handshake with the listeners' provider and protocol versions costs (without
//! client certificates), with the hybrid post-quantum key exchange they offer first
//! (X25519MLKEM768) and with X25519 alone: both ends in one thread over an in-memory pipe, so
//! the time is the CPU of both ends, and the bytes are what each end sent. A handshake is what
//! a client that never authenticates can make a listener pay for, so this is the price of one.
//!
//! `cargo run --release -p ste-bridge --example tls_handshakes [-- HANDSHAKES]`

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use rcgen::{CertificateParams, KeyPair};
use rustls::crypto::{aws_lc_rs, CryptoProvider};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

fn main() -> anyhow::Result<()> {
    let handshakes: u32 = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(2_000);
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["localhost".into()])?.self_signed(&key)?;
    let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    println!(
        "{handshakes} handshakes a group and round, 5 rounds alternated after one to warm up; \
         TLS 1.3, ECDSA P-256 certificate, both ends in one thread; the median round"
    );
    println!(
        "{:<16} {:>14} {:>16} {:>16}",
        "group", "µs/handshake", "client bytes", "server bytes"
    );
    // Alternated, so that a busy machine weighs on both alike; the first round warms up.
    const ROUNDS: usize = 6;
    let groups = [
        ("X25519MLKEM768", aws_lc_rs::default_provider().kx_groups),
        ("X25519", vec![aws_lc_rs::kx_group::X25519]),
    ];
    // Per group: each measured round's µs a handshake, and the bytes each end sent.
    let mut results = [(Vec::new(), 0, 0), (Vec::new(), 0, 0)];
    for round in 0..ROUNDS {
        for ((_, kx_groups), result) in groups.iter().zip(&mut results) {
            let provider = Arc::new(CryptoProvider {
                kx_groups: kx_groups.clone(),
                ..aws_lc_rs::default_provider()
            });
            let server = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(vec![cert.der().clone()], der.clone_key())?;
            let client = rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
            let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
            let (mut sent_by_client, mut sent_by_server) = (0_u64, 0_u64);
            let started = Instant::now();
            for _ in 0..handshakes {
                let (near, far) = tokio::io::duplex(64 * 1024);
                let (near, near_count) = Counted::new(near);
                let (far, far_count) = Counted::new(far);
                runtime.block_on(async {
                    let name = ServerName::try_from("localhost").expect("a name");
                    let (accepted, connected) =
                        tokio::join!(acceptor.accept(far), connector.connect(name, near));
                    // One byte each way: the handshake is over on both ends.
                    let (mut accepted, mut connected) = (accepted?, connected?);
                    let (mut a, mut b) = ([0_u8; 1], [0_u8; 1]);
                    let (written, read) = tokio::join!(
                        async {
                            connected.write_all(b"x").await?;
                            connected.flush().await?;
                            connected.read_exact(&mut b).await
                        },
                        async {
                            accepted.read_exact(&mut a).await?;
                            accepted.write_all(b"y").await?;
                            accepted.flush().await
                        }
                    );
                    written?;
                    read?;
                    anyhow::Ok(())
                })?;
                sent_by_client += near_count.load(Ordering::Relaxed);
                sent_by_server += far_count.load(Ordering::Relaxed);
            }
            if round > 0 {
                result
                    .0
                    .push(started.elapsed().as_secs_f64() * 1e6 / f64::from(handshakes));
                result.1 = sent_by_client / u64::from(handshakes);
                result.2 = sent_by_server / u64::from(handshakes);
            }
        }
    }
    for ((name, _), (mut micros, client, server)) in groups.into_iter().zip(results) {
        micros.sort_by(f64::total_cmp);
        let median = micros[micros.len() / 2];
        println!(
            "{name:<16} {median:>14.0} {client:>16} {server:>16}   (rounds {:.0}–{:.0})",
            micros[0],
            micros[micros.len() - 1]
        );
    }
    Ok(())
}

/// A stream that counts the bytes written through it.
struct Counted<S> {
    inner: S,
    written: Arc<AtomicU64>,
}

impl<S> Counted<S> {
    fn new(inner: S) -> (Counted<S>, Arc<AtomicU64>) {
        let written = Arc::new(AtomicU64::new(0));
        (
            Counted {
                inner,
                written: written.clone(),
            },
            written,
        )
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &poll {
            self.written.fetch_add(*n as u64, Ordering::Relaxed);
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
