//! STE: a straight-through-processing trade-matching engine.
//!
//! The pure parts (codec, validator, matcher, routing) do no I/O and read no clock; the queue
//! network in [`pipeline`] wires them together with bounded channels, instrumented stations and
//! batched stores in one process; [`cluster`] wires the same stations across the nodes of a
//! cluster on NATS JetStream.

// The pure core, under the paths the engine has always given it.
pub use ste_core::{
    codec, draw, generator, keys, matcher, model, profile, reason, refdata, routing, sign, validate,
};

pub mod cluster;
pub mod cluster_samples;
pub mod cpu;
pub mod lease;
pub mod network;
pub mod options;
pub mod pipeline;
pub mod ports;
pub mod queue;
pub mod station;
pub mod stations;
pub mod store;
