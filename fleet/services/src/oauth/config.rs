//! The provider table: `[credentials.providers.<name>]` of the services TOML, checked once at start-up.
//!
//! ```toml
//! [credentials.providers.google]
//! authorize_url = "https://accounts.google.com/o/oauth2/v2/auth"
//! token_url = "https://oauth2.googleapis.com/token"
//! userinfo_url = "https://openidconnect.googleapis.com/v1/userinfo"
//! client_id = "1234.apps.googleusercontent.com"
//! client_secret_file = "/etc/fleet/google-client-secret"
//! scopes = ["openid", "email", "https://www.googleapis.com/auth/gmail.readonly"]
//! authorize_params = { access_type = "offline", prompt = "consent" }
//! credential_mapping = { GOOGLE_ACCESS_TOKEN = "$access_token", GMAIL_ACCESS_TOKEN = "$access_token" }
//! ```
//!
//! A mapping's value is `$access_token` (spec §4.2: the live access token of the user's default account);
//! `$refresh_token` is refused ("Reserved. Never exposed to plugins"), and so is anything else. A credential name
//! is mapped by one provider at most.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use zeroize::Zeroizing;

use crate::ServicesError;
use crate::credentials::valid_name;

/// The only mapping value a provider may give a credential name (spec §4.2).
pub const ACCESS_TOKEN: &str = "$access_token";
/// The reserved mapping value that is never exposed (spec §4.2, §8.8 HR-CD-01).
pub const REFRESH_TOKEN: &str = "$refresh_token";

/// Longest provider name.
const PROVIDER_NAME_MAX_CHARS: usize = 32;

/// Authorization request parameters the flow sets itself; `authorize_params` may not.
const RESERVED_AUTHORIZE_PARAMS: [&str; 7] = [
    "response_type",
    "client_id",
    "redirect_uri",
    "state",
    "scope",
    "code_challenge",
    "code_challenge_method",
];

/// `[credentials]` of the services TOML.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CredentialsConfig {
    /// The OAuth providers users may connect accounts of, by name (`[credentials.providers.<name>]`); none:
    /// `credentials/*` is not offered and no `credentials_token` is minted.
    #[serde(default)]
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Platform credentials (the names a provider maps) only for plugins the user's grant allows them to
    /// (`credential:<NAME>` among the grant's capabilities, `fleet grant --allow credential:<NAME>`), and the
    /// `credentials_token` covering only those providers; off: any plugin whose published manifest declares a mapped
    /// name receives it (spec §8.8). Recommended in production.
    #[serde(default)]
    pub require_grant: bool,
}

/// How the client authenticates at the token endpoint (RFC 6749 §2.3.1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    /// HTTP Basic with the client id and secret (`client_secret_basic`).
    #[default]
    Basic,
    /// `client_id` and `client_secret` in the form body (`client_secret_post`).
    Post,
}

/// One provider (`[credentials.providers.<name>]`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// The authorization endpoint the browser is sent to.
    pub authorize_url: String,
    /// The token endpoint (code exchange, refresh).
    pub token_url: String,
    /// An endpoint answering the account's identity (`sub` or `id`, `email`) for its access token; absent: the
    /// token response's `id_token` is read, else the account has no known identity (each connect adds one).
    #[serde(default)]
    pub userinfo_url: Option<String>,
    /// The client id registered at the provider.
    pub client_id: String,
    /// A file holding the client secret (surrounding whitespace ignored); absent: a public client (PKCE only).
    #[serde(default)]
    pub client_secret_file: Option<PathBuf>,
    /// `basic` (default) or `post`.
    #[serde(default)]
    pub client_auth: ClientAuth,
    /// The scopes the connect flow asks for.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// More authorization request parameters (e.g. `access_type = "offline"`, `prompt = "consent"` for a
    /// Google refresh token); the flow's own (`state`, `code_challenge`, …) cannot be set here.
    #[serde(default)]
    pub authorize_params: BTreeMap<String, String>,
    /// Credential name → `$access_token`: the names a manifest declares that this provider fills (spec §4.2
    /// HR-CR-01), and that make the host mint a `credentials_token` for it (spec §8.8).
    #[serde(default)]
    pub credential_mapping: BTreeMap<String, String>,
}

/// A client secret; `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct ClientSecret(pub(crate) Zeroizing<String>);

impl fmt::Debug for ClientSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClientSecret(<redacted>)")
    }
}

/// A checked provider.
#[derive(Debug, Clone)]
pub(crate) struct Provider {
    pub(crate) name: String,
    pub(crate) authorize_url: url::Url,
    pub(crate) token_url: url::Url,
    pub(crate) userinfo_url: Option<url::Url>,
    pub(crate) client_id: String,
    pub(crate) secret: Option<ClientSecret>,
    pub(crate) client_auth: ClientAuth,
    pub(crate) scopes: Vec<String>,
    pub(crate) authorize_params: BTreeMap<String, String>,
    /// The credential names it fills (all with `$access_token`).
    pub(crate) credentials: Vec<String>,
}

fn config_err(name: &str, what: impl fmt::Display) -> ServicesError {
    ServicesError::Config(format!("credentials.providers.{name}: {what}"))
}

/// An endpoint URL: http(s), no credentials, no fragment (a query is allowed: some authorization endpoints carry
/// one). The error names the rule, never the URL.
fn endpoint(name: &str, field: &str, text: &str) -> Result<url::Url, ServicesError> {
    let url = url::Url::parse(text.trim()).map_err(|e| config_err(name, format!("{field}: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(config_err(
            name,
            format!("{field}: the scheme must be http or https"),
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(config_err(
            name,
            format!("{field}: no credentials in the URL (the secret belongs in client_secret_file)"),
        ));
    }
    if url.fragment().is_some() {
        return Err(config_err(name, format!("{field}: no fragment")));
    }
    Ok(url)
}

/// Whether `name` can name a provider: 1–32 of `[a-z0-9_-]`, starting with a letter or digit (it is a path
/// segment of `/v1/oauth/<provider>/…`).
pub fn valid_provider_name(name: &str) -> bool {
    name.len() <= PROVIDER_NAME_MAX_CHARS
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

impl ProviderConfig {
    fn check(&self, name: &str) -> Result<Provider, ServicesError> {
        if !valid_provider_name(name) {
            return Err(ServicesError::Config(format!(
                "credentials.providers: the provider name {name:?} is not 1–{PROVIDER_NAME_MAX_CHARS} of [a-z0-9_-]"
            )));
        }
        let client_id = self.client_id.trim();
        if client_id.is_empty() {
            return Err(config_err(name, "client_id is empty"));
        }
        let secret = match &self.client_secret_file {
            None => None,
            Some(path) => {
                let text =
                    Zeroizing::new(std::fs::read_to_string(path).map_err(|e| {
                        config_err(name, format!("client_secret_file {}: {e}", path.display()))
                    })?);
                let trimmed = text.trim();
                if trimmed.is_empty() {
                    return Err(config_err(
                        name,
                        format!("client_secret_file {} is empty", path.display()),
                    ));
                }
                Some(ClientSecret(Zeroizing::new(trimmed.to_owned())))
            }
        };
        if let Some(reserved) = self
            .authorize_params
            .keys()
            .find(|k| RESERVED_AUTHORIZE_PARAMS.contains(&k.as_str()))
        {
            return Err(config_err(
                name,
                format!("authorize_params: {reserved:?} is set by the connect flow itself"),
            ));
        }
        if self.scopes.iter().any(|s| s.is_empty() || s.contains(' ')) {
            return Err(config_err(name, "scopes: a scope is non-empty and has no space"));
        }
        let mut credentials = Vec::new();
        for (credential, value) in &self.credential_mapping {
            if !valid_name(credential) {
                return Err(config_err(
                    name,
                    format!(
                        "credential_mapping: {credential:?} is not a credential name ([A-Za-z_][A-Za-z0-9_]*)"
                    ),
                ));
            }
            match value.as_str() {
                ACCESS_TOKEN => credentials.push(credential.clone()),
                REFRESH_TOKEN => {
                    return Err(config_err(
                        name,
                        format!(
                            "credential_mapping.{credential}: $refresh_token is never exposed to plugins"
                        ),
                    ));
                }
                _ => {
                    return Err(config_err(
                        name,
                        format!("credential_mapping.{credential}: the only value is \"{ACCESS_TOKEN}\""),
                    ));
                }
            }
        }
        Ok(Provider {
            name: name.to_owned(),
            authorize_url: endpoint(name, "authorize_url", &self.authorize_url)?,
            token_url: endpoint(name, "token_url", &self.token_url)?,
            userinfo_url: self
                .userinfo_url
                .as_deref()
                .map(|u| endpoint(name, "userinfo_url", u))
                .transpose()?,
            client_id: client_id.to_owned(),
            secret,
            client_auth: self.client_auth,
            scopes: self.scopes.clone(),
            authorize_params: self.authorize_params.clone(),
            credentials,
        })
    }
}

/// The checked provider table.
#[derive(Debug, Clone, Default)]
pub(crate) struct Providers {
    by_name: BTreeMap<String, Provider>,
    /// Credential name → the provider that fills it.
    by_credential: BTreeMap<String, String>,
}

impl Providers {
    /// Checks every provider: names, URLs, secrets (read now), mappings (each name mapped once).
    pub(crate) fn new(config: &CredentialsConfig) -> Result<Providers, ServicesError> {
        let mut out = Providers::default();
        for (name, provider) in &config.providers {
            let provider = provider.check(name)?;
            for credential in &provider.credentials {
                if let Some(other) = out.by_credential.insert(credential.clone(), name.clone()) {
                    return Err(ServicesError::Config(format!(
                        "credentials.providers: {credential} is mapped by both {other} and {name}"
                    )));
                }
            }
            out.by_name.insert(name.clone(), provider);
        }
        Ok(out)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Provider> {
        self.by_name.get(name)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Provider> {
        self.by_name.values()
    }

    /// The provider that fills the credential `name`, if any.
    pub(crate) fn for_credential(&self, name: &str) -> Option<&Provider> {
        self.by_credential.get(name).and_then(|p| self.by_name.get(p))
    }

    /// The providers `names` (a manifest's `credentials[].name`) map to, each once, in name order.
    pub(crate) fn covering<'a>(&self, names: impl IntoIterator<Item = &'a String>) -> Vec<String> {
        let mut out: Vec<String> = names
            .into_iter()
            .filter_map(|n| self.by_credential.get(n).cloned())
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn provider(mapping: &[(&str, &str)]) -> ProviderConfig {
        ProviderConfig {
            authorize_url: "https://id.example/authorize".into(),
            token_url: "https://id.example/token".into(),
            client_id: "client".into(),
            credential_mapping: mapping
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..ProviderConfig::default()
        }
    }

    fn table(entries: &[(&str, ProviderConfig)]) -> Result<Providers, String> {
        Providers::new(&CredentialsConfig {
            providers: entries
                .iter()
                .map(|(n, p)| ((*n).to_owned(), p.clone()))
                .collect(),
            require_grant: false,
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn mappings_take_access_tokens_only_and_each_name_once() {
        let p = table(&[(
            "google",
            provider(&[
                ("GOOGLE_ACCESS_TOKEN", "$access_token"),
                ("GMAIL_ACCESS_TOKEN", "$access_token"),
            ]),
        )])
        .unwrap();
        assert_eq!(p.for_credential("GMAIL_ACCESS_TOKEN").unwrap().name, "google");
        assert!(p.for_credential("OTHER").is_none());
        let names = [
            "OTHER".to_owned(),
            "GMAIL_ACCESS_TOKEN".to_owned(),
            "GOOGLE_ACCESS_TOKEN".to_owned(),
        ];
        assert_eq!(p.covering(&names), ["google"]);

        let e = table(&[("google", provider(&[("G", "$refresh_token")]))]).unwrap_err();
        assert!(e.contains("never exposed"), "{e}");
        let e = table(&[("google", provider(&[("G", "$id_token")]))]).unwrap_err();
        assert!(e.contains("the only value"), "{e}");
        let e = table(&[("google", provider(&[("1G", "$access_token")]))]).unwrap_err();
        assert!(e.contains("not a credential name"), "{e}");
        let e = table(&[
            ("a", provider(&[("TOKEN", "$access_token")])),
            ("b", provider(&[("TOKEN", "$access_token")])),
        ])
        .unwrap_err();
        assert!(e.contains("mapped by both a and b"), "{e}");
    }

    #[test]
    fn names_urls_and_reserved_parameters_are_checked() {
        for bad in ["", "Google", "-x", "a/b", &"x".repeat(33)] {
            assert!(table(&[(bad, provider(&[]))]).is_err(), "{bad:?}");
        }
        let mut p = provider(&[]);
        p.token_url = "ftp://id.example/token".into();
        assert!(table(&[("x", p)]).unwrap_err().contains("scheme"));
        let mut p = provider(&[]);
        p.token_url = "https://user:pw@id.example/token".into();
        let e = table(&[("x", p)]).unwrap_err();
        assert!(e.contains("no credentials") && !e.contains("pw"), "{e}");
        let mut p = provider(&[]);
        p.authorize_params.insert("state".into(), "fixed".into());
        assert!(table(&[("x", p)]).unwrap_err().contains("\"state\""));
        let mut p = provider(&[]);
        p.client_secret_file = Some("/nonexistent/secret".into());
        assert!(table(&[("x", p)]).unwrap_err().contains("client_secret_file"));
        let mut p = provider(&[]);
        p.scopes = vec!["a b".into()];
        assert!(table(&[("x", p)]).is_err());
    }

    #[test]
    fn the_secret_is_read_trimmed_and_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "  s3cret-value\n").unwrap();
        let mut p = provider(&[]);
        p.client_secret_file = Some(path);
        let t = table(&[("x", p)]).unwrap();
        let provider = t.get("x").unwrap();
        assert_eq!(provider.secret.as_ref().unwrap().0.as_str(), "s3cret-value");
        assert!(!format!("{t:?}").contains("s3cret"));
    }
}
