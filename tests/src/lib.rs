//! Harness for end-to-end tests and benchmarks: starts real Sluice service
//! instances in this process on 127.0.0.1:0 against the real broker and
//! PostgreSQL, each test with its own topic prefix, schema prefix and consumer
//! groups, so tests run in parallel and rerun without cleanup.

pub mod pki;
pub mod tokens;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message;
use rand::Rng;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_common::kafka::client_config;
use sluice_common::{Faults, Shutdown, SluiceConfig};
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::limits_client::LimitsClient;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

static LOGGING: Once = Once::new();

/// Logs for tests: `RUST_LOG` or warnings only.
pub fn init_logging() {
    LOGGING.call_once(|| {
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_string());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    });
}

/// A unique prefix, valid for topics, consumer groups and schemas.
pub fn unique_prefix(name: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(16)
        .collect::<String>()
        .to_ascii_lowercase();
    let random: u32 = rand::rng().random();
    format!("it_{clean}_{}_{random:08x}_", COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// Settings every test shares: small partition counts, short timers.
const TEST_SETTINGS: &[(&str, &str)] = &[
    ("postgres.max_connections", "8"),
    ("kafka.partitions.requested", "2"),
    ("kafka.partitions.admitted", "2"),
    ("kafka.partitions.limit_commands", "4"),
    ("kafka.partitions.rate_commands", "2"),
    ("kafka.partitions.jobs", "2"),
    ("kafka.partitions.refresh_due", "2"),
    ("kafka.partitions.refresh_tasks", "1"),
    ("kafka.session_timeout_ms", "6000"),
    // Idle consumers spin inside tansu at small fetch waits; many tests
    // run at once, so trade a little latency for CPU.
    ("kafka.fetch_wait_max_ms", "25"),
    ("admission.sweep_interval", "200ms"),
    ("admission.resend_waiting_after", "5s"),
    ("admission.claim_timeout", "10s"),
    ("admission.stand_behind_interval", "1s"),
    ("limit_grant.ticket_grace", "3s"),
    // Tests of authentication turn it on with their own keys.
    ("auth.enabled", "false"),
];

/// A service binary of this build (`sluice-<service>`, beside the test
/// binaries' `deps` directory) run as a process of its own with the test
/// settings, the test's prefixes and `overrides` as `SLUICE__` variables,
/// listening on `port`: killing it with SIGKILL leaves its consumer group
/// member behind as a real crash does (an instance inside the test process
/// leaves the group when it stops). The binaries come from `make build`
/// (or `cargo build --workspace --bins`), which `make test` runs first.
pub struct ServiceProcess {
    child: std::process::Child,
    pub endpoint: String,
}

impl ServiceProcess {
    pub fn start(service: &str, prefix: &str, overrides: &[(&str, &str)], port: u16) -> anyhow::Result<Self> {
        let deps = std::env::current_exe()?;
        let binary = deps
            .parent()
            .and_then(std::path::Path::parent)
            .context("no target directory above the test binary")?
            .join(format!("sluice-{service}"));
        anyhow::ensure!(
            binary.exists(),
            "{} is not built: run `make build` (cargo build --workspace --bins) first",
            binary.display()
        );
        let mut command = std::process::Command::new(&binary);
        command.arg("run");
        let prefixes = [("kafka.topic_prefix", prefix), ("postgres.schema_prefix", prefix)];
        for (key, value) in TEST_SETTINGS.iter().chain(&prefixes).chain(overrides) {
            command.env(format!("SLUICE__{}", key.replace('.', "__").to_uppercase()), value);
        }
        let section = service.replace('-', "_").to_uppercase();
        command
            .env(format!("SLUICE__{section}__LISTEN"), format!("127.0.0.1:{port}"))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_string()),
            )
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit());
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(ServiceProcess {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        })
    }

    /// SIGKILL, and wait until the process is gone (its port is free).
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Test configuration: defaults, the test's prefixes, small partition counts
/// and short timers, then `overrides`.
pub fn test_config(name: &str, overrides: &[(&str, &str)]) -> anyhow::Result<SluiceConfig> {
    let prefix = unique_prefix(name);
    let mut settings: Vec<(&str, &str)> = TEST_SETTINGS.to_vec();
    settings.push(("kafka.topic_prefix", prefix.as_str()));
    settings.push(("postgres.schema_prefix", prefix.as_str()));
    settings.extend_from_slice(overrides);
    Ok(with_single_message_batches(SluiceConfig::load_with(None, &settings)?))
}

/// One message per produce batch. tansu reports a partition's high
/// watermark as its last batch's base offset + 1, so a consumer that resumes
/// inside a multi-message batch (after a rebalance or restart) fetches
/// nothing until newer data arrives. Real Kafka has no such bug.
fn with_single_message_batches(mut config: SluiceConfig) -> SluiceConfig {
    config
        .kafka
        .producer_properties
        .insert("batch.num.messages".to_string(), "1".to_string());
    config
}

/// Like `test_config`, with `toml` (e.g. task groups with caps) layered as a
/// configuration file under the test's overrides.
pub fn test_config_toml(name: &str, toml: &str, overrides: &[(&str, &str)]) -> anyhow::Result<SluiceConfig> {
    let base = test_config(name, overrides)?;
    let path = std::env::temp_dir().join(format!("{}config.toml", base.kafka.topic_prefix));
    std::fs::write(&path, toml)?;
    let prefix = base.kafka.topic_prefix.clone();
    let mut settings: Vec<(&str, &str)> = TEST_SETTINGS.to_vec();
    settings.push(("kafka.topic_prefix", prefix.as_str()));
    settings.push(("postgres.schema_prefix", prefix.as_str()));
    settings.extend_from_slice(overrides);
    let loaded = SluiceConfig::load_with(Some(&path), &settings)?;
    let _ = std::fs::remove_file(&path);
    Ok(with_single_message_batches(loaded))
}

/// A tansu broker of a test's own, on a port of its own, so freezing,
/// restarting or killing it disturbs no other test. The binary is
/// `SLUICE_TANSU` (set by `scripts/with-test-broker.sh`), else `tansu` on the
/// PATH.
pub struct PrivateBroker {
    child: Option<std::process::Child>,
    port: u16,
    pub address: String,
}

impl PrivateBroker {
    pub async fn start() -> anyhow::Result<Self> {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
            probe.local_addr()?.port()
        };
        let mut broker = PrivateBroker {
            child: None,
            port,
            address: format!("127.0.0.1:{port}"),
        };
        broker.spawn().await?;
        Ok(broker)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let binary = std::env::var("SLUICE_TANSU").unwrap_or_else(|_| "tansu".to_string());
        let child = std::process::Command::new(&binary)
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &url])
            .args(["--storage-engine", "memory://tansu/"])
            .env_remove("LISTENER_URL")
            .env_remove("STORAGE_ENGINE")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {binary} (set SLUICE_TANSU or put tansu on the PATH)"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(&self.address).await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "tansu did not start on {}", self.address);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Send a signal (`-STOP`, `-CONT`, ...) to the broker process.
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let Some(child) = &self.child else {
            anyhow::bail!("the broker is not running");
        };
        let status = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill {signal} failed");
        Ok(())
    }

    /// Kill the broker and start a new one on the same port: memory storage,
    /// so every topic, offset and group is gone (a broker that lost its log).
    pub async fn restart_empty(&mut self) -> anyhow::Result<()> {
        self.kill();
        // The port is free once the old process is reaped.
        self.spawn().await
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = std::process::Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A stable address for a service, as a Kubernetes Service gives one: each
/// connection goes to the first of the service's instances that accepts it
/// (starting from a rotating position). Admission reads the owner directory
/// through it; instances come and go behind it.
pub struct ServiceProxy {
    pub endpoint: String,
    backends: Arc<Mutex<Vec<String>>>,
    stop: Shutdown,
}

impl ServiceProxy {
    /// A TCP proxy; `tls`: the instances behind it speak TLS (the proxy
    /// passes the bytes through), so its endpoint is `https://`.
    pub async fn start(tls: bool) -> anyhow::Result<ServiceProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("{}://{}", scheme(tls), listener.local_addr()?);
        let backends: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
        let stop = Shutdown::new();
        let accepting = {
            let backends = backends.clone();
            let stop = stop.clone();
            async move {
                let mut next = 0usize;
                loop {
                    let accepted = tokio::select! {
                        _ = stop.cancelled() => return,
                        accepted = listener.accept() => accepted,
                    };
                    let Ok((mut inbound, _)) = accepted else {
                        continue;
                    };
                    let mut candidates = backends.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
                    if !candidates.is_empty() {
                        let start = next % candidates.len();
                        candidates.rotate_left(start);
                    }
                    next = next.wrapping_add(1);
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        for address in candidates {
                            if let Ok(mut outbound) = tokio::net::TcpStream::connect(address.as_str()).await {
                                tokio::select! {
                                    _ = stop.cancelled() => {}
                                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                                }
                                return;
                            }
                        }
                    });
                }
            }
        };
        tokio::spawn(accepting);
        Ok(ServiceProxy {
            endpoint,
            backends,
            stop,
        })
    }

    /// One more instance behind the address (`http://host:port`).
    pub fn add(&self, endpoint: &str) {
        self.backends
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(address_of(endpoint));
    }

    /// An instance gone from behind the address, as Kubernetes drops a
    /// stopped pod's endpoint. Kept, its port could be taken by another
    /// test's instance (tests run side by side), and the address would
    /// reach that instead.
    pub fn remove(&self, endpoint: &str) {
        let address = address_of(endpoint);
        self.backends
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .retain(|backend| *backend != address);
    }
}

fn address_of(endpoint: &str) -> String {
    endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .to_string()
}

impl Drop for ServiceProxy {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

/// One running service instance.
pub struct Node {
    pub name: &'static str,
    pub endpoint: String,
    pub shutdown: Shutdown,
    pub faults: Faults,
    handle: Option<JoinHandle<Result<(), String>>>,
}

impl Node {
    /// Graceful stop.
    pub async fn stop(mut self) {
        self.shutdown.trigger();
        self.join().await;
    }

    /// Graceful stop that must finish within `bound` (the drain is bounded).
    pub async fn stop_within(mut self, bound: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        self.shutdown.trigger();
        let Some(handle) = self.handle.take() else {
            return Ok(Duration::ZERO);
        };
        match tokio::time::timeout(bound, handle).await {
            Ok(_) => Ok(started.elapsed()),
            Err(_) => anyhow::bail!("{} did not stop within {bound:?} of being asked to", self.name),
        }
    }

    /// Stop at once, skipping every flush (a killed process).
    pub async fn kill(mut self) {
        self.shutdown.crash();
        self.join().await;
    }

    /// Wait until the node stops by itself (a fault hook crashed it).
    pub async fn wait_stopped(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.handle.as_ref().is_none_or(JoinHandle::is_finished) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} did not stop within {timeout:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.join().await;
        Ok(())
    }

    async fn join(&mut self) {
        if let Some(handle) = self.handle.take() {
            match tokio::time::timeout(Duration::from_secs(30), handle).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(error))) => tracing::info!(node = self.name, %error, "node stopped with an error"),
                Ok(Err(join_error)) => tracing::warn!(node = self.name, %join_error, "node task failed"),
                Err(_) => tracing::warn!(node = self.name, "node did not stop within 30s"),
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown.crash();
    }
}

fn scheme(tls: bool) -> &'static str {
    if tls {
        "https"
    } else {
        "http"
    }
}

async fn listener(tls: bool) -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("{}://{}", scheme(tls), listener.local_addr()?);
    Ok((listener, endpoint))
}

/// Start one service instance in this process on 127.0.0.1:0.
async fn start_node<F, Fut, E>(
    name: &'static str,
    config: &Arc<SluiceConfig>,
    faults: Faults,
    run: F,
) -> anyhow::Result<Node>
where
    F: FnOnce(Arc<SluiceConfig>, tokio::net::TcpListener, Shutdown, Faults) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    let (listener, endpoint) = listener(config.tls.server_enabled()).await?;
    let shutdown = Shutdown::new();
    let running = run(config.clone(), listener, shutdown.clone(), faults.clone());
    let handle = tokio::spawn(async move { running.await.map_err(|error| error.to_string()) });
    Ok(Node {
        name,
        endpoint,
        shutdown,
        faults,
        handle: Some(handle),
    })
}

pub async fn start_limit_grant(config: &Arc<SluiceConfig>, faults: Faults) -> anyhow::Result<Node> {
    start_node("limit-grant", config, faults, sluice_limit_grant::run).await
}

pub async fn start_rate_window(config: &Arc<SluiceConfig>, faults: Faults) -> anyhow::Result<Node> {
    start_node("rate-window", config, faults, sluice_rate_window::run).await
}

pub async fn start_refresh_dispatcher(config: &Arc<SluiceConfig>, faults: Faults) -> anyhow::Result<Node> {
    start_node("refresh-dispatcher", config, faults, sluice_refresh_dispatcher::run).await
}

/// Start admission; it reaches limit-grant at `config.admission.limit_grant_endpoint`.
pub async fn start_admission(config: &Arc<SluiceConfig>, faults: Faults) -> anyhow::Result<Node> {
    start_node("admission", config, faults, sluice_admission::run).await
}

/// A whole stack: limit-grant, rate-window, refresh-dispatcher and admission
/// instances.
pub struct Stack {
    pub config: Arc<SluiceConfig>,
    pub limit_grants: Vec<Node>,
    pub rate_windows: Vec<Node>,
    pub refresh_dispatchers: Vec<Node>,
    pub admissions: Vec<Node>,
    pub pool: PgPool,
    /// The stable addresses admission reaches limit-grant and rate-window at.
    pub limit_grant_service: ServiceProxy,
    pub rate_window_service: ServiceProxy,
}

impl Stack {
    /// Start `limit_grants` limit-grant instances, then one admission pointed
    /// at the first of them. Waits until every partition has an owner and
    /// every node serves.
    pub async fn start(mut config: SluiceConfig, limit_grants: usize) -> anyhow::Result<Stack> {
        init_logging();
        let pool = admin_pool(&config).await?;
        // Create topics up front so consumers of every instance see them.
        sluice_common::kafka::ensure_topics(&config.kafka, &sluice_common::service::all_topics(&config), true).await?;
        let tls = config.tls.server_enabled();
        let limit_grant_service = ServiceProxy::start(tls).await?;
        let rate_window_service = ServiceProxy::start(tls).await?;
        config.admission.limit_grant_endpoint = limit_grant_service.endpoint.clone();
        config.admission.rate_window_endpoint = rate_window_service.endpoint.clone();
        let bootstrap = Arc::new(config.clone());
        let mut nodes = Vec::new();
        for _ in 0..limit_grants {
            let node = start_limit_grant(&bootstrap, Faults::none()).await?;
            limit_grant_service.add(&node.endpoint);
            nodes.push(node);
        }
        let rate_window = start_rate_window(&bootstrap, Faults::none()).await?;
        rate_window_service.add(&rate_window.endpoint);
        let refresh_dispatcher = start_refresh_dispatcher(&bootstrap, Faults::none()).await?;
        let config = Arc::new(config);
        let mut stack = Stack {
            config,
            limit_grants: nodes,
            rate_windows: vec![rate_window],
            refresh_dispatchers: vec![refresh_dispatcher],
            admissions: Vec::new(),
            pool,
            limit_grant_service,
            rate_window_service,
        };
        stack.add_admission(Faults::none()).await?;
        Ok(stack)
    }

    /// Start one more admission instance and wait until the job partitions
    /// are spread over the instances and every node serves again.
    pub async fn add_admission(&mut self, faults: Faults) -> anyhow::Result<()> {
        let node = start_admission(&self.config, faults).await?;
        self.admissions.push(node);
        self.wait_settled(Duration::from_secs(60)).await
    }

    /// Wait until every partition of every service has an owner, each
    /// admission instance owns job partitions (as many as there are to
    /// share), and every node serves. An owner row is written when a
    /// takeover starts, before the partition is loaded (readiness says
    /// NOT_SERVING meanwhile), so the last wait is on the nodes' health, as a
    /// readiness probe would.
    pub async fn wait_settled(&self, timeout: Duration) -> anyhow::Result<()> {
        self.wait_owned(timeout).await?;
        let owning = i64::from(self.config.kafka.partitions.jobs).min(i64::try_from(self.admissions.len())?);
        let query = format!(
            "SELECT count(DISTINCT endpoint) FROM \"{}\".owners",
            self.config.schema("admission")
        );
        eventually(
            timeout,
            "job partitions spread over the admission instances",
            || async {
                let endpoints: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(query.clone()))
                    .fetch_one(&self.pool)
                    .await?;
                Ok(endpoints >= owning)
            },
        )
        .await?;
        let nodes = self
            .admissions
            .iter()
            .chain(&self.limit_grants)
            .chain(&self.rate_windows)
            .chain(&self.refresh_dispatchers);
        for node in nodes {
            wait_serving(&node.endpoint, timeout).await?;
        }
        Ok(())
    }

    pub async fn add_limit_grant(&mut self, faults: Faults) -> anyhow::Result<()> {
        let node = start_limit_grant(&self.config, faults).await?;
        self.limit_grant_service.add(&node.endpoint);
        self.limit_grants.push(node);
        Ok(())
    }

    pub async fn add_rate_window(&mut self, faults: Faults) -> anyhow::Result<()> {
        let node = start_rate_window(&self.config, faults).await?;
        self.rate_window_service.add(&node.endpoint);
        self.rate_windows.push(node);
        Ok(())
    }

    /// Take limit-grant instance `index` out of the stack and from behind
    /// its service address (to stop or kill it).
    pub fn take_limit_grant(&mut self, index: usize) -> Node {
        let node = self.limit_grants.remove(index);
        self.limit_grant_service.remove(&node.endpoint);
        node
    }

    /// Take rate-window instance `index` out of the stack and from behind
    /// its service address (to stop or kill it).
    pub fn take_rate_window(&mut self, index: usize) -> Node {
        let node = self.rate_windows.remove(index);
        self.rate_window_service.remove(&node.endpoint);
        node
    }

    /// Wait until every limit-command and rate-command partition has an owner row.
    pub async fn wait_owned(&self, timeout: Duration) -> anyhow::Result<()> {
        let checks = [
            ("admission", self.config.kafka.partitions.jobs),
            ("limit_grant", self.config.kafka.partitions.limit_commands),
            ("rate_window", self.config.kafka.partitions.rate_commands),
            ("refresh_dispatcher", self.config.kafka.partitions.refresh_due),
        ];
        let deadline = Instant::now() + timeout;
        for (schema, partitions) in checks {
            let query = format!("SELECT count(*) FROM \"{}\".owners", self.config.schema(schema));
            loop {
                let owned: Result<i64, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(query.clone()))
                    .fetch_one(&self.pool)
                    .await;
                if owned.as_ref().is_ok_and(|count| *count >= i64::from(partitions)) {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{schema} partitions not owned within {timeout:?}: {owned:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Wait until everything given to the stack before this call is
    /// applied and committed, so a test can check that something did NOT
    /// happen without sleeping: every request produced to
    /// `jobs.requested` and every hand-over on `sluice.jobs` is handed over
    /// (`consumed_to_end`), then each admission instance's barrier
    /// (`sluice_admission::barrier`: its job partitions, the commands on its
    /// links applied by their owners, and the grants those owners sent back
    /// applied). Tenant topics and the Kafka paths off the hot path
    /// (floating-limit commands, refresh events) are not covered.
    pub async fn barrier(&self) -> anyhow::Result<()> {
        let config = &self.config;
        let requests = config.group(&format!("{}-requests", config.admission.consumer_group));
        consumed_to_end(config, &config.topic(&config.topics.requested), &requests).await?;
        let jobs = config.group(&format!("{}-jobs", config.admission.consumer_group));
        consumed_to_end(config, &config.topic(&config.topics.jobs), &jobs).await?;
        for admission in &self.admissions {
            tokio::time::timeout(Duration::from_secs(60), admission.faults.barrier())
                .await
                .context("admission's barrier took over 60 s")?
                .map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }

    pub async fn rates_client(
        &self,
    ) -> anyhow::Result<sluice_proto::v1::rate_limits_client::RateLimitsClient<Channel>> {
        let endpoint = &self.rate_windows.first().context("no rate-window")?.endpoint;
        Ok(sluice_proto::v1::rate_limits_client::RateLimitsClient::new(
            connect(endpoint).await?,
        ))
    }

    pub async fn refresh_client(&self) -> anyhow::Result<sluice_proto::v1::refresh_client::RefreshClient<Channel>> {
        let endpoint = &self
            .refresh_dispatchers
            .first()
            .context("no refresh-dispatcher")?
            .endpoint;
        Ok(sluice_proto::v1::refresh_client::RefreshClient::new(
            connect(endpoint).await?,
        ))
    }

    pub async fn admission_client(&self) -> anyhow::Result<AdmissionClient<Channel>> {
        let endpoint = &self.admissions.first().context("no admission")?.endpoint;
        Ok(AdmissionClient::new(connect(endpoint).await?))
    }

    pub async fn limits_client(&self) -> anyhow::Result<LimitsClient<Channel>> {
        let endpoint = &self.limit_grants.first().context("no limit-grant")?.endpoint;
        Ok(LimitsClient::new(connect(endpoint).await?))
    }

    /// Tickets (held or waiting) limit-grant has committed, over every
    /// partition.
    pub async fn tickets_left(&self) -> anyhow::Result<i64> {
        Ok(i64::try_from(self.saved_tickets().await?.len())?)
    }

    /// Every ticket limit-grant has committed (each partition's snapshot
    /// and journal, read as a new owner would load them).
    pub async fn saved_tickets(&self) -> anyhow::Result<Vec<sluice_limit_grant::core::TicketRecord>> {
        // A connection of its own (detached from the pool), so the search
        // path set here never reaches another query.
        let mut connection = self.pool.acquire().await?.detach();
        let search_path = format!("SET search_path TO \"{}\"", self.config.schema("limit_grant"));
        sqlx::query(sqlx::AssertSqlSafe(search_path))
            .execute(&mut connection)
            .await?;
        let mut tickets = Vec::new();
        for partition in 0..self.config.kafka.partitions.limit_commands {
            let saved = sluice_limit_grant::store::load_tickets(&mut connection, partition).await?;
            tickets.extend(saved.tickets.into_values());
        }
        Ok(tickets)
    }

    /// Count of jobs per status code. Ended jobs count by their outcome rows;
    /// an active job's state lives in its owner's memory, so it is asked for
    /// with GetJob (a job no owner answers for yet counts under 0).
    pub async fn job_statuses(&self) -> anyhow::Result<HashMap<i16, i64>> {
        use futures::StreamExt;
        let schema = self.config.schema("admission");
        let query = format!(
            "SELECT j.job_id, o.status FROM \"{schema}\".jobs j
             LEFT JOIN \"{schema}\".job_outcomes o USING (job_id)"
        );
        let rows: Vec<(String, Option<i16>)> = sqlx::query_as(sqlx::AssertSqlSafe(query)).fetch_all(&self.pool).await?;
        let mut counts: HashMap<i16, i64> = HashMap::new();
        let mut active = Vec::new();
        for (job_id, status) in rows {
            match status {
                Some(status) => *counts.entry(status).or_default() += 1,
                None => active.push(job_id),
            }
        }
        if active.is_empty() {
            return Ok(counts);
        }
        let client = self.admission_client().await?;
        let answers: Vec<i16> = futures::stream::iter(active)
            .map(|job_id| {
                let mut client = client.clone();
                async move {
                    match client.get_job(pb::GetJobRequest { job_id }).await {
                        Ok(response) => response
                            .into_inner()
                            .job
                            .map_or(0, |job| i16::try_from(job.status).unwrap_or(0)),
                        Err(_) => 0,
                    }
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        for status in answers {
            *counts.entry(status).or_default() += 1;
        }
        Ok(counts)
    }

    /// (priority, enqueued_at_us) of every job, by id.
    pub async fn job_order(&self) -> anyhow::Result<HashMap<String, (i16, i64)>> {
        let query = format!(
            "SELECT job_id, priority, enqueued_at_us FROM \"{}\".jobs",
            self.config.schema("admission")
        );
        let rows: Vec<(String, i16, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(query)).fetch_all(&self.pool).await?;
        Ok(rows
            .into_iter()
            .map(|(id, priority, at)| (id, (priority, at)))
            .collect())
    }

    /// Stop every node and keep the data (benchmarks read statistics after).
    pub async fn stop_nodes(&mut self) {
        for node in self.admissions.drain(..) {
            node.stop().await;
        }
        for node in self.rate_windows.drain(..) {
            node.stop().await;
        }
        for node in self.refresh_dispatchers.drain(..) {
            node.stop().await;
        }
        for node in self.limit_grants.drain(..) {
            node.stop().await;
        }
    }

    /// Stop every node, then drop the test's schemas (a failed test leaves
    /// them for inspection; unique names make that harmless).
    pub async fn stop(self) {
        for node in self.admissions {
            node.stop().await;
        }
        for node in self.rate_windows {
            node.stop().await;
        }
        for node in self.refresh_dispatchers {
            node.stop().await;
        }
        for node in self.limit_grants {
            node.stop().await;
        }
        cleanup(&self.config, &self.pool).await;
        self.pool.close().await;
    }
}

/// Drop the schemas named with this test's prefix. Topics stay: deleting
/// topics on tansu makes librdkafka 2.12 crash in its metadata cache (seen in
/// `make bench`), and unique names keep runs apart anyway.
pub async fn cleanup(config: &SluiceConfig, pool: &PgPool) {
    if let Err(error) = sluice_common::storage::drop_schemas_with_prefix(pool, &config.postgres.schema_prefix).await {
        tracing::warn!(%error, "dropping test schemas failed");
    }
}

pub async fn admin_pool(config: &SluiceConfig) -> anyhow::Result<PgPool> {
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(config.postgres.url.expose())
        .await?)
}

/// A channel to `endpoint`; `https://` ones trust the CA the stack's
/// services in this process were configured with (`tls.ca_file`).
pub async fn connect(endpoint: &str) -> anyhow::Result<Channel> {
    Ok(sluice_common::tls::endpoint(endpoint)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

/// Whether the endpoint's standard health service says SERVING.
pub async fn health_serving(endpoint: &str) -> anyhow::Result<bool> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let mut client = tonic_health::pb::health_client::HealthClient::new(connect(endpoint).await?);
    let response = client
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await?;
    Ok(response.into_inner().status == ServingStatus::Serving as i32)
}

/// Wait until the endpoint's health service says SERVING.
pub async fn wait_serving(endpoint: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if health_serving(endpoint).await.unwrap_or(false) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{endpoint} not serving within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// Producing job requests over Kafka

pub struct RequestProducer {
    producer: FutureProducer,
    topic: String,
}

impl RequestProducer {
    pub fn new(config: &SluiceConfig) -> anyhow::Result<Self> {
        Self::to_topic(config, &config.topics.requested)
    }

    /// A producer writing to `topic` (before the prefix), e.g. a tenant's
    /// own requested-jobs topic.
    pub fn to_topic(config: &SluiceConfig, topic: &str) -> anyhow::Result<Self> {
        let mut client = client_config(&config.kafka);
        client.set("linger.ms", "5").set("enable.idempotence", "true");
        sluice_common::kafka::apply_producer_properties(&mut client, &config.kafka);
        Ok(RequestProducer {
            producer: client.create()?,
            topic: config.topic(topic),
        })
    }

    /// Send messages (any bytes) and wait for every ack.
    pub async fn send_messages(&self, messages: Vec<RawRequest>) -> anyhow::Result<()> {
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in &messages {
            let mut headers = OwnedHeaders::new();
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            let mut record = FutureRecord::<[u8], [u8]>::to(&self.topic)
                .payload(&message.payload)
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key);
            }
            if let Some(partition) = message.partition {
                record = record.partition(partition);
            }
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => {
                        deliveries.push(delivery);
                        break;
                    }
                    Err((
                        rdkafka::error::KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull),
                        returned,
                    )) => {
                        record = returned;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((error, _)) => anyhow::bail!("produce failed: {error}"),
                }
            }
        }
        for delivery in deliveries {
            delivery
                .await
                .context("delivery cancelled")?
                .map_err(|(error, _)| anyhow::anyhow!("delivery failed: {error}"))?;
        }
        Ok(())
    }

    /// Send protobuf requests keyed by their payload, so they spread over partitions.
    pub async fn send(&self, requests: &[pb::JobRequest]) -> anyhow::Result<()> {
        self.send_messages(
            requests
                .iter()
                .map(|request| RawRequest {
                    partition: None,
                    key: Some(request.payload.clone()),
                    payload: request.encode_to_vec(),
                    headers: Vec::new(),
                })
                .collect(),
        )
        .await
    }
}

/// An SDK worker on Work streams (task group `default`) that counts the
/// jobs it runs, started and waited for until a stream is open.
pub async fn start_counting_stream_worker(
    options: sluice_client::ClientOptions,
) -> anyhow::Result<(Arc<std::sync::atomic::AtomicUsize>, sluice_client::CancellationToken)> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ran = Arc::new(AtomicUsize::new(0));
    let counted = ran.clone();
    let worker = sluice_client::Worker::builder(options, move |_job: sluice_client::Job| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok(()) }
    })
    .task_group("default")
    .transport(sluice_client::Transport::Stream)
    .build()?;
    let status = worker.status();
    let token = sluice_client::CancellationToken::new();
    tokio::spawn(worker.run(token.clone()));
    eventually(Duration::from_secs(30), "the worker's stream open", || async {
        Ok(status.snapshot().streams >= 1)
    })
    .await?;
    Ok((ran, token))
}

/// A reader of the dead-letter topic from its start.
pub fn dead_letter_reader(config: &SluiceConfig) -> anyhow::Result<rdkafka::consumer::StreamConsumer> {
    use rdkafka::consumer::Consumer as _;
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", format!("{}dlq-reader", config.kafka.topic_prefix))
        .set("auto.offset.reset", "earliest");
    let consumer: rdkafka::consumer::StreamConsumer = settings.create()?;
    consumer.subscribe(&[&config.topic(&config.topics.deadletter)])?;
    Ok(consumer)
}

/// A message's header as text ("" when it has none of that name).
pub use sluice_common::kafka::message_header as header_text;

/// One message for `jobs.requested`, as bytes.
#[derive(Clone, Debug, Default)]
pub struct RawRequest {
    /// Where to send it; `None` lets the producer pick by key.
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// The limit command that acquires a ticket (attempt 1, step 0) of `job_id`
/// on `key` with the job's own max `max`, as admission sends it.
pub fn acquire_command(tenant: &str, key: &str, job_id: &str, max: u32) -> pb::LimitCommand {
    pb::LimitCommand {
        trace: None,
        sent_at_ms: 0,
        command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            ticket: Some(pb::TicketId {
                job_id: job_id.to_string(),
                attempt: 1,
                step: 0,
            }),
            priority: 10,
            enqueued_at_us: 1,
            limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(max)),
            fairness_key: String::new(),
            shadow: false,
        })),
    }
}

/// A job on one concurrency key.
pub fn concurrency_job(tenant: &str, key: &str, max: u32, priority: u32, payload: &str) -> pb::JobRequest {
    pb::JobRequest {
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        priority: Some(priority),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: key.to_string(),
                max_concurrency: max,
                shadow: false,
            })),
        }],
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------
// Workers

/// One run of one attempt, as a test worker saw it.
#[derive(Clone, Debug)]
pub struct RunRecord {
    pub job_id: String,
    pub attempt: u32,
    pub payload: String,
    pub claimed_at: Instant,
    pub finished_at: Instant,
}

#[derive(Default)]
pub struct Recorder {
    pub runs: Mutex<Vec<RunRecord>>,
    pub claim_outcomes: Mutex<HashMap<i32, u64>>,
    pub deliveries: AtomicU64,
}

impl Recorder {
    pub fn runs(&self) -> Vec<RunRecord> {
        self.runs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn completed(&self) -> usize {
        self.runs.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len()
    }

    fn count_claim(&self, outcome: i32) {
        *self
            .claim_outcomes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(outcome)
            .or_default() += 1;
    }
}

/// How a test worker behaves.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub worker_id: String,
    pub task_group: String,
    pub group: String,
    pub concurrency: usize,
    pub min_run: Duration,
    pub max_run: Duration,
}

/// Consume admitted jobs, claim, "run" for a random short time, complete.
/// Runs until `stop` is cancelled.
pub async fn run_worker(
    config: Arc<SluiceConfig>,
    admission_endpoint: String,
    options: WorkerOptions,
    recorder: Arc<Recorder>,
    stop: Shutdown,
) -> anyhow::Result<()> {
    let mut client_settings = client_config(&config.kafka);
    client_settings
        .set("group.id", &options.group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string());
    let consumer: StreamConsumer = client_settings.create()?;
    consumer.subscribe(&[&config.admitted_topic(&options.task_group)])?;
    let client = AdmissionClient::new(connect(&admission_endpoint).await?);
    let slots = Arc::new(tokio::sync::Semaphore::new(options.concurrency));
    let mut running = tokio::task::JoinSet::new();
    loop {
        let received = tokio::select! {
            _ = stop.cancelled() => break,
            received = consumer.recv() => received,
        };
        let message = match received {
            Ok(message) => message,
            // A broker restarting or a partition end: the client recovers.
            Err(error) => {
                tracing::debug!(%error, "test worker: consumer error");
                continue;
            }
        };
        recorder.deliveries.fetch_add(1, Ordering::Relaxed);
        let admitted = pb::AdmittedJob::decode(message.payload().unwrap_or_default())?;
        let permit = slots.clone().acquire_owned().await?;
        let mut client = client.clone();
        let recorder = recorder.clone();
        let options = options.clone();
        running.spawn(async move {
            let _permit = permit;
            let claimed = client
                .claim(pb::ClaimRequest {
                    worker_id: options.worker_id.clone(),
                    jobs: vec![pb::JobAttempt {
                        job_id: admitted.job_id.clone(),
                        attempt: admitted.attempt,
                    }],
                })
                .await;
            let Ok(claimed) = claimed else {
                return;
            };
            let Some(result) = claimed.into_inner().results.pop() else {
                return;
            };
            recorder.count_claim(result.outcome);
            if result.outcome != pb::ClaimOutcome::Claimed as i32 {
                return;
            }
            let claimed_at = Instant::now();
            let run_for = if options.max_run > options.min_run {
                rand::rng().random_range(options.min_run..options.max_run)
            } else {
                options.min_run
            };
            tokio::time::sleep(run_for).await;
            let finished_at = Instant::now();
            // As the worker protocol says: a completion answered
            // UNAVAILABLE (an owner handing its partition over) is sent
            // again, for longer than a takeover after a crash takes (the
            // group's session timeout, then the load): a worker that gave up
            // after 5 s left a job claimed just before its owner crashed to
            // fail by lease expiry (crash::admission_killed_after_publish_before_offset_commit,
            // once in a fresh-clone `make test`).
            let mut completed;
            let give_up_at = Instant::now() + Duration::from_secs(60);
            loop {
                completed = client
                    .complete(pb::CompleteRequest {
                        worker_id: options.worker_id.clone(),
                        completions: vec![pb::Completion {
                            job_id: admitted.job_id.clone(),
                            attempt: admitted.attempt,
                            outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
                        }],
                    })
                    .await;
                match &completed {
                    // UNAVAILABLE, or a connection that broke mid-call.
                    Err(status)
                        if matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown)
                            && Instant::now() < give_up_at =>
                    {
                        tracing::info!(job_id = %admitted.job_id, %status, "test worker: complete failed; sending it again");
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                    _ => break,
                }
            }
            let accepted = completed.is_ok_and(|response| {
                response
                    .into_inner()
                    .results
                    .first()
                    .is_some_and(|result| result.outcome == pb::CompleteOutcome::Accepted as i32)
            });
            if accepted {
                recorder
                    .runs
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(RunRecord {
                        job_id: admitted.job_id,
                        attempt: admitted.attempt,
                        payload: String::from_utf8_lossy(&admitted.payload).to_string(),
                        claimed_at,
                        finished_at,
                    });
            }
        });
        while running.try_join_next().is_some() {}
    }
    running.shutdown().await;
    Ok(())
}

/// The largest number of overlapping runs among `runs`.
pub fn max_overlap(runs: &[&RunRecord]) -> usize {
    let mut edges: Vec<(Instant, i32)> = Vec::with_capacity(runs.len() * 2);
    for run in runs {
        edges.push((run.claimed_at, 1));
        edges.push((run.finished_at, -1));
    }
    // At equal instants, ends go first: touching intervals do not overlap.
    edges.sort_by(|left, right| left.0.cmp(&right.0).then(left.1.cmp(&right.1)));
    let mut current = 0i32;
    let mut peak = 0i32;
    for (_, delta) in edges {
        current += delta;
        peak = peak.max(current);
    }
    usize::try_from(peak).unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Observing grant events

/// Record every grant limit-grant and rate-window send from now on (their
/// `WatchGrants` streams, through the services' stable addresses; a stream
/// that ends is opened again, to whichever instance now answers). Returns
/// once both streams are open, so no grant made after it is missed.
pub async fn observe_grants(
    stack: &Stack,
    events: Arc<Mutex<Vec<pb::GrantEvent>>>,
    stop: Shutdown,
) -> anyhow::Result<()> {
    for endpoint in [&stack.limit_grant_service.endpoint, &stack.rate_window_service.endpoint] {
        let (opened, opened_receiver) = tokio::sync::oneshot::channel();
        tokio::spawn(watch_grants(endpoint.clone(), events.clone(), stop.clone(), opened));
        tokio::time::timeout(Duration::from_secs(30), opened_receiver)
            .await
            .context("the grant watch did not open within 30s")?
            .context("the grant watch stopped")?;
    }
    Ok(())
}

/// Record the grants `endpoint` sends until `stop`, opening the stream
/// again when it ends; `opened` fires once it first opens.
pub async fn watch_grants(
    endpoint: String,
    events: Arc<Mutex<Vec<pb::GrantEvent>>>,
    stop: Shutdown,
    opened: tokio::sync::oneshot::Sender<()>,
) {
    let mut opened = Some(opened);
    while !stop.is_triggered() {
        let watched = async {
            let channel = connect(&endpoint).await?;
            let mut stream = sluice_proto::v1::owner_link_client::OwnerLinkClient::new(channel)
                .watch_grants(pb::WatchGrantsRequest {})
                .await?
                .into_inner();
            if let Some(opened) = opened.take() {
                let _ = opened.send(());
            }
            while let Some(batch) = stream.message().await? {
                let decoded: Vec<pb::GrantEvent> = batch
                    .events
                    .iter()
                    .filter_map(|event| pb::GrantEvent::decode(event.as_slice()).ok())
                    .collect();
                events
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .extend(decoded);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = watched => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The job as GetJob shows it.
pub async fn job_view(client: &AdmissionClient<Channel>, job_id: &str) -> anyhow::Result<pb::JobView> {
    let mut client = client.clone();
    Ok(client
        .get_job(pb::GetJobRequest {
            job_id: job_id.to_string(),
        })
        .await?
        .into_inner()
        .job
        .unwrap_or_default())
}

/// Wait until the job has `status`; returns its view.
pub async fn wait_status(
    client: &AdmissionClient<Channel>,
    job_id: &str,
    status: pb::JobStatus,
    timeout: Duration,
) -> anyhow::Result<pb::JobView> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut lookup = client.clone();
        let answer = lookup
            .get_job(pb::GetJobRequest {
                job_id: job_id.to_string(),
            })
            .await;
        let seen = match answer {
            Ok(response) => {
                let view = response.into_inner().job.context("GetJob answered no job")?;
                if view.status == status as i32 {
                    return Ok(view);
                }
                format!("{:?} ({})", pb::JobStatus::try_from(view.status), view.reason)
            }
            // A job sent over Kafka exists once its owner has read it.
            Err(not_yet) if not_yet.code() == tonic::Code::NotFound => "not found yet".to_string(),
            Err(status) => return Err(status.into()),
        };
        anyhow::ensure!(
            Instant::now() < deadline,
            "job {job_id} not {status:?} within {timeout:?}: {seen}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Enqueue one job over gRPC with the given id; returns the response.
pub async fn enqueue_with_id(
    client: &AdmissionClient<Channel>,
    job_id: &str,
    mut request: pb::JobRequest,
) -> anyhow::Result<pb::EnqueueResponse> {
    request.job_id = Some(job_id.to_string());
    let mut client = client.clone();
    Ok(client
        .enqueue(pb::EnqueueRequest { job: Some(request) })
        .await?
        .into_inner())
}

/// Claim one attempt; the outcome.
pub async fn claim_one(
    client: &AdmissionClient<Channel>,
    worker: &str,
    job_id: &str,
    attempt: u32,
) -> anyhow::Result<i32> {
    let mut client = client.clone();
    let response = client
        .claim(pb::ClaimRequest {
            worker_id: worker.to_string(),
            jobs: vec![pb::JobAttempt {
                job_id: job_id.to_string(),
                attempt,
            }],
        })
        .await?
        .into_inner();
    Ok(response.results.first().map_or(0, |result| result.outcome))
}

/// Complete one attempt with `outcome`; the result.
pub async fn complete_one(
    client: &AdmissionClient<Channel>,
    worker: &str,
    job_id: &str,
    attempt: u32,
    outcome: pb::completion::Outcome,
) -> anyhow::Result<pb::CompleteResult> {
    let mut client = client.clone();
    let response = client
        .complete(pb::CompleteRequest {
            worker_id: worker.to_string(),
            completions: vec![pb::Completion {
                job_id: job_id.to_string(),
                attempt,
                outcome: Some(outcome),
            }],
        })
        .await?
        .into_inner();
    response.results.into_iter().next().context("no complete result")
}

/// Heartbeat one attempt; the outcome.
pub async fn heartbeat_one(
    client: &AdmissionClient<Channel>,
    worker: &str,
    job_id: &str,
    attempt: u32,
) -> anyhow::Result<i32> {
    let mut client = client.clone();
    let response = client
        .heartbeat(pb::HeartbeatRequest {
            worker_id: worker.to_string(),
            jobs: vec![pb::JobAttempt {
                job_id: job_id.to_string(),
                attempt,
            }],
            stream_ended: None,
        })
        .await?
        .into_inner();
    Ok(response.results.first().map_or(0, |result| result.outcome))
}

/// A job listing several concurrency keys.
pub fn multi_key_job(tenant: &str, keys: &[(&str, u32)], payload: &str) -> pb::JobRequest {
    pb::JobRequest {
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: keys
            .iter()
            .map(|(key, max)| pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key: key.to_string(),
                    max_concurrency: *max,
                    shadow: false,
                })),
            })
            .collect(),
        ..Default::default()
    }
}

/// Holders and waiting count of a key, from its owner.
/// Change a key's settings (`Limits.SetLimit`); the key's state after it.
pub async fn set_key(
    stack: &Stack,
    tenant: &str,
    key: &str,
    change: pb::set_limit_request::Change,
) -> anyhow::Result<pb::KeyState> {
    let mut limits = stack.limits_client().await?;
    Ok(limits
        .set_limit(pb::SetLimitRequest {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            change: Some(change),
        })
        .await?
        .into_inner()
        .state
        .unwrap_or_default())
}

pub async fn key_state(stack: &Stack, tenant: &str, key: &str) -> anyhow::Result<pb::KeyState> {
    let mut limits = stack.limits_client().await?;
    Ok(limits
        .describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            ticket: None,
            first_waiters: 10,
        })
        .await?
        .into_inner()
        .state
        .unwrap_or_default())
}

/// The most timestamps in any half-open interval `[s, s + window_ms)`.
pub fn max_in_window(times: &[i64], window_ms: i64) -> usize {
    let mut sorted = times.to_vec();
    sorted.sort_unstable();
    let mut best = 0;
    let mut end = 0;
    for start in 0..sorted.len() {
        while end < sorted.len() && sorted[end] < sorted[start] + window_ms {
            end += 1;
        }
        best = best.max(end - start);
    }
    best
}

/// A job with one inline rate limit.
pub fn rate_job(tenant: &str, name: &str, limit: i64, duration_ms: i64, payload: &str) -> pb::JobRequest {
    pb::JobRequest {
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name: name.to_string(),
                    unique_key: String::new(),
                    limit,
                    duration_ms,
                    cost: 1,
                })),
            })),
        }],
        ..Default::default()
    }
}

/// First grant time of each rate ticket among observed events.
pub fn rate_grant_times(events: &[pb::GrantEvent], key: &str) -> Vec<i64> {
    let mut seen = std::collections::HashSet::new();
    events
        .iter()
        .filter(|event| event.kind == pb::LimitKind::Rate as i32)
        .filter(|event| event.key.as_ref().is_some_and(|key_ref| key_ref.key == key))
        .filter(|event| seen.insert(event.ticket.clone()))
        .map(|event| event.granted_at_ms)
        .collect()
}

/// How many messages were ever written to `topic`: the sum of its
/// partitions' high watermarks.
pub async fn messages_written(config: &SluiceConfig, topic: &str) -> anyhow::Result<i64> {
    use rdkafka::consumer::BaseConsumer;
    let consumer: BaseConsumer = client_config(&config.kafka).create()?;
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        let mut total = 0;
        for partition in metadata.topics().iter().flat_map(|found| found.partitions()) {
            let (_, high) = consumer.fetch_watermarks(&topic, partition.id(), Duration::from_secs(10))?;
            total += high;
        }
        Ok(total)
    })
    .await?
}

/// Wait until consumer group `group` has committed, on every partition of
/// `topic`, the end offset the partition had when this was called: every
/// message produced to `topic` before the call was dealt with (Sluice's
/// consumers store an offset only once its message is handed over or
/// applied, and auto-commit sends what is stored).
pub async fn consumed_to_end(config: &SluiceConfig, topic: &str, group: &str) -> anyhow::Result<()> {
    use rdkafka::consumer::BaseConsumer;
    use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
    let consumer: BaseConsumer = client_config(&config.kafka).set("group.id", group).create()?;
    let topic = topic.to_string();
    let ends = {
        let topic = topic.clone();
        let consumer: BaseConsumer = client_config(&config.kafka).create()?;
        tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(i32, i64, i64)>> {
            let metadata = consumer.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
            let partitions: Vec<i32> = metadata
                .topics()
                .iter()
                .flat_map(|found| found.partitions().iter().map(|partition| partition.id()))
                .collect();
            anyhow::ensure!(!partitions.is_empty(), "topic {topic} has no partitions");
            partitions
                .into_iter()
                .map(|partition| {
                    let (low, high) = consumer.fetch_watermarks(&topic, partition, Duration::from_secs(10))?;
                    Ok((partition, low, high))
                })
                .collect()
        })
        .await??
    };
    let consumer = Arc::new(consumer);
    eventually(
        Duration::from_secs(60),
        &format!("{group} to commit the end of {topic}"),
        || {
            let consumer = consumer.clone();
            let topic = topic.clone();
            let ends = ends.clone();
            async move {
                tokio::task::spawn_blocking(move || -> anyhow::Result<bool> {
                    let mut wanted = TopicPartitionList::new();
                    for (partition, _, _) in &ends {
                        wanted.add_partition(&topic, *partition);
                    }
                    let committed = consumer.committed_offsets(wanted, Duration::from_secs(10))?;
                    Ok(ends.iter().all(|(partition, low, high)| {
                        if high <= low {
                            return true;
                        }
                        matches!(
                            committed.find_partition(&topic, *partition).map(|found| found.offset()),
                            Some(Offset::Offset(offset)) if offset >= *high
                        )
                    }))
                })
                .await?
            }
        },
    )
    .await
}

/// Poll `condition` until it holds.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut condition: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if condition().await? {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------
// Refresh workers (floating limits)

/// One refresh task as a test worker handled it.
#[derive(Clone, Debug)]
pub struct RefreshRecord {
    pub task: pb::RefreshTask,
    /// What the handler answered: a new max or an error.
    pub result: Result<i64, String>,
    /// Wall clock (unix ms) just before and after `ReportRefresh`.
    pub reporting_at_ms: i64,
    pub reported_at_ms: i64,
    pub response: pb::ReportRefreshResponse,
}

/// Computes a key's new max from its refresh task.
pub type RefreshHandler = Arc<dyn Fn(&pb::RefreshTask) -> Result<i64, String> + Send + Sync>;

/// Where a refresh worker reports: any refresh-dispatcher instance. Tests
/// that replace the dispatcher point it at the new one (in production it is
/// a Service address).
pub type DispatcherAddress = Arc<Mutex<String>>;

/// Consume `refresh.tasks`, run `handler`, report with `ReportRefresh` to
/// the dispatcher at `dispatcher` (any instance). Runs until `stop`.
pub async fn run_refresh_worker(
    config: Arc<SluiceConfig>,
    dispatcher: DispatcherAddress,
    handler: RefreshHandler,
    records: Arc<Mutex<Vec<RefreshRecord>>>,
    stop: Shutdown,
) -> anyhow::Result<()> {
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", format!("{}refresh-workers", config.kafka.topic_prefix))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string());
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[&config.topic(&config.topics.refresh_tasks)])?;
    loop {
        let message = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            received = consumer.recv() => received?,
        };
        let task = pb::RefreshTask::decode(message.payload().unwrap_or_default())?;
        let result = handler(&task);
        let request = pb::ReportRefreshRequest {
            task_id: task.task_id.clone(),
            key: task.key.clone(),
            result: Some(match &result {
                Ok(value) => pb::report_refresh_request::Result::NewMax(*value),
                Err(error) => pb::report_refresh_request::Result::Error(error.clone()),
            }),
        };
        let reporting_at_ms = sluice_common::clock::wall_clock_ms();
        // The key's owner may be moving (a restart): retry until it answers.
        let deadline = Instant::now() + Duration::from_secs(60);
        let response = loop {
            let endpoint = dispatcher
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone();
            let outcome = match connect(&endpoint).await {
                Ok(channel) => sluice_proto::v1::refresh_client::RefreshClient::new(channel)
                    .report_refresh(request.clone())
                    .await
                    .map_err(|status| anyhow::anyhow!("{status}")),
                Err(error) => Err(error),
            };
            match outcome {
                Ok(response) => break response.into_inner(),
                Err(error) => {
                    anyhow::ensure!(Instant::now() < deadline, "ReportRefresh kept failing: {error}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let reported_at_ms = sluice_common::clock::wall_clock_ms();
        records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(RefreshRecord {
                task,
                result,
                reporting_at_ms,
                reported_at_ms,
                response,
            });
    }
}

/// A job on one floating concurrency key.
pub fn floating_job(
    tenant: &str,
    key: &str,
    default_max: u32,
    refresh_interval_ms: u64,
    payload: &str,
) -> pb::JobRequest {
    pb::JobRequest {
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                key: key.to_string(),
                default_max,
                refresh_interval_ms,
                metadata: [("pool".to_string(), "gpu".to_string())].into_iter().collect(),
            })),
        }],
        ..Default::default()
    }
}

// ---------------------------------------------------------------------------
// Dead letters and quarantined input

/// One message of the dead-letter topic.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    pub payload: Vec<u8>,
    pub headers: HashMap<String, String>,
}

impl DeadLetter {
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// (source partition, source offset).
    pub fn source(&self) -> (String, String) {
        (
            self.header("sluice-source-partition").to_string(),
            self.header("sluice-source-offset").to_string(),
        )
    }
}

/// Read the dead-letter topic from its start until `until` holds for what
/// was read (or `timeout` passes: an error).
pub async fn read_dead_letters(
    config: &SluiceConfig,
    timeout: Duration,
    until: impl Fn(&[DeadLetter]) -> bool,
) -> anyhow::Result<Vec<DeadLetter>> {
    use rdkafka::message::Headers as _;
    let mut settings = client_config(&config.kafka);
    settings
        .set(
            "group.id",
            format!("{}dlq-{}", config.kafka.topic_prefix, uuid::Uuid::new_v4()),
        )
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "25");
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[&config.topic(&config.topics.deadletter)])?;
    let deadline = Instant::now() + timeout;
    let mut letters = Vec::new();
    while !until(&letters) {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            !left.is_zero(),
            "dead letters not as expected within {timeout:?}: {} read",
            letters.len()
        );
        let Ok(received) = tokio::time::timeout(left.min(Duration::from_secs(1)), consumer.recv()).await else {
            continue;
        };
        let message = received?;
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|header| {
                        (
                            header.key.to_string(),
                            String::from_utf8_lossy(header.value.unwrap_or_default()).to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        letters.push(DeadLetter {
            payload: message.payload().unwrap_or_default().to_vec(),
            headers,
        });
    }
    Ok(letters)
}

/// Read `topic` from its start until `until` holds for the payloads read.
pub async fn read_topic(
    config: &SluiceConfig,
    topic: &str,
    timeout: Duration,
    until: impl Fn(&[Vec<u8>]) -> bool,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut settings = client_config(&config.kafka);
    settings
        .set(
            "group.id",
            format!("{}reader-{}", config.kafka.topic_prefix, uuid::Uuid::new_v4()),
        )
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", "25");
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[topic])?;
    let deadline = Instant::now() + timeout;
    let mut payloads = Vec::new();
    while !until(&payloads) {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(
            !left.is_zero(),
            "{topic} not as expected within {timeout:?}: {} read",
            payloads.len()
        );
        if let Ok(received) = tokio::time::timeout(left.min(Duration::from_secs(1)), consumer.recv()).await {
            payloads.push(received?.payload().unwrap_or_default().to_vec());
        }
    }
    Ok(payloads)
}

/// Rows of a service's quarantine table: (input offset, entry, reason).
pub async fn quarantined(stack: &Stack, service_schema: &str) -> anyhow::Result<Vec<(i64, Vec<u8>, String)>> {
    let query = format!(
        "SELECT input_offset, entry, reason FROM \"{}\".quarantine ORDER BY id",
        stack.config.schema(service_schema)
    );
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
        .fetch_all(&stack.pool)
        .await?)
}

/// Publish raw messages (internal topics included) as a broken or hostile
/// producer would.
pub async fn publish_raw(config: &SluiceConfig, messages: Vec<sluice_common::kafka::OutMsg>) -> anyhow::Result<()> {
    sluice_common::kafka::Publisher::new(&config.kafka)?
        .send_all(messages)
        .await?;
    Ok(())
}

/// The partition librdkafka's default `consistent_random` partitioner gives
/// a message with `key` among `partitions`: CRC-32 (IEEE) of the key.
pub fn keyed_partition(key: &[u8], partitions: i32) -> i32 {
    let mut crc = 0xFFFF_FFFFu32;
    for byte in key {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    let hash = i64::from(!crc);
    i32::try_from(hash % i64::from(partitions.max(1))).unwrap_or(0)
}
