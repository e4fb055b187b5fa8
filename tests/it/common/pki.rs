//! A private certificate authority for the TLS tests: certificates for a broker's listeners, a
//! TLS upstream and its clients, written as the PEM files a config names.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A root that issues certificates; trusted only by whoever is given its PEM.
pub struct Authority {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

/// A certificate and its key, as PEM.
pub struct Issued {
    pub cert: String,
    pub key: String,
}

impl Authority {
    pub fn new(name: &str) -> Authority {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        let pem = params.self_signed(&key).unwrap().pem();
        Authority { issuer: Issuer::new(params, key), pem }
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn server(&self, names: &[&str]) -> Issued {
        self.issue(names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate, for mTLS.
    pub fn client(&self, name: &str) -> Issued {
        self.issue(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, names[0]);
        params.extended_key_usages = vec![usage];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued { cert: cert.pem(), key: key.serialize_pem() }
    }

    /// Its certificate, written to `dir/<stem>.pem`.
    pub fn write(&self, dir: &Path, stem: &str) -> PathBuf {
        let path = dir.join(format!("{stem}.pem"));
        std::fs::write(&path, &self.pem).unwrap();
        path
    }

    /// A reqwest client that trusts this authority only.
    pub fn client_trusting(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .no_proxy()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(self.pem.as_bytes()).unwrap())
            .build()
            .unwrap()
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(self.pem.as_bytes()).unwrap()).unwrap();
        roots
    }
}

impl Issued {
    /// Written to `dir/<stem>.crt` and `dir/<stem>.key`: (certificate, key).
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
        std::fs::write(&cert, &self.cert).unwrap();
        std::fs::write(&key, &self.key).unwrap();
        (cert, key)
    }

    /// A TLS server's configuration presenting this certificate; asking every client for one
    /// issued by `clients` when given.
    pub fn server_config(&self, clients: Option<&Authority>) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match clients {
            None => builder.with_no_client_auth(),
            Some(authority) => builder.with_client_cert_verifier(
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(authority.roots()), provider)
                    .build()
                    .unwrap(),
            ),
        };
        let chain = CertificateDer::pem_slice_iter(self.cert.as_bytes()).collect::<Result<Vec<_>, _>>().unwrap();
        let key = PrivateKeyDer::from_pem_slice(self.key.as_bytes()).unwrap();
        builder.with_single_cert(chain, key).unwrap()
    }
}
