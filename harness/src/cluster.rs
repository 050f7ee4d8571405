//! A real local Redis Cluster: masters (and replicas) on free loopback ports,
//! created with `redis-cli --cluster create`, torn down on drop.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use crate::redis_server::{Flavour, RedisServer, raw_command, redis_cli_binary};

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// `masters` masters, each with `replicas_per_master` replicas.
    pub fn start(masters: usize, replicas_per_master: usize) -> Self {
        Self::start_flavour(Flavour::Redis, masters, replicas_per_master)
    }

    /// A cluster of `flavour`'s servers, as [`start`](Self::start).
    pub fn start_flavour(flavour: Flavour, masters: usize, replicas_per_master: usize) -> Self {
        let total = masters * (1 + replicas_per_master);
        let nodes: Vec<RedisServer> = (0..total)
            .map(|_| {
                RedisServer::start_flavour(
                    flavour,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "1000",
                        // A replica of a lost master is promoted even if it lagged.
                        "--cluster-replica-validity-factor",
                        "0",
                    ],
                )
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = Command::new(redis_cli_binary())
            .args(["--cluster", "create"])
            .args(&addresses)
            .args([
                "--cluster-replicas",
                &replicas_per_master.to_string(),
                "--cluster-yes",
            ])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_until_ok(Duration::from_secs(30));
        cluster.wait_for_replicas_online(replicas_per_master, Duration::from_secs(30));
        cluster
    }

    /// Waits until every master has this many replicas, each in sync.
    fn wait_for_replicas_online(&self, per_master: usize, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let masters = self.master_ports();
            let synced = masters.iter().all(|&port| {
                let info = raw_command(port, &["INFO", "replication"]);
                info.contains(&format!("connected_slaves:{per_master}"))
                    && info.matches("state=online").count() == per_master
            });
            if synced {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replicas did not come online in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Seed URLs for the client.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// Waits until every running node reports `cluster_state:ok` and agrees
    /// that all 16384 slots are served.
    pub fn wait_until_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.running().all(|n| {
                let info = raw_command(n.port(), &["CLUSTER", "INFO"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "cluster did not reach cluster_state:ok in {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn running(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|n| n.is_running())
    }

    /// Ports of the nodes that are masters now.
    pub fn master_ports(&self) -> Vec<u16> {
        self.running()
            .filter(|n| raw_command(n.port(), &["ROLE"]).starts_with("master"))
            .map(|n| n.port())
            .collect()
    }

    /// Waits until `masters` running nodes are masters again and the cluster is ok.
    pub fn wait_for_masters(&self, masters: usize, within: Duration) {
        let deadline = Instant::now() + within;
        while self.master_ports().len() < masters {
            assert!(
                Instant::now() < deadline,
                "no replica was promoted within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_until_ok(deadline.saturating_duration_since(Instant::now()));
    }

    pub fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("no node on that port")
    }

    /// Keys stored on the node at `port`.
    pub fn dbsize(port: u16) -> u64 {
        raw_command(port, &["DBSIZE"]).trim().parse().unwrap()
    }
}
