//! A deterministic simulation of a Sluice cluster (docs/architecture.md,
//! "The simulation"): the services' real cores — admission's job
//! partitions and limit-grant's key partitions — run by a model of the
//! owner runtime (fenced commits, answers after them, takeovers that load
//! what was saved, standing by when fenced), talking over modelled links
//! (delays, breaks, owners that move) with Kafka workers that claim,
//! heartbeat, complete, die, stall and abandon jobs. Everything happens in
//! one thread on simulated time, driven by one seed: a failing seed replays
//! exactly.
//!
//! After every step the simulation checks the guarantees: no key over its
//! max (the owner's holders, and the jobs the workers run), one running
//! attempt per job, no attempt run twice; when the faults stop, every job
//! ends within a bound of simulated time.

mod calls;
mod checks;
mod config;
mod faults;
mod links;
mod model;
mod owners;
mod producer;
mod report;
mod services;
mod workers;
mod world;

pub use config::{Bug, SimConfig, Trace};
pub use report::Report;
pub use world::run;
