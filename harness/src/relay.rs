//! A TCP relay in front of a real server, to take the network to it away:
//! [`Relay::cut`] drops every relayed connection and refuses new ones (the
//! server is unreachable), [`Relay::stall`] stops moving bytes (the server
//! hangs), [`Relay::restore`] brings it back, [`Relay::lose_answers`]
//! drops the connection as the server's answer arrives (the server acted,
//! the client never hears of it). The server itself keeps running; tests
//! share it.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Open,
    Stalled,
    Cut,
}

pub struct Relay {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    /// Answers still to lose.
    lose: Arc<AtomicUsize>,
}

impl Relay {
    /// Relays a port on loopback to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, _) = watch::channel(Mode::Open);
        let modes = mode.clone();
        let upstream = upstream.to_owned();
        let lose = Arc::new(AtomicUsize::new(0));
        let losing = lose.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *modes.borrow() == Mode::Cut {
                    continue; // dropped: closed at once
                }
                let upstream = upstream.clone();
                let mode = modes.subscribe();
                let lose = losing.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&upstream).await {
                        pipe(client, server, mode, lose).await;
                    }
                });
            }
        });
        Self { addr, mode, lose }
    }

    /// The next `n` times the server answers on a relayed connection, the
    /// answer is thrown away and both sockets are closed: the lost answer.
    pub fn lose_answers(&self, n: usize) {
        self.lose.store(n, Ordering::SeqCst);
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
    }

    pub fn stall(&self) {
        self.mode.send_replace(Mode::Stalled);
    }

    pub fn restore(&self) {
        self.mode.send_replace(Mode::Open);
    }
}

/// Moves bytes both ways while open, none while stalled, and drops both
/// sockets when cut.
async fn pipe(
    mut client: TcpStream,
    mut server: TcpStream,
    mut mode: watch::Receiver<Mode>,
    lose: Arc<AtomicUsize>,
) {
    let (mut up, mut down) = ([0u8; 16 * 1024], [0u8; 16 * 1024]);
    loop {
        let current = *mode.borrow_and_update();
        match current {
            Mode::Cut => return,
            Mode::Stalled => {
                if mode.changed().await.is_err() {
                    return;
                }
            }
            Mode::Open => {
                tokio::select! {
                    read = client.read(&mut up) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(n) => if server.write_all(&up[..n]).await.is_err() { return },
                    },
                    read = server.read(&mut down) => match read {
                        Ok(0) | Err(_) => return,
                        Ok(_) if lose.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() => return,
                        Ok(n) => if client.write_all(&down[..n]).await.is_err() { return },
                    },
                    changed = mode.changed() => if changed.is_err() { return },
                }
            }
        }
    }
}
