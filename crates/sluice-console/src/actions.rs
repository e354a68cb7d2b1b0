//! Everything the console changes goes through here: an `Action`, parsed
//! from a form, shown on a confirmation page, and applied only when the
//! confirmation comes back carrying the token minted for exactly that
//! action. `authorize` is the one place a role check goes (issue 14): every
//! action, confirmed or not, passes it first.

use std::fmt::Write as _;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use sluice_proto::v1 as pb;

use crate::html::{job_link, key_link, link};
use crate::services::{ApiError, Services};

/// A change to a running Sluice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    SetOverride {
        tenant: String,
        key: String,
        max: u32,
    },
    ClearOverride {
        tenant: String,
        key: String,
    },
    Pause {
        tenant: String,
        key: String,
    },
    Resume {
        tenant: String,
        key: String,
    },
    CancelJob {
        job_id: String,
        reason: String,
    },
    PutRateLimit {
        tenant: String,
        resource_key: String,
        max_count: i64,
        window_seconds: i64,
    },
    DeleteRateLimit {
        tenant: String,
        resource_key: String,
    },
}

/// The fields of every action form; which are used depends on `action`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ActionForm {
    pub action: String,
    pub tenant: String,
    pub key: String,
    pub max: String,
    pub job_id: String,
    pub reason: String,
    pub resource_key: String,
    pub max_count: String,
    pub window_seconds: String,
    /// Set by the confirmation page's button, with `token`.
    pub confirmed: String,
    pub token: String,
}

fn required<'a>(field: &str, value: &'a str) -> Result<&'a str, String> {
    let value = value.trim();
    if value.is_empty() {
        return Err(format!("{field}: must not be empty"));
    }
    Ok(value)
}

fn number<T: std::str::FromStr>(field: &str, value: &str, what: &str) -> Result<T, String> {
    required(field, value)?.parse().map_err(|_| format!("{field}: {what}"))
}

impl Action {
    /// The action a form asks for; the services check the values again.
    pub fn from_form(form: &ActionForm) -> Result<Action, String> {
        let tenant = || required("tenant", &form.tenant).map(str::to_string);
        // Keys are taken as written: surrounding spaces are part of a key.
        let key = || {
            if form.key.is_empty() {
                Err("key: must not be empty".to_string())
            } else {
                Ok(form.key.clone())
            }
        };
        match form.action.as_str() {
            "set-override" => Ok(Action::SetOverride {
                tenant: tenant()?,
                key: key()?,
                max: number("max", &form.max, "a whole number from 0 (pause) to 2147483647")?,
            }),
            "clear-override" => Ok(Action::ClearOverride {
                tenant: tenant()?,
                key: key()?,
            }),
            "pause" => Ok(Action::Pause {
                tenant: tenant()?,
                key: key()?,
            }),
            "resume" => Ok(Action::Resume {
                tenant: tenant()?,
                key: key()?,
            }),
            "cancel-job" => Ok(Action::CancelJob {
                job_id: required("job_id", &form.job_id)?.to_string(),
                reason: form.reason.trim().to_string(),
            }),
            "put-rate-limit" => Ok(Action::PutRateLimit {
                tenant: tenant()?,
                resource_key: required("resource_key", &form.resource_key)?.to_string(),
                max_count: number("max_count", &form.max_count, "a whole number of units")?,
                window_seconds: number("window_seconds", &form.window_seconds, "a whole number of seconds")?,
            }),
            "delete-rate-limit" => Ok(Action::DeleteRateLimit {
                tenant: tenant()?,
                resource_key: required("resource_key", &form.resource_key)?.to_string(),
            }),
            other => Err(format!("action: unknown action {other:?}")),
        }
    }

    /// The form fields that ask for this action again (the confirmation).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        match self {
            Action::SetOverride { tenant, key, max } => vec![
                ("action", "set-override".to_string()),
                ("tenant", tenant.clone()),
                ("key", key.clone()),
                ("max", max.to_string()),
            ],
            Action::ClearOverride { tenant, key } => vec![
                ("action", "clear-override".to_string()),
                ("tenant", tenant.clone()),
                ("key", key.clone()),
            ],
            Action::Pause { tenant, key } => vec![
                ("action", "pause".to_string()),
                ("tenant", tenant.clone()),
                ("key", key.clone()),
            ],
            Action::Resume { tenant, key } => vec![
                ("action", "resume".to_string()),
                ("tenant", tenant.clone()),
                ("key", key.clone()),
            ],
            Action::CancelJob { job_id, reason } => vec![
                ("action", "cancel-job".to_string()),
                ("job_id", job_id.clone()),
                ("reason", reason.clone()),
            ],
            Action::PutRateLimit {
                tenant,
                resource_key,
                max_count,
                window_seconds,
            } => vec![
                ("action", "put-rate-limit".to_string()),
                ("tenant", tenant.clone()),
                ("resource_key", resource_key.clone()),
                ("max_count", max_count.to_string()),
                ("window_seconds", window_seconds.to_string()),
            ],
            Action::DeleteRateLimit { tenant, resource_key } => vec![
                ("action", "delete-rate-limit".to_string()),
                ("tenant", tenant.clone()),
                ("resource_key", resource_key.clone()),
            ],
        }
    }

    /// What will happen, in one sentence, for the confirmation page.
    pub fn describe(&self) -> String {
        match self {
            Action::SetOverride { tenant, key, max: 0 } => {
                format!("Set the override of key {key:?} (tenant {tenant:?}) to 0, which pauses it")
            }
            Action::SetOverride { tenant, key, max } => {
                format!("Set the override of key {key:?} (tenant {tenant:?}) to {max}")
            }
            Action::ClearOverride { tenant, key } => format!("Clear the override of key {key:?} (tenant {tenant:?})"),
            Action::Pause { tenant, key } => format!("Pause key {key:?} (tenant {tenant:?})"),
            Action::Resume { tenant, key } => format!("Resume key {key:?} (tenant {tenant:?})"),
            Action::CancelJob { job_id, .. } => format!("Cancel job {job_id:?}"),
            Action::PutRateLimit {
                tenant,
                resource_key,
                max_count,
                window_seconds,
            } => format!("Store rate limit {resource_key:?} (tenant {tenant:?}): {max_count} per {window_seconds} s"),
            Action::DeleteRateLimit { tenant, resource_key } => {
                format!("Delete rate limit {resource_key:?} (tenant {tenant:?})")
            }
        }
    }

    /// What it means, for the confirmation page.
    pub fn consequence(&self) -> &'static str {
        match self {
            Action::SetOverride { max: 0, .. } | Action::Pause { .. } => {
                "No job is granted the key until it is resumed; running jobs are not interrupted."
            }
            Action::SetOverride { .. } => {
                "The override beats the jobs' own max and is persisted. Raising it grants waiters at once; \
                 lowering it applies to new grants only (running jobs are never interrupted)."
            }
            Action::ClearOverride { .. } | Action::Resume { .. } => {
                "The jobs' own max (or the floating value) applies again; waiters it allows are granted at once."
            }
            Action::CancelJob { .. } => {
                "A waiting job ends now and gives its tickets back; a running job is cancelling until its \
                 worker confirms or its lease expires."
            }
            Action::PutRateLimit { .. } => {
                "Creates the stored rate limit, or updates it in place; a raised limit grants waiters at once."
            }
            Action::DeleteRateLimit { .. } => {
                "Jobs waiting on it are released at once; a reference to a missing rate limit does not throttle."
            }
        }
    }

    /// The page to go back to.
    pub fn return_to(&self) -> String {
        match self {
            Action::SetOverride { tenant, key, .. }
            | Action::ClearOverride { tenant, key }
            | Action::Pause { tenant, key }
            | Action::Resume { tenant, key } => key_link(tenant, key),
            Action::CancelJob { job_id, .. } => job_link(job_id),
            Action::PutRateLimit { tenant, .. } | Action::DeleteRateLimit { tenant, .. } => {
                link("/rate-limits", &[("tenant", tenant)])
            }
        }
    }

    /// Unambiguous bytes of the action, for its token.
    fn canonical(&self) -> String {
        let mut text = String::new();
        for (name, value) in self.fields() {
            let _ = write!(text, "{name}:{}:{value};", value.len());
        }
        text
    }
}

/// Who is asking: the principal `crate::require_admin` authenticated (with
/// auth off, anyone: an admin).
#[derive(Clone, Debug, Default)]
pub struct Caller {
    pub identity: Option<String>,
    pub roles: Vec<String>,
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let principal = parts
            .extensions
            .get::<std::sync::Arc<sluice_common::auth::Principal>>()
            .cloned()
            .unwrap_or_else(|| std::sync::Arc::new(sluice_common::auth::Principal::open()));
        Ok(Caller {
            identity: Some(principal.name.clone()),
            roles: principal.roles.iter().map(|role| role.name().to_string()).collect(),
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Forbidden(pub String);

/// The single role check of the console: every action passes here before it
/// is confirmed or applied. The console shows every tenant, so only an admin
/// may act through it (with auth off, everyone is one).
pub fn authorize(caller: &Caller, action: &Action) -> Result<(), Forbidden> {
    if caller.roles.iter().any(|role| role == "admin") {
        return Ok(());
    }
    let _ = action;
    Err(Forbidden(format!(
        "{} may not do this: the console acts on every tenant, so it needs the admin role",
        caller.identity.as_deref().unwrap_or("this caller")
    )))
}

/// Mints and checks confirmation tokens: a hash of a per-process secret and
/// the exact action. A page of another site cannot read the token, so it
/// cannot confirm anything (CSRF); a token confirms only its own action.
#[derive(Clone)]
pub struct ConfirmKey {
    secret: [u8; 32],
}

impl ConfirmKey {
    pub fn random() -> Self {
        ConfirmKey { secret: rand::random() }
    }

    pub fn token(&self, action: &Action) -> String {
        let mut hasher = Sha256::new();
        hasher.update(self.secret);
        hasher.update(action.canonical().as_bytes());
        hasher
            .finalize()
            .iter()
            .fold(String::with_capacity(64), |mut text, byte| {
                let _ = write!(text, "{byte:02x}");
                text
            })
    }

    pub fn confirms(&self, action: &Action, token: &str) -> bool {
        let expected = self.token(action);
        expected.len() == token.len()
            && expected
                .bytes()
                .zip(token.bytes())
                .fold(0u8, |difference, (left, right)| difference | (left ^ right))
                == 0
    }
}

/// What an applied action did, for the page it returns to.
pub fn done_message(code: &str) -> Option<&'static str> {
    match code {
        "override-set" => Some("Override set."),
        "override-cleared" => Some("Override cleared."),
        "paused" => Some("Key paused."),
        "resumed" => Some("Key resumed."),
        "cancel-requested" => Some("Cancel requested."),
        "rate-limit-saved" => Some("Rate limit saved."),
        "rate-limit-deleted" => Some("Rate limit deleted."),
        _ => None,
    }
}

/// Apply a confirmed, authorized action; returns the `done` code.
pub async fn apply(services: &Services, action: &Action) -> Result<&'static str, ApiError> {
    match action {
        Action::SetOverride { tenant, key, max } => {
            services.set_limit(tenant, key, Some(*max)).await?;
            Ok(if *max == 0 { "paused" } else { "override-set" })
        }
        Action::Pause { tenant, key } => {
            services.set_limit(tenant, key, Some(0)).await?;
            Ok("paused")
        }
        Action::ClearOverride { tenant, key } => {
            services.set_limit(tenant, key, None).await?;
            Ok("override-cleared")
        }
        Action::Resume { tenant, key } => {
            services.set_limit(tenant, key, None).await?;
            Ok("resumed")
        }
        Action::CancelJob { job_id, reason } => {
            let reason = if reason.is_empty() {
                "cancelled from the console"
            } else {
                reason
            };
            services.cancel_job(job_id, reason).await?;
            Ok("cancel-requested")
        }
        Action::PutRateLimit {
            tenant,
            resource_key,
            max_count,
            window_seconds,
        } => {
            services
                .put_rate_limit(pb::RateLimitResource {
                    tenant: tenant.clone(),
                    resource_key: resource_key.clone(),
                    max_count: *max_count,
                    window_seconds: *window_seconds,
                })
                .await?;
            Ok("rate-limit-saved")
        }
        Action::DeleteRateLimit { tenant, resource_key } => {
            services.delete_rate_limit(tenant, resource_key).await?;
            Ok("rate-limit-deleted")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(fields: &[(&str, &str)]) -> ActionForm {
        let mut form = ActionForm::default();
        for (name, value) in fields {
            let value = value.to_string();
            match *name {
                "action" => form.action = value,
                "tenant" => form.tenant = value,
                "key" => form.key = value,
                "max" => form.max = value,
                "job_id" => form.job_id = value,
                "resource_key" => form.resource_key = value,
                "max_count" => form.max_count = value,
                "window_seconds" => form.window_seconds = value,
                _ => {}
            }
        }
        form
    }

    #[test]
    fn forms_parse_into_actions_and_back() {
        let action = Action::from_form(&form(&[
            ("action", "set-override"),
            ("tenant", "acme"),
            ("key", "k"),
            ("max", "3"),
        ]))
        .unwrap();
        assert_eq!(
            action,
            Action::SetOverride {
                tenant: "acme".to_string(),
                key: "k".to_string(),
                max: 3
            }
        );
        let fields = action.fields();
        let again: Vec<(&str, &str)> = fields.iter().map(|(name, value)| (*name, value.as_str())).collect();
        assert_eq!(Action::from_form(&form(&again)).unwrap(), action);
        let error = Action::from_form(&form(&[
            ("action", "set-override"),
            ("tenant", "a"),
            ("key", "k"),
            ("max", "-1"),
        ]))
        .unwrap_err();
        assert!(error.starts_with("max:"), "{error}");
        let error = Action::from_form(&form(&[("action", "drop-table")])).unwrap_err();
        assert!(error.contains("unknown action"), "{error}");
        let error = Action::from_form(&form(&[("action", "cancel-job")])).unwrap_err();
        assert!(error.starts_with("job_id:"), "{error}");
    }

    #[test]
    fn a_token_confirms_only_its_own_action_in_this_process() {
        let key = ConfirmKey::random();
        let pause = Action::Pause {
            tenant: "acme".to_string(),
            key: "k".to_string(),
        };
        let other = Action::Pause {
            tenant: "acme".to_string(),
            key: "k2".to_string(),
        };
        let token = key.token(&pause);
        assert!(key.confirms(&pause, &token));
        assert!(!key.confirms(&other, &token));
        assert!(!key.confirms(&pause, ""));
        assert!(!ConfirmKey::random().confirms(&pause, &token));
        // Field boundaries cannot be shifted to forge another action.
        let shifted = Action::Pause {
            tenant: "acme;key:1:k".to_string(),
            key: String::new(),
        };
        assert_ne!(key.token(&shifted), token);
    }
}
