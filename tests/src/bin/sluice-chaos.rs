//! `make chaos`: the four services as separate processes, two of each, on
//! the real broker and PostgreSQL, while producers enqueue jobs on
//! concurrency keys and stream workers run them; every few seconds one
//! instance (or one worker) is killed with SIGKILL and restarted. Then the
//! history is checked: no job lost, no two attempts of a job at once, no key
//! over its limit, no slot held at the end, and the longest stall (a key with
//! waiting jobs and nothing running). One JSON line at the end; exit 1 when a
//! guarantee fails.
//!
//! Faults, one every 3-6 s while jobs are enqueued: SIGKILL of a service instance (restarted
//! after 0.5-2 s) or of a worker, SIGSTOP of the broker for 1-3 s
//! (CHAOS_BROKER_PID names it), every PostgreSQL connection of the
//! services paused for 1-3 s (they go through a proxy in this runner), or
//! both instances of one service killed and restarted after 5 s.
//!
//! Environment: CHAOS_JOBS (2000), CHAOS_KEYS (50), CHAOS_LIMIT (3),
//! CHAOS_KILLS (1; 0 runs the same workload without faults),
//! CHAOS_DEADLINE_S (600), CHAOS_RATE (40 jobs/s enqueued),
//! CHAOS_SERVICE_LOG (the services' RUST_LOG, `warn`), CHAOS_VICTIMS
//! (`workers`: kill only workers). The service
//! binaries are taken from this binary's directory (`make chaos` builds
//! them); the configuration is the built-in defaults plus a test prefix.

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::Rng;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

/// Every fourth job (but the floating ones) also takes a unit of one of
/// three rate limits, each `RATE_LIMIT` per `RATE_WINDOW_MS`. A job holds the
/// slots of its earlier steps while it waits for a later one: a floating job
/// waiting for a rate token (or for a rate-window instance that was killed)
/// would hold the floating key's few slots, and the floating key's stalls
/// would measure rate waits.
const RATE_LIMIT: i64 = 10;
const RATE_WINDOW_MS: i64 = 1000;

fn rate_key_of(job: usize) -> Option<String> {
    (job % 4 == 3 && !is_floating(job)).then(|| format!("r{}", job % 3))
}

/// Every fifth job also takes the floating limit `FLOATING_KEY` (default
/// max `FLOATING_DEFAULT_MAX`, refreshed every `FLOATING_REFRESH_MS` while it
/// has waiters) and runs longer, so that it has waiters. The refresh
/// worker answers a max from 1 to `FLOATING_CEILING`.
const FLOATING_KEY: &str = "f0";
const FLOATING_DEFAULT_MAX: u32 = 2;
const FLOATING_CEILING: u32 = 3;
const FLOATING_REFRESH_MS: u64 = 1000;

fn is_floating(job: usize) -> bool {
    job % 5 == 1
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// One handler run of one attempt.
#[derive(Clone, Debug)]
struct Run {
    job: usize,
    attempt: u32,
    started: Instant,
    ended: Instant,
}

/// What the workers saw, shared by all of them.
#[derive(Default)]
struct History {
    runs: Mutex<Vec<Run>>,
    enqueued: Mutex<HashMap<usize, Instant>>,
    /// The floating max each refresh answered.
    refreshes: Mutex<Vec<u32>>,
}

/// A TCP proxy to PostgreSQL whose connections can all be paused: nothing
/// moves either way until it resumes (a stalled network or server, as
/// the services see it).
struct PausingProxy {
    port: u16,
    paused: tokio::sync::watch::Sender<bool>,
}

impl PausingProxy {
    async fn start(upstream: String) -> anyhow::Result<Self> {
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

    fn pause(&self, paused: bool) {
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
struct Instance {
    service: &'static str,
    port: u16,
    child: Option<tokio::process::Child>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

struct Cluster {
    binaries: std::path::PathBuf,
    config_file: std::path::PathBuf,
    log_dir: std::path::PathBuf,
    instances: Vec<Instance>,
}

impl Cluster {
    fn spawn(&self, instance: &mut Instance) -> anyhow::Result<()> {
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
    async fn restart(&mut self, indices: &[usize], down: Duration) {
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

    async fn kill(instance: &mut Instance) {
        if let Some(mut child) = instance.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// `kill -<signal> <pid>`.
async fn signal(pid: i32, signal: &str) {
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
fn postgres_address(url: &str) -> anyhow::Result<String> {
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
fn proxied_url(url: &str, port: u16) -> anyhow::Result<String> {
    let address = postgres_address(url)?;
    let original = if url.contains(&address) {
        address
    } else {
        address.trim_end_matches(":5432").to_string()
    };
    Ok(url.replacen(&original, &format!("127.0.0.1:{port}"), 1))
}

fn endpoint(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_logging();
    let jobs: usize = env_number("CHAOS_JOBS", 2000);
    let keys: usize = env_number("CHAOS_KEYS", 50);
    let limit: u32 = env_number("CHAOS_LIMIT", 3);
    let kills = env_number::<u32>("CHAOS_KILLS", 1) > 0;
    let workers_only = std::env::var("CHAOS_VICTIMS").is_ok_and(|victims| victims == "workers");
    let deadline = Duration::from_secs(env_number("CHAOS_DEADLINE_S", 600));
    let rate: f64 = env_number("CHAOS_RATE", 40.0);
    let broker_pid: Option<i32> = std::env::var("CHAOS_BROKER_PID").ok().and_then(|pid| pid.parse().ok());
    let base = test_config("chaos", &[])?;
    let postgres = PausingProxy::start(postgres_address(base.postgres.url.expose())?).await?;
    let postgres_url = proxied_url(base.postgres.url.expose(), postgres.port)?;
    let binaries = std::env::current_exe()?
        .parent()
        .context("the binary's directory")?
        .to_path_buf();
    let work = std::env::temp_dir().join(format!("sluice-chaos-{}", base.kafka.topic_prefix));
    std::fs::create_dir_all(&work)?;

    // Every instance's configuration: the defaults, the test's prefixes.
    let limit_grant = ServiceProxy::start(false).await?;
    let rate_window = ServiceProxy::start(false).await?;
    let admission = ServiceProxy::start(false).await?;
    let refresh = ServiceProxy::start(false).await?;
    let config_file = work.join("sluice.toml");
    std::fs::write(
        &config_file,
        format!(
            "[kafka]\nbrokers = {brokers:?}\ntopic_prefix = {prefix:?}\n\
             [kafka.producer_properties]\n\"batch.num.messages\" = \"1\"\n\
             [kafka.partitions]\njobs = 4\nlimit_commands = 4\nrate_commands = 4\nrefresh_due = 2\nrequested = 2\n\
             [postgres]\nurl = {postgres_url:?}\nschema_prefix = {prefix:?}\nmax_connections = 8\n\
             [telemetry]\nmetrics_listen = \"\"\nlog_format = \"json\"\n\
             [auth]\nenabled = false\n\
             [admission]\nlimit_grant_endpoint = {limits:?}\nrate_window_endpoint = {rates:?}\n",
            brokers = base.kafka.brokers,
            prefix = base.kafka.topic_prefix,
            limits = limit_grant.endpoint,
            rates = rate_window.endpoint,
        ),
    )?;
    let mut cluster = Cluster {
        binaries,
        config_file,
        log_dir: work.clone(),
        instances: Vec::new(),
    };
    for service in ["limit-grant", "rate-window", "refresh-dispatcher", "admission"] {
        for _ in 0..2 {
            let mut instance = Instance {
                service,
                port: free_port()?,
                child: None,
            };
            cluster.spawn(&mut instance)?;
            match service {
                "limit-grant" => limit_grant.add(&endpoint(instance.port)),
                "rate-window" => rate_window.add(&endpoint(instance.port)),
                "admission" => admission.add(&endpoint(instance.port)),
                _ => refresh.add(&endpoint(instance.port)),
            }
            cluster.instances.push(instance);
        }
    }
    for instance in &cluster.instances {
        wait_serving(&endpoint(instance.port), Duration::from_secs(120)).await?;
    }

    // Every rate grant, as each rate-window instance sends it.
    let grants: Arc<Mutex<Vec<pb::GrantEvent>>> = Arc::default();
    let watching_grants = sluice_common::Shutdown::new();
    for instance in cluster
        .instances
        .iter()
        .filter(|instance| instance.service == "rate-window")
    {
        let (opened, opened_receiver) = tokio::sync::oneshot::channel();
        tokio::spawn(watch_grants(
            endpoint(instance.port),
            grants.clone(),
            watching_grants.clone(),
            opened,
        ));
        tokio::time::timeout(Duration::from_secs(60), opened_receiver)
            .await
            .context("watching a rate-window instance's grants")??;
    }

    let history = Arc::new(History::default());
    let started = Instant::now();
    let refresher = start_refresh_worker(&base, &admission.endpoint, &refresh.endpoint, history.clone())?;
    let workers = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..2 {
        let handle = start_worker(&admission.endpoint, history.clone());
        workers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(handle);
    }

    // Faults: every 3-6 s one instance or one worker dies and comes back.
    let stop = sluice_common::Shutdown::new();
    let finish = sluice_common::Shutdown::new();
    let kill_count = Arc::new(Mutex::new(0u32));
    let chaos = {
        let stop = stop.clone();
        let finish = finish.clone();
        let kill_count = kill_count.clone();
        let workers = workers.clone();
        let admission_endpoint = admission.endpoint.clone();
        let history = history.clone();
        tokio::spawn(async move {
            let mut cluster = cluster;
            loop {
                let pause = Duration::from_millis(rand::rng().random_range(3000..6000));
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(pause) => {}
                }
                if !kills {
                    continue;
                }
                // The instances, a worker, the broker, PostgreSQL, a whole
                // service.
                let worker_victim = cluster.instances.len();
                let victims = cluster.instances.len() + 4;
                let victim = if workers_only {
                    worker_victim
                } else {
                    rand::rng().random_range(0..victims)
                };
                *kill_count.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) += 1;
                eprint!("chaos: at {:.1}s ", started.elapsed().as_secs_f64());
                let paused_for = Duration::from_millis(rand::rng().random_range(1000..3000));
                if victim == worker_victim + 1 {
                    let Some(pid) = broker_pid else {
                        eprintln!("chaos: no CHAOS_BROKER_PID: the broker is not paused");
                        continue;
                    };
                    eprintln!("chaos: SIGSTOP the broker for {paused_for:?}");
                    signal(pid, "STOP").await;
                    tokio::time::sleep(paused_for).await;
                    signal(pid, "CONT").await;
                    continue;
                }
                if victim == worker_victim + 2 {
                    eprintln!("chaos: PostgreSQL connections paused for {paused_for:?}");
                    postgres.pause(true);
                    tokio::time::sleep(paused_for).await;
                    postgres.pause(false);
                    continue;
                }
                if victim == worker_victim {
                    let handle = workers
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .remove(0);
                    handle.abort();
                    let fresh = start_worker(&admission_endpoint, history.clone());
                    workers
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .push(fresh);
                    eprintln!("chaos: killed a worker");
                    continue;
                }
                if victim == worker_victim + 3 {
                    // A whole service down for 5 s.
                    let services = ["limit-grant", "rate-window", "refresh-dispatcher", "admission"];
                    let service = services[rand::rng().random_range(0..services.len())];
                    eprintln!("chaos: kill -9 every sluice-{service} for 5s");
                    let all: Vec<usize> = (0..cluster.instances.len())
                        .filter(|index| cluster.instances[*index].service == service)
                        .collect();
                    cluster.restart(&all, Duration::from_secs(5)).await;
                    continue;
                }
                let instance = &cluster.instances[victim];
                eprintln!("chaos: kill -9 sluice-{} on port {}", instance.service, instance.port);
                let down = Duration::from_millis(rand::rng().random_range(500..2000));
                cluster.restart(&[victim], down).await;
            }
            // No more faults; the instances serve until the checks are done.
            finish.cancelled().await;
            for instance in &mut cluster.instances {
                Cluster::kill(instance).await;
            }
        })
    };

    // Producers: every job once, retried with its id until accepted.
    let client = AdmissionClient::new(connect(&admission.endpoint).await?);
    let watching = tokio::spawn(watch_slow_jobs(
        client.clone(),
        limit_grant.endpoint.clone(),
        history.clone(),
        started,
    ));
    // Up to 16 enqueues in flight, started at `rate` per second at most.
    let producing = {
        let history = history.clone();
        let client = client.clone();
        tokio::spawn(async move {
            let every = Duration::from_secs_f64(1.0 / rate.max(1.0));
            let in_flight = Arc::new(tokio::sync::Semaphore::new(16));
            for job in 0..jobs {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let request = chaos_request(job, keys, limit);
                let client = client.clone();
                let history = history.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    loop {
                        let mut client = client.clone();
                        match client
                            .enqueue(pb::EnqueueRequest {
                                job: Some(request.clone()),
                            })
                            .await
                        {
                            Ok(_) => break,
                            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                        }
                    }
                    // Waiting in Sluice from when it was accepted (a retry
                    // may have been accepted the first time: this is later,
                    // so a stall is never overstated).
                    history
                        .enqueued
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .insert(job, Instant::now());
                });
                tokio::time::sleep(every).await;
            }
            // Every enqueue answered.
            let _ = in_flight.acquire_many(16).await;
        })
    };
    producing.await?;
    // Faults while jobs are enqueued; then the system must heal and finish
    // every job (a fault under way completes: its instances come back).
    stop.trigger();

    // Until every job succeeded (as GetJob says), or the deadline.
    let mut pending: Vec<usize> = (0..jobs).collect();
    while !pending.is_empty() && started.elapsed() < deadline {
        let mut still = Vec::new();
        for job in pending {
            let mut client = client.clone();
            let succeeded = client
                .get_job(pb::GetJobRequest {
                    job_id: format!("chaos-{job}"),
                })
                .await
                .ok()
                .and_then(|response| response.into_inner().job)
                .is_some_and(|view| view.status == pb::JobStatus::Succeeded as i32);
            if !succeeded {
                still.push(job);
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let elapsed = started.elapsed();
    watching.abort();
    // What the jobs that did not succeed are doing.
    let mut unfinished: BTreeMap<String, usize> = BTreeMap::new();
    for job in &pending {
        let mut client = client.clone();
        let seen = match client
            .get_job(pb::GetJobRequest {
                job_id: format!("chaos-{job}"),
            })
            .await
        {
            Ok(response) => response.into_inner().job.map_or("no job".to_string(), |view| {
                format!(
                    "{:?} attempt {}",
                    pb::JobStatus::try_from(view.status).unwrap_or_default(),
                    view.attempt
                )
            }),
            Err(status) => format!("{:?}", status.code()),
        };
        eprintln!("chaos: chaos-{job} did not succeed: {seen}");
        *unfinished.entry(seen).or_default() += 1;
    }

    // Slots still held once every job ended (releases are asynchronous).
    let mut limits = sluice_proto::v1::limits_client::LimitsClient::new(connect(&limit_grant.endpoint).await?);
    // `None`: some key could not be read (counted as a failure).
    let mut held: Option<usize> = None;
    let mut unread = String::new();
    let settle = Instant::now() + Duration::from_secs(60);
    while Instant::now() < settle {
        // A new connection each round: through the proxy, to either
        // instance (one still loading a partition answers NOT_OWNER).
        if let Ok(channel) = connect(&limit_grant.endpoint).await {
            limits = sluice_proto::v1::limits_client::LimitsClient::new(channel);
        }
        let mut counted = Some(0usize);
        for key in 0..keys {
            let state = match limits
                .describe_key(pb::DescribeKeyRequest {
                    key: Some(pb::KeyRef {
                        tenant: "chaos".to_string(),
                        key: format!("k{key}"),
                    }),
                    ..Default::default()
                })
                .await
            {
                Ok(response) => response.into_inner().state,
                Err(status) => {
                    unread = format!("k{key}: {status}");
                    None
                }
            };
            counted = match (counted, state) {
                (Some(total), Some(state)) => Some(total + state.holders.len()),
                _ => None,
            };
        }
        held = counted;
        if held.is_none() {
            eprintln!("chaos: a key could not be read: {unread}");
        }
        if held == Some(0) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    finish.trigger();
    let _ = chaos.await;
    for handle in workers
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .drain(..)
    {
        handle.abort();
    }
    refresher.abort();

    let runs = history
        .runs
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    let enqueued = history
        .enqueued
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    watching_grants.trigger();
    let rate_grants = grants.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
    let (rate_granted, over_rate) = rate_windows_exceeded(&rate_grants);
    let overlapping = overlapping_attempts(&runs);
    let over_limit =
        max_running(&runs, |job| Some(job % keys.max(1))).saturating_sub(usize::try_from(limit).unwrap_or(usize::MAX));
    // The floating max moves between 1 and FLOATING_CEILING; a lower max
    // only affects new grants, so the ceiling is never passed.
    let floating_running = max_running(&runs, |job| is_floating(job).then_some(0));
    let floating_over_limit = floating_running.saturating_sub(usize::try_from(FLOATING_CEILING).unwrap_or(usize::MAX));
    let refreshes = history
        .refreshes
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .len();
    // Jobs that wait for a rate or floating limit are not stalled on their
    // key.
    let unthrottled: HashMap<usize, Instant> = enqueued
        .iter()
        .filter(|(job, _)| rate_key_of(**job).is_none() && !is_floating(**job))
        .map(|(job, at)| (*job, *at))
        .collect();
    let stalls = stalls_of(&runs, &unthrottled, |job| job % keys.max(1), started + elapsed);
    // The floating key's own stalls: its jobs waited, none of them ran
    // (they may also wait for their concurrency key or a rate limit).
    let floating_jobs: HashMap<usize, Instant> = enqueued
        .iter()
        .filter(|(job, _)| is_floating(**job))
        .map(|(job, at)| (*job, *at))
        .collect();
    let floating_runs: Vec<Run> = runs.iter().filter(|run| is_floating(run.job)).cloned().collect();
    let floating_stall = stalls_of(&floating_runs, &floating_jobs, |_| 0, started + elapsed)
        .last()
        .map_or(0.0, |stall| stall.seconds);
    let percentile = |p: f64| -> f64 {
        if stalls.is_empty() {
            return 0.0;
        }
        let index = ((stalls.len() as f64 - 1.0) * p).round() as usize;
        stalls[index.min(stalls.len() - 1)].seconds
    };
    let longest = stalls.last().copied();
    let figures = serde_json::json!({
        "jobs": jobs,
        "keys": keys,
        "limit": limit,
        "kills": *kill_count.lock().unwrap_or_else(|poisoned| poisoned.into_inner()),
        "lost": pending.len(),
        "unfinished": unfinished,
        "overlapping_attempts": overlapping,
        "over_limit": over_limit,
        // Rate grants seen (distinct tickets), and windows of
        // RATE_WINDOW_MS holding more than RATE_LIMIT of them.
        "rate_grants": rate_granted,
        "rate_windows_exceeded": over_rate,
        "held_slots_at_end": held,
        // The most floating-limit jobs that ran at once, those over
        // FLOATING_CEILING, and the refreshes the worker answered (none is
        // a failure: the floating key has waiters all along).
        "floating_max_running": floating_running,
        "floating_over_limit": floating_over_limit,
        "refreshes": refreshes,
        "floating_stall_max_s": floating_stall,
        "runs": runs.len(),
        "max_attempt": runs.iter().map(|run| run.attempt).max().unwrap_or(0),
        "stall_p50_s": percentile(0.5),
        "stall_p99_s": percentile(0.99),
        "stall_max_s": longest.map_or(0.0, |stall| stall.seconds),
        // Which key, and when (seconds into the run): match it with the
        // faults printed on stderr and the services' logs.
        "stall_max_key": longest.map(|stall| format!("k{}", stall.key)),
        "stall_max_from_s": longest.map(|stall| stall.from.saturating_duration_since(started).as_secs_f64()),
        "jobs_per_s": jobs as f64 / elapsed.as_secs_f64(),
        "elapsed_s": elapsed.as_secs_f64(),
        "logs": work.to_string_lossy(),
    });
    println!("{figures}");
    let failed = !pending.is_empty()
        || overlapping > 0
        || over_limit > 0
        || floating_over_limit > 0
        || refreshes == 0
        || over_rate > 0
        || held != Some(0);
    std::process::exit(i32::from(failed));
}

/// Job `job`: on key `k<job % keys>` of `limit`, every fourth one also on
/// a rate limit, every fifth on the floating limit, retried up to 100
/// attempts.
fn chaos_request(job: usize, keys: usize, limit: u32) -> pb::JobRequest {
    let mut request = concurrency_job("chaos", &format!("k{}", job % keys), limit, 0, &job.to_string());
    request.job_id = Some(format!("chaos-{job}"));
    if let Some(name) = rate_key_of(job) {
        request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name,
                    unique_key: String::new(),
                    limit: RATE_LIMIT,
                    duration_ms: RATE_WINDOW_MS,
                    cost: 1,
                })),
            })),
        });
    }
    if is_floating(job) {
        request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                key: FLOATING_KEY.to_string(),
                default_max: FLOATING_DEFAULT_MAX,
                refresh_interval_ms: FLOATING_REFRESH_MS,
                metadata: Default::default(),
            })),
        });
    }
    // A killed worker's attempt ends as a lease expiry, which uses up an
    // attempt: enough of them that faults never fail a job.
    request.retry = Some(pb::RetryPolicy {
        max_attempts: 100,
        initial_backoff: "100ms".to_string(),
        max_backoff: "1s".to_string(),
        ..pb::RetryPolicy::default()
    });
    request
}

/// Every 5 s, say on stderr where the jobs on concurrency keys alone that
/// have waited longest without running are (a stall's cause, while it
/// lasts), and the oldest floating-limit job past 20 s.
async fn watch_slow_jobs(
    client: AdmissionClient<tonic::transport::Channel>,
    limit_grant: String,
    history: Arc<History>,
    started: Instant,
) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let ran: std::collections::HashSet<usize> = history
            .runs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|run| run.job)
            .collect();
        let mut slow: Vec<(usize, Instant)> = history
            .enqueued
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .filter(|(job, at)| !ran.contains(job) && at.elapsed() > Duration::from_secs(10))
            .map(|(job, at)| (*job, *at))
            .collect();
        slow.sort_by_key(|(_, at)| *at);
        // The three oldest a stall counts (a rate or floating limit's wait
        // is its capacity), and the oldest floating-limit job once it has
        // waited 20 s.
        let counted = slow
            .iter()
            .filter(|(job, _)| rate_key_of(*job).is_none() && !is_floating(*job))
            .take(3);
        let floating = slow
            .iter()
            .filter(|(job, at)| is_floating(*job) && at.elapsed() > Duration::from_secs(20))
            .take(1);
        let shown: Vec<(usize, Instant)> = counted.chain(floating).copied().collect();
        for (job, at) in shown {
            let mut client = client.clone();
            let view = client
                .get_job(pb::GetJobRequest {
                    job_id: format!("chaos-{job}"),
                })
                .await
                .ok()
                .and_then(|response| response.into_inner().job);
            let Some(view) = view else { continue };
            eprintln!(
                "chaos: at {:.1}s chaos-{job} (key k{}) waited {:.1}s: {:?} attempt {} step {}; {}; history {:?}",
                started.elapsed().as_secs_f64(),
                job % env_number::<usize>("CHAOS_KEYS", 50),
                at.elapsed().as_secs_f64(),
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.attempt,
                view.step,
                view.reason,
                view.history
                    .iter()
                    .map(|record| record.outcome.as_str())
                    .collect::<Vec<_>>(),
            );
            if is_floating(job) {
                print_floating_holders(&client, &limit_grant).await;
            }
        }
    }
}

/// Who holds the floating key, and what those jobs are doing (a floating
/// job waiting long: is a holder running?).
async fn print_floating_holders(client: &AdmissionClient<tonic::transport::Channel>, limit_grant: &str) {
    let Ok(channel) = connect(limit_grant).await else {
        eprintln!("chaos: the floating key's holders: limit-grant unreachable");
        return;
    };
    let described = sluice_proto::v1::limits_client::LimitsClient::new(channel)
        .describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef {
                tenant: "chaos".to_string(),
                key: FLOATING_KEY.to_string(),
            }),
            ..Default::default()
        })
        .await;
    let state = match described {
        Ok(response) => response.into_inner().state.unwrap_or_default(),
        Err(status) => {
            eprintln!("chaos: the floating key's holders: {status}");
            return;
        }
    };
    for holder in state.holders {
        let Some(ticket) = holder.ticket else { continue };
        let mut client = client.clone();
        let view = client
            .get_job(pb::GetJobRequest {
                job_id: ticket.job_id.clone(),
            })
            .await
            .ok()
            .and_then(|response| response.into_inner().job);
        eprintln!(
            "chaos:   {FLOATING_KEY} held by {} attempt {} step {} since {} ms (floating max {:?}): {}",
            ticket.job_id,
            ticket.attempt,
            ticket.step,
            holder.granted_at_ms,
            state.floating_max,
            view.map_or("no job".to_string(), |view| format!(
                "{:?} attempt {} step {}; {}",
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.attempt,
                view.step,
                view.reason
            )),
        );
    }
}

fn start_worker(admission: &str, history: Arc<History>) -> tokio::task::JoinHandle<()> {
    let options = sluice_client::ClientOptions {
        brokers: String::new(),
        admission_endpoint: admission.to_string(),
        ..sluice_client::ClientOptions::default()
    };
    tokio::spawn(async move {
        let worker = sluice_client::Worker::builder(options, move |job: sluice_client::Job| {
            let history = history.clone();
            async move {
                let started = Instant::now();
                let index: usize = std::str::from_utf8(job.payload())
                    .ok()
                    .and_then(|text| text.parse().ok())
                    .unwrap_or(usize::MAX);
                let pause = if is_floating(index) {
                    rand::rng().random_range(300..900)
                } else {
                    rand::rng().random_range(10..40)
                };
                tokio::time::sleep(Duration::from_millis(pause)).await;
                history
                    .runs
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(Run {
                        job: index,
                        attempt: job.attempt(),
                        started,
                        ended: Instant::now(),
                    });
                Ok(())
            }
        })
        .task_group("default")
        .concurrency(16)
        .transport(sluice_client::Transport::Stream)
        .build();
        match worker {
            Ok(worker) => {
                let _ = worker.run(sluice_client::CancellationToken::new()).await;
            }
            Err(error) => eprintln!("chaos: worker failed to build: {error}"),
        }
    })
}

/// A worker that only computes floating-limit refreshes: a max from 1 to
/// `FLOATING_CEILING`, at random, reported through `refresh` (any
/// refresh-dispatcher instance).
fn start_refresh_worker(
    base: &sluice_common::SluiceConfig,
    admission: &str,
    refresh: &str,
    history: Arc<History>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let options = sluice_client::ClientOptions {
        brokers: base.kafka.brokers.clone(),
        topic_prefix: base.kafka.topic_prefix.clone(),
        admission_endpoint: admission.to_string(),
        refresh_endpoint: refresh.to_string(),
        ..sluice_client::ClientOptions::default()
    };
    let worker = sluice_client::Worker::builder(options, |_job: sluice_client::Job| async {
        Err(sluice_client::JobError::retryable("the refresh worker runs no jobs"))
    })
    .task_group("chaos-refresh-only")
    .transport(sluice_client::Transport::Stream)
    .refresh_handler(move |_task: pb::RefreshTask| {
        let history = history.clone();
        async move {
            let max = rand::rng().random_range(1..=FLOATING_CEILING);
            history
                .refreshes
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(max);
            Ok::<u32, sluice_client::RefreshError>(max)
        }
    })
    .build()
    .context("the refresh worker")?;
    Ok(tokio::spawn(async move {
        let _ = worker.run(sluice_client::CancellationToken::new()).await;
    }))
}

/// Distinct rate grants (by ticket), and how many of them have more than
/// `RATE_LIMIT` grants of their key within `RATE_WINDOW_MS` up to and
/// including themselves, by the rate-window's grant time.
fn rate_windows_exceeded(events: &[pb::GrantEvent]) -> (usize, usize) {
    let mut by_key: HashMap<String, BTreeMap<(String, u32, u32), i64>> = HashMap::new();
    for event in events {
        if event.kind != pb::LimitKind::Rate as i32 {
            continue;
        }
        let (Some(key), Some(ticket)) = (&event.key, &event.ticket) else {
            continue;
        };
        by_key
            .entry(key.key.clone())
            .or_default()
            .entry((ticket.job_id.clone(), ticket.attempt, ticket.step))
            .or_insert(event.granted_at_ms);
    }
    let mut granted = 0;
    let mut exceeded = 0;
    for tickets in by_key.values() {
        let mut times: Vec<i64> = tickets.values().copied().collect();
        times.sort_unstable();
        granted += times.len();
        let mut first = 0;
        for (last, at) in times.iter().enumerate() {
            while times[first] <= at - RATE_WINDOW_MS {
                first += 1;
            }
            if i64::try_from(last - first + 1).unwrap_or(i64::MAX) > RATE_LIMIT {
                exceeded += 1;
            }
        }
    }
    (granted, exceeded)
}

/// Pairs of runs of one job that overlap in time.
fn overlapping_attempts(runs: &[Run]) -> usize {
    let mut by_job: BTreeMap<usize, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        by_job.entry(run.job).or_default().push(run);
    }
    let mut overlapping = 0;
    for runs in by_job.values() {
        for (index, first) in runs.iter().enumerate() {
            for second in &runs[index + 1..] {
                if first.started < second.ended && second.started < first.ended {
                    overlapping += 1;
                }
            }
        }
    }
    overlapping
}

/// The most runs of one key at once; `key_of` says which key a job counts
/// on (`None`: none).
fn max_running(runs: &[Run], key_of: impl Fn(usize) -> Option<usize>) -> usize {
    let mut events: BTreeMap<usize, Vec<(Instant, i32)>> = BTreeMap::new();
    for run in runs {
        let Some(key) = key_of(run.job) else {
            continue;
        };
        // An end before a start at the same instant: back to back is fine.
        events.entry(key).or_default().push((run.started, 1));
        events.entry(key).or_default().push((run.ended, -1));
    }
    let mut most = 0;
    for mut events in events.into_values() {
        events.sort_by_key(|(at, change)| (*at, *change));
        let mut running = 0i32;
        for (_, change) in events {
            running += change;
            most = most.max(usize::try_from(running).unwrap_or(0));
        }
    }
    most
}

/// A period in which a key had a waiting job and nothing running.
#[derive(Clone, Copy, Debug)]
struct Stall {
    seconds: f64,
    key: usize,
    /// When it began, after the run started.
    from: Instant,
}

/// Every stall, shortest first.
fn stalls_of(
    runs: &[Run],
    enqueued: &HashMap<usize, Instant>,
    key_of: impl Fn(usize) -> usize,
    end: Instant,
) -> Vec<Stall> {
    let mut first_start: HashMap<usize, Instant> = HashMap::new();
    for run in runs {
        let entry = first_start.entry(run.job).or_insert(run.started);
        *entry = (*entry).min(run.started);
    }
    let mut events: BTreeMap<usize, Vec<(Instant, i32, i32)>> = BTreeMap::new();
    for (job, at) in enqueued {
        let key = key_of(*job);
        let started = first_start.get(job).copied().unwrap_or(end);
        events.entry(key).or_default().push((*at, 1, 0));
        events.entry(key).or_default().push((started, -1, 0));
    }
    for run in runs {
        let key = key_of(run.job);
        events.entry(key).or_default().push((run.started, 0, 1));
        events.entry(key).or_default().push((run.ended, 0, -1));
    }
    let mut periods = Vec::new();
    for (key, mut events) in events {
        events.sort_by_key(|(at, waiting, running)| (*at, -(*running), -(*waiting)));
        let (mut waiting, mut running) = (0i32, 0i32);
        let mut since: Option<Instant> = None;
        for (at, waiting_change, running_change) in events {
            waiting += waiting_change;
            running += running_change;
            let stalled = waiting > 0 && running == 0;
            match (stalled, since) {
                (true, None) => since = Some(at),
                (false, Some(from)) => {
                    periods.push(Stall {
                        seconds: at.duration_since(from).as_secs_f64(),
                        key,
                        from,
                    });
                    since = None;
                }
                _ => {}
            }
        }
        if let Some(from) = since {
            periods.push(Stall {
                seconds: end.saturating_duration_since(from).as_secs_f64(),
                key,
                from,
            });
        }
    }
    periods.sort_by(|left, right| left.seconds.total_cmp(&right.seconds));
    periods
}
