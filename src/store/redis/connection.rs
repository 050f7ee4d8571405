//! One handle over a single node or a cluster, so the protocol code exists once.

use redis::{Cmd, RedisResult, ScriptInvocation, Value, aio::ConnectionManager};

#[derive(Clone)]
pub(super) enum Connection {
    Single(ConnectionManager),
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Connection {
    /// EVALSHA, loading the script on NOSCRIPT (a restarted or promoted node).
    pub(super) async fn invoke(&self, invocation: &ScriptInvocation<'_>) -> RedisResult<Value> {
        match self.clone() {
            Self::Single(mut c) => invocation.invoke_async(&mut c).await,
            #[cfg(feature = "cluster")]
            Self::Cluster(mut c) => invocation.invoke_async(&mut c).await,
        }
    }

    /// WAIT on the node that holds `key`: it counts the replicas that
    /// acknowledged this connection's writes to that node.
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
