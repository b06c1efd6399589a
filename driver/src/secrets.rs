//! A cluster's secrets, made at setup (`driver secrets --dir DIR`) and never committed: one
//! folder, readable by its owner only, that `deploy/local-cluster.sh up` and the cluster tests
//! make on first start and reuse after.
//!
//! | file | what | who reads it |
//! |---|---|---|
//! | `ca.pem` | the cluster's CA certificate | every process (TLS) |
//! | `ca.key` | the CA's private key | only `driver secrets`, to sign certificates |
//! | `nats-server.pem`, `.key` | the NATS servers' certificate (client TLS and routes) | NATS servers |
//! | `pg-server.pem`, `.key` | the shards' PostgreSQL certificate | PostgreSQL |
//! | `nats-<identity>.nk` | the seed of an identity's nkey ([`Role`]) | the process of that role |
//! | `nats-<identity>.retiring.pub` | the public key an identity is rotating away from | `driver secrets` |
//! | `nats-authorization.conf` | every identity's public keys with its role's permissions | NATS servers |
//! | `pg-owner.password` | the password of `ste_owner`, who owns the shards' schemas and migrates them | setup |
//! | `pg-shard-<k>.password` | the password of `ste_shard_<k>`, shard k's role at run time | nodes, drivers |
//! | `pgpass` | both, in PostgreSQL's password-file format (`PGPASSFILE`) | nodes, drivers, setup |
//!
//! Every file holding a private key or seed is mode 0600; the folder 0700. The authorization
//! names public keys only, so it is no secret, but it is made here from the seeds.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use ste_engine::cluster::roles::{nats_authorization, NatsIdentity, Role};
use ste_engine::keys::{read_private, write_private};
use ste_engine::queue::jetstream::{ca_file, nkey_file};

/// Names every server certificate answers to besides those asked for: loopback, and the
/// services of `deploy/docker-compose.yml`.
pub const HOSTS_DEFAULT: [&str; 9] = [
    "localhost",
    "127.0.0.1",
    "nats-0",
    "nats-1",
    "nats-2",
    "shard-0",
    "shard-1",
    "shard-2",
    "shard-3",
];

/// Gateway identities made by default (`gateway-0` …).
pub const GATEWAYS_DEFAULT: u32 = 4;
/// Load identities made by default (`load-0` …): drivers that may run at once.
pub const LOADS_DEFAULT: u32 = 2;
/// Shards whose database roles are made by default.
pub const SHARDS_DEFAULT: u32 = 8;

/// The database role that owns a shard's schema and applies its migrations.
pub const PG_OWNER: &str = "ste_owner";

/// The database role of shard `shard` at run time: it may do what a shard's owner does there.
pub fn pg_shard_role(shard: u32) -> String {
    format!("ste_shard_{shard}")
}

/// The password file of a database role in a secrets folder.
pub fn pg_password_file(dir: &Path, role: &str) -> PathBuf {
    let name = role.strip_prefix("ste_").unwrap_or(role).replace('_', "-");
    dir.join(format!("pg-{name}.password"))
}

/// The password file, in PostgreSQL's format, of every database role in a secrets folder.
pub fn pgpass_file(dir: &Path) -> PathBuf {
    dir.join(ste_engine::store::PGPASS_FILE)
}

/// How long certificates made here are valid.
const VALIDITY_DAYS: i64 = 825;

/// The server configuration file of the identities' permissions.
pub const NATS_AUTHORIZATION: &str = "nats-authorization.conf";

/// What to make.
#[derive(Debug, Clone)]
pub struct SecretsSpec {
    pub dir: PathBuf,
    /// Names the servers' certificates answer to, besides [`HOSTS_DEFAULT`].
    pub hosts: Vec<String>,
    pub gateways: u32,
    pub loads: u32,
    /// Shards whose database roles get a password.
    pub shards: u32,
}

impl SecretsSpec {
    /// The defaults, in `dir`.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            hosts: Vec::new(),
            gateways: GATEWAYS_DEFAULT,
            loads: LOADS_DEFAULT,
            shards: SHARDS_DEFAULT,
        }
    }

    /// The identities of the cluster.
    pub fn roles(&self) -> Vec<Role> {
        [Role::Node, Role::Sink, Role::Monitor]
            .into_iter()
            .chain((0..self.gateways).map(Role::Gateway))
            .chain((0..self.loads).map(Role::Load))
            .collect()
    }
}

/// Makes whatever of the cluster's secrets is missing in `spec.dir`, keeps what is there, and
/// writes the servers' authorization anew from the seeds. Returns the files made.
pub fn ensure(spec: &SecretsSpec) -> anyhow::Result<Vec<PathBuf>> {
    let dir = &spec.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("narrowing {}", dir.display()))?;
    }
    let mut made = Vec::new();
    let ca = ensure_ca(dir, &mut made)?;
    let hosts: Vec<String> = HOSTS_DEFAULT
        .iter()
        .map(|host| (*host).to_owned())
        .chain(spec.hosts.iter().cloned())
        .collect();
    for server in ["nats-server", "pg-server"] {
        ensure_server_certificate(dir, server, &hosts, &ca, &mut made)?;
    }
    for role in spec.roles() {
        let path = nkey_file(dir, &role.name());
        if !path.exists() {
            write_seed(&path)?;
            made.push(path);
        }
    }
    write_authorization(dir)?;
    let roles: Vec<String> = std::iter::once(PG_OWNER.to_owned())
        .chain((0..spec.shards).map(pg_shard_role))
        .collect();
    for role in &roles {
        let path = pg_password_file(dir, role);
        if !path.exists() {
            let password: [u8; 24] = rand::random();
            write_private(&path, format!("{}\n", hex::encode(password)).as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            made.push(path);
        }
    }
    write_pgpass(dir)?;
    Ok(made)
}

/// The files of `dir` named `<prefix><stem><suffix>`, in name order, with their stems.
fn files_named(dir: &Path, prefix: &str, suffix: &str) -> anyhow::Result<Vec<(String, PathBuf)>> {
    let mut files: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let stem = path
                .file_name()?
                .to_str()?
                .strip_prefix(prefix)?
                .strip_suffix(suffix)?
                .to_owned();
            Some((stem, path))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Writes `pgpass` from every database role's password file in `dir`: any host, port and
/// database, the role's name and its password.
fn write_pgpass(dir: &Path) -> anyhow::Result<()> {
    let mut lines = String::new();
    for (name, path) in files_named(dir, "pg-", ".password")? {
        let role = format!("ste_{}", name.replace('-', "_"));
        lines.push_str(&format!("*:*:*:{role}:{}\n", read_private(&path)?));
    }
    let path = pgpass_file(dir);
    write_private(&path, lines.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// Gives identity `role` a new seed; its old public key stays allowed (`.retiring.pub`) until
/// [`retire`], so that its processes can be restarted on the new seed one by one.
pub fn rotate(dir: &Path, role: Role) -> anyhow::Result<()> {
    let path = nkey_file(dir, &role.name());
    let old = public_key_of(&path)?;
    std::fs::write(retiring_file(dir, role), format!("{old}\n"))
        .with_context(|| format!("writing {}", retiring_file(dir, role).display()))?;
    write_seed(&path)?;
    write_authorization(dir)
}

/// Stops allowing the public key `role` rotated away from.
pub fn retire(dir: &Path, role: Role) -> anyhow::Result<()> {
    let path = retiring_file(dir, role);
    if path.exists() {
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    write_authorization(dir)
}

fn retiring_file(dir: &Path, role: Role) -> PathBuf {
    dir.join(format!("nats-{}.retiring.pub", role.name()))
}

fn write_seed(path: &Path) -> anyhow::Result<()> {
    let seed = nkeys::KeyPair::new_user()
        .seed()
        .context("drawing an nkey")?;
    write_private(path, format!("{seed}\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

fn public_key_of(seed_file: &Path) -> anyhow::Result<String> {
    let seed = read_private(seed_file)?;
    Ok(nkeys::KeyPair::from_seed(&seed)
        .with_context(|| format!("{} holds no nkey seed", seed_file.display()))?
        .public_key())
}

/// Writes the servers' authorization from every seed in `dir` (and the keys being retired).
fn write_authorization(dir: &Path) -> anyhow::Result<()> {
    let mut identities = Vec::new();
    for (identity, path) in files_named(dir, "nats-", ".nk")? {
        let role = Role::parse(&identity)?;
        let mut public_keys = vec![public_key_of(&path)?];
        let retiring = retiring_file(dir, role);
        if retiring.exists() {
            let key = std::fs::read_to_string(&retiring)
                .with_context(|| format!("reading {}", retiring.display()))?;
            public_keys.push(key.trim().to_owned());
        }
        identities.push(NatsIdentity { role, public_keys });
    }
    let path = dir.join(NATS_AUTHORIZATION);
    std::fs::write(&path, nats_authorization(&identities))
        .with_context(|| format!("writing {}", path.display()))
}

/// The CA's fixed parameters: its certificate can be made again from them and its key.
fn ca_params() -> anyhow::Result<CertificateParams> {
    let mut params = CertificateParams::new(Vec::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params
        .distinguished_name
        .push(DnType::CommonName, "STE cluster CA");
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut params);
    Ok(params)
}

fn validity(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(VALIDITY_DAYS);
}

/// The CA, made where missing.
fn ensure_ca(dir: &Path, made: &mut Vec<PathBuf>) -> anyhow::Result<Issuer<'static, KeyPair>> {
    let (cert_path, key_path) = (ca_file(dir), dir.join("ca.key"));
    let key = if key_path.exists() {
        KeyPair::from_pem(&read_private(&key_path)?)
            .with_context(|| format!("{} holds no private key", key_path.display()))?
    } else {
        if cert_path.exists() {
            bail!(
                "{} is there without its key {}: remove it (and every certificate it signed) to \
                 make a new CA",
                cert_path.display(),
                key_path.display()
            );
        }
        let key = KeyPair::generate().context("drawing the CA's key")?;
        let cert = ca_params()?.self_signed(&key)?;
        write_private(&key_path, key.serialize_pem().as_bytes())?;
        std::fs::write(&cert_path, cert.pem())?;
        made.extend([key_path, cert_path]);
        key
    };
    Ok(Issuer::new(ca_params()?, key))
}

/// A server certificate `name` (`<name>.pem`, `<name>.key`) for `hosts`, signed by the CA, for
/// servers and for their own connections to each other (NATS routes), made where missing.
fn ensure_server_certificate(
    dir: &Path,
    name: &str,
    hosts: &[String],
    ca: &Issuer<'static, KeyPair>,
    made: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    let (cert_path, key_path) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.key")),
    );
    if cert_path.exists() && key_path.exists() {
        return Ok(());
    }
    let mut params = CertificateParams::new(hosts.to_vec())?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    validity(&mut params);
    let key = KeyPair::generate().context("drawing a server's key")?;
    let cert = params.signed_by(&key, ca)?;
    write_private(&key_path, key.serialize_pem().as_bytes())?;
    std::fs::write(&cert_path, cert.pem())?;
    made.extend([key_path, cert_path]);
    Ok(())
}

/// The lines of a NATS server's configuration that require TLS of clients and routes with the
/// cluster's certificates in `dir`, and let in only the identities of `nats-authorization.conf`.
pub fn nats_server_settings(dir: &Path) -> anyhow::Result<NatsServerSettings> {
    let path = |name: &str| -> anyhow::Result<String> {
        let path = dir.join(name);
        if !path.exists() {
            bail!(
                "{} is missing: driver secrets --dir {} makes it",
                path.display(),
                dir.display()
            );
        }
        let path = std::fs::canonicalize(&path)?;
        Ok(path.display().to_string())
    };
    let (cert, key, ca) = (
        path("nats-server.pem")?,
        path("nats-server.key")?,
        path("ca.pem")?,
    );
    let authorization = std::fs::read_to_string(dir.join(NATS_AUTHORIZATION))
        .with_context(|| format!("reading {}", dir.join(NATS_AUTHORIZATION).display()))?;
    let tls = format!("cert_file: \"{cert}\", key_file: \"{key}\", ca_file: \"{ca}\", timeout: 5");
    Ok(NatsServerSettings {
        top: format!("tls {{ {tls} }}\n{authorization}"),
        cluster: format!("tls {{ {tls}, verify: true }}"),
    })
}

/// What [`nats_server_settings`] adds to a server's configuration.
pub struct NatsServerSettings {
    /// At the top level: client TLS and the authorization.
    pub top: String,
    /// Inside the `cluster { }` block: the routes' TLS, certificates checked both ways.
    pub cluster: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_made_once_kept_after_and_readable_by_their_owner_only() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("a folder");
        let spec = SecretsSpec::new(&dir.path().join("secrets"));
        let made = ensure(&spec).expect("made");
        assert!(made.len() >= 6 + spec.roles().len(), "{made:?}");
        let mode = |path: &Path| {
            std::fs::metadata(path)
                .expect("exists")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode(&spec.dir), 0o700);
        for path in &made {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if name.ends_with(".key") || name.ends_with(".nk") {
                assert_eq!(mode(path), 0o600, "{name}");
            }
        }
        let pgpass = std::fs::read_to_string(pgpass_file(&spec.dir)).expect("a password file");
        assert_eq!(pgpass.lines().count(), 1 + spec.shards as usize, "{pgpass}");
        assert!(pgpass.contains(":ste_owner:") && pgpass.contains(":ste_shard_7:"));
        assert_eq!(mode(&pgpass_file(&spec.dir)), 0o600);
        let seed = std::fs::read_to_string(nkey_file(&spec.dir, "node")).expect("a seed");
        assert!(seed.starts_with("SU"), "a user seed: {seed}");
        // Again: nothing new, the seed kept.
        assert!(ensure(&spec).expect("kept").is_empty());
        assert_eq!(
            std::fs::read_to_string(nkey_file(&spec.dir, "node")).expect("a seed"),
            seed
        );
        let authorization =
            std::fs::read_to_string(spec.dir.join(NATS_AUTHORIZATION)).expect("written");
        let node_key = public_key_of(&nkey_file(&spec.dir, "node")).expect("a key");
        assert!(authorization.contains(&node_key));
        assert!(
            !authorization.contains(seed.trim()),
            "no seed in the servers' file"
        );
    }

    #[test]
    fn a_rotated_identity_keeps_its_old_key_allowed_until_it_is_retired() {
        let dir = tempfile::tempdir().expect("a folder");
        let spec = SecretsSpec::new(dir.path());
        ensure(&spec).expect("made");
        let seed_file = nkey_file(dir.path(), "gateway-1");
        let old = public_key_of(&seed_file).expect("a key");
        rotate(dir.path(), Role::Gateway(1)).expect("rotated");
        let new = public_key_of(&seed_file).expect("a key");
        assert_ne!(old, new);
        let authorization =
            || std::fs::read_to_string(dir.path().join(NATS_AUTHORIZATION)).expect("written");
        assert!(authorization().contains(&old) && authorization().contains(&new));
        retire(dir.path(), Role::Gateway(1)).expect("retired");
        assert!(!authorization().contains(&old) && authorization().contains(&new));
    }

    #[test]
    fn a_seed_others_may_read_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("a folder");
        ensure(&SecretsSpec::new(dir.path())).expect("made");
        let seed_file = nkey_file(dir.path(), "sink");
        std::fs::set_permissions(&seed_file, std::fs::Permissions::from_mode(0o644))
            .expect("widened");
        let error = public_key_of(&seed_file).expect_err("refused");
        assert!(error.to_string().contains("chmod 600"), "{error}");
    }
}
