//! Authentication and authorization for the public gRPC APIs.
//!
//! A call is made by a [`Principal`]: the tenants it may act on and its
//! roles. It is found, in this order, from
//! - the internal token (`auth.internal_token_file`), which the services
//!   send on their calls to each other: a service principal, acting on
//!   behalf of the principal named in `x-sluice-principal` when the call was
//!   forwarded for a caller;
//! - a bearer JWT (`authorization: Bearer …`) verified against
//!   `auth.jwks_file` or `auth.public_key_files`, with its issuer, audience
//!   and expiry checked; its tenants and roles come from two claims;
//! - a client certificate (mutual TLS) whose common name or a DNS / URI
//!   subject alternative name is mapped in `auth.client_certificates`.
//!
//! [`Authenticator`] is a tonic interceptor put in front of every Sluice
//! service (health and reflection stay open): it refuses a call without
//! credentials (`UNAUTHENTICATED`) and stores the principal in the request's
//! extensions, where each RPC checks it against the tenant it touches
//! ([`Principal::authorize`], [`Principal::job_scope`]).
//!
//! With `auth.enabled = false` (only `sluice dev` defaults to it) every call
//! is made by an open principal that may do anything.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::Status;

use crate::shutdown::Shutdown;

pub use crate::config::{AuthConfig, ClientCertificatePrincipal};

/// The header a forwarding service names its caller in.
pub const PRINCIPAL_HEADER: &str = "x-sluice-principal";

/// What a principal may do on its tenants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Enqueue jobs.
    Producer,
    /// Claim, heartbeat and complete jobs (Work streams too); report
    /// floating-limit refreshes; take rate tokens (`TryAcquire`).
    Worker,
    /// Change limits, pause keys, cancel jobs, manage rate and floating
    /// limits.
    Operator,
    /// Read jobs, keys and limits.
    Reader,
    /// Everything, on every tenant, including the global tenant `*`.
    Admin,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Producer, Role::Worker, Role::Operator, Role::Reader, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Producer => "producer",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::Reader => "reader",
            Role::Admin => "admin",
        }
    }

    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|role| role.name() == name)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// What an RPC does, and so which roles may do it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Enqueue,
    Work,
    Operate,
    Read,
}

impl Action {
    fn allowed_by(self, role: Role) -> bool {
        matches!(
            (self, role),
            (_, Role::Admin)
                | (Action::Enqueue, Role::Producer)
                | (Action::Work, Role::Worker)
                | (Action::Operate, Role::Operator)
                | (
                    Action::Read,
                    Role::Reader | Role::Operator | Role::Producer | Role::Worker
                )
        )
    }

    fn needs(self) -> &'static str {
        match self {
            Action::Enqueue => "the producer role",
            Action::Work => "the worker role",
            Action::Operate => "the operator role",
            Action::Read => "a role (reader, producer, worker or operator)",
        }
    }
}

/// Who makes a call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Principal {
    /// The token's subject, the certificate's name, or a service's.
    pub name: String,
    /// Tenants it may act on (an admin may act on every tenant).
    pub tenants: BTreeSet<String>,
    pub roles: BTreeSet<Role>,
    /// Authenticated with the internal token: may use the services' own
    /// APIs (owner links) and forward calls for others.
    #[serde(skip)]
    pub service: bool,
}

/// The jobs a call may touch: those of every tenant, or of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobScope {
    All,
    Tenants(Arc<BTreeSet<String>>),
}

impl JobScope {
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            JobScope::All => true,
            JobScope::Tenants(tenants) => tenants.contains(tenant),
        }
    }
}

impl Principal {
    /// Anyone, when authentication is off.
    pub fn open() -> Principal {
        Principal {
            name: "anonymous (auth off)".to_string(),
            tenants: BTreeSet::new(),
            roles: BTreeSet::from([Role::Admin]),
            service: true,
        }
    }

    /// Sluice itself (the internal token; work a service does on its own,
    /// such as handing back undelivered pushes).
    pub fn system() -> Principal {
        Principal {
            name: "sluice service".to_string(),
            tenants: BTreeSet::new(),
            roles: BTreeSet::from([Role::Admin]),
            service: true,
        }
    }

    pub fn is_admin(&self) -> bool {
        self.roles.contains(&Role::Admin)
    }

    fn may(&self, action: Action) -> bool {
        self.roles.iter().any(|role| action.allowed_by(*role))
    }

    /// May this principal do `action` on `tenant`'s keys or jobs? A tenant
    /// it may not act on answers `NOT_FOUND` naming `what` (its keys and
    /// jobs do not exist for this caller), except for `Enqueue`
    /// (`PERMISSION_DENIED`: nothing is looked up). The global tenant `*`
    /// is an admin's only; a missing role is `PERMISSION_DENIED`.
    pub fn authorize(&self, tenant: &str, action: Action, what: impl fmt::Display) -> Result<(), Status> {
        if self.is_admin() {
            return Ok(());
        }
        if tenant == "*" {
            return Err(Status::permission_denied(format!(
                "{}: tenant `*` (global caps) needs the admin role",
                self.name
            )));
        }
        if !self.tenants.contains(tenant) {
            if action == Action::Enqueue {
                return Err(Status::permission_denied(format!(
                    "{} may not enqueue for tenant {tenant:?}",
                    self.name
                )));
            }
            return Err(Status::not_found(format!("{what} not found")));
        }
        if !self.may(action) {
            return Err(Status::permission_denied(format!(
                "{}: this needs {}",
                self.name,
                action.needs()
            )));
        }
        Ok(())
    }

    /// The jobs this principal may do `action` on (job ids name no tenant:
    /// the job's owner checks each job's tenant against the scope and
    /// answers as if a job out of scope did not exist).
    pub fn job_scope(&self, action: Action) -> Result<JobScope, Status> {
        if self.is_admin() {
            return Ok(JobScope::All);
        }
        if !self.may(action) {
            return Err(Status::permission_denied(format!(
                "{}: this needs {}",
                self.name,
                action.needs()
            )));
        }
        Ok(JobScope::Tenants(Arc::new(self.tenants.clone())))
    }

    /// The principal as the `x-sluice-principal` header value.
    pub fn encode(&self) -> Option<AsciiMetadataValue> {
        let json = serde_json::to_vec(self).ok()?;
        AsciiMetadataValue::try_from(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)).ok()
    }

    fn decode(value: &str) -> Option<Principal> {
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(value).ok()?;
        serde_json::from_slice(&json).ok()
    }
}

/// The principal an interceptor stored on the request (the open one when
/// none was stored: a service built without auth, as in unit tests).
pub fn principal_of<T>(request: &tonic::Request<T>) -> Arc<Principal> {
    request
        .extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .unwrap_or_else(open_principal)
}

/// The one open principal (auth off): shared, not built per call.
fn open_principal() -> Arc<Principal> {
    static OPEN: std::sync::OnceLock<Arc<Principal>> = std::sync::OnceLock::new();
    OPEN.get_or_init(|| Arc::new(Principal::open())).clone()
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("auth.{setting}: cannot read {path:?}: {source}")]
    Read {
        setting: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("auth.{setting}: {path:?}: {message}")]
    Key {
        setting: &'static str,
        path: String,
        message: String,
    },
}

fn read(setting: &'static str, path: &str) -> Result<Vec<u8>, AuthError> {
    std::fs::read(Path::new(path.trim())).map_err(|source| AuthError::Read {
        setting,
        path: path.to_string(),
        source,
    })
}

/// One verification key and the algorithms it may verify.
struct VerifyingKey {
    kid: Option<String>,
    key: jsonwebtoken::DecodingKey,
    algorithms: Vec<jsonwebtoken::Algorithm>,
}

fn algorithms_of(family: &str) -> Vec<jsonwebtoken::Algorithm> {
    use jsonwebtoken::Algorithm::*;
    match family {
        "rsa" => vec![RS256, RS384, RS512, PS256, PS384, PS512],
        "ec" => vec![ES256, ES384],
        _ => vec![EdDSA],
    }
}

fn jwks_keys(path: &str) -> Result<Vec<VerifyingKey>, AuthError> {
    let bytes = read("jwks_file", path)?;
    let invalid = |message: String| AuthError::Key {
        setting: "jwks_file",
        path: path.to_string(),
        message,
    };
    let set: jsonwebtoken::jwk::JwkSet =
        serde_json::from_slice(&bytes).map_err(|error| invalid(format!("not a JWKS document: {error}")))?;
    let mut keys = Vec::new();
    for jwk in &set.keys {
        let family = match &jwk.algorithm {
            jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => "rsa",
            jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => "ec",
            jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => "ed",
            // Shared secrets are not accepted: anyone who can verify could sign.
            jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_) => continue,
        };
        let key = jsonwebtoken::DecodingKey::from_jwk(jwk)
            .map_err(|error| invalid(format!("key {:?}: {error}", jwk.common.key_id)))?;
        keys.push(VerifyingKey {
            kid: jwk.common.key_id.clone(),
            key,
            algorithms: algorithms_of(family),
        });
    }
    if keys.is_empty() {
        return Err(invalid("holds no RSA, EC or Ed25519 public key".to_string()));
    }
    Ok(keys)
}

/// Reads a PEM public key of one family.
type KeyParser = fn(&[u8]) -> jsonwebtoken::errors::Result<jsonwebtoken::DecodingKey>;

fn pem_key(path: &str) -> Result<VerifyingKey, AuthError> {
    let bytes = read("public_key_files", path)?;
    let attempts: [(&str, KeyParser); 3] = [
        ("rsa", jsonwebtoken::DecodingKey::from_rsa_pem),
        ("ec", jsonwebtoken::DecodingKey::from_ec_pem),
        ("ed", jsonwebtoken::DecodingKey::from_ed_pem),
    ];
    for (family, parse) in attempts {
        if let Ok(key) = parse(&bytes) {
            return Ok(VerifyingKey {
                kid: None,
                key,
                algorithms: algorithms_of(family),
            });
        }
    }
    Err(AuthError::Key {
        setting: "public_key_files",
        path: path.to_string(),
        message: "not a PEM RSA, EC or Ed25519 public key".to_string(),
    })
}

/// What the key files held when last read (and their contents, to notice
/// a change).
struct Keys {
    files: Vec<Vec<u8>>,
    keys: Vec<VerifyingKey>,
}

impl Keys {
    fn read(config: &AuthConfig) -> Result<Keys, AuthError> {
        let mut files = Vec::new();
        let mut keys = Vec::new();
        if !config.jwks_file.trim().is_empty() {
            files.push(read("jwks_file", &config.jwks_file)?);
            keys.extend(jwks_keys(&config.jwks_file)?);
        }
        for path in &config.public_key_files {
            files.push(read("public_key_files", path)?);
            keys.push(pem_key(path)?);
        }
        Ok(Keys { files, keys })
    }
}

struct Inner {
    config: AuthConfig,
    internal_token: Option<String>,
    keys: RwLock<Keys>,
}

/// Finds the principal of each call (see the module docs); a tonic
/// interceptor.
#[derive(Clone)]
pub struct Authenticator {
    inner: Option<Arc<Inner>>,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Authenticator")
            .field("enabled", &self.inner.is_some())
            .finish()
    }
}

fn unauthenticated(message: impl Into<String>) -> Status {
    Status::unauthenticated(message.into())
}

/// Equal without an early exit (a token compared byte by byte would leak
/// how much of it matched through timing).
fn same_secret(left: &[u8], right: &[u8]) -> bool {
    if left.len() != right.len() {
        return false;
    }
    left.iter().zip(right).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

impl Authenticator {
    /// Every call open.
    pub fn open() -> Authenticator {
        Authenticator { inner: None }
    }

    /// From `[auth]`: the key files are read now (a file that does not
    /// load is an error naming the setting).
    pub fn load(config: &AuthConfig) -> Result<Authenticator, AuthError> {
        if !config.enabled {
            return Ok(Authenticator::open());
        }
        config.validate()?;
        let internal_token = read_internal_token(config)?;
        let keys = Keys::read(config)?;
        Ok(Authenticator {
            inner: Some(Arc::new(Inner {
                config: config.clone(),
                internal_token,
                keys: RwLock::new(keys),
            })),
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Read the key files again every `auth.reload_interval` while serving:
    /// rotated keys are used without a restart; files that do not load are
    /// logged and the previous keys kept.
    pub async fn watch(self, shutdown: Shutdown) {
        let Some(inner) = self.inner else {
            return;
        };
        let every = inner.config.reload_interval.0.max(Duration::from_millis(100));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
            match Keys::read(&inner.config) {
                Ok(keys) => {
                    let mut current = inner.keys.write().unwrap_or_else(|poisoned| poisoned.into_inner());
                    if current.files != keys.files {
                        tracing::info!(keys = keys.keys.len(), "token verification keys reloaded");
                        *current = keys;
                    }
                }
                Err(error) => tracing::warn!(%error, "token verification keys do not load; keeping the previous ones"),
            }
        }
    }

    /// The principal making a call with `metadata` over a connection whose
    /// client presented `certificates` (leaf first).
    pub fn authenticate(
        &self,
        metadata: &MetadataMap,
        certificates: Option<&[rustls_pki_types::CertificateDer<'static>]>,
    ) -> Result<Principal, Status> {
        let Some(inner) = &self.inner else {
            return Ok(Principal::open());
        };
        if let Some(value) = metadata.get("authorization") {
            let value = value
                .to_str()
                .map_err(|_| unauthenticated("the authorization header is not ASCII"))?;
            let token = value
                .strip_prefix("Bearer ")
                .or_else(|| value.strip_prefix("bearer "))
                .ok_or_else(|| unauthenticated("the authorization header must be `Bearer <token>`"))?
                .trim();
            if let Some(internal) = &inner.internal_token {
                if same_secret(token.as_bytes(), internal.as_bytes()) {
                    return Ok(on_behalf_of(metadata).unwrap_or_else(Principal::system));
                }
            }
            return inner.verify(token);
        }
        if let Some(leaf) = certificates.and_then(|certificates| certificates.first()) {
            return inner.certificate_principal(leaf);
        }
        Err(unauthenticated(
            "no credentials: send `authorization: Bearer <token>` or a client certificate",
        ))
    }
}

/// The caller a service forwarded this call for.
fn on_behalf_of(metadata: &MetadataMap) -> Option<Principal> {
    let value = metadata.get(PRINCIPAL_HEADER)?.to_str().ok()?;
    Principal::decode(value)
}

fn read_internal_token(config: &AuthConfig) -> Result<Option<String>, AuthError> {
    if config.internal_token_file.trim().is_empty() {
        return Ok(None);
    }
    let bytes = read("internal_token_file", &config.internal_token_file)?;
    let token = String::from_utf8(bytes)
        .map(|token| token.trim().to_string())
        .unwrap_or_default();
    if token.len() < 16 || !token.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Err(AuthError::Key {
            setting: "internal_token_file",
            path: config.internal_token_file.clone(),
            message: "must hold a secret of at least 16 printable ASCII characters".to_string(),
        });
    }
    Ok(Some(token))
}

impl Inner {
    fn verify(&self, token: &str) -> Result<Principal, Status> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|error| unauthenticated(format!("bad token: {error}")))?;
        let keys = self.keys.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let candidates: Vec<&VerifyingKey> = keys
            .keys
            .iter()
            .filter(|key| key.algorithms.contains(&header.alg))
            .filter(|key| match (&header.kid, &key.kid) {
                (Some(wanted), Some(kid)) => wanted == kid,
                _ => true,
            })
            .collect();
        if candidates.is_empty() {
            return Err(unauthenticated(format!(
                "no configured key verifies {:?} tokens{}",
                header.alg,
                header
                    .kid
                    .as_deref()
                    .map(|kid| format!(" with kid {kid:?}"))
                    .unwrap_or_default()
            )));
        }
        let mut validation = jsonwebtoken::Validation::new(header.alg);
        validation.leeway = self.config.leeway.0.as_secs();
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.set_issuer(&[self.config.issuer.as_str()]);
        validation.set_audience(&[self.config.audience.as_str()]);
        let mut last = None;
        for candidate in candidates {
            match jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &candidate.key, &validation)
            {
                Ok(data) => return self.token_principal(&data.claims),
                Err(error) => last = Some(error),
            }
        }
        let reason = match last.as_ref().map(|error| error.kind()) {
            Some(jsonwebtoken::errors::ErrorKind::ExpiredSignature) => "the token has expired".to_string(),
            Some(jsonwebtoken::errors::ErrorKind::InvalidAudience) => {
                format!("the token's audience is not {:?}", self.config.audience)
            }
            Some(jsonwebtoken::errors::ErrorKind::InvalidIssuer) => {
                format!("the token's issuer is not {:?}", self.config.issuer)
            }
            Some(jsonwebtoken::errors::ErrorKind::InvalidSignature) => {
                "the token's signature does not verify with any configured key".to_string()
            }
            Some(kind) => format!("invalid token: {kind:?}"),
            None => "invalid token".to_string(),
        };
        Err(unauthenticated(reason))
    }

    fn token_principal(&self, claims: &serde_json::Map<String, serde_json::Value>) -> Result<Principal, Status> {
        let name = claims
            .get("sub")
            .and_then(|subject| subject.as_str())
            .unwrap_or_default()
            .to_string();
        let strings = |claim: &str| -> Result<Vec<String>, Status> {
            match claims.get(claim) {
                None => Ok(Vec::new()),
                Some(serde_json::Value::Array(values)) => values
                    .iter()
                    .map(|value| {
                        value
                            .as_str()
                            .map(str::to_string)
                            .ok_or_else(|| unauthenticated(format!("the token's {claim:?} claim must hold strings")))
                    })
                    .collect(),
                Some(serde_json::Value::String(value)) => Ok(value
                    .split([' ', ','])
                    .filter(|part| !part.is_empty())
                    .map(str::to_string)
                    .collect()),
                Some(_) => Err(unauthenticated(format!(
                    "the token's {claim:?} claim must be a list of strings"
                ))),
            }
        };
        let tenants = strings(&self.config.tenants_claim)?;
        let mut roles = BTreeSet::new();
        for role in strings(&self.config.roles_claim)? {
            let parsed = Role::parse(&role).ok_or_else(|| {
                unauthenticated(format!(
                    "the token names role {role:?}; roles are producer, worker, operator, reader and admin"
                ))
            })?;
            roles.insert(parsed);
        }
        Ok(Principal {
            name,
            tenants: tenants.into_iter().collect(),
            roles,
            service: false,
        })
    }

    fn certificate_principal(&self, leaf: &rustls_pki_types::CertificateDer<'static>) -> Result<Principal, Status> {
        let names = certificate_names(leaf);
        for mapping in &self.config.client_certificates {
            if names.iter().any(|name| name == &mapping.name) {
                return Ok(Principal {
                    name: mapping.name.clone(),
                    tenants: mapping.tenants.iter().cloned().collect(),
                    roles: mapping.roles.iter().filter_map(|role| Role::parse(role)).collect(),
                    service: false,
                });
            }
        }
        Err(unauthenticated(format!(
            "client certificate {names:?} is not mapped to a principal (auth.client_certificates)"
        )))
    }
}

/// A certificate's common names and DNS / URI subject alternative names.
pub use crate::cert_names::certificate_names;

impl tonic::service::Interceptor for Authenticator {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let principal = if self.enabled() {
            let certificates = request.peer_certs();
            Arc::new(self.authenticate(request.metadata(), certificates.as_deref().map(Vec::as_slice))?)
        } else {
            open_principal()
        };
        request.extensions_mut().insert(principal);
        Ok(request)
    }
}

/// A service behind the authenticator.
pub fn guarded<S>(
    service: S,
    auth: &Authenticator,
) -> tonic::service::interceptor::InterceptedService<S, Authenticator> {
    tonic::service::interceptor::InterceptedService::new(service, auth.clone())
}

/// At a service's start: the authenticator of its servers (its key files
/// watched until `shutdown`) and the credentials of its clients.
pub fn start(config: &AuthConfig, shutdown: &Shutdown) -> Result<Authenticator, AuthError> {
    configure_clients(config)?;
    let auth = Authenticator::load(config)?;
    if auth.enabled() {
        tokio::spawn(auth.clone().watch(shutdown.clone()));
    } else {
        tracing::warn!(
            "authentication is off (auth.enabled = false): anyone who reaches the gRPC ports may act on every tenant"
        );
    }
    Ok(auth)
}

/// What this process's gRPC clients send: the internal token, when auth is
/// on (set once at startup by [`configure_clients`]).
static CLIENT_TOKEN: RwLock<Option<AsciiMetadataValue>> = RwLock::new(None);

/// Make this process's calls to the services carry the internal token.
pub fn configure_clients(config: &AuthConfig) -> Result<(), AuthError> {
    let token = if config.enabled {
        read_internal_token(config)?
    } else {
        None
    };
    let value = token.and_then(|token| AsciiMetadataValue::try_from(format!("Bearer {token}")).ok());
    *CLIENT_TOKEN.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = value;
    Ok(())
}

/// Set the bearer token this process's calls carry (the `sluice` command's
/// `--token-file`).
pub fn set_client_token(token: &str) -> Result<(), AuthError> {
    let value = AsciiMetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| AuthError::Key {
        setting: "token",
        path: String::new(),
        message: "must be printable ASCII".to_string(),
    })?;
    *CLIENT_TOKEN.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(value);
    Ok(())
}

/// Adds this process's credentials to every call of a channel.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    bearer: Option<AsciiMetadataValue>,
}

impl tonic::service::Interceptor for Credentials {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(bearer) = &self.bearer {
            if !request.metadata().contains_key("authorization") {
                request.metadata_mut().insert("authorization", bearer.clone());
            }
        }
        Ok(request)
    }
}

/// A channel whose calls carry this process's credentials.
pub type Channel = tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Credentials>;

/// `channel` with this process's credentials (read now).
pub fn with_credentials(channel: tonic::transport::Channel) -> Channel {
    let bearer = CLIENT_TOKEN
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    tonic::service::interceptor::InterceptedService::new(channel, Credentials { bearer })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(tenants: &[&str], roles: &[Role]) -> Principal {
        Principal {
            name: "someone".to_string(),
            tenants: tenants.iter().map(|tenant| tenant.to_string()).collect(),
            roles: roles.iter().copied().collect(),
            service: false,
        }
    }

    #[test]
    fn another_tenants_keys_do_not_exist_and_a_missing_role_is_denied() {
        let operator = principal(&["a"], &[Role::Operator]);
        assert!(operator.authorize("a", Action::Operate, "key a/k").is_ok());
        let other = operator.authorize("b", Action::Operate, "key b/k").unwrap_err();
        assert_eq!(other.code(), tonic::Code::NotFound);
        assert_eq!(other.message(), "key b/k not found");
        let producer = principal(&["a"], &[Role::Producer]);
        let denied = producer.authorize("a", Action::Operate, "key a/k").unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            producer.authorize("b", Action::Enqueue, "job").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(producer.authorize("a", Action::Read, "key a/k").is_ok());
    }

    #[test]
    fn the_global_tenant_is_an_admins_only() {
        let everything = principal(&["*", "a"], &[Role::Operator, Role::Reader]);
        let refused = everything.authorize("*", Action::Read, "key */k").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("admin"), "{}", refused.message());
        let admin = principal(&[], &[Role::Admin]);
        assert!(admin.authorize("*", Action::Operate, "key */k").is_ok());
        assert_eq!(admin.job_scope(Action::Work).unwrap(), JobScope::All);
    }

    #[test]
    fn a_job_scope_is_the_principals_tenants_and_needs_the_role() {
        let worker = principal(&["a"], &[Role::Worker]);
        let scope = worker.job_scope(Action::Work).unwrap();
        assert!(scope.allows("a"));
        assert!(!scope.allows("b"));
        assert_eq!(
            worker.job_scope(Action::Operate).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
    }

    #[test]
    fn a_forwarded_principal_round_trips_through_its_header() {
        let worker = principal(&["a", "b c"], &[Role::Worker, Role::Reader]);
        let header = worker.encode().unwrap();
        let decoded = Principal::decode(header.to_str().unwrap()).unwrap();
        assert_eq!(decoded, worker);
    }

    /// Auth on with only an internal token (no keys).
    fn internal_only(token_file: &std::path::Path) -> AuthConfig {
        AuthConfig {
            enabled: true,
            internal_token_file: token_file.to_string_lossy().into_owned(),
            jwks_file: String::new(),
            public_key_files: Vec::new(),
            issuer: String::new(),
            audience: String::new(),
            tenants_claim: "sluice_tenants".to_string(),
            roles_claim: "sluice_roles".to_string(),
            leeway: crate::config::HumanDuration(Duration::from_secs(30)),
            reload_interval: crate::config::HumanDuration(Duration::from_secs(10)),
            client_certificates: Vec::new(),
        }
    }

    fn metadata(pairs: &[(&'static str, String)]) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        for (name, value) in pairs {
            metadata.insert(*name, value.parse().unwrap());
        }
        metadata
    }

    #[test]
    fn only_the_internal_token_may_name_the_caller_it_acts_for() {
        let folder = std::env::temp_dir().join(format!("sluice-auth-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&folder).unwrap();
        let token_file = folder.join("internal-token");
        std::fs::write(&token_file, "0123456789abcdef-internal\n").unwrap();
        let config = internal_only(&token_file);
        let auth = Authenticator::load(&config).unwrap();
        let worker = principal(&["a"], &[Role::Worker]);
        let forwarded = worker.encode().unwrap().to_str().unwrap().to_string();

        // With the internal token: the caller named, or the system itself.
        let acting = auth
            .authenticate(
                &metadata(&[
                    ("authorization", "Bearer 0123456789abcdef-internal".to_string()),
                    (PRINCIPAL_HEADER, forwarded.clone()),
                ]),
                None,
            )
            .unwrap();
        assert_eq!(acting, worker);
        assert!(!acting.service, "a forwarded caller is not a service");
        let system = auth
            .authenticate(
                &metadata(&[("authorization", "Bearer 0123456789abcdef-internal".to_string())]),
                None,
            )
            .unwrap();
        assert!(system.service && system.is_admin());

        // Anyone else naming a caller gets nowhere.
        let admin = Principal {
            roles: BTreeSet::from([Role::Admin]),
            ..principal(&[], &[])
        };
        let spoofed = admin.encode().unwrap().to_str().unwrap().to_string();
        for credentials in [
            vec![(PRINCIPAL_HEADER, spoofed.clone())],
            vec![
                ("authorization", "Bearer not-the-token".to_string()),
                (PRINCIPAL_HEADER, spoofed.clone()),
            ],
            vec![("authorization", "Basic 0123456789abcdef-internal".to_string())],
        ] {
            let refused = auth.authenticate(&metadata(&credentials), None).unwrap_err();
            assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{credentials:?}");
        }
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn an_internal_token_too_short_to_be_a_secret_is_refused() {
        let folder = std::env::temp_dir().join(format!("sluice-auth-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&folder).unwrap();
        let token_file = folder.join("internal-token");
        std::fs::write(&token_file, "short").unwrap();
        let config = internal_only(&token_file);
        let error = Authenticator::load(&config).unwrap_err().to_string();
        assert!(
            error.contains("auth.internal_token_file") && error.contains("16"),
            "{error}"
        );
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn secrets_compare_by_content() {
        assert!(same_secret(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!same_secret(b"0123456789abcdef", b"0123456789abcdeF"));
        assert!(!same_secret(b"0123", b"01234"));
    }
}
