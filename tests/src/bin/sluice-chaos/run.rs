//! One run: a fresh stack (two processes of each service), worker
//! processes of one kind, the producers, the faults (or none), and at the
//! end the figures of its JSON line.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use rand::Rng;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

use crate::analysis::{self, JobEnd, WorkerHistory};
use crate::cluster::{
    endpoint, postgres_address, proxied_url, signal, Addresses, Cluster, ConfigFile, PausingProxy, SERVICES,
};
use crate::events::{self, now_ms, Event};
use crate::watch::{start_refresh_worker, watch_slow_jobs, Progress};
use crate::worker;
use crate::workload::{chaos_request, is_floating, job_id, FLOATING_CEILING};

/// What one run does.
#[derive(Clone, Debug)]
pub struct Spec {
    /// `stream` or `kafka`.
    pub workers: String,
    pub faults: bool,
    pub jobs: usize,
    pub keys: usize,
    pub limit: u32,
    /// Jobs enqueued per second, at most.
    pub rate: f64,
    pub deadline: Duration,
    /// The task group's lease.
    pub lease: String,
    /// The share of jobs a live worker abandons (faults only).
    pub abandon: f64,
    /// A worker process is killed about this often (faults only).
    pub worker_kill_every: Duration,
    /// Kill only workers (CHAOS_VICTIMS=workers).
    pub workers_only: bool,
    pub worker_processes: usize,
    /// Jobs at once per worker process.
    pub slots: usize,
    pub broker_pid: Option<i32>,
}

/// What happened, counted while it happened.
#[derive(Default, Debug)]
struct Faults {
    instance_kills: u32,
    broker_stops: u32,
    postgres_pauses: u32,
    service_down: Option<String>,
    worker_kills: u32,
    jobs_in_flight_at_worker_kills: usize,
}

/// The worker processes, each slot's current one, and every one started.
pub struct WorkerPool {
    exe: PathBuf,
    dir: PathBuf,
    template: worker::Settings,
    children: Vec<Option<tokio::process::Child>>,
    current: Vec<usize>,
    /// Every process: its event log, when the runner killed it.
    started: Vec<(PathBuf, Option<i64>)>,
}

impl WorkerPool {
    /// No process yet: `start` starts one per slot, this binary with
    /// `worker`, its event log and stderr in `dir`.
    pub fn new(exe: PathBuf, dir: PathBuf, template: worker::Settings) -> Self {
        WorkerPool {
            exe,
            dir,
            template,
            children: Vec::new(),
            current: Vec::new(),
            started: Vec::new(),
        }
    }

    pub fn start(&mut self, slot: usize) -> anyhow::Result<()> {
        let name = format!("w{slot}-{}", self.started.len());
        let log = self.dir.join(format!("worker-{name}.events"));
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("worker-{name}.log")))?;
        let settings = worker::Settings {
            worker_id: format!("chaos-{name}"),
            log: log.clone(),
            ..self.template.clone()
        };
        let child = tokio::process::Command::new(&self.exe)
            .arg("worker")
            .envs(settings.to_env())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true)
            .spawn()
            .context("starting a worker process")?;
        if self.children.len() <= slot {
            self.children.resize_with(slot + 1, || None);
            self.current.resize(slot + 1, 0);
        }
        self.children[slot] = Some(child);
        self.current[slot] = self.started.len();
        self.started.push((log, None));
        Ok(())
    }

    /// SIGKILL the slot's process; how many handlers it was running.
    pub async fn kill(&mut self, slot: usize, as_fault: bool) -> usize {
        let Some(mut child) = self.children.get_mut(slot).and_then(Option::take) else {
            return 0;
        };
        let _ = child.start_kill();
        let _ = child.wait().await;
        if as_fault {
            let index = self.current[slot];
            self.started[index].1 = Some(now_ms());
        }
        self.in_flight(slot)
    }

    /// Handlers the slot's process started and did not end.
    fn in_flight(&self, slot: usize) -> usize {
        let Some(index) = self.current.get(slot) else { return 0 };
        let mut running: HashSet<(usize, u32)> = HashSet::new();
        for line in events::read(&self.started[*index].0) {
            match line.event {
                Event::Start => {
                    running.insert((line.job, line.attempt));
                }
                Event::End { .. } => {
                    running.remove(&(line.job, line.attempt));
                }
                _ => {}
            }
        }
        running.len()
    }

    pub fn slots(&self) -> usize {
        self.children.len()
    }

    pub fn logs(&self) -> Vec<PathBuf> {
        self.started.iter().map(|(log, _)| log.clone()).collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The figures of one run, and the guarantees it broke.
pub struct Outcome {
    pub figures: serde_json::Map<String, serde_json::Value>,
    pub failures: Vec<String>,
    pub idle_max_s: f64,
    pub jobs_per_s: f64,
}

pub async fn run(spec: &Spec) -> anyhow::Result<Outcome> {
    let base = test_config("chaos", &[])?;
    let postgres = PausingProxy::start(postgres_address(base.postgres.url.expose())?).await?;
    let postgres_url = proxied_url(base.postgres.url.expose(), postgres.port)?;
    let exe = std::env::current_exe()?;
    let binaries = exe.parent().context("the binary's directory")?.to_path_buf();
    let work = std::env::temp_dir().join(format!("sluice-chaos-{}", base.kafka.topic_prefix));
    std::fs::create_dir_all(&work)?;
    eprintln!(
        "chaos: {} workers, {}: logs in {}",
        spec.workers,
        if spec.faults { "faults" } else { "no faults" },
        work.display()
    );

    // Every instance's configuration: the defaults, the test's prefixes.
    let addresses = Addresses::start().await?;
    let config_file = work.join("sluice.toml");
    let mut config = ConfigFile::new(&base, &postgres_url, &addresses);
    config
        .set(
            "kafka.producer_properties",
            "\"batch.num.messages\"",
            "\"1\"".to_string(),
        )
        .set("kafka.partitions", "jobs", "4".to_string())
        .set("kafka.partitions", "limit_commands", "4".to_string())
        .set("kafka.partitions", "rate_commands", "4".to_string())
        .set("kafka.partitions", "refresh_due", "2".to_string())
        .set("kafka.partitions", "requested", "2".to_string())
        .set("postgres", "max_connections", "8".to_string())
        .set("task_groups.default", "lease", format!("{:?}", spec.lease));
    std::fs::write(&config_file, config.text())?;
    let cluster = Cluster::start(binaries, config_file.clone(), work.clone(), &addresses, 2).await?;
    let Addresses {
        limit_grant,
        rate_window: _,
        admission,
        refresh,
    } = &addresses;

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

    let progress = Arc::new(Progress::default());
    let refreshes: Arc<Mutex<Vec<u32>>> = Arc::default();
    let refresher = start_refresh_worker(&base, &admission.endpoint, &refresh.endpoint, refreshes.clone())?;
    let mut pool = WorkerPool::new(
        exe,
        work.clone(),
        worker::Settings {
            kind: spec.workers.clone(),
            worker_id: String::new(),
            log: PathBuf::new(),
            admission: admission.endpoint.clone(),
            config: config_file,
            abandon: if spec.faults { spec.abandon } else { 0.0 },
            slots: spec.slots,
            instant: false,
        },
    );
    for slot in 0..spec.worker_processes.max(1) {
        pool.start(slot)?;
    }
    // Jobs flow once the stack settled (both admission instances own job
    // partitions) and every worker is ready: the start-up is not measured.
    let client = AdmissionClient::new(connect(&admission.endpoint).await?);
    let settled = async {
        loop {
            let listed = client
                .clone()
                .instances(pb::InstancesRequest {})
                .await
                .map_or(0, |response| response.into_inner().endpoints.len());
            let logs = pool.logs();
            let ready = logs
                .iter()
                .filter(|log| events::read(log).iter().any(|line| line.event == Event::Ready))
                .count();
            if listed >= 2 && ready == logs.len() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), settled).await.is_err() {
        eprintln!("chaos: the stack or the workers not ready within 60s; starting anyway");
    }
    let pool = Arc::new(tokio::sync::Mutex::new(pool));
    let started_ms = now_ms();

    // Faults: every 3-6 s one instance dies and comes back, the broker
    // stops or PostgreSQL pauses; once, both instances of one service go
    // down together; and about every `worker_kill_every` a worker process
    // is killed with its jobs in flight.
    let stop = sluice_common::Shutdown::new();
    let finish = sluice_common::Shutdown::new();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let (quiet, quiet_receiver) = tokio::sync::oneshot::channel::<()>();
    let instance_faults = {
        let (stop, finish, faults, spec) = (stop.clone(), finish.clone(), faults.clone(), spec.clone());
        tokio::spawn(async move {
            let mut cluster = cluster;
            let mut count = 0u32;
            let whole_service_at = rand::rng().random_range(2..=4u32);
            loop {
                let pause = Duration::from_millis(rand::rng().random_range(3000..6000));
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(pause) => {}
                }
                if !spec.faults || spec.workers_only {
                    continue;
                }
                count += 1;
                eprint!("chaos: at {:.1}s ", (now_ms() - started_ms) as f64 / 1000.0);
                if count == whole_service_at {
                    let service = std::env::var("CHAOS_DOWN_SERVICE")
                        .ok()
                        .and_then(|name| SERVICES.iter().find(|service| **service == name).copied())
                        .unwrap_or_else(|| SERVICES[rand::rng().random_range(0..SERVICES.len())]);
                    eprintln!("kill -9 every sluice-{service} for 5s");
                    lock(&faults).service_down = Some(service.to_string());
                    let all: Vec<usize> = (0..cluster.instances.len())
                        .filter(|index| cluster.instances[*index].service == service)
                        .collect();
                    cluster.restart(&all, Duration::from_secs(5)).await;
                    continue;
                }
                let victim = rand::rng().random_range(0..cluster.instances.len() + 2);
                let paused_for = Duration::from_millis(rand::rng().random_range(1000..3000));
                if victim == cluster.instances.len() {
                    let Some(pid) = spec.broker_pid else {
                        eprintln!("no CHAOS_BROKER_PID: the broker is not paused");
                        continue;
                    };
                    eprintln!("SIGSTOP the broker for {paused_for:?}");
                    lock(&faults).broker_stops += 1;
                    signal(pid, "STOP").await;
                    tokio::time::sleep(paused_for).await;
                    signal(pid, "CONT").await;
                } else if victim == cluster.instances.len() + 1 {
                    eprintln!("PostgreSQL connections paused for {paused_for:?}");
                    lock(&faults).postgres_pauses += 1;
                    postgres.pause(true);
                    tokio::time::sleep(paused_for).await;
                    postgres.pause(false);
                } else {
                    let instance = &cluster.instances[victim];
                    eprintln!("kill -9 sluice-{} on port {}", instance.service, instance.port);
                    lock(&faults).instance_kills += 1;
                    let down = Duration::from_millis(rand::rng().random_range(500..2000));
                    cluster.restart(&[victim], down).await;
                }
            }
            // No more faults; the instances serve until the checks are done.
            let _ = quiet.send(());
            finish.cancelled().await;
            for instance in &mut cluster.instances {
                Cluster::kill(instance).await;
            }
        })
    };
    let worker_faults = {
        let (stop, faults, pool, spec) = (stop.clone(), faults.clone(), pool.clone(), spec.clone());
        tokio::spawn(async move {
            if !spec.faults {
                return;
            }
            let every = spec.worker_kill_every.as_secs_f64().max(1.0);
            loop {
                let pause = Duration::from_secs_f64(rand::rng().random_range(every * 0.75..every * 1.25));
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                let mut pool = pool.lock().await;
                // The worker with the most jobs running, once one has some
                // (within 5 s), so that jobs are in flight when it dies.
                let mut slot = rand::rng().random_range(0..pool.children.len().max(1));
                for _ in 0..250 {
                    let busiest = (0..pool.children.len()).map(|slot| (pool.in_flight(slot), slot)).max();
                    if let Some((_, busiest)) = busiest.filter(|(running, _)| *running > 0) {
                        slot = busiest;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let in_flight = pool.kill(slot, true).await;
                eprintln!(
                    "chaos: at {:.1}s kill -9 worker {slot} with {in_flight} jobs running",
                    (now_ms() - started_ms) as f64 / 1000.0
                );
                {
                    let mut faults = lock(&faults);
                    faults.worker_kills += 1;
                    faults.jobs_in_flight_at_worker_kills += in_flight;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                if let Err(error) = pool.start(slot) {
                    eprintln!("chaos: restarting a worker failed: {error:#}");
                }
            }
        })
    };

    // Producers: every job once, retried with its id until accepted.
    let watching = tokio::spawn(watch_slow_jobs(
        client.clone(),
        limit_grant.endpoint.clone(),
        progress.clone(),
        spec.keys,
        started_ms,
    ));
    // Up to 16 enqueues in flight, started at `rate` per second at most.
    let producing = {
        let (progress, client, spec) = (progress.clone(), client.clone(), spec.clone());
        tokio::spawn(async move {
            let every = Duration::from_secs_f64(1.0 / spec.rate.max(1.0));
            let in_flight = Arc::new(tokio::sync::Semaphore::new(16));
            let mut next = tokio::time::Instant::now();
            for job in 0..spec.jobs {
                let Ok(permit) = in_flight.clone().acquire_owned().await else {
                    break;
                };
                let request = chaos_request(job, spec.keys, spec.limit);
                let client = client.clone();
                let progress = progress.clone();
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
                    lock(&progress.enqueued).insert(job, now_ms());
                });
                next += every;
                tokio::time::sleep_until(next).await;
            }
            // Every enqueue answered.
            let _ = in_flight.acquire_many(16).await;
        })
    };

    // What the workers' logs say, read every half second.
    let reading = {
        let (pool, progress) = (pool.clone(), progress.clone());
        tokio::spawn(async move {
            loop {
                let logs = pool.lock().await.logs();
                let (mut started, mut succeeded, mut last) = (HashMap::new(), HashSet::new(), 0);
                for line in logs.iter().flat_map(|log| events::read(log)) {
                    match &line.event {
                        Event::Start => {
                            let at = started.entry(line.job).or_insert(line.at_ms);
                            *at = line.at_ms.max(*at);
                        }
                        Event::Complete { answer, .. } if answer == "ACCEPTED" => {
                            succeeded.insert(line.job);
                            last = line.at_ms.max(last);
                        }
                        _ => {}
                    }
                }
                *lock(&progress.started) = started;
                *lock(&progress.succeeded) = (succeeded, last);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    // Until every job succeeded (its completion ACCEPTED, or GetJob says
    // so), or the deadline; faults go on all along. Done when the last
    // success was answered.
    let mut confirmed: HashSet<usize> = HashSet::new();
    let mut done_ms = now_ms();
    let deadline_ms = started_ms + i64::try_from(spec.deadline.as_millis()).unwrap_or(i64::MAX);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (succeeded, last) = lock(&progress.succeeded).clone();
        let pending: Vec<usize> = (0..spec.jobs)
            .filter(|job| !succeeded.contains(job) && !confirmed.contains(job))
            .collect();
        if pending.is_empty() {
            done_ms = done_ms.max(last);
            break;
        }
        // A success whose answer its killed worker never logged.
        if producing.is_finished() && pending.len() <= 100 {
            let found: Vec<usize> = futures::stream::iter(pending)
                .map(|job| {
                    let client = client.clone();
                    async move {
                        let view = tokio::time::timeout(Duration::from_secs(5), job_view(&client, &job_id(job))).await;
                        matches!(view, Ok(Ok(view)) if view.status == pb::JobStatus::Succeeded as i32).then_some(job)
                    }
                })
                .buffer_unordered(8)
                .filter_map(|job| async move { job })
                .collect()
                .await;
            if !found.is_empty() {
                done_ms = now_ms();
            }
            confirmed.extend(found);
        }
        if now_ms() > deadline_ms {
            done_ms = now_ms();
            break;
        }
    }
    reading.abort();
    stop.trigger();
    watching.abort();
    let _ = producing.await;
    let _ = worker_faults.await;
    let _ = tokio::time::timeout(Duration::from_secs(30), quiet_receiver).await;

    let held = held_slots(&limit_grant.endpoint, spec.keys).await;

    // Every job's end as GetJob shows it (its history of attempts).
    let ends: HashMap<usize, JobEnd> = futures::stream::iter(0..spec.jobs)
        .map(|job| {
            let client = client.clone();
            async move {
                for _ in 0..5 {
                    if let Ok(view) = job_view(&client, &job_id(job)).await {
                        return Some((job, JobEnd::from_view(&view)));
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                None
            }
        })
        .buffer_unordered(8)
        .filter_map(|end| async move { end })
        .collect()
        .await;
    let mut unfinished: BTreeMap<String, usize> = BTreeMap::new();
    for job in 0..spec.jobs {
        if ends.get(&job).is_some_and(|end| end.succeeded) {
            continue;
        }
        let seen = match job_view(&client, &job_id(job)).await {
            Ok(view) => format!(
                "{:?} attempt {}",
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.attempt
            ),
            Err(error) => format!("unread: {error}"),
        };
        eprintln!("chaos: chaos-{job} did not succeed: {seen}");
        *unfinished.entry(seen).or_default() += 1;
    }

    finish.trigger();
    let _ = instance_faults.await;
    let mut pool = Arc::try_unwrap(pool)
        .map_err(|_| anyhow::anyhow!("the worker pool is still shared"))?
        .into_inner();
    for slot in 0..pool.children.len() {
        pool.kill(slot, false).await;
    }
    refresher.abort();
    watching_grants.trigger();

    let histories: Vec<WorkerHistory> = pool
        .started
        .iter()
        .map(|(log, killed_at)| WorkerHistory {
            lines: events::read(log),
            killed_at: *killed_at,
        })
        .collect();
    let rate_grants = lock(&grants).clone();
    let enqueued = lock(&progress.enqueued).clone();
    let faults = std::mem::take(&mut *lock(&faults));
    let refreshes = lock(&refreshes).len();
    Ok(figures(
        spec,
        Observed {
            started_ms,
            done_ms,
            histories,
            ends,
            enqueued,
            rate_grants,
            faults,
            refreshes,
            held,
            unfinished,
            logs: work,
        },
    ))
}

/// Slots still held on the keys once every job ended (releases are
/// asynchronous: up to a minute); `None` when some key could not be read.
async fn held_slots(limit_grant: &str, keys: usize) -> Option<usize> {
    let mut held = None;
    let mut unread = String::new();
    let settle = tokio::time::Instant::now() + Duration::from_secs(60);
    while tokio::time::Instant::now() < settle {
        // A new connection each round: through the proxy, to either
        // instance (one still loading a partition answers NOT_OWNER).
        let Ok(channel) = connect(limit_grant).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut limits = sluice_proto::v1::limits_client::LimitsClient::new(channel);
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
    held
}

struct Observed {
    started_ms: i64,
    done_ms: i64,
    histories: Vec<WorkerHistory>,
    ends: HashMap<usize, JobEnd>,
    enqueued: HashMap<usize, i64>,
    rate_grants: Vec<pb::GrantEvent>,
    faults: Faults,
    refreshes: usize,
    held: Option<usize>,
    unfinished: BTreeMap<String, usize>,
    logs: PathBuf,
}

fn seconds(ms: i64) -> f64 {
    ms as f64 / 1000.0
}

fn figures(spec: &Spec, observed: Observed) -> Outcome {
    let Observed {
        started_ms,
        done_ms,
        histories,
        ends,
        enqueued,
        rate_grants,
        faults,
        refreshes,
        held,
        unfinished,
        logs,
    } = observed;
    let runs = analysis::runs_of(&histories, done_ms);
    let succeeded: HashSet<usize> = ends
        .iter()
        .filter(|(_, end)| end.succeeded)
        .map(|(job, _)| *job)
        .collect();
    let lost = spec.jobs - succeeded.len().min(spec.jobs);
    let duplicates = analysis::duplicates(&histories, &runs);
    let (not_counted, not_counted_examples) = analysis::attempts_not_counted(&histories, &ends);
    let (abandoned_not_expired, abandoned_examples) = analysis::abandoned_not_expired(&runs, &ends);
    let limit = usize::try_from(spec.limit).unwrap_or(usize::MAX);
    let keys = spec.keys.max(1);
    let over_limit = analysis::max_running(&runs, |job| Some(job % keys)).saturating_sub(limit);
    // The floating max moves between 1 and FLOATING_CEILING; a lower max
    // only affects new grants, so the ceiling is never passed.
    let floating_running = analysis::max_running(&runs, |job| is_floating(job).then_some(0));
    let ceiling = usize::try_from(FLOATING_CEILING).unwrap_or(usize::MAX);
    let floating_over_limit = floating_running.saturating_sub(ceiling);
    let (rate_granted, over_rate) = analysis::rate_windows_exceeded(&rate_grants);
    let rate_waits = analysis::rate_waits(&rate_grants);
    let idle_inputs = analysis::IdleInputs {
        enqueued: &enqueued,
        succeeded: &succeeded,
        rate_waits: &rate_waits,
        limit: spec.limit,
        end: done_ms,
    };
    let idle = analysis::idle_periods(&runs, &idle_inputs, analysis::plain_key(keys));
    let no_rate_waits = HashMap::new();
    let floating_idle = analysis::idle_periods(
        &runs,
        &analysis::IdleInputs {
            rate_waits: &no_rate_waits,
            limit: FLOATING_CEILING,
            ..idle_inputs
        },
        |job| is_floating(job).then_some(0),
    );
    let idle_max_s = idle.last().map_or(0.0, |period| seconds(period.ms()));
    let idle_bound_s: f64 = crate::env_number("CHAOS_IDLE_BOUND_S", 10.0);
    let worst: Vec<serde_json::Value> = idle
        .iter()
        .rev()
        .take(5)
        .map(|period| {
            serde_json::json!({
                "key": format!("k{}", period.key),
                "from_s": seconds(period.from - started_ms),
                "to_s": seconds(period.to - started_ms),
                "s": seconds(period.ms()),
            })
        })
        .collect();
    let keys_idle_over_bound = idle
        .iter()
        .filter(|period| seconds(period.ms()) > idle_bound_s)
        .map(|period| period.key)
        .collect::<HashSet<_>>()
        .len();
    // Enqueue to the first run of each job.
    let mut first_start: HashMap<usize, i64> = HashMap::new();
    for run in &runs {
        first_start.entry(run.job).or_insert(run.start);
    }
    let mut waits: Vec<i64> = enqueued
        .iter()
        .filter_map(|(job, at)| first_start.get(job).map(|start| (start - at).max(0)))
        .collect();
    waits.sort_unstable();
    let wait_p99 = waits
        .get(((waits.len() as f64 - 1.0) * 0.99).round().max(0.0) as usize)
        .map_or(0.0, |ms| seconds(*ms));
    let outcome_count = |wanted: &str, detail: &str| {
        ends.values()
            .flat_map(|end| &end.history)
            .filter(|(_, outcome, text)| outcome == wanted && text.contains(detail))
            .count()
    };
    let abandoned = runs.iter().filter(|run| run.how == "abandoned").count();
    let elapsed_ms = (done_ms - started_ms).max(1);
    let jobs_per_s = succeeded.len() as f64 / seconds(elapsed_ms);

    let mut failures = Vec::new();
    let mut check = |broken: bool, what: String| {
        if broken {
            failures.push(what);
        }
    };
    check(lost > 0, format!("{lost} jobs lost"));
    check(duplicates.total() > 0, format!("{} duplicated", duplicates.total()));
    check(over_limit > 0, format!("a key {over_limit} over its limit"));
    check(not_counted > 0, format!("{not_counted} confirmed attempts not counted"));
    check(
        abandoned_not_expired > 0,
        format!("{abandoned_not_expired} abandoned attempts did not expire"),
    );
    check(floating_over_limit > 0, "the floating key over its ceiling".to_string());
    check(refreshes == 0, "no floating-limit refresh".to_string());
    check(over_rate > 0, format!("{over_rate} rate windows exceeded"));
    check(held != Some(0), format!("slots held at the end: {held:?}"));
    let idle_bound_held = idle_max_s <= idle_bound_s;
    if std::env::var("CHAOS_STRICT_IDLE").is_ok_and(|strict| strict == "1") && !idle_bound_held {
        failures.push(format!("a key idle with waiters for {idle_max_s:.1}s"));
    }

    let value = serde_json::json!({
        "workers": spec.workers,
        "faults": spec.faults,
        "jobs": spec.jobs,
        "keys": spec.keys,
        "limit": spec.limit,
        "lease": spec.lease,
        "lost": lost,
        "unfinished": unfinished,
        // No attempt won by two claims or pushes, no two runs of a job at
        // once, no run after an accepted success (a STALE answer while the
        // worker's lease held counts as one: it is how a job runs twice).
        "duplicated": duplicates.total(),
        "attempts_won_twice": duplicates.won_twice,
        "overlapping_runs": duplicates.overlapping,
        "runs_after_success": duplicates.after_success,
        "stale_while_held": duplicates.stale_while_held,
        "lease_lost_while_held": duplicates.lease_lost_while_held,
        "duplicated_jobs": duplicates.examples,
        "over_limit": over_limit,
        // Confirmed attempts that admission handed back as never confirmed
        // (so they used no attempt).
        "attempts_not_counted": not_counted,
        "attempts_not_counted_jobs": not_counted_examples,
        "lease_expiries": outcome_count("lease_expired", ""),
        "unconfirmed_hand_backs": outcome_count("handed_back", "no sign of worker"),
        "abandoned": abandoned,
        // Abandoned after admission confirmed them, and not ended by a
        // lease expiry (which uses an attempt).
        "abandoned_not_expired": abandoned_not_expired,
        "abandoned_not_expired_jobs": abandoned_examples,
        // A key with waiting jobs and nothing running (rate waits in a
        // full window excepted), per period: p99, max, the worst ones (in
        // seconds into the run: match them with the faults on stderr and
        // the services' logs), keys with one over the bound.
        "key_idle_p99_s": analysis::percentile_s(&idle, 0.99),
        "key_idle_max_s": idle_max_s,
        "key_idle_worst": worst,
        "keys_idle_over_bound": keys_idle_over_bound,
        "idle_bound_s": idle_bound_s,
        "idle_bound_held": idle_bound_held,
        "floating_idle_max_s": floating_idle.last().map_or(0.0, |period| seconds(period.ms())),
        "enqueue_to_start_p99_s": wait_p99,
        "jobs_per_s": jobs_per_s,
        "elapsed_s": seconds(elapsed_ms),
        "instance_kills": faults.instance_kills,
        "broker_stops": faults.broker_stops,
        "postgres_pauses": faults.postgres_pauses,
        "service_down": faults.service_down,
        "worker_kills": faults.worker_kills,
        "jobs_in_flight_at_worker_kills": faults.jobs_in_flight_at_worker_kills,
        // Rate grants seen (distinct tickets), and windows of
        // RATE_WINDOW_MS holding more than RATE_LIMIT of them.
        "rate_grants": rate_granted,
        "rate_windows_exceeded": over_rate,
        "held_slots_at_end": held,
        // The most floating-limit jobs that ran at once, those over
        // FLOATING_CEILING, and the refreshes the worker answered.
        "floating_max_running": floating_running,
        "floating_over_limit": floating_over_limit,
        "refreshes": refreshes,
        "runs": runs.len(),
        "max_attempt": runs.iter().map(|run| run.attempt).max().unwrap_or(0),
        "failed": failures.clone(),
        "logs": logs.to_string_lossy(),
    });
    let figures = match value {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    };
    Outcome {
        figures,
        failures,
        idle_max_s,
        jobs_per_s,
    }
}
