//! A MariaDB Galera cluster on loopback, for the tests: `n` `mariadbd`
//! processes with the Galera provider, each with its own data directory and
//! ports (SQL, group communication, incremental and full state transfer),
//! the first bootstrapping the cluster and the others joining it by state
//! transfer (rsync). Killed and removed when dropped. A missing
//! `mariadbd` or Galera provider makes it panic with what to install.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use sqlx::{Connection, MySqlConnection};

use crate::redis_server::free_port;

/// Where Debian, Fedora and others put the Galera 4 provider.
const PROVIDERS: [&str; 4] = [
    "/usr/lib/galera/libgalera_smm.so",
    "/usr/lib/galera-4/libgalera_smm.so",
    "/usr/lib64/galera-4/libgalera_smm.so",
    "/usr/lib/libgalera_smm.so",
];

const INSTALL: &str = "The Galera tests need MariaDB and the Galera 4 provider: \
    `sudo apt-get install mariadb-server galera-4 rsync` (Debian/Ubuntu)";

struct Node {
    dir: PathBuf,
    port: u16,
    gcomm: u16,
    ist: u16,
    sst: u16,
    child: Option<Child>,
}

pub struct GaleraCluster {
    dir: PathBuf,
    provider: &'static str,
    /// The user the servers run as: `mysql` when the tests run as root
    /// (state transfer's rsync daemon must own the data directories).
    user: String,
    nodes: Vec<Node>,
}

impl GaleraCluster {
    /// Starts a cluster of `n` nodes and waits until all are synced.
    pub fn start(n: usize) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let provider = PROVIDERS
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or_else(|| panic!("no Galera provider (libgalera_smm.so) found. {INSTALL}"));
        for tool in ["mariadbd", "mariadb-install-db", "rsync"] {
            let found = Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            assert!(found, "`{tool}` is not on PATH. {INSTALL}");
        }
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-galera-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let user = if is_root() {
            "mysql".to_owned()
        } else {
            std::env::var("USER").unwrap_or_else(|_| "nobody".into())
        };
        let mut cluster = Self {
            dir,
            provider,
            user,
            nodes: Vec::new(),
        };
        for i in 0..n {
            let dir = cluster.dir.join(format!("node{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            cluster.chown(&dir);
            let install = Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg(format!("--datadir={}", dir.join("data").display()))
                .arg(format!("--user={}", cluster.user))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
                .output()
                .unwrap_or_else(|e| panic!("mariadb-install-db: {e}. {INSTALL}"));
            assert!(
                install.status.success(),
                "mariadb-install-db failed: {}",
                String::from_utf8_lossy(&install.stderr)
            );
            cluster.nodes.push(Node {
                dir,
                port: free_port(),
                gcomm: free_port(),
                ist: free_port(),
                sst: free_port(),
                child: None,
            });
        }
        cluster.spawn(0, true);
        cluster.wait_synced(0);
        for i in 1..n {
            cluster.spawn(i, false);
        }
        for i in 1..n {
            cluster.wait_synced(i);
        }
        cluster
    }

    /// `mysql://root@127.0.0.1:PORT` of node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("mysql://root@127.0.0.1:{}", self.nodes[i].port)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// SIGKILL node `i`, as in a crash: the others go on as a cluster.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn chown(&self, dir: &Path) {
        if is_root() {
            let _ = Command::new("chown")
                .args(["-R", &format!("{}:", self.user)])
                .arg(dir)
                .status();
        }
    }

    fn spawn(&mut self, i: usize, bootstrap: bool) {
        let first = self.nodes[0].gcomm;
        let node = &self.nodes[i];
        let address = if bootstrap {
            "gcomm://".to_owned()
        } else {
            format!("gcomm://127.0.0.1:{first}")
        };
        let mut command = Command::new("mariadbd");
        command
            .arg("--no-defaults")
            .arg(format!("--datadir={}", node.dir.join("data").display()))
            .arg(format!("--socket={}", node.dir.join("sock").display()))
            .arg(format!("--pid-file={}", node.dir.join("pid").display()))
            .arg(format!("--log-error={}", node.dir.join("error.log").display()))
            .arg(format!("--port={}", node.port))
            .arg(format!("--user={}", self.user))
            .args(["--bind-address=127.0.0.1", "--skip-name-resolve"])
            .args(["--wsrep-on=ON", &format!("--wsrep-provider={}", self.provider)])
            .arg(format!("--wsrep-cluster-address={address}"))
            .arg(format!("--wsrep-node-address=127.0.0.1:{}", node.gcomm))
            .arg(format!("--wsrep-node-name=node{i}"))
            .arg("--wsrep-cluster-name=tower-idempotency-test")
            .arg(format!(
                "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{};ist.recv_addr=127.0.0.1:{};gcache.size=32M",
                node.gcomm, node.ist
            ))
            .arg(format!("--wsrep-sst-receive-address=127.0.0.1:{}", node.sst))
            .args([
                "--wsrep-sst-method=rsync",
                "--binlog-format=ROW",
                "--default-storage-engine=InnoDB",
                "--innodb-autoinc-lock-mode=2",
                "--innodb-buffer-pool-size=32M",
                "--innodb-log-file-size=16M",
                "--max-connections=500",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if bootstrap {
            command.arg("--wsrep-new-cluster");
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mariadbd: {e}. {INSTALL}"));
        self.nodes[i].child = Some(child);
    }

    /// Waits (up to 60 s) until node `i` accepts connections and is synced
    /// with the cluster.
    fn wait_synced(&mut self, i: usize) {
        let url = self.url(i);
        let deadline = Instant::now() + Duration::from_secs(60);
        let synced = crate::blocking(async move || {
            loop {
                if let Ok(mut on) = MySqlConnection::connect(&url).await {
                    let state: Result<(String, String), _> =
                        sqlx::query_as("SHOW STATUS LIKE 'wsrep_local_state_comment'")
                            .fetch_one(&mut on)
                            .await;
                    if state.is_ok_and(|(_, s)| s == "Synced") {
                        return true;
                    }
                }
                if Instant::now() > deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        if !synced {
            let log =
                std::fs::read_to_string(self.nodes[i].dir.join("error.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            panic!(
                "Galera node {i} did not sync within 60 s. {INSTALL}. Its log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }
}

impl Drop for GaleraCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
