//! The stack as processes: instances of each service on fixed ports behind
//! a stable address each, reading one configuration file, killed and
//! started again; a PostgreSQL proxy whose connections can be paused;
//! signals to the broker; what a process holds in memory.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use sluice_common::SluiceConfig;
use sluice_e2e::{wait_serving, ServiceProxy};

/// Every service, in the order their instances start.
pub const SERVICES: [&str; 4] = ["limit-grant", "rate-window", "refresh-dispatcher", "admission"];

/// Each service's stable address (as a Kubernetes Service gives one).
pub struct Addresses {
    pub limit_grant: ServiceProxy,
    pub rate_window: ServiceProxy,
    pub admission: ServiceProxy,
    pub refresh: ServiceProxy,
}

impl Addresses {
    pub async fn start() -> anyhow::Result<Self> {
        Ok(Addresses {
            limit_grant: ServiceProxy::start(false).await?,
            rate_window: ServiceProxy::start(false).await?,
            admission: ServiceProxy::start(false).await?,
            refresh: ServiceProxy::start(false).await?,
        })
    }

    pub fn of(&self, service: &str) -> &ServiceProxy {
        match service {
            "limit-grant" => &self.limit_grant,
            "rate-window" => &self.rate_window,
            "admission" => &self.admission,
            _ => &self.refresh,
        }
    }
}

/// The configuration file every instance reads: the built-in defaults
/// under it, then tables of TOML values (`set` adds or replaces one).
pub struct ConfigFile {
    tables: BTreeMap<String, BTreeMap<String, String>>,
}

impl ConfigFile {
    /// The run's broker, topic and schema prefixes (from `base`), its
    /// PostgreSQL URL, the services' addresses, no metrics listener, JSON
    /// logs, no authentication.
    pub fn new(base: &SluiceConfig, postgres_url: &str, addresses: &Addresses) -> Self {
        let mut file = ConfigFile {
            tables: BTreeMap::new(),
        };
        let prefix = &base.kafka.topic_prefix;
        file.set("kafka", "brokers", format!("{:?}", base.kafka.brokers));
        file.set("kafka", "topic_prefix", format!("{prefix:?}"));
        file.set("postgres", "url", format!("{postgres_url:?}"));
        file.set("postgres", "schema_prefix", format!("{prefix:?}"));
        file.set("telemetry", "metrics_listen", "\"\"".to_string());
        file.set("telemetry", "log_format", "\"json\"".to_string());
        file.set("auth", "enabled", "false".to_string());
        file.set(
            "admission",
            "limit_grant_endpoint",
            format!("{:?}", addresses.limit_grant.endpoint),
        );
        file.set(
            "admission",
            "rate_window_endpoint",
            format!("{:?}", addresses.rate_window.endpoint),
        );
        file
    }

    /// `key = value` in `[table]`; `value` is TOML (a string quoted).
    pub fn set(&mut self, table: &str, key: &str, value: String) -> &mut Self {
        self.tables
            .entry(table.to_string())
            .or_default()
            .insert(key.to_string(), value);
        self
    }

    pub fn text(&self) -> String {
        let mut text = String::new();
        for (table, entries) in &self.tables {
            text.push_str(&format!("[{table}]\n"));
            for (key, value) in entries {
                text.push_str(&format!("{key} = {value}\n"));
            }
        }
        text
    }
}

/// A TCP proxy to PostgreSQL whose connections can all be paused: nothing
/// moves either way until it resumes (a stalled network or server, as
/// the services see it).
pub struct PausingProxy {
    pub port: u16,
    paused: tokio::sync::watch::Sender<bool>,
}

impl PausingProxy {
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (paused, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::select! {
                        _ = pipe(client_read, server_write, watch.clone()) => {}
                        _ = pipe(server_read, client_write, watch) => {}
                    }
                });
            }
        });
        Ok(Self { port, paused })
    }

    pub fn pause(&self, paused: bool) {
        let _ = self.paused.send(paused);
    }
}

/// Copy `from` to `to`, holding each chunk while paused.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = from.read(&mut buffer).await?;
        if read == 0 {
            return Ok(());
        }
        if paused.wait_for(|paused| !*paused).await.is_err() {
            return Ok(());
        }
        to.write_all(&buffer[..read]).await?;
    }
}

/// One service instance: a child process on a fixed port.
pub struct Instance {
    pub service: &'static str,
    pub port: u16,
    pub child: Option<tokio::process::Child>,
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub struct Cluster {
    pub binaries: std::path::PathBuf,
    pub config_file: std::path::PathBuf,
    pub log_dir: std::path::PathBuf,
    pub instances: Vec<Instance>,
}

impl Cluster {
    /// `per_service` instances of every service, each behind its service's
    /// address, once all of them serve.
    pub async fn start(
        binaries: std::path::PathBuf,
        config_file: std::path::PathBuf,
        log_dir: std::path::PathBuf,
        addresses: &Addresses,
        per_service: usize,
    ) -> anyhow::Result<Cluster> {
        let mut cluster = Cluster {
            binaries,
            config_file,
            log_dir,
            instances: Vec::new(),
        };
        for service in SERVICES {
            for _ in 0..per_service {
                let mut instance = Instance {
                    service,
                    port: free_port()?,
                    child: None,
                };
                cluster.spawn(&mut instance)?;
                addresses.of(service).add(&endpoint(instance.port));
                cluster.instances.push(instance);
            }
        }
        for instance in &cluster.instances {
            wait_serving(&endpoint(instance.port), Duration::from_secs(120)).await?;
        }
        Ok(cluster)
    }

    pub fn spawn(&self, instance: &mut Instance) -> anyhow::Result<()> {
        let section = instance.service.replace('-', "_").to_uppercase();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("{}-{}.log", instance.service, instance.port)))?;
        let child = tokio::process::Command::new(self.binaries.join(format!("sluice-{}", instance.service)))
            .arg("--config")
            .arg(&self.config_file)
            .arg("run")
            .env(
                format!("SLUICE__{section}__LISTEN"),
                format!("127.0.0.1:{}", instance.port),
            )
            .env(
                "RUST_LOG",
                std::env::var("CHAOS_SERVICE_LOG").unwrap_or_else(|_| "warn".to_string()),
            )
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting sluice-{}", instance.service))?;
        instance.child = Some(child);
        Ok(())
    }

    /// Kill the instances at `indices`, and start them again after `down`.
    pub async fn restart(&mut self, indices: &[usize], down: Duration) {
        for index in indices {
            Cluster::kill(&mut self.instances[*index]).await;
        }
        tokio::time::sleep(down).await;
        for index in indices {
            let mut instance = std::mem::replace(
                &mut self.instances[*index],
                Instance {
                    service: "",
                    port: 0,
                    child: None,
                },
            );
            if let Err(error) = self.spawn(&mut instance) {
                eprintln!("chaos: restarting failed: {error:#}");
            }
            self.instances[*index] = instance;
        }
    }

    pub async fn kill(instance: &mut Instance) {
        if let Some(mut child) = instance.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// The resident memory of process `pid` (VmRSS), in bytes; 0 once it is
/// gone.
pub fn resident_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// `kill -<signal> <pid>`.
pub async fn signal(pid: i32, signal: &str) {
    let sent = tokio::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .await;
    if !sent.is_ok_and(|status| status.success()) {
        eprintln!("chaos: kill -{signal} {pid} failed");
    }
}

/// The `host:port` of a PostgreSQL URL.
pub fn postgres_address(url: &str) -> anyhow::Result<String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    let address = rest.split(['/', '?']).next().unwrap_or_default();
    anyhow::ensure!(!address.is_empty(), "no host in the PostgreSQL URL");
    Ok(if address.contains(':') {
        address.to_string()
    } else {
        format!("{address}:5432")
    })
}

/// The URL with its host and port replaced by the proxy's.
pub fn proxied_url(url: &str, port: u16) -> anyhow::Result<String> {
    let address = postgres_address(url)?;
    let original = if url.contains(&address) {
        address
    } else {
        address.trim_end_matches(":5432").to_string()
    };
    Ok(url.replacen(&original, &format!("127.0.0.1:{port}"), 1))
}

pub fn endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}
