//! TLS in the configuration: towards an upstream (`ca_file`, `client_cert`, `client_key`,
//! `server_name`, on a route or an `[[upstreams]]` entry), and on the listeners
//! (`[server] tls_cert`/`tls_key`, `admin_tls_cert`/`admin_tls_key`). Every file is read and
//! checked when the configuration is (at start, by `idem check`, and at each reload), so a
//! certificate that does not parse is refused naming its key, and a reload rotates certificates
//! by reading the files again.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{invalid, ConfigError};

/// `ca_file`, `client_cert`, `client_key` and `server_name` as written.
#[derive(Deserialize, Default, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstreamTls {
    pub(super) ca_file: Option<PathBuf>,
    pub(super) client_cert: Option<PathBuf>,
    pub(super) client_key: Option<PathBuf>,
    pub(super) server_name: Option<String>,
}

impl RawUpstreamTls {
    pub(super) fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none() && self.server_name.is_none()
    }

    /// The settings, their files read and checked, ready to connect with; `key` names the
    /// table they sit in.
    pub(super) fn validate(self, key: &str, upstream: &url::Url) -> Result<Option<UpstreamTls>, ConfigError> {
        let set = [
            ("ca_file", self.ca_file.is_some()),
            ("client_cert", self.client_cert.is_some()),
            ("client_key", self.client_key.is_some()),
            ("server_name", self.server_name.is_some()),
        ];
        let Some((first, _)) = set.iter().find(|(_, set)| *set) else { return Ok(None) };
        if upstream.scheme() != "https" {
            return Err(invalid(
                format!("{key}.{first}"),
                format!("TLS settings are for an https upstream, and `{upstream}` is not one"),
            ));
        }
        let roots = match &self.ca_file {
            Some(path) => certificates(&format!("{key}.ca_file"), path)?,
            None => Vec::new(),
        };
        let mut trusted = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        for root in &roots {
            trusted
                .add(root.clone())
                .map_err(|e| invalid(format!("{key}.ca_file"), format!("a certificate in it cannot be a root: {e}")))?;
        }
        let mut digest = Sha256::new();
        for root in &roots {
            digest.update(root.as_ref());
        }
        let config = client_config_builder().with_root_certificates(trusted);
        let (config, client) = match (self.client_cert, self.client_key) {
            (None, None) => (config.with_no_client_auth(), None),
            (Some(cert), Some(private)) => {
                let chain = certificates(&format!("{key}.client_cert"), &cert)?;
                let pem = read(&format!("{key}.client_key"), &private)?;
                let private_key = private_key(&format!("{key}.client_key"), &private, &pem)?;
                digest.update(&pem);
                for cert in &chain {
                    digest.update(cert.as_ref());
                }
                // Refuses a key that is not the certificate's, or of a kind it cannot sign with.
                let config = config.with_client_auth_cert(chain.clone(), private_key).map_err(|e| {
                    invalid(
                        format!("{key}.client_key"),
                        format!("{} cannot sign for {}: {e}", private.display(), cert.display()),
                    )
                })?;
                (config, Some(chain))
            }
            (Some(_), None) => return Err(invalid(format!("{key}.client_key"), "is needed with client_cert")),
            (None, Some(_)) => return Err(invalid(format!("{key}.client_cert"), "is needed with client_key")),
        };
        let server_name = self
            .server_name
            .map(|name| {
                ServerName::try_from(name.clone()).map_err(|_| {
                    invalid(format!("{key}.server_name"), format!("`{name}` is not a DNS name or an IP address"))
                })
            })
            .transpose()?;
        if let Some(name) = &server_name {
            digest.update(name.to_str().as_bytes());
        }
        Ok(Some(UpstreamTls { id: digest.finalize().into(), roots, client, server_name, config: Arc::new(config) }))
    }
}

/// How Idem speaks TLS to upstreams: rustls with ring, TLS 1.2 and 1.3.
fn client_config_builder() -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::WantsVerifier> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
}

/// TLS towards an upstream with no settings of its own: certificates checked against the
/// Mozilla roots built in, as browsers do; no client certificate.
pub fn default_upstream_tls() -> rustls::ClientConfig {
    let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    client_config_builder().with_root_certificates(roots).with_no_client_auth()
}

/// TLS towards one upstream, its files read: what the upstream client is built from. Two
/// routes with the same settings share one connection pool (`id` names them).
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    /// A digest of everything below: settings read from equal files are one profile, and a
    /// reload that reads changed files makes another.
    pub id: [u8; 32],
    /// Trusted besides the built-in Mozilla roots.
    pub roots: Vec<CertificateDer<'static>>,
    /// The certificate chain presented to an upstream that asks for one (mTLS).
    pub client: Option<Vec<CertificateDer<'static>>>,
    /// The name the upstream's certificate is checked against and sent as SNI, instead of the
    /// URL's host.
    pub server_name: Option<ServerName<'static>>,
    /// All of it as rustls takes it, the client's key included: checked, so connecting with it
    /// cannot fail for the settings' sake.
    pub config: Arc<rustls::ClientConfig>,
}

impl UpstreamTls {
    /// What it adds to the defaults, as `idem check` says it.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if !self.roots.is_empty() {
            parts.push(format!("{} extra root(s)", self.roots.len()));
        }
        if self.client.is_some() {
            parts.push("a client certificate".to_string());
        }
        if let Some(name) = &self.server_name {
            parts.push(format!("server name {}", name.to_str()));
        }
        parts.join(", ")
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &UpstreamTls) -> bool {
        self.id == other.id
    }
}

/// A listener's certificate and key, as files: read at start and at each reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The keys that name them (`server.tls_cert`, `server.tls_key`, or the admin's), for errors.
    keys: (&'static str, &'static str),
}

impl ListenerTls {
    /// `cert` and `key` as written for one listener, the files checked now: that they parse, and
    /// that the key is the certificate's. `None` when neither is set.
    pub(super) fn validate(
        (cert_key, cert): (&'static str, Option<PathBuf>),
        (key_key, key): (&'static str, Option<PathBuf>),
    ) -> Result<Option<ListenerTls>, ConfigError> {
        let tls = match (cert, key) {
            (None, None) => return Ok(None),
            (Some(cert), Some(key)) => ListenerTls { cert, key, keys: (cert_key, key_key) },
            (Some(_), None) => return Err(invalid(key_key, format!("is needed with {cert_key}"))),
            (None, Some(_)) => return Err(invalid(cert_key, format!("is needed with {key_key}"))),
        };
        tls.load()?;
        Ok(Some(tls))
    }

    /// Files named without being read: for a test of what a reload compares.
    #[cfg(test)]
    pub(crate) fn for_test(cert: PathBuf, key: PathBuf) -> ListenerTls {
        ListenerTls { cert, key, keys: ("server.tls_cert", "server.tls_key") }
    }

    /// The certificate chain and key its files hold now, ready to serve.
    pub fn load(&self) -> Result<Arc<CertifiedKey>, ConfigError> {
        let (cert_key, key_key) = self.keys;
        let chain = certificates(cert_key, &self.cert)?;
        let pem = read(key_key, &self.key)?;
        let key = private_key(key_key, &self.key, &pem)?;
        let certified = CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider()).map_err(|e| {
            invalid(key_key, format!("{} cannot sign for {}: {e}", self.key.display(), self.cert.display()))
        })?;
        Ok(Arc::new(certified))
    }
}

/// A PostgreSQL store URL as the driver will read it: `sslmode` spelt as libpq spells it, and
/// the authority `sslrootcert` names readable PEM, so that a typo is refused by `idem check`
/// rather than at the first connection.
pub(super) fn check_postgres_url(url: &str) -> Result<(), ConfigError> {
    super::PostgresUrl::read(url).map_err(|why| invalid("store.url", why))?;
    let query = url.split_once('?').map_or("", |(_, query)| query);
    for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
        if name == "sslrootcert" {
            certificates("store.url", Path::new(value.as_ref()))?;
        }
    }
    Ok(())
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("cannot read {}: {e}", path.display())))
}

/// Every certificate of a PEM file; at least one.
fn certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let pem = read(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(key, format!("{} is not PEM certificates: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(invalid(key, format!("{} holds no PEM certificate", path.display())));
    }
    Ok(certs)
}

fn private_key(key: &str, path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, ConfigError> {
    PrivateKeyDer::from_pem_slice(pem)
        .map_err(|e| invalid(key, format!("{} holds no PEM private key: {e}", path.display())))
}
