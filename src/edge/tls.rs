//! TLS on a listener (docs/security.md#tls). Each handshake takes the certificate from a slot
//! that a reload fills again from the files, so a certificate rotates without a restart and
//! without cutting a connection: those open keep the one they were greeted with. HTTP/1.1 only:
//! ALPN offers `http/1.1`, never `h2`.

use std::sync::{Arc, RwLock};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use crate::config::{Config, ConfigError, ListenerTls};

/// One listener's certificate, replaced whole.
#[derive(Debug)]
pub struct Certificate(RwLock<Arc<CertifiedKey>>);

impl Certificate {
    /// The certificate `tls` names, read now.
    pub fn load(tls: &ListenerTls) -> Result<Arc<Certificate>, ConfigError> {
        Ok(Arc::new(Certificate(RwLock::new(tls.load()?))))
    }

    /// Serves `key` from the next handshake on; true when its chain is not the one it replaces.
    fn replace(&self, key: Arc<CertifiedKey>) -> bool {
        let mut current = self.0.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        let rotated = current.cert != key.cert;
        *current = key;
        rotated
    }

    pub fn acceptor(self: &Arc<Self>) -> TlsAcceptor {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        TlsAcceptor::from(Arc::new(config))
    }
}

impl ResolvesServerCert for Certificate {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone())
    }
}

/// The certificates of both listeners, for those that speak TLS.
#[derive(Debug, Default)]
pub struct Certificates {
    pub data: Option<Arc<Certificate>>,
    pub admin: Option<Arc<Certificate>>,
}

impl Certificates {
    pub fn load(config: &Config) -> Result<Certificates, ConfigError> {
        let load = |tls: &Option<ListenerTls>| tls.as_ref().map(Certificate::load).transpose();
        Ok(Certificates { data: load(&config.server.tls)?, admin: load(&config.server.admin_tls)? })
    }

    /// Reads the files `config` names again and serves them: both or, when one cannot be read,
    /// neither. Returns the keys of the certificates that changed. Whether a listener speaks TLS
    /// at all is fixed at start ([`crate::config::RESTART_ONLY`]).
    pub fn reload(&self, config: &Config) -> Result<Vec<&'static str>, ConfigError> {
        let read = |tls: &Option<ListenerTls>| tls.as_ref().map(ListenerTls::load).transpose();
        let (data, admin) = (read(&config.server.tls)?, read(&config.server.admin_tls)?);
        let mut rotated = Vec::new();
        let pairs = [(&self.data, data, "server.tls_cert"), (&self.admin, admin, "server.admin_tls_cert")];
        for (certificate, key, name) in pairs {
            if let (Some(certificate), Some(key)) = (certificate, key) {
                if certificate.replace(key) {
                    rotated.push(name);
                }
            }
        }
        Ok(rotated)
    }
}
