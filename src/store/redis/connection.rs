//! One handle over a single node or a cluster, so the protocol code exists once.

use redis::{Cmd, RedisResult, Value, aio::ConnectionManager};

/// A Lua script: its source, to load it, and its SHA-1, to call it.
pub(super) struct Lua {
    source: &'static str,
    sha1: String,
}

impl Lua {
    pub(super) fn new(source: &'static str) -> Self {
        let sha1 = redis::Script::new(source).get_hash().to_owned();
        Self { source, sha1 }
    }

    /// `EVALSHA` of this script on one key: an owned command, so a call can
    /// outlive its caller (see `RedisStore::claim`).
    pub(super) fn evalsha(&self, key: &str, args: &[&[u8]]) -> Cmd {
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(&self.sha1).arg(1).arg(key);
        args.iter().for_each(|a| {
            evalsha.arg(*a);
        });
        evalsha
    }

    /// `SCRIPT LOAD` of this script.
    pub(super) fn load(&self) -> Cmd {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(self.source);
        load
    }
}

#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Connection {
    /// `EVALSHA script 1 key args…`, built as one command (no per-argument
    /// buffers); on NOSCRIPT (a restarted or promoted node) the script is
    /// loaded and run again.
    pub(super) async fn eval(&self, lua: &Lua, key: &str, args: &[&[u8]]) -> RedisResult<Value> {
        self.eval_cmd(lua, &lua.evalsha(key, args)).await
    }

    /// Runs a command built by [`Lua::evalsha`].
    pub(super) async fn eval_cmd(&self, lua: &Lua, evalsha: &Cmd) -> RedisResult<Value> {
        match self.query(evalsha).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.query(&lua.load()).await?;
                self.query(evalsha).await
            }
            reply => reply,
        }
    }

    /// One command, routed by its key on a cluster.
    pub(super) async fn query(&self, cmd: &Cmd) -> RedisResult<Value> {
        match self.clone() {
            Self::Single(mut c) => cmd.query_async(&mut c).await,
            #[cfg(feature = "cluster")]
            Self::Cluster(mut c) => cmd.query_async(&mut c).await,
        }
    }

    /// WAIT on the node that holds `key`: it counts the replicas that
    /// acknowledged this connection's writes to that node.
    // A single node has one: only a cluster reads `key` to find it.
    #[cfg_attr(not(feature = "cluster"), allow(unused_variables))]
    pub(super) async fn wait_for_replicas(
        &self,
        key: &str,
        replicas: usize,
        timeout_ms: u64,
    ) -> RedisResult<usize> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(timeout_ms);
        match self.clone() {
            Self::Single(mut c) => wait.query_async(&mut c).await,
            #[cfg(feature = "cluster")]
            Self::Cluster(mut c) => {
                use redis::cluster_routing::{
                    Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr,
                };
                let route = Route::with_slot(Slot::for_key(key), SlotAddr::Master);
                let value = c
                    .route_command(
                        wait,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await?;
                Ok(redis::from_redis_value(value)?)
            }
        }
    }

    /// A command answered by every master (a single node is its own master);
    /// the replies, in no particular order.
    pub(super) async fn on_every_master(&self, cmd: Cmd) -> RedisResult<Vec<Value>> {
        match self.clone() {
            Self::Single(mut c) => Ok(vec![cmd.query_async(&mut c).await?]),
            #[cfg(feature = "cluster")]
            Self::Cluster(mut c) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                Ok(vec![c.route_command(cmd, all).await?])
            }
        }
    }
}
