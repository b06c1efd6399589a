//! STE's pure core: the message model and its canonical codec, signing, reference data and
//! keys, routing, the matching tolerances, the validator and the matcher, and the seeded draws
//! that make the reference data and the load.
//!
//! Nothing here does I/O on a network or a database, starts a thread or reads the clock: time
//! comes in as an argument, so that a seed reproduces any run. This crate's dependencies keep
//! that true — no async runtime, database or messaging crate is among them. (Reference data,
//! key sets and matching profiles can be read from files, as configuration is, before a run.)

pub mod codec;
pub mod draw;
pub mod generator;
pub mod keys;
pub mod matcher;
pub mod model;
pub mod profile;
pub mod reason;
pub mod refdata;
pub mod routing;
pub mod sign;
pub mod validate;
