//! Who may do what on a cluster's NATS servers: the roles of the processes that connect, and
//! for each the subjects it may publish to and subscribe to. The servers refuse (and log)
//! everything else. Each role has an identity of its own (an nkey whose seed is the role's
//! secret, [`NatsIdentity`]), so that a leaked credential gives away one role and no more.
//!
//! | role | publishes | subscribes |
//! |---|---|---|
//! | `node` (shard owner) | answers `ste.ack.*`, CLS `ste.cls`, its samples `ste.samples.*`; shard and member leases; takes the inbound queues and reads the delivery book | its inbox |
//! | `gateway-<n>` | messages onto the inbound queues `ste.in.*`; its own lease `gateway.<n>` | its own answers `ste.ack.<n>`, copies of CLS `ste.cls` |
//! | `load-<n>` (the driver as a load source) | as `gateway-<m>` with `m` = [`LOAD_NUMBERS_FIRST`] + `n` | as `gateway-<m>` |
//! | `sink` | confirmations into the delivery book | takes the CLS queue |
//! | `monitor` | the queues' lengths (stream info) | every node's samples `ste.samples.>` |
//!
//! Node and sink also publish what their queues hold that does not decode onto the aside stream
//! (`ste.aside.<queue>`), bounded, for an operator to look at.
//!
//! Every role reads the state of the cluster's streams (their info), its leases and the
//! delivery book; none may delete, purge or change a stream, or delete a consumer other than
//! its own. Replies (JetStream's answers, pulled batches) come to an inbox prefix of the
//! identity's own (`_INBOX_<identity>`), so that no role can listen to another's.

use super::{ClusterLayout, GATEWAYS_MAX};
use crate::lease::{DELIVERY_BUCKET, LEASE_BUCKET};
use crate::queue::jetstream::{stream_name, ASIDE_TOPIC};

/// Shards whose streams the roles' permissions name (a stream's name is one token of a
/// subject, so that they are named one by one): a cluster on credentials has at most this many.
pub const SHARDS_PERMITTED: u32 = 64;

/// The first gateway number of the driver's load identities (`load-<n>` answers on
/// `ste.ack.<LOAD_NUMBERS_FIRST + n>`): gateways have the numbers below it.
pub const LOAD_NUMBERS_FIRST: u32 = GATEWAYS_MAX / 2;

/// A role of a process on a cluster's NATS servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A node: owns shards (takes their inbound queues, commits, answers, emits CLS).
    Node,
    /// A gateway holding gateway number `n`: puts participants' messages in, hears their
    /// answers and copies of CLS.
    Gateway(u32),
    /// The driver as a load source, as a gateway of number [`LOAD_NUMBERS_FIRST`] + `n`.
    Load(u32),
    /// The cluster's sink: takes the CLS queue and confirms delivery.
    Sink,
    /// Whoever collects the nodes' samples and the queues' lengths (the driver of a run).
    Monitor,
}

/// Why an identity's name is not one of a role's.
#[derive(Debug, thiserror::Error)]
#[error("no role is called {0:?}: node, sink, monitor, gateway-<n> (n < {LOAD_NUMBERS_FIRST}) or load-<n> (n < {LOAD_NUMBERS_FIRST})")]
pub struct UnknownRole(pub String);

impl Role {
    /// The identity's name: `node`, `gateway-3`, `load-0`, `sink`, `monitor`.
    pub fn name(self) -> String {
        match self {
            Self::Node => "node".to_owned(),
            Self::Gateway(n) => format!("gateway-{n}"),
            Self::Load(n) => format!("load-{n}"),
            Self::Sink => "sink".to_owned(),
            Self::Monitor => "monitor".to_owned(),
        }
    }

    /// The role of an identity's name.
    pub fn parse(name: &str) -> Result<Self, UnknownRole> {
        let numbered = |prefix: &str| {
            name.strip_prefix(prefix)
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| *n < LOAD_NUMBERS_FIRST)
        };
        match name {
            "node" => Ok(Self::Node),
            "sink" => Ok(Self::Sink),
            "monitor" => Ok(Self::Monitor),
            _ => numbered("gateway-")
                .map(Self::Gateway)
                .or_else(|| numbered("load-").map(Self::Load))
                .ok_or_else(|| UnknownRole(name.to_owned())),
        }
    }

    /// The gateway number whose answers this role hears (gateways and load sources).
    pub fn gateway_number(self) -> Option<u32> {
        match self {
            Self::Gateway(n) => Some(n),
            Self::Load(n) => Some(LOAD_NUMBERS_FIRST + n),
            _ => None,
        }
    }

    /// The prefix of this identity's inboxes, where the servers' replies to it come.
    pub fn inbox_prefix(self) -> String {
        format!("_INBOX_{}", self.name())
    }

    /// The subjects this role may publish to and subscribe to.
    pub fn permissions(self) -> Permissions {
        let api = "$JS.API";
        // A stream name is one token: the shards' streams are named one by one.
        let inbound: Vec<(String, String)> = (0..SHARDS_PERMITTED)
            .map(|shard| {
                (
                    stream_name(&ClusterLayout::inbound_queue(shard)),
                    super::owner::owner_consumer(shard),
                )
            })
            .collect();
        let cls = stream_name(ClusterLayout::CLS_QUEUE);
        let aside = stream_name(ASIDE_TOPIC);
        let leases = format!("KV_{LEASE_BUCKET}");
        let book = format!("KV_{DELIVERY_BUCKET}");
        let streams: Vec<&String> = inbound
            .iter()
            .map(|(stream, _)| stream)
            .chain([&cls, &aside, &leases, &book])
            .collect();
        // A consumer sets aside what it cannot decode, on the aside stream.
        let set_aside = |publish: &mut Vec<String>, queue: &str| {
            publish.push(format!("ste.{ASIDE_TOPIC}.{queue}"));
        };
        // Every role reads the state of the cluster's streams and its buckets' entries.
        let mut publish: Vec<String> = streams
            .iter()
            .map(|stream| format!("{api}.STREAM.INFO.{stream}"))
            .chain([
                format!("{api}.INFO"),
                format!("{api}.DIRECT.GET.{leases}.>"),
                format!("{api}.DIRECT.GET.{book}.>"),
            ])
            .collect();
        let mut subscribe = vec![format!("{}.>", self.inbox_prefix())];
        // Taking a queue through a durable consumer of one's own name.
        let take = |publish: &mut Vec<String>, stream: &str, durable: &str| {
            publish.extend([
                format!("{api}.CONSUMER.INFO.{stream}.{durable}"),
                format!("{api}.CONSUMER.DURABLE.CREATE.{stream}.{durable}"),
                format!("{api}.CONSUMER.CREATE.{stream}.{durable}"),
                format!("{api}.CONSUMER.CREATE.{stream}.{durable}.>"),
                format!("{api}.CONSUMER.DELETE.{stream}.{durable}"),
                format!("{api}.CONSUMER.MSG.NEXT.{stream}.{durable}"),
                format!("$JS.ACK.{stream}.{durable}.>"),
            ]);
        };
        // Making the streams and buckets where they are missing (a create does not change a
        // stream that exists).
        let make = |publish: &mut Vec<String>| {
            publish.extend(
                streams
                    .iter()
                    .map(|stream| format!("{api}.STREAM.CREATE.{stream}")),
            );
        };
        match self {
            Self::Node => {
                make(&mut publish);
                for (stream, durable) in &inbound {
                    take(&mut publish, stream, durable);
                }
                set_aside(&mut publish, "in.*");
                publish.extend([
                    "ste.ack.*".to_owned(),
                    format!("ste.{}", ClusterLayout::CLS_QUEUE),
                    "ste.samples.*".to_owned(),
                    format!("$KV.{LEASE_BUCKET}.shard.*"),
                    format!("$KV.{LEASE_BUCKET}.member.*"),
                ]);
            }
            Self::Gateway(_) | Self::Load(_) => {
                let number = self.gateway_number().unwrap_or_default();
                if matches!(self, Self::Load(_)) {
                    make(&mut publish);
                }
                publish.extend([
                    "ste.in.*".to_owned(),
                    format!("$KV.{LEASE_BUCKET}.gateway.{number}"),
                ]);
                subscribe.extend([
                    format!("ste.{}", ClusterLayout::ack_topic(number)),
                    format!("ste.{}", ClusterLayout::CLS_QUEUE),
                ]);
            }
            Self::Sink => {
                make(&mut publish);
                take(&mut publish, &cls, "sink");
                set_aside(&mut publish, ClusterLayout::CLS_QUEUE);
                publish.push(format!("$KV.{DELIVERY_BUCKET}.shard.*"));
            }
            Self::Monitor => {
                subscribe.push("ste.samples.>".to_owned());
            }
        }
        Permissions { publish, subscribe }
    }
}

/// Subjects a role may publish to and subscribe to (NATS wildcards `*` and `>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permissions {
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
}

/// One identity allowed on the servers: its role and the public nkeys that sign in as it (two
/// while its credentials are rotated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsIdentity {
    pub role: Role,
    pub public_keys: Vec<String>,
}

/// The `authorization` block of a NATS server's configuration that lets `identities` in, each
/// with its role's permissions, and nobody else.
pub fn nats_authorization(identities: &[NatsIdentity]) -> String {
    let list = |subjects: &[String]| {
        subjects
            .iter()
            .map(|subject| format!("\"{subject}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut users = String::new();
    for identity in identities {
        let permissions = identity.role.permissions();
        for key in &identity.public_keys {
            users.push_str(&format!(
                "    # {}\n    {{ nkey: {key}, permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }} }} }}\n",
                identity.role.name(),
                list(&permissions.publish),
                list(&permissions.subscribe),
            ));
        }
    }
    format!("authorization {{\n  users: [\n{users}  ]\n}}\n")
}

/// Whether `subject` is one `pattern` allows (NATS wildcards: `*` one token, `>` the rest).
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut pattern = pattern.split('.');
    let mut subject = subject.split('.');
    loop {
        match (pattern.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(p), Some(s)) if p == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A role of each kind.
    const ROLES: [Role; 5] = [
        Role::Node,
        Role::Gateway(0),
        Role::Load(0),
        Role::Sink,
        Role::Monitor,
    ];

    fn may_publish(role: Role, subject: &str) -> bool {
        role.permissions()
            .publish
            .iter()
            .any(|pattern| subject_matches(pattern, subject))
    }

    fn may_subscribe(role: Role, subject: &str) -> bool {
        role.permissions()
            .subscribe
            .iter()
            .any(|pattern| subject_matches(pattern, subject))
    }

    #[test]
    fn names_and_roles_go_both_ways() {
        for role in ROLES.into_iter().chain([Role::Gateway(7), Role::Load(1)]) {
            assert_eq!(Role::parse(&role.name()).expect("a role"), role);
        }
        for bad in [
            "",
            "nodes",
            "gateway-",
            "gateway-x",
            "load-512",
            "gateway-9999",
        ] {
            assert!(Role::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Role::Load(2).gateway_number(), Some(LOAD_NUMBERS_FIRST + 2));
    }

    #[test]
    fn wildcards_match_as_the_servers_match_them() {
        assert!(subject_matches("ste.in.*", "ste.in.3"));
        assert!(!subject_matches("ste.in.*", "ste.in.3.x"));
        assert!(!subject_matches("ste.in.*", "ste.in"));
        assert!(subject_matches("_INBOX_node.>", "_INBOX_node.abc.def"));
        assert!(!subject_matches("_INBOX_node.>", "_INBOX_node"));
        assert!(!subject_matches("_INBOX_node.>", "_INBOX_sink.abc"));
    }

    #[test]
    fn only_gateways_and_load_sources_put_messages_in() {
        for role in [Role::Gateway(0), Role::Load(0)] {
            assert!(may_publish(role, "ste.in.0"));
            assert!(may_publish(role, "ste.in.3"));
        }
        for role in [Role::Node, Role::Sink, Role::Monitor] {
            assert!(!may_publish(role, "ste.in.0"), "{role:?}");
        }
    }

    #[test]
    fn a_gateway_hears_its_own_answers_and_takes_its_own_number_only() {
        let gateway = Role::Gateway(3);
        assert!(may_subscribe(gateway, "ste.ack.3"));
        assert!(!may_subscribe(gateway, "ste.ack.4"));
        assert!(!may_subscribe(gateway, "ste.>"));
        assert!(
            !may_publish(gateway, "ste.ack.3"),
            "answers come from owners"
        );
        assert!(may_publish(gateway, "$KV.ste_leases.gateway.3"));
        assert!(!may_publish(gateway, "$KV.ste_leases.gateway.4"));
        assert!(!may_publish(gateway, "$KV.ste_leases.shard.0"));
        assert!(!may_publish(gateway, "$KV.ste_delivered.shard.0"));
        assert!(!may_publish(gateway, "ste.samples.node-1"));
        assert!(!may_publish(gateway, "ste.cls"));
        let load = Role::Load(0);
        assert!(may_subscribe(
            load,
            &format!("ste.ack.{LOAD_NUMBERS_FIRST}")
        ));
        assert!(!may_subscribe(load, "ste.ack.0"));
    }

    #[test]
    fn leases_the_book_and_samples_are_written_by_their_keepers_only() {
        assert!(may_publish(Role::Node, "$KV.ste_leases.shard.2"));
        assert!(may_publish(Role::Node, "$KV.ste_leases.member.7"));
        assert!(!may_publish(Role::Node, "$KV.ste_leases.gateway.0"));
        assert!(!may_publish(Role::Node, "$KV.ste_delivered.shard.0"));
        assert!(may_publish(Role::Sink, "$KV.ste_delivered.shard.0"));
        assert!(!may_publish(Role::Sink, "$KV.ste_leases.shard.0"));
        assert!(!may_publish(Role::Sink, "ste.cls"));
        assert!(may_publish(Role::Node, "ste.samples.node-1"));
        assert!(may_publish(
            Role::Node,
            "$JS.API.CONSUMER.MSG.NEXT.STE_IN_63.owner-63"
        ));
        assert!(!may_publish(
            Role::Node,
            "$JS.API.CONSUMER.MSG.NEXT.STE_CLS.sink"
        ));
        assert!(may_publish(
            Role::Sink,
            "$JS.API.CONSUMER.MSG.NEXT.STE_CLS.sink"
        ));
        assert!(!may_publish(Role::Monitor, "ste.samples.node-1"));
        assert!(may_subscribe(Role::Monitor, "ste.samples.node-1"));
        assert!(!may_subscribe(Role::Node, "ste.samples.node-1"));
    }

    #[test]
    fn nobody_deletes_purges_or_changes_a_stream_or_reads_another_inbox() {
        for role in ROLES {
            for subject in [
                "$JS.API.STREAM.DELETE.STE_IN_0",
                "$JS.API.STREAM.PURGE.STE_CLS",
                "$JS.API.STREAM.UPDATE.KV_ste_leases",
                "$JS.API.STREAM.MSG.DELETE.STE_IN_0",
                "$JS.API.STREAM.MSG.GET.STE_IN_0",
                "$JS.API.CONSUMER.DELETE.STE_CLS.other",
                "$JS.API.STREAM.CREATE.OTHER",
                "$JS.API.CONSUMER.MSG.NEXT.STE_CLS.owner-0",
                "$JS.API.CONSUMER.DELETE.STE_IN_0.sink",
            ] {
                assert!(!may_publish(role, subject), "{role:?} {subject}");
            }
            assert!(!may_subscribe(role, "_INBOX.x"), "{role:?}");
            assert!(!may_subscribe(role, "ste.in.0"), "{role:?}");
            let other = if role == Role::Sink { "node" } else { "sink" };
            assert!(!may_subscribe(role, &format!("_INBOX_{other}.x")));
        }
    }

    #[test]
    fn the_servers_configuration_lists_every_key_with_its_roles_subjects() {
        let config = nats_authorization(&[
            NatsIdentity {
                role: Role::Node,
                public_keys: vec!["UNODE1".into(), "UNODE2".into()],
            },
            NatsIdentity {
                role: Role::Gateway(0),
                public_keys: vec!["UGATE".into()],
            },
        ]);
        assert_eq!(config.matches("nkey: UNODE").count(), 2);
        assert!(config.contains("nkey: UGATE"));
        assert!(config.contains("\"ste.ack.0\""));
        assert!(config.starts_with("authorization {"));
    }
}
