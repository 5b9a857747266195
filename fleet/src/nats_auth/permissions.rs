//! Least privilege per role: which subjects each of the fleet's NATS users may publish and subscribe to, and
//! which JetStream resources it may create, write or only read. This table is the only place they are decided;
//! the permission table of `docs/operations.md` is generated from it (see `tests/nats_trust.rs`, which also
//! tries every refusal against a real server).
//!
//! JetStream access is granted per stream through the subjects of JetStream's API (`$JS.API.STREAM.INFO.<S>`,
//! `$JS.API.CONSUMER.CREATE.<S>.>`, …) and of the data (`$KV.<bucket>.>`, `$O.<bucket>.>`). NATS cannot narrow
//! it further, to keys of one user: a worker serves every user, so it may read and write every user's job
//! records, progress and host-service data. ARCHITECTURE.md ("NATS trust boundary") says how that gap is closed.

use fleet_client::creds::{Role, inbox_prefix};

use super::{API_SUBJECTS, EVENT_SUBJECTS, Permissions};

/// The default prefix of every bucket, stream and subject of the job layer (`StoreSettings::prefix`).
pub const DEFAULT_PREFIX: &str = "fleet";

/// The fronts' delegated tool-call subjects (`fleet.v1.delegate.<front id>.<method>`).
pub const DELEGATED_SUBJECTS: &str = fleet_proto::api::delegation::ALL;
/// Every worker's exec subjects (`fleet.v1.worker.<id>.exec`).
pub const WORKER_EXEC: &str = "fleet.v1.worker.*.exec";
/// Every worker's cancel subjects (`fleet.v1.worker.<id>.cancel`).
pub const WORKER_CANCEL: &str = "fleet.v1.worker.*.cancel";
/// Every worker's job-holding subjects (`fleet.v1.worker.<id>.jobs`): a sweeper's "do you still run these?".
pub const WORKER_JOBS: &str = "fleet.v1.worker.*.jobs";
/// Where terminal job records are announced to the fronts (`fleet_proto::api::subjects::JOBS_FINISHED`).
pub const JOBS_FINISHED: &str = fleet_proto::api::subjects::JOBS_FINISHED;
/// Every subject of the worker plane.
pub const WORKER_SUBJECTS: &str = "fleet.v1.worker.>";
/// Every subject of the operator APIs.
pub const ADMIN_SUBJECTS: &str = "fleet.v1.admin.>";
/// The Animus cancel subjects a worker listens on (`matrix.cancel.<id>`).
pub const MATRIX_CANCEL: &str = "matrix.cancel.*";
/// The service-discovery subjects of NATS services (`$SRV.PING`, `$SRV.INFO.<name>`, …).
pub const SERVICE_DISCOVERY: &str = "$SRV.>";

/// Every reply subject a requester of the fleet's account can give: the inboxes of its users (`_INBOX.<user>.…`)
/// and the subjects NATS maps the reply of an imported request to (`_R_.…`: an app's API request seen from the
/// FLEET account). A front answers on them explicitly, not only through the response permission NATS grants per
/// delivered request, because that grant lives on the server that delivered the request: a front whose
/// connection fails over to another server of the cluster could not answer the requests it took before.
pub const ANY_REPLY: [&str; 2] = ["_INBOX.>", IMPORTED_REPLIES];

/// The subjects NATS maps the replies of imported requests to (`fleet_proto::api::subjects::IMPORTED_REPLY_PREFIX`).
pub const IMPORTED_REPLIES: &str = "_R_.>";

/// What a role may do with one JetStream resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Read: stream info, direct and message gets, consumers (watches, scans).
    Read,
    /// Read, and put, delete and purge its data.
    Write,
    /// Write, and create and update the resource itself (the front provisions every resource).
    Admin,
}

impl Access {
    /// `"read"`, `"write"` or `"create + write"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::Admin => "create + write",
        }
    }
}

/// The kind of a JetStream resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A KV bucket (stream `KV_<bucket>`, data `$KV.<bucket>.>`).
    Kv,
    /// An object store (stream `OBJ_<bucket>`, data `$O.<bucket>.>`).
    Objects,
    /// A plain stream of the job layer (stream `<prefix>_<name>`, data `<prefix>.v1.<name>.>`): progress rings,
    /// the job queue.
    Stream,
}

/// One JetStream resource of the fleet: its kind and its name without the prefix (`jobs` → `fleet_jobs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    /// KV, objects or the progress stream.
    pub kind: Kind,
    /// The name after `<prefix>_`.
    pub name: &'static str,
}

const fn kv(name: &'static str) -> Resource {
    Resource { kind: Kind::Kv, name }
}

const fn objects(name: &'static str) -> Resource {
    Resource {
        kind: Kind::Objects,
        name,
    }
}

/// The data subjects of the job layer's plain streams under any prefix (the front provisions every prefix).
const STREAM_DATA: [&str; 2] = ["*.v1.progress.>", "*.v1.job_queue.>"];

/// Job records (`<user_key>.<job_id>`).
pub const JOBS: Resource = kv("jobs");
/// Per-user active job sets.
pub const ACTIVE: Resource = kv("active");
/// The worker registry.
pub const WORKERS: Resource = kv("workers");
/// Manifests of described tools.
pub const MANIFESTS: Resource = kv("manifests");
/// The per-user job index of `listJobs` (written by fronts at job creation).
pub const JOB_INDEX: Resource = kv("job_index");
/// Job progress rings.
pub const PROGRESS: Resource = Resource {
    kind: Kind::Stream,
    name: "progress",
};
/// Jobs waiting for a worker with room (work queue).
pub const JOB_QUEUE: Resource = Resource {
    kind: Kind::Stream,
    name: "job_queue",
};
/// Grants of host capabilities (written by the operator API only).
pub const GRANTS: Resource = kv("grants");
/// Plugin records (written by the operator API only).
pub const PLUGINS: Resource = kv("plugins");
/// Plugin packages (uploaded by operator tooling, read by workers).
pub const PLUGIN_PACKAGES: Resource = objects("plugin_packages");
/// Issued app credentials and revocations (the front's operator API only).
pub const APP_CREDS: Resource = kv("app_creds");
/// Per-user credentials, sealed (written by the operator API only; workers read them at each invoke).
pub const CREDENTIALS: Resource = kv("credentials");
/// Users' connected OAuth accounts, sealed (written by fronts at the connect flow and by the user's account
/// edits, and by workers when a refresh rotates a token or marks an account for re-authorization).
pub const OAUTH_ACCOUNTS: Resource = kv("oauth_accounts");
/// OAuth connect flows in progress (fronts only: started and finished on the HTTP listener).
pub const OAUTH_STATE: Resource = kv("oauth_state");
/// APS storage KV.
pub const APS_KV: Resource = kv("aps_kv");
/// APS bytes per user.
pub const APS_USAGE: Resource = kv("aps_usage");
/// Daily usage per user and metered family (`image/*` images, `web/*` compute units).
pub const USAGE: Resource = kv("usage");
/// Agent sessions, their run leases and the per-user session indexes (`agent/session.*`).
pub const AGENT_SESSIONS: Resource = kv("agent_sessions");
/// The delegations of jobs (written by fronts only: a worker that could write one could act as any user).
pub const DELEGATIONS: Resource = kv("delegations");
/// APS file index.
pub const APS_FILES: Resource = kv("aps_files");
/// APS files begun, not completed.
pub const APS_PENDING: Resource = kv("aps_pending");
/// APS file contents.
pub const APS_OBJECTS: Resource = objects("aps_objects");
/// APS uploads in progress.
pub const APS_STAGING: Resource = objects("aps_staging");
/// `host/uploadFile` objects.
pub const UPLOADS: Resource = objects("uploads");

/// Every JetStream resource of the fleet.
pub const RESOURCES: [Resource; 24] = [
    JOBS,
    ACTIVE,
    WORKERS,
    MANIFESTS,
    JOB_INDEX,
    PROGRESS,
    JOB_QUEUE,
    GRANTS,
    PLUGINS,
    PLUGIN_PACKAGES,
    APP_CREDS,
    CREDENTIALS,
    APS_KV,
    APS_USAGE,
    APS_FILES,
    APS_PENDING,
    APS_OBJECTS,
    APS_STAGING,
    UPLOADS,
    USAGE,
    AGENT_SESSIONS,
    DELEGATIONS,
    OAUTH_ACCOUNTS,
    OAUTH_STATE,
];

impl Resource {
    /// The bucket (or stream) name: `<prefix>_<name>`.
    pub fn bucket(&self, prefix: &str) -> String {
        format!("{prefix}_{}", self.name)
    }

    /// The JetStream stream behind it: `KV_<bucket>`, `OBJ_<bucket>` or `<prefix>_progress`.
    pub fn stream(&self, prefix: &str) -> String {
        match self.kind {
            Kind::Kv => format!("KV_{}", self.bucket(prefix)),
            Kind::Objects => format!("OBJ_{}", self.bucket(prefix)),
            Kind::Stream => self.bucket(prefix),
        }
    }

    /// The subjects its data is written on.
    pub fn data_subject(&self, prefix: &str) -> String {
        match self.kind {
            Kind::Kv => format!("$KV.{}.>", self.bucket(prefix)),
            Kind::Objects => format!("$O.{}.>", self.bucket(prefix)),
            Kind::Stream => format!("{prefix}.v1.{}.>", self.name),
        }
    }

    /// The subjects `access` to it needs to publish to.
    pub fn publish_subjects(&self, prefix: &str, access: Access) -> Vec<String> {
        let s = self.stream(prefix);
        let mut out = vec![
            format!("$JS.API.STREAM.INFO.{s}"),
            format!("$JS.API.STREAM.MSG.GET.{s}"),
            format!("$JS.API.DIRECT.GET.{s}"),
            format!("$JS.API.DIRECT.GET.{s}.>"),
            format!("$JS.API.CONSUMER.CREATE.{s}"),
            format!("$JS.API.CONSUMER.CREATE.{s}.>"),
            format!("$JS.API.CONSUMER.INFO.{s}.>"),
            format!("$JS.API.CONSUMER.DELETE.{s}.>"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{s}.>"),
            format!("$JS.ACK.{s}.>"),
            format!("$JS.FC.{s}.>"),
        ];
        if access >= Access::Write {
            out.push(self.data_subject(prefix));
            out.push(format!("$JS.API.STREAM.PURGE.{s}"));
            out.push(format!("$JS.API.STREAM.MSG.DELETE.{s}"));
        }
        if access == Access::Admin {
            out.push(format!("$JS.API.STREAM.CREATE.{s}"));
            out.push(format!("$JS.API.STREAM.UPDATE.{s}"));
        }
        out
    }
}

/// The JetStream resources a role may use, and how.
pub fn jetstream_access(role: Role) -> Vec<(Resource, Access)> {
    match role {
        Role::Front => RESOURCES.iter().map(|r| (*r, Access::Admin)).collect(),
        Role::Worker => {
            // The job index with the jobs and the active sets: a job's terminal write, a worker's too, settles
            // its user's storage account in the index head (a worker could already write any job record).
            let mut out: Vec<(Resource, Access)> = [
                JOBS,
                ACTIVE,
                JOB_INDEX,
                WORKERS,
                MANIFESTS,
                PROGRESS,
                JOB_QUEUE,
                APS_KV,
                APS_USAGE,
                APS_FILES,
                APS_PENDING,
                APS_OBJECTS,
                APS_STAGING,
                UPLOADS,
                USAGE,
                AGENT_SESSIONS,
                OAUTH_ACCOUNTS,
            ]
            .iter()
            .map(|r| (*r, Access::Write))
            .collect();
            out.extend(
                [GRANTS, PLUGINS, PLUGIN_PACKAGES, CREDENTIALS]
                    .iter()
                    .map(|r| (*r, Access::Read)),
            );
            out
        }
        Role::Operator => vec![
            (PLUGIN_PACKAGES, Access::Write),
            (PLUGINS, Access::Read),
            (WORKERS, Access::Read),
        ],
        Role::App | Role::Sys => Vec::new(),
    }
}

fn inbox(name: &str) -> String {
    format!("{}.>", inbox_prefix(name))
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// The permissions of one of the fleet's own users, for a job layer under `prefix`.
pub fn for_role(role: Role, prefix: &str) -> Permissions {
    let name = role.as_str();
    let mut publish_allow = Vec::new();
    let mut publish_deny = Vec::new();
    let mut subscribe_allow = vec![inbox(name)];
    let mut subscribe_deny = Vec::new();
    let mut allow_responses = false;
    let js = jetstream_access(role);
    if !js.is_empty() {
        publish_allow.push("$JS.API.INFO".to_owned());
    }
    if role == Role::Front {
        // The provisioner: every stream of the FLEET account, whatever its prefix (only the fleet's own live
        // there); deleting one stays denied.
        publish_allow.extend(strings(&["$JS.API.>", "$KV.>", "$O.>", "$JS.ACK.>", "$JS.FC.>"]));
        publish_allow.extend(STREAM_DATA.iter().map(|s| (*s).to_owned()));
    } else {
        for (resource, access) in &js {
            publish_allow.extend(resource.publish_subjects(prefix, *access));
        }
    }
    match role {
        Role::Front => {
            publish_allow.extend(strings(&[
                WORKER_EXEC,
                WORKER_CANCEL,
                WORKER_JOBS,
                EVENT_SUBJECTS,
                JOBS_FINISHED,
            ]));
            // Its own inbox is among them. A front is trusted with every stream already; answering any
            // requester adds no reach.
            publish_allow.extend(strings(&ANY_REPLY));
            subscribe_allow.extend(strings(&[
                API_SUBJECTS,
                DELEGATED_SUBJECTS,
                ADMIN_SUBJECTS,
                EVENT_SUBJECTS,
                JOBS_FINISHED,
                SERVICE_DISCOVERY,
            ]));
            allow_responses = true;
        }
        Role::Worker => {
            publish_allow.push(EVENT_SUBJECTS.to_owned());
            // The terminal records of the jobs it runs. It adds no reach: a worker writes job records already.
            publish_allow.push(JOBS_FINISHED.to_owned());
            publish_allow.push(inbox(name));
            // The fronts' inboxes, where it answers exec requests, also after its connection failed over to
            // another server (see [`ANY_REPLY`]). It adds no reach: the worker credential already receives every
            // exec request (one credential serves every worker), and the fronts' other reply subjects (their
            // JetStream API answers) are random per request and never seen by a worker.
            publish_allow.push(inbox(Role::Front.as_str()));
            // The reply subjects of apps' imported requests: a worker publishes the answer of a sync call there
            // itself, on the one subject the front named in the sealed request (`ExecRequest::reply_to`). It
            // never subscribes there, so it learns no other app's reply subject (they are random per request).
            publish_allow.push(IMPORTED_REPLIES.to_owned());
            // The agent sessions' tool calls, with the delegation a front sealed into the invoke: the front
            // answers them only as the user and within the invoke that delegation names (`crate::delegation`).
            publish_allow.push(DELEGATED_SUBJECTS.to_owned());
            subscribe_allow.extend(strings(&[WORKER_EXEC, WORKER_CANCEL, WORKER_JOBS, MATRIX_CANCEL]));
            // Spelled out although outside the allow list: a worker never acts as a front or an operator.
            publish_deny.extend(strings(&[ADMIN_SUBJECTS, WORKER_SUBJECTS, API_SUBJECTS]));
            publish_deny.extend(
                [
                    GRANTS,
                    PLUGINS,
                    PLUGIN_PACKAGES,
                    APP_CREDS,
                    CREDENTIALS,
                    DELEGATIONS,
                    OAUTH_STATE,
                ]
                .map(|r| r.data_subject(prefix)),
            );
            publish_deny.push("$JS.API.STREAM.CREATE.>".to_owned());
            publish_deny.push("$JS.API.STREAM.UPDATE.>".to_owned());
            publish_deny.push("$JS.API.STREAM.DELETE.>".to_owned());
            subscribe_deny.extend(strings(&[API_SUBJECTS, ADMIN_SUBJECTS]));
            allow_responses = true;
        }
        Role::Operator => {
            publish_allow.push(ADMIN_SUBJECTS.to_owned());
            // Service discovery (`$SRV.PING`, `$SRV.INFO.cloud-agents`, …): what `nats micro` asks.
            publish_allow.push(SERVICE_DISCOVERY.to_owned());
            publish_allow.push(inbox(name));
            publish_deny.push(WORKER_SUBJECTS.to_owned());
        }
        Role::App => return app_user(name),
        Role::Sys => {
            publish_allow.extend(strings(&[
                "$SYS.REQ.CLAIMS.UPDATE",
                "$SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE",
            ]));
            publish_allow.push(inbox(name));
        }
    }
    publish_deny.push("$JS.API.STREAM.DELETE.>".to_owned());
    if role == Role::Front {
        publish_deny.push("$JS.API.ACCOUNT.>".to_owned());
    }
    publish_deny.dedup();
    subscribe_deny.dedup();
    Permissions {
        publish_allow,
        publish_deny,
        subscribe_allow,
        subscribe_deny,
        allow_responses,
    }
}

/// The permissions of an app user named `name` (the `app` role and every issued credential): request the API,
/// receive its own replies, hear the events; nothing of JetStream, the worker plane, the operator APIs or `$SYS`.
pub fn app_user(name: &str) -> Permissions {
    Permissions {
        publish_allow: vec![API_SUBJECTS.to_owned(), inbox(name)],
        publish_deny: strings(&[
            "$JS.>",
            "$KV.>",
            "$O.>",
            "$SYS.>",
            WORKER_SUBJECTS,
            ADMIN_SUBJECTS,
        ]),
        subscribe_allow: vec![inbox(name), EVENT_SUBJECTS.to_owned()],
        subscribe_deny: strings(&[
            "$JS.>",
            "$KV.>",
            "$O.>",
            "$SYS.>",
            WORKER_SUBJECTS,
            ADMIN_SUBJECTS,
        ]),
        allow_responses: false,
    }
}

/// The default table: [`for_role`] under [`DEFAULT_PREFIX`].
pub fn default_for_role(role: Role) -> Permissions {
    for_role(role, DEFAULT_PREFIX)
}

/// The permission table of `docs/operations.md`: per role, the core subjects it may publish and subscribe to
/// (JetStream API and data subjects summarised per resource) and its JetStream access. `tests/nats_trust.rs`
/// keeps the document equal to it.
pub fn markdown_table(prefix: &str) -> String {
    let js_subject = |s: &str| s.starts_with("$JS.") || s.starts_with("$KV.") || s.starts_with("$O.");
    let stream_data: Vec<String> = STREAM_DATA.iter().map(|s| (*s).to_owned()).collect();
    let own_stream_data: Vec<String> = RESOURCES
        .iter()
        .filter(|r| r.kind == Kind::Stream)
        .map(|r| r.data_subject(prefix))
        .collect();
    let list = |items: &[String]| {
        let shown: Vec<String> = items
            .iter()
            .filter(|s| !js_subject(s) && !stream_data.contains(s) && !own_stream_data.contains(s))
            .map(|s| format!("`{s}`"))
            .collect();
        if shown.is_empty() {
            "—".to_owned()
        } else {
            shown.join(", ")
        }
    };
    let mut out = String::from(
        "| role | account | publish | subscribe | replies | JetStream |\n|---|---|---|---|---|---|\n",
    );
    for role in Role::ALL {
        let p = for_role(role, prefix);
        let account = match role {
            Role::Front | Role::Worker | Role::Operator => "FLEET",
            Role::App => "APP",
            Role::Sys => "SYS",
        };
        let mut publish = list(&p.publish_allow);
        if !p.publish_deny.is_empty() {
            let denied: Vec<String> = p.publish_deny.iter().map(|s| format!("`{s}`")).collect();
            publish.push_str(&format!("; denied: {}", denied.join(", ")));
        }
        let js = jetstream_access(role);
        let js = if role == Role::Front {
            "create + write: every stream of the FLEET account (`$JS.API.>`, `$KV.>`, `$O.>`, progress subjects); \
             `$JS.API.ACCOUNT.>` denied"
                .to_owned()
        } else if role == Role::App {
            "none (account without JetStream); `$JS.>`, `$KV.>`, `$O.>` denied".to_owned()
        } else if js.is_empty() {
            "none".to_owned()
        } else {
            let mut by_access: Vec<(Access, Vec<String>)> = Vec::new();
            for access in [Access::Admin, Access::Write, Access::Read] {
                let names: Vec<String> = js
                    .iter()
                    .filter(|(_, a)| *a == access)
                    .map(|(r, _)| format!("`{}`", r.bucket(prefix)))
                    .collect();
                if !names.is_empty() {
                    by_access.push((access, names));
                }
            }
            by_access
                .iter()
                .map(|(a, names)| format!("{}: {}", a.as_str(), names.join(", ")))
                .collect::<Vec<_>>()
                .join("; ")
        };
        out.push_str(&format!(
            "| `{}` | {account} | {publish} | {} | {} | {js} |\n",
            role.as_str(),
            list(&p.subscribe_allow),
            if p.allow_responses { "yes" } else { "no" },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use async_nats::jetstream::{kv, object_store, stream};
    use fleet_store::StoreSettings;

    use super::*;

    /// The two tables of the fleet's JetStream resources cannot drift: every resource of [`RESOURCES`] is
    /// configured in `fleet_store::settings` under the same kind and name (and a stream on the same subjects),
    /// and nothing is configured there that this table does not grant.
    #[test]
    fn every_resource_is_configured_in_the_store_settings_under_its_name() {
        let kv = |c: kv::Config| (Kind::Kv, c.bucket, None);
        let objects = |c: object_store::Config| (Kind::Objects, c.bucket, None);
        let stream = |c: stream::Config| (Kind::Stream, c.name, Some(c.subjects));
        for prefix in [DEFAULT_PREFIX, "other-prefix_2"] {
            let s = StoreSettings {
                prefix: prefix.to_owned(),
                ..StoreSettings::default()
            };
            let configured = [
                (JOBS, kv(s.jobs_kv_config())),
                (ACTIVE, kv(s.active_kv_config())),
                (WORKERS, kv(s.workers_kv_config())),
                (MANIFESTS, kv(s.manifests_kv_config())),
                (JOB_INDEX, kv(s.job_index_kv_config())),
                (PROGRESS, stream(s.progress_stream_config())),
                (JOB_QUEUE, stream(s.job_queue_stream_config())),
                (GRANTS, kv(s.grants_kv_config())),
                (PLUGINS, kv(s.plugins_kv_config())),
                (PLUGIN_PACKAGES, objects(s.plugin_packages_config())),
                (APP_CREDS, kv(s.app_creds_kv_config())),
                (CREDENTIALS, kv(s.credentials_kv_config())),
                (APS_KV, kv(s.aps_kv_config(1024))),
                (APS_USAGE, kv(s.aps_usage_kv_config())),
                (APS_FILES, kv(s.aps_files_kv_config(1024))),
                (APS_PENDING, kv(s.aps_pending_kv_config(1024))),
                (APS_OBJECTS, objects(s.aps_objects_config())),
                (APS_STAGING, objects(s.aps_staging_config())),
                (UPLOADS, objects(s.uploads_config())),
                (USAGE, kv(s.usage_kv_config())),
                (AGENT_SESSIONS, kv(s.agent_sessions_kv_config())),
                (DELEGATIONS, kv(s.delegations_kv_config())),
                (OAUTH_ACCOUNTS, kv(s.oauth_accounts_kv_config())),
                (OAUTH_STATE, kv(s.oauth_state_kv_config())),
            ];
            assert_eq!(configured.len(), RESOURCES.len(), "one config per resource");
            for resource in RESOURCES {
                let mut matching = configured.iter().filter(|(r, _)| *r == resource);
                let Some((_, (kind, name, subjects))) = matching.next() else {
                    panic!("{resource:?} has no config in fleet_store::settings");
                };
                assert!(matching.next().is_none(), "{resource:?} is listed twice");
                assert_eq!(*kind, resource.kind, "{resource:?}: kind");
                assert_eq!(*name, resource.bucket(prefix), "{resource:?}: name");
                if let Some(subjects) = subjects {
                    assert_eq!(
                        *subjects,
                        vec![resource.data_subject(prefix)],
                        "{resource:?}: subjects"
                    );
                }
            }
        }
    }
}
