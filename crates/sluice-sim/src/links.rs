//! Links between admission and limit-grant: commands kept until applied and
//! routed by the owner directory, refusals, breaks and reconnects; grants
//! routed by the job partitions each admission instance claims.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use prost::Message;
use rand::Rng;
use sluice_admission::partition::Local;
use sluice_common::core::Ask;
use sluice_common::partition::job_partition;
use sluice_limit_grant::core::{LimitAnswer, LimitPartition, LimitQuery};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::calls::LOADING_WAIT_MS;
use crate::world::{Event, Svc, World};

/// One admission instance's link client (modelled after
/// `sluice_common::link::LinkClient`): commands kept until applied,
/// written to the owner its directory names.
#[derive(Default)]
pub(crate) struct LinkClient {
    pub(crate) next_seq: u64,
    pub(crate) unacked: BTreeMap<u64, Pending>,
    pub(crate) directory: BTreeMap<usize, usize>,
    pub(crate) directory_wanted: bool,
}

/// A link batch waiting for its commit at an owner.
pub(crate) struct LinkAck {
    pub(crate) adm: usize,
    pub(crate) owner: usize,
    pub(crate) conn: u64,
    pub(crate) seq: u64,
    pub(crate) receiver: oneshot::Receiver<LimitAnswer>,
}

pub(crate) struct Pending {
    pub(crate) partition: usize,
    pub(crate) commands: Arc<Vec<Vec<u8>>>,
    pub(crate) sent: Option<(usize, u64)>,
}

/// A limit-grant instance's grant router: job partition → (admission
/// instance, epoch, connection).
#[derive(Default)]
pub(crate) struct Router {
    pub(crate) routes: BTreeMap<usize, (usize, i64, u64)>,
}

impl World {
    pub(crate) fn conn_open(&self, adm: usize, owner: usize, conn: u64) -> bool {
        self.adm.up[adm] && self.lg.up[owner] && self.conns[adm][owner] == Some(conn)
    }

    pub(crate) fn connect(&mut self, adm: usize, owner: usize) {
        if !self.adm.up[adm] {
            return;
        }
        if !self.lg.up[owner] {
            self.at(500, Event::Connect { adm, owner });
            return;
        }
        if self.conns[adm][owner].is_some() {
            return;
        }
        self.next_conn += 1;
        let conn = self.next_conn;
        self.conns[adm][owner] = Some(conn);
        let claims = self.claims[adm].clone();
        let delay = self.conn_delay(conn, true);
        self.at(
            delay,
            Event::Hello {
                adm,
                owner,
                conn,
                claims,
            },
        );
        let seqs: Vec<u64> = self.clients[adm].unacked.keys().copied().collect();
        for seq in seqs {
            self.route(adm, seq);
        }
    }

    /// A link breaks: what was on its way is lost; the client connects
    /// again and sends what was not applied.
    pub fn break_link(&mut self, adm: usize, owner: usize) {
        let Some(conn) = self.conns[adm][owner].take() else {
            return;
        };
        self.conn_last_arrival.remove(&(conn, true));
        self.conn_last_arrival.remove(&(conn, false));
        for pending in self.clients[adm].unacked.values_mut() {
            if pending.sent.is_some_and(|(sent_to, _)| sent_to == owner) {
                pending.sent = None;
            }
        }
        self.clients[adm].directory_wanted = true;
        self.at(250, Event::DirectoryRead { adm });
        let retry = self.rng.random_range(100..1_000);
        self.at(retry, Event::Connect { adm, owner });
    }

    pub(crate) fn read_directory(&mut self, adm: usize) {
        if !self.adm.up[adm] {
            return;
        }
        let directory: BTreeMap<usize, usize> = self
            .lg
            .stores
            .iter()
            .enumerate()
            .filter_map(|(partition, store)| store.owner.map(|owner| (partition, owner)))
            .collect();
        self.clients[adm].directory = directory;
        self.clients[adm].directory_wanted = false;
        let seqs: Vec<u64> = self.clients[adm].unacked.keys().copied().collect();
        for seq in seqs {
            self.route(adm, seq);
        }
        self.at(10_000, Event::DirectoryRead { adm });
    }

    pub(crate) fn client_send(&mut self, adm: usize, partition: usize, entries: Vec<Vec<u8>>) {
        let client = &mut self.clients[adm];
        client.next_seq += 1;
        let seq = client.next_seq;
        client.unacked.insert(
            seq,
            Pending {
                partition,
                commands: Arc::new(entries),
                sent: None,
            },
        );
        self.route(adm, seq);
    }

    pub(crate) fn route(&mut self, adm: usize, seq: u64) {
        let Some(pending) = self.clients[adm].unacked.get(&seq) else {
            return;
        };
        let partition = pending.partition;
        let Some(owner) = self.clients[adm].directory.get(&partition).copied() else {
            if !self.clients[adm].directory_wanted {
                self.clients[adm].directory_wanted = true;
                self.at(250, Event::DirectoryRead { adm });
            }
            return;
        };
        let Some(conn) = self.conns[adm][owner] else {
            return;
        };
        if pending.sent == Some((owner, conn)) {
            return;
        }
        let commands = pending.commands.clone();
        if let Some(pending) = self.clients[adm].unacked.get_mut(&seq) {
            pending.sent = Some((owner, conn));
        }
        let delay = self.conn_delay(conn, true);
        self.at(
            delay,
            Event::Commands {
                adm,
                owner,
                conn,
                seq,
                partition,
                commands,
            },
        );
    }

    pub(crate) fn refused(&mut self, adm: usize, seq: u64) {
        let Some(pending) = self.clients[adm].unacked.get_mut(&seq) else {
            return;
        };
        pending.sent = None;
        let partition = pending.partition;
        self.clients[adm].directory.remove(&partition);
        self.clients[adm].directory_wanted = true;
        self.at(250, Event::DirectoryRead { adm });
    }

    pub(crate) fn commands_arrive(
        &mut self,
        adm: usize,
        owner: usize,
        conn: u64,
        seq: u64,
        partition: usize,
        commands: Arc<Vec<Vec<u8>>>,
    ) {
        if !self.conn_open(adm, owner, conn) {
            return;
        }
        if !self.lg.owns(owner, partition) {
            let delay = self.conn_delay(conn, false);
            self.at(delay, Event::Refused { adm, owner, conn, seq });
            return;
        }
        let (reply, receiver) = oneshot::channel();
        let ask = Ask::Query {
            query: LimitQuery::Link {
                commands: commands.as_ref().clone(),
                client: Arc::from(format!("admission-{adm}").as_str()),
            },
            reply,
        };
        self.link_acks.push(LinkAck {
            adm,
            owner,
            conn,
            seq,
            receiver,
        });
        // Taking the partition over, the owner refuses them after the wait
        // (sent again after a directory read).
        self.ask_limit_task(owner, partition, ask);
    }

    /// A request for limit-grant `owner`'s task for `partition`: queued
    /// for its next batch when it serves; while it takes the partition
    /// over, the request waits for it, `LOADING_WAIT_MS` at most (then its
    /// channel closes).
    pub(crate) fn ask_limit_task(&mut self, owner: usize, partition: usize, ask: Ask<LimitPartition>) {
        if let Some(task) = self.lg.serving(owner, partition) {
            task.locals.push(ask);
            self.schedule_run(Svc::LimitGrant, owner, partition, 1);
        } else if let Some(task) = self.lg.loading(owner, partition) {
            task.waiting.push((self.now + LOADING_WAIT_MS, ask));
            self.at(
                LOADING_WAIT_MS,
                Event::LoadingWaitOver {
                    svc: Svc::LimitGrant,
                    instance: owner,
                    partition,
                },
            );
        }
    }

    pub(crate) fn resolve_link_acks(&mut self) {
        let acks = std::mem::take(&mut self.link_acks);
        for mut ack in acks {
            match ack.receiver.try_recv() {
                Ok(_) => {
                    let delay = self.conn_delay(ack.conn, false);
                    self.at(
                        delay,
                        Event::Applied {
                            adm: ack.adm,
                            owner: ack.owner,
                            conn: ack.conn,
                            seq: ack.seq,
                        },
                    );
                }
                Err(oneshot::error::TryRecvError::Closed)
                    if self.config.bug == Some(crate::config::Bug::DroppedCommandsNotRefused) => {}
                Err(oneshot::error::TryRecvError::Closed) => {
                    let delay = self.conn_delay(ack.conn, false);
                    self.at(
                        delay,
                        Event::Refused {
                            adm: ack.adm,
                            owner: ack.owner,
                            conn: ack.conn,
                            seq: ack.seq,
                        },
                    );
                }
                Err(oneshot::error::TryRecvError::Empty) => self.link_acks.push(ack),
            }
        }
    }

    /// A limit-grant instance sends grants of `job_partition` to the link
    /// that claimed it (dropped when none does: the claim brings them again).
    pub(crate) fn route_grants(&mut self, owner: usize, job_partition: usize, entries: Vec<Vec<u8>>) {
        let Some((adm, _, conn)) = self.routers[owner].routes.get(&job_partition).copied() else {
            return;
        };
        if self.conns[adm][owner] != Some(conn) {
            return;
        }
        let delay = self.conn_delay(conn, false);
        self.at(
            delay,
            Event::Grants {
                adm,
                owner,
                conn,
                entries,
            },
        );
    }

    /// An admission instance's claims reach an owner: the job partitions
    /// now routed to it get every held ticket's grant again.
    pub(crate) fn hello_arrives(&mut self, adm: usize, owner: usize, conn: u64, claims: Vec<(usize, i64)>) {
        let router = &mut self.routers[owner];
        let claimed: BTreeSet<usize> = claims.iter().map(|(partition, _)| *partition).collect();
        router
            .routes
            .retain(|partition, route| !(route.0 == adm && route.2 == conn) || claimed.contains(partition));
        let mut newly_routed = Vec::new();
        for (partition, epoch) in claims {
            let replace = router.routes.get(&partition).is_none_or(|route| epoch >= route.1);
            if replace {
                if router
                    .routes
                    .get(&partition)
                    .is_none_or(|route| !(route.0 == adm && route.2 == conn))
                {
                    newly_routed.push(i32::try_from(partition).unwrap_or(0));
                }
                router.routes.insert(partition, (adm, epoch, conn));
            }
        }
        if newly_routed.is_empty() {
            return;
        }
        for partition in 0..self.lg.partitions() {
            if self.lg.owns(owner, partition) {
                // Not answered (nobody waits for it): the channel is kept
                // open and dropped with the batch.
                let (reply, _unanswered) = oneshot::channel();
                let ask = Ask::Query {
                    query: LimitQuery::ResendGrants {
                        job_partitions: newly_routed.clone(),
                    },
                    reply,
                };
                self.ask_limit_task(owner, partition, ask);
            }
        }
    }

    /// The job partitions `adm` serves changed: it claims them on every link.
    pub(crate) fn claims_changed(&mut self, adm: usize) {
        let claims: Vec<(usize, i64)> = (0..self.adm.partitions())
            .filter_map(|partition| {
                self.adm.tasks[adm][partition]
                    .as_ref()
                    .filter(|task| !task.standing_by && !task.loading)
                    .map(|task| (partition, task.epoch))
            })
            .collect();
        if claims == self.claims[adm] {
            return;
        }
        self.claims[adm] = claims.clone();
        for owner in 0..self.config.instances {
            if let Some(conn) = self.conns[adm][owner] {
                let delay = self.conn_delay(conn, true);
                self.at(
                    delay,
                    Event::Hello {
                        adm,
                        owner,
                        conn,
                        claims: claims.clone(),
                    },
                );
            }
        }
    }

    pub(crate) fn grants_arrive(&mut self, adm: usize, entries: Vec<Vec<u8>>) {
        let mut by_partition: BTreeMap<usize, Vec<pb::GrantEvent>> = BTreeMap::new();
        for entry in entries {
            let Ok(event) = pb::GrantEvent::decode(entry.as_slice()) else {
                continue;
            };
            let job_id = event
                .ticket
                .as_ref()
                .map(|ticket| ticket.job_id.clone())
                .unwrap_or_default();
            let partition = job_partition(&job_id, i32::try_from(self.config.job_partitions).unwrap_or(1));
            by_partition
                .entry(usize::try_from(partition).unwrap_or(0))
                .or_default()
                .push(event);
        }
        for (partition, events) in by_partition {
            if let Some(task) = self.adm.serving(adm, partition) {
                task.locals.push(Local::Grants(events));
                self.schedule_run(Svc::Admission, adm, partition, 1);
            }
        }
    }
}
