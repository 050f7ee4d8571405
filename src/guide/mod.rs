//! The guide: how the crate behaves and how to run it, topic by topic.
//! Pages only — nothing here is code; the API pages link to them.
//!
//! | page | for |
//! |---|---|
//! | [`semantics`] | what a request with a key gets, what is stored, where the layer goes among others |
//! | [`configuration`] | the layer's and the Redis store's settings, what counts as the same request, webhooks |
//! | [`sql`] | the record and the effect in one transaction; the supported databases; MySQL, MariaDB and Galera |
//! | [`stores`] | each store, and writing your own |
//! | [`consumers`] | queue consumers on SQS, JetStream and RabbitMQ |
//! | [`outbox`] | the handler's outgoing messages, committed with its record and relayed with stable ids |
//! | [`client`] | calling an idempotent API safely |
//! | [`grpc`] | tonic services |
//! | [`mcp`] | MCP tool calls from AI agents: where the key goes, what is stored, the error codes |
//! | [`operations`] | inspecting and forgetting a key, publishing your policy, logs and metrics |
//! | [`capacity`] | what a record costs, and compressing it |

pub mod semantics {
    #![doc = include_str!("semantics.md")]
}

pub mod configuration {
    #![doc = include_str!("configuration.md")]
}

pub mod sql {
    #![doc = include_str!("sql.md")]
}

pub mod stores {
    #![doc = include_str!("stores.md")]
}

pub mod consumers {
    #![doc = include_str!("consumers.md")]
}

pub mod outbox {
    #![doc = include_str!("outbox.md")]
}

pub mod client {
    #![doc = include_str!("client.md")]
}

pub mod grpc {
    #![doc = include_str!("grpc.md")]
}

pub mod mcp {
    #![doc = include_str!("mcp.md")]
}

pub mod operations {
    #![doc = include_str!("operations.md")]
}

pub mod capacity {
    #![doc = include_str!("capacity.md")]
}
