//! TLS for every listener (rustls): the node's certificate chain and key from PEM files, and
//! optionally the CA whose certificates clients must present (mutual TLS).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

/// Where the node's TLS material is.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// The private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When given, clients must present a certificate signed by one of these CAs (PEM).
    pub client_ca: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {detail}")]
    Pem { path: String, detail: String },
    #[error("{path} holds no certificate")]
    NoCertificate { path: String },
    #[error("bad TLS configuration: {0}")]
    Config(String),
}

fn pem_error(path: &Path, error: impl std::fmt::Display) -> TlsError {
    TlsError::Pem {
        path: path.display().to_string(),
        detail: error.to_string(),
    }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|error| pem_error(path, error))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| pem_error(path, error))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.display().to_string(),
        });
    }
    Ok(chain)
}

/// A listener's TLS acceptor.
#[derive(Clone)]
pub struct Tls(pub TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Tls(..)")
    }
}

/// The acceptor every listener uses: TLS 1.2 and 1.3 with rustls' safe defaults (aws-lc-rs,
/// X25519MLKEM768 offered first).
pub fn acceptor(files: &TlsFiles) -> Result<Tls, TlsError> {
    let chain = certificates(&files.cert)?;
    let key =
        PrivateKeyDer::from_pem_file(&files.key).map_err(|error| pem_error(&files.key, error))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| TlsError::Config(error.to_string()))?;
    let builder = match &files.client_ca {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for certificate in certificates(path)? {
                roots
                    .add(certificate)
                    .map_err(|error| pem_error(path, error))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|error| TlsError::Config(error.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|error| TlsError::Config(error.to_string()))?;
    Ok(Tls(TlsAcceptor::from(Arc::new(config))))
}

/// What a client trusts, and the certificate it presents where the engine asks for one.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// The CA that signed the engine's certificate (PEM).
    pub ca: PathBuf,
    /// The client's certificate chain and key (PEM), for engines that require one.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// A client-side TLS configuration, with the same provider and versions as the listeners.
pub fn connector(files: &ClientTls) -> Result<tokio_rustls::TlsConnector, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in certificates(&files.ca)? {
        roots
            .add(certificate)
            .map_err(|error| pem_error(&files.ca, error))?;
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|error| TlsError::Config(error.to_string()))?
    .with_root_certificates(roots);
    let config = match &files.identity {
        Some((cert, key)) => {
            let chain = certificates(cert)?;
            let key = PrivateKeyDer::from_pem_file(key).map_err(|error| pem_error(key, error))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|error| TlsError::Config(error.to_string()))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}
