//! Support library of the `fleet-e2e` test crate, whose tests run fleet internals in-process: a worker over a
//! temporary catalogue (`worker`) and a whole fleet in one process (`cluster`). Where the workspace, the fixture
//! plugins and their binaries are, and the fake LLM upstream, are `fleet-e2e-client`'s (re-exported here).

pub use fleet_e2e_client::{
    cargo_build, chromium, echo_plugin_bin, fake_images, fake_llm, fake_oauth, fake_web, fleet_bin,
    hang_report, profile_dir, python_plugin_path, sandbox_stub_bin, workspace_root,
};

/// The host services over `js` with `config`, a fixed link secret and credentials keyring (the services tests).
pub async fn open_services(
    js: &async_nats::jetstream::Context,
    config: &fleet_services::ServicesConfig,
) -> fleet_services::FleetServices {
    Box::pin(fleet_services::FleetServices::open(
        js,
        &fleet_store::StoreSettings::default(),
        config,
        fleet_services::files::LinkSigner::new(b"host-services-test-link-secret-32b"),
        fleet_services::credentials::Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("host services")
}

/// A worker over a temporary catalogue of echo-plugin installs, for the worker tests.
pub mod worker {
    use std::os::unix::fs::PermissionsExt as _;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use fleet_worker::catalogue::{Catalogue, LoadOptions};
    use fleet_worker::config::{IsolationMode, WorkerConfig};
    use fleet_worker::metrics::WorkerMetrics;
    use fleet_worker::pool::Pool;
    use fleet_worker::sandbox::Sandbox;
    use fleet_worker::services::{HostServices, NoServices, NoTokens, TokenSource};
    use fleet_worker::session::WorkerContext;
    use serde_json::json;

    use super::echo_plugin_bin;

    /// One echo-plugin install: its tool id and the plugin's extra flags.
    #[derive(Debug, Clone)]
    pub struct Plugin {
        /// The install's `tool_id`.
        pub tool_id: String,
        /// Flags after the binary.
        pub flags: Vec<String>,
        /// The raw `limits` extension, if any.
        pub limits: Option<serde_json::Value>,
        /// Whether its first describe already happened (no 60 s first-launch describe timeout).
        pub described: bool,
    }

    impl Plugin {
        /// An install of the echo plugin with these flags.
        pub fn echo(tool_id: &str, flags: &[&str]) -> Plugin {
            Plugin {
                tool_id: tool_id.into(),
                flags: flags.iter().map(|s| s.to_string()).collect(),
                limits: None,
                described: true,
            }
        }

        /// With cgroup limit overrides.
        pub fn limits(mut self, limits: serde_json::Value) -> Plugin {
            self.limits = Some(limits);
            self
        }

        /// As a never-described install (first launch: 60 s describe).
        pub fn first_launch(mut self) -> Plugin {
            self.described = false;
            self
        }
    }

    /// A running worker over a temporary catalogue and state directory.
    pub struct TestWorker {
        /// The pool.
        pub pool: Pool,
        /// The counters.
        pub metrics: Arc<WorkerMetrics>,
        /// The config in force.
        pub config: Arc<WorkerConfig>,
        /// The sandbox.
        pub sandbox: Sandbox,
        /// Keeps the directories alive.
        pub root: tempfile::TempDir,
    }

    impl std::fmt::Debug for TestWorker {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("TestWorker")
                .field("root", &self.root.path())
                .finish()
        }
    }

    /// A config for tests: a unique worker id, fast restart/shutdown knobs (each test that checks a schedule
    /// sets its own), cgroup isolation.
    pub fn test_config(name: &str) -> WorkerConfig {
        WorkerConfig {
            worker_id: format!("t-{name}-{}", std::process::id()),
            isolation: IsolationMode::Cgroup,
            restart_backoff: Duration::from_millis(50),
            shutdown_grace: Duration::from_secs(2),
            sandbox_stub: Some(super::sandbox_stub_bin()),
            ..WorkerConfig::default()
        }
    }

    /// The addresses this machine resolves the default package indexes
    /// ([`fleet_worker::config::DEFAULT_INDEX_HOSTS`]) to, each as a range of one: a preparation's
    /// `preparation.allow_cidrs` when it must reach them. The test machines reach PyPI through a mirror on a
    /// documentation range (`203.0.113.0/24`), which the egress proxy refuses unless an operator opens it.
    pub fn index_host_ranges() -> Vec<ipnet::IpNet> {
        use std::net::ToSocketAddrs as _;
        let mut ranges: Vec<ipnet::IpNet> = fleet_worker::config::DEFAULT_INDEX_HOSTS
            .iter()
            .filter_map(|host| (*host, 443).to_socket_addrs().ok())
            .flatten()
            .map(|addr| ipnet::IpNet::from(addr.ip()))
            .collect();
        ranges.sort();
        ranges.dedup();
        ranges
    }

    /// Writes the catalogue for `plugins` under `root/catalogue`.
    pub fn write_catalogue(root: &Path, plugins: &[Plugin]) -> PathBuf {
        let dir = root.join("catalogue");
        std::fs::create_dir_all(&dir).expect("catalogue dir");
        for p in plugins {
            let d = dir.join(&p.tool_id);
            std::fs::create_dir_all(&d).expect("install dir");
            let mut command = vec![echo_plugin_bin().display().to_string()];
            command.extend(p.flags.iter().cloned());
            let mut entry = json!({ "tool_id": p.tool_id, "type": "binary", "command": command });
            if let Some(l) = &p.limits {
                entry["limits"] = l.clone();
            }
            std::fs::write(
                d.join("executa.json"),
                serde_json::to_vec_pretty(&entry).expect("json"),
            )
            .expect("executa.json");
            if p.described {
                std::fs::write(d.join(".fleet-described"), b"").expect("marker");
            }
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        }
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755)).expect("chmod root");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod catalogue");
        dir
    }

    impl TestWorker {
        /// A worker with `config` (catalogue and state dirs filled in) and no host services.
        pub fn start(config: WorkerConfig, plugins: &[Plugin]) -> TestWorker {
            Self::with_services(config, plugins, Arc::new(NoServices), Arc::new(NoTokens))
        }

        /// A worker with the given services and token source.
        pub fn with_services(
            mut config: WorkerConfig,
            plugins: &[Plugin],
            services: Arc<dyn HostServices>,
            tokens: Arc<dyn TokenSource>,
        ) -> TestWorker {
            let root = tempfile::tempdir().expect("tempdir");
            config.catalogue_dir = write_catalogue(root.path(), plugins);
            config.state_dir = root.path().join("state");
            let (catalogue, problems) =
                Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).expect("catalogue loads");
            assert!(problems.is_empty(), "catalogue problems: {problems:?}");
            let sandbox = Sandbox::new(&config).expect("sandbox (cgroups as root)");
            // As a worker does at start (a no-op outside a runtime: the first session starts them then).
            sandbox.start_stubs();
            let metrics = Arc::new(WorkerMetrics::default());
            let config = Arc::new(config);
            let ctx = WorkerContext {
                config: config.clone(),
                sandbox: sandbox.clone(),
                services,
                tokens,
                metrics: metrics.clone(),
            };
            TestWorker {
                pool: Pool::new(ctx, Arc::new(catalogue)),
                metrics,
                config,
                sandbox,
                root,
            }
        }
    }

    impl Drop for TestWorker {
        /// Whatever the test did (or where it panicked), its cgroups and their processes go: the sweep kills
        /// every process in the worker's subtree and removes it.
        fn drop(&mut self) {
            let _ = self.sandbox.remove_subtree();
        }
    }

    /// Failure guard of the helpers below (never a synchronisation).
    pub(crate) const CALL_GUARD: Duration = Duration::from_secs(60);

    /// An invoke of `tool` with `args` (a JSON object) and a fresh `inv-<pid>-<n>` invoke id.
    pub fn req(tool: &str, args: serde_json::Value) -> fleet_worker::session::InvokeRequest {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let arguments = serde_json::from_value(args).expect("arguments must be a JSON object");
        fleet_worker::session::InvokeRequest {
            tool: tool.into(),
            arguments,
            invoke_id: format!(
                "inv-{}-{}",
                std::process::id(),
                N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
            ..fleet_worker::session::InvokeRequest::default()
        }
    }

    /// Runs `r` on (user, tool_id)'s session; an invoke failure is `Err`, any other pool error panics.
    pub async fn call(
        w: &TestWorker,
        user: &str,
        tool_id: &str,
        r: fleet_worker::session::InvokeRequest,
    ) -> Result<fleet_worker::session::InvokeOutput, fleet_worker::session::InvokeError> {
        match tokio::time::timeout(CALL_GUARD, w.pool.invoke(user, tool_id, r))
            .await
            .expect("failure guard")
        {
            Ok(out) => Ok(out),
            Err(fleet_worker::pool::PoolError::Invoke(e)) => Err(e),
            Err(other) => panic!("pool error: {other}"),
        }
    }

    /// `call` of `tool` expecting an answer (successful or not).
    pub async fn output(
        w: &TestWorker,
        user: &str,
        tool_id: &str,
        tool: &str,
        args: serde_json::Value,
    ) -> fleet_worker::session::InvokeOutput {
        call(w, user, tool_id, req(tool, args)).await.expect("invoke")
    }

    /// `call` of `tool` expecting `success: true`; returns its `data`.
    pub async fn data(
        w: &TestWorker,
        user: &str,
        tool_id: &str,
        tool: &str,
        args: serde_json::Value,
    ) -> serde_json::Value {
        let out = output(w, user, tool_id, tool, args).await;
        assert!(out.success(), "{tool} failed: {:?}", out.error_message());
        out.data().expect("data")
    }

    pub use fleet_e2e_client::alive;

    /// Polls `cond` until it holds or `limit` passes (a failure guard, not a synchronisation by time: it returns
    /// as soon as the observable holds).
    pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if cond() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The host services of one process over a real nats-server started under `dir` (as a front opens them: it
/// creates the resources), for the tests that drive `FleetServices::serve` directly. A fixed credentials keyring.
///
/// # Panics
/// If nats-server cannot start or the services cannot open.
pub async fn host_services(
    dir: &std::path::Path,
    config: &fleet_services::ServicesConfig,
    link_secret: &[u8],
) -> (fleet::nats_server::NatsServer, fleet_services::FleetServices) {
    let nats = fleet::nats_server::NatsServer::start(&dir.join("nats"))
        .expect("nats-server (run scripts/test.sh once)");
    let client = nats
        .connect(fleet_client::creds::Role::Front)
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(client);
    let services = Box::pin(fleet_services::FleetServices::open(
        &js,
        &fleet_store::StoreSettings::default(),
        config,
        fleet_services::files::LinkSigner::new(link_secret),
        fleet_services::credentials::Keyring::fixed(&[("k1", [7; 32])]),
    ))
    .await
    .expect("services");
    (nats, services)
}

/// A whole fleet in one test process: a real nats-server, the JetStream store, N front replicas (each with its
/// own NATS connection) and M worker nodes over echo-plugin catalogues, with real JWTs.
pub mod cluster {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use fleet::front::{Front, FrontConfig, FrontService};
    use fleet::metrics::FleetMetrics;
    use fleet::nats_server::NatsServer;
    use fleet::node::WorkerNode;
    use fleet_client::api::api_request;
    use fleet_client::auth::{
        DEFAULT_AUDIENCE, DEFAULT_ISSUER, OPERATOR_AUDIENCE, OperatorVerifier, SigningKey, Verifier,
    };
    pub use fleet_client::creds::Role;
    use fleet_proto::api::{ApiError, ApiResponse, methods, subjects};
    use fleet_store::{Store, StoreSettings};
    use fleet_worker::catalogue::{Catalogue, LoadOptions};
    use fleet_worker::metrics::WorkerMetrics;
    use fleet_worker::pool::Pool;
    use fleet_worker::sandbox::Sandbox;
    use fleet_worker::services::{NoServices, NoTokens};
    use fleet_worker::session::WorkerContext;
    use serde_json::Value;

    use super::hang_report;
    use super::worker::{Plugin, test_config, write_catalogue};

    /// The HS256 secret of test tokens.
    pub const SECRET: &[u8] = b"cloud-agents-test-secret-32-bytes-long!!";
    /// The HS256 secret of test operator tokens (a key of its own, as in production).
    pub const OPERATOR_SECRET: &[u8] = b"cloud-agents-test-OPERATOR-secret-32-bytes!!";

    /// One worker node and what it needs.
    #[derive(Debug)]
    pub struct Worker {
        /// The node (None once killed or shut down).
        pub node: Option<WorkerNode>,
        /// Its sandbox (removed on drop).
        pub sandbox: Sandbox,
        /// Its counters.
        pub metrics: Arc<WorkerMetrics>,
    }

    /// The fleet.
    pub struct Cluster {
        /// The server (auth on, as in production; dropped last).
        pub nats: NatsServer,
        /// A connection as the `front` user, for what tests do on the fleet's side (store, sweeper, services).
        pub client: async_nats::Client,
        /// A connection as the `app` user: the API calls of [`Cluster::call`] go through it.
        pub app: async_nats::Client,
        /// A connection as the `operator` tooling user (admin APIs).
        pub operator: async_nats::Client,
        /// The store (over `client`).
        pub store: Store,
        /// Front replicas.
        pub fronts: Vec<(Front, FrontService)>,
        /// Worker nodes.
        pub workers: Vec<Worker>,
        /// Signs test tokens.
        pub key: SigningKey,
        /// Signs test operator tokens.
        pub operator_key: SigningKey,
        /// The plugins every worker serves.
        pub plugins: Vec<Plugin>,
        /// The metrics every front and worker node of the cluster records into (like `fleet up`).
        pub metrics: Arc<FleetMetrics>,
        /// Keeps directories alive.
        pub root: tempfile::TempDir,
        name: String,
    }

    impl std::fmt::Debug for Cluster {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Cluster")
                .field("url", &self.nats.url())
                .finish_non_exhaustive()
        }
    }

    /// A new NATS connection to `nats` as `role` (the role's `.creds`, as production connects).
    pub async fn connect(nats: &NatsServer, role: Role) -> async_nats::Client {
        nats.connect(role)
            .await
            .unwrap_or_else(|e| panic!("connect to the test nats-server as {role}: {e}"))
    }

    /// Store settings of a worker: it attaches to what the front created.
    pub fn worker_settings() -> StoreSettings {
        StoreSettings {
            provision: fleet_store::Provision::Attach,
            ..StoreSettings::default()
        }
    }

    impl Cluster {
        /// Starts `fronts` front replicas and `workers` worker nodes, each serving `plugins`.
        pub async fn start(name: &str, fronts: usize, workers: usize, plugins: &[Plugin]) -> Cluster {
            Box::pin(Self::start_boxed(name, fronts, workers, plugins)).await
        }

        async fn start_boxed(name: &str, fronts: usize, workers: usize, plugins: &[Plugin]) -> Cluster {
            hang_report::arm();
            hang_report::milestone(format!("cluster {name}: starting"));
            let root = tempfile::tempdir().expect("tempdir");
            let nats =
                NatsServer::start(&root.path().join("nats")).expect("nats-server (run scripts/test.sh once)");
            hang_report::milestone("nats-server ready");
            let client = connect(&nats, Role::Front).await;
            let app = connect(&nats, Role::App).await;
            let operator = connect(&nats, Role::Operator).await;
            let store = Store::open(
                async_nats::jetstream::new(client.clone()),
                StoreSettings::default(),
            )
            .await
            .expect("store");
            // What a production front creates besides the store (`fleet up`): the plugin store and the host
            // services' buckets, which every worker (node or `fleet worker` process) attaches to.
            let js = async_nats::jetstream::new(client.clone());
            fleet::plugins::PluginStore::open(&js, &StoreSettings::default())
                .await
                .expect("plugin store");
            Box::pin(fleet_services::args::ServicesArgs::default().open(
                &js,
                &StoreSettings::default(),
                root.path(),
                None,
            ))
            .await
            .expect("host services");
            let key = SigningKey::hs256(SECRET).expect("key");
            let operator_key = SigningKey::hs256(OPERATOR_SECRET).expect("operator key");
            let mut cluster = Cluster {
                nats,
                client,
                app,
                operator,
                store,
                fronts: Vec::new(),
                workers: Vec::new(),
                key,
                operator_key,
                plugins: plugins.to_vec(),
                metrics: Arc::new(FleetMetrics::new()),
                root,
                name: name.to_string(),
            };
            for _ in 0..fronts {
                cluster.add_front().await;
            }
            for _ in 0..workers {
                cluster.add_worker().await;
            }
            hang_report::milestone("cluster started");
            cluster
        }

        /// Failure guard of the waits for a front's membership watch to see a worker.
        const MEMBERSHIP_GUARD: Duration = Duration::from_secs(60);

        /// Adds a front replica with its own connection.
        pub async fn add_front(&mut self) -> usize {
            self.add_front_with(FrontConfig::default()).await
        }

        /// Adds a front replica with its own connection and these settings.
        pub async fn add_front_with(&mut self, config: FrontConfig) -> usize {
            self.add_front_with_store(config, StoreSettings::default()).await
        }

        /// Adds a front replica whose store has `settings` (same resources: only what the store decides by its
        /// settings differs, e.g. the per-user cap of retained jobs).
        pub async fn add_front_with_store(&mut self, config: FrontConfig, settings: StoreSettings) -> usize {
            let client = connect(&self.nats, Role::Front).await;
            let store = Store::open(async_nats::jetstream::new(client.clone()), settings)
                .await
                .expect("store");
            let verifier = Verifier::new(
                vec![self.key.verify_key().expect("verify key")],
                DEFAULT_ISSUER,
                DEFAULT_AUDIENCE,
            )
            .expect("verifier");
            let seals = Arc::new(self.nats.exec_signer().expect("exec signing key"));
            let front = Front::new(client, store, verifier, config, seals).with_metrics(self.metrics.clone());
            let service = front.serve().await.expect("serve");
            hang_report::milestone("front serving");
            // Started means knowing the running workers (as `add_worker` waits for every front to know it).
            let ids: Vec<String> = self
                .workers
                .iter()
                .filter_map(|w| w.node.as_ref().map(|n| n.id().to_string()))
                .collect();
            let deadline = std::time::Instant::now() + Self::MEMBERSHIP_GUARD;
            loop {
                let live = front.dispatcher().live().await;
                if ids.iter().all(|id| live.iter().any(|w| &w.id == id)) {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "failure guard: a new front did not see the workers {ids:?} within {:?}",
                    Self::MEMBERSHIP_GUARD
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            self.fronts.push((front, service));
            self.fronts.len() - 1
        }

        /// Adds a worker node with its own connection, catalogue and sandbox.
        pub async fn add_worker(&mut self) -> usize {
            let name = format!("{}-w{}", self.name, self.workers.len());
            self.add_worker_with(&name, |_| {}).await
        }

        /// Adds a worker node whose configuration `tweak` adjusts (the test defaults otherwise).
        pub async fn add_worker_with(
            &mut self,
            name: &str,
            tweak: impl FnOnce(&mut fleet_worker::config::WorkerConfig),
        ) -> usize {
            let i = self.workers.len();
            let dir = self.root.path().join(format!("w{i}-{name}"));
            std::fs::create_dir_all(&dir).expect("worker dir");
            let mut config = test_config(name);
            config.catalogue_dir = write_catalogue(&dir, &self.plugins);
            config.state_dir = dir.join("state");
            tweak(&mut config);
            let (catalogue, problems) =
                Catalogue::load(&config.catalogue_dir, &LoadOptions::from_env()).expect("catalogue");
            assert!(problems.is_empty(), "{problems:?}");
            let sandbox = Sandbox::new(&config).expect("sandbox");
            sandbox.start_stubs();
            hang_report::milestone(format!(
                "worker {name}: sandbox ready (cgroups and the confinement probe)"
            ));
            let metrics = Arc::new(WorkerMetrics::default());
            let ctx = WorkerContext {
                config: Arc::new(config.clone()),
                sandbox: sandbox.clone(),
                services: Arc::new(NoServices),
                tokens: Arc::new(NoTokens),
                metrics: metrics.clone(),
            };
            let client = connect(&self.nats, Role::Worker).await;
            let store = Store::open(async_nats::jetstream::new(client.clone()), worker_settings())
                .await
                .expect("store");
            let node = WorkerNode::start(
                client,
                store,
                Pool::new(ctx, Arc::new(catalogue)),
                &config.worker_id,
                self.metrics.clone(),
                Arc::new(self.nats.exec_verifier().expect("exec verifying key")),
                fleet::node::direct_replies_allowed(Some(&self.nats.creds(Role::Worker))),
            )
            .await
            .expect("worker node");
            let id = node.id().to_string();
            hang_report::milestone(format!("worker {id} started"));
            self.workers.push(Worker {
                node: Some(node),
                sandbox,
                metrics,
            });
            // Started means known: every front's membership watch has seen the new worker (a test that expects a
            // call on a given worker must not race the watch).
            for (front, _) in &self.fronts {
                let deadline = std::time::Instant::now() + Self::MEMBERSHIP_GUARD;
                while !front.dispatcher().live().await.iter().any(|w| w.id == id) {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "failure guard: a front did not see worker {id} within {:?}",
                        Self::MEMBERSHIP_GUARD
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            hang_report::milestone(format!("worker {id} known to every front"));
            i
        }

        /// A connection as a FLEET user allowed everything, for fault injection that no fleet role may do (deleting
        /// a stream): what an operator's break-glass credential would do.
        pub async fn break_glass(&self) -> async_nats::Client {
            let user = self
                .nats
                .auth()
                .issue_fleet_user("break-glass", &fleet::nats_auth::Permissions::all())
                .expect("break-glass user");
            async_nats::ConnectOptions::with_credentials(&user.creds)
                .expect("creds")
                .custom_inbox_prefix(fleet_client::creds::inbox_prefix("break-glass"))
                .connect(self.nats.url())
                .await
                .expect("break-glass connection")
        }

        /// The verifier the admin APIs of the cluster use.
        pub fn operator_verifier(&self) -> OperatorVerifier {
            OperatorVerifier::new(
                vec![self.operator_key.verify_key().expect("operator verify key")],
                DEFAULT_ISSUER,
            )
            .expect("operator verifier")
        }

        /// The HTTP gateway's state over the first front: API tokens of the cluster's key, operator tokens of its
        /// operator key, the front's metrics.
        pub async fn http_state(&self, config: fleet::http::HttpConfig) -> fleet::http::HttpState {
            let front = self.fronts[0].0.clone();
            let verifier = Verifier::new(
                vec![self.key.verify_key().expect("verify key")],
                DEFAULT_ISSUER,
                DEFAULT_AUDIENCE,
            )
            .expect("verifier");
            fleet::http::HttpState::start(
                front.clone(),
                self.client.clone(),
                verifier,
                self.operator_verifier(),
                front.metrics().clone(),
                config,
            )
            .await
            .expect("gateway state")
        }

        /// A valid operator token.
        pub fn operator_token(&self) -> String {
            self.operator_key
                .mint(
                    "ops",
                    DEFAULT_ISSUER,
                    OPERATOR_AUDIENCE,
                    Duration::from_secs(600),
                    false,
                )
                .expect("mint operator token")
        }

        /// A valid token for `user`.
        pub fn token(&self, user: &str) -> String {
            self.key
                .mint(
                    user,
                    DEFAULT_ISSUER,
                    DEFAULT_AUDIENCE,
                    Duration::from_secs(600),
                    false,
                )
                .expect("mint")
        }

        /// Waits (at most `guard`) until every API method answers: `Front::serve` returns before the server has
        /// seen the endpoints' subscriptions, so a request sent at once may find no responders.
        pub async fn wait_for_api(&self, guard: Duration) {
            let deadline = Instant::now() + guard;
            for method in methods::ALL {
                loop {
                    let request = async_nats::Request::new()
                        .payload("{}".into())
                        .timeout(Some(guard));
                    match self.app.send_request(subjects::api(method), request).await {
                        Ok(_) => break,
                        Err(e) => assert!(Instant::now() < deadline, "{method} never answered: {e}"),
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }

        /// Waits until `tools.list` shows every one of `tool_ids`: a worker records each manifest after describing
        /// the plugin at start-up, so a listing right after the start may not show it yet. Bounded by `guard`.
        pub async fn wait_listed(&self, tool_ids: &[&str], guard: Duration) {
            let deadline = Instant::now() + guard;
            loop {
                let listed = self.ok("alice", "tools.list", serde_json::json!({})).await;
                let all = tool_ids.iter().all(|id| {
                    listed["tools"]
                        .as_array()
                        .is_some_and(|t| t.iter().any(|t| t["tool_id"] == *id))
                });
                if all {
                    return;
                }
                assert!(Instant::now() < deadline, "failure guard: {listed}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        /// Calls an API method as `user` and returns the response envelope.
        pub async fn call(&self, user: &str, method: &str, args: Value) -> ApiResponse<Value> {
            self.call_with_token(&format!("Bearer {}", self.token(user)), method, args)
                .await
        }

        /// Calls an API method with an explicit `Authorization` header value.
        pub async fn call_with_token(&self, auth: &str, method: &str, args: Value) -> ApiResponse<Value> {
            let request = api_request(auth, &args, Duration::from_secs(120));
            let reply = self
                .app
                .send_request(subjects::api(method), request)
                .await
                .expect("API reply");
            serde_json::from_slice(&reply.payload).expect("ApiResponse")
        }

        /// `call` expecting success.
        pub async fn ok(&self, user: &str, method: &str, args: Value) -> Value {
            match self.call(user, method, args).await {
                ApiResponse::Ok(v) => v,
                ApiResponse::Err(e) => panic!("{method} failed: {e}"),
            }
        }

        /// `call` expecting an error.
        pub async fn err(&self, user: &str, method: &str, args: Value) -> ApiError {
            match self.call(user, method, args).await {
                ApiResponse::Ok(v) => panic!("{method} unexpectedly succeeded: {v}"),
                ApiResponse::Err(e) => e,
            }
        }

        /// Starts a worker as a separate `fleet worker --nats-url …` process (so a test can `kill -9` it),
        /// serving the cluster's plugins; returns once it is registered.
        pub async fn spawn_worker_process(&self, id: &str) -> std::process::Child {
            use std::io::BufRead as _;
            let dir = self.root.path().join(format!("proc-{id}"));
            std::fs::create_dir_all(&dir).expect("dir");
            let catalogue = write_catalogue(&dir, &self.plugins);
            let mut child = std::process::Command::new(super::fleet_bin())
                .args(["worker", "--nats-url", &self.nats.url(), "--worker-id", id])
                .arg("--nats-creds")
                .arg(self.nats.creds(Role::Worker))
                .arg("--catalogue")
                .arg(&catalogue)
                .arg("--state-dir")
                .arg(dir.join("state"))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("fleet worker");
            let stdout = child.stdout.take().expect("stdout");
            let reader = tokio::task::spawn_blocking(move || {
                let mut lines = std::io::BufReader::new(stdout).lines();
                let _swept = lines.next();
                let ready = lines.next();
                std::thread::spawn(move || for _ in lines {});
                ready
            });
            // Bounded: a worker that never prints its ready line is killed (which ends the reader) and named.
            let lines = match tokio::time::timeout(super::worker::CALL_GUARD, reader).await {
                Ok(lines) => lines.expect("reader"),
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "fleet worker {id} printed no ready line within {:?}",
                        super::worker::CALL_GUARD
                    );
                }
            };
            assert!(lines.is_some(), "fleet worker did not start");
            child
        }

        /// Shuts everything down.
        pub async fn shutdown(mut self) {
            hang_report::milestone("shutdown: stopping the fronts");
            for (_, service) in self.fronts.drain(..) {
                service.stop().await;
            }
            hang_report::milestone("shutdown: draining the workers");
            // Teardown: no grace (a test that checks draining calls `WorkerNode::drain` itself).
            for w in &mut self.workers {
                if let Some(node) = w.node.take() {
                    node.drain(Duration::ZERO).await;
                }
            }
            hang_report::milestone("shutdown: done");
        }
    }

    impl Drop for Cluster {
        fn drop(&mut self) {
            hang_report::milestone("cluster dropped: removing the sandboxes");
            for w in &self.workers {
                let _ = w.sandbox.remove_subtree();
            }
            hang_report::milestone("cluster dropped: sandboxes removed");
        }
    }
}
