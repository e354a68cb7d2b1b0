//! Bearer tokens for authentication tests: an ES256 key pair generated at
//! test time, tokens signed with it, and the files the services read.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};

pub const ISSUER: &str = "https://issuer.sluice.test";
pub const AUDIENCE: &str = "sluice";

/// Signs tokens; its public key verifies them.
pub struct TokenIssuer {
    key: EncodingKey,
    pub public_pem: String,
}

fn now_s() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

impl TokenIssuer {
    pub fn new() -> anyhow::Result<TokenIssuer> {
        let pair = rcgen::KeyPair::generate()?;
        Ok(TokenIssuer {
            key: EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes())?,
            public_pem: pair.public_key_pem(),
        })
    }

    /// A token for `subject` acting on `tenants` with `roles`, valid for an
    /// hour, for this test's issuer and audience.
    pub fn token(&self, subject: &str, tenants: &[&str], roles: &[&str]) -> anyhow::Result<String> {
        self.sign(serde_json::json!({
            "sub": subject,
            "iss": ISSUER,
            "aud": AUDIENCE,
            "exp": now_s() + 3600,
            "sluice_tenants": tenants,
            "sluice_roles": roles,
        }))
    }

    /// A token with exactly these claims.
    pub fn sign(&self, claims: serde_json::Value) -> anyhow::Result<String> {
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::ES256),
            &claims,
            &self.key,
        )?)
    }

    /// Seconds since the epoch, for claims.
    pub fn now_s() -> i64 {
        now_s()
    }
}

/// Write the issuer's public key and an internal token into `folder`;
/// returns the settings that turn authentication on with them.
pub fn auth_settings(folder: &Path, issuer: &TokenIssuer) -> anyhow::Result<Vec<(&'static str, String)>> {
    let public_key = folder.join("issuer.pem");
    std::fs::write(&public_key, &issuer.public_pem)?;
    let internal = folder.join("internal-token");
    std::fs::write(&internal, format!("{}\n", uuid::Uuid::new_v4().simple()))?;
    Ok(vec![
        ("auth.enabled", "true".to_string()),
        ("auth.internal_token_file", internal.to_string_lossy().into_owned()),
        ("auth.public_key_files", public_key.to_string_lossy().into_owned()),
        ("auth.issuer", ISSUER.to_string()),
        ("auth.audience", AUDIENCE.to_string()),
    ])
}

/// `message` as a request carrying `token`.
pub fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}
