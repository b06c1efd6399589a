//! STE: a straight-through-processing trade-matching engine.
//!
//! The pure parts (codec, validator, matcher, routing) do no I/O and read no clock; the queue
//! network in [`pipeline`] wires them together with bounded channels, instrumented stations and
//! batched stores in one process; [`cluster`] wires the same stations across the nodes of a
//! cluster on NATS JetStream.

pub mod cluster;
pub mod cluster_samples;
pub mod codec;
pub mod generator;
pub mod keys;
pub mod lease;
pub mod matcher;
pub mod model;
pub mod network;
pub mod pipeline;
pub mod ports;
pub mod profile;
pub mod queue;
pub mod reason;
pub mod refdata;
pub mod routing;
pub mod sign;
pub mod station;
pub mod stations;
pub mod store;
pub mod validate;
