//! A small file system of its own, to fill up or make read-only: a tmpfs
//! mounted on a fresh directory, unmounted when the test ends. Mounting
//! needs root (or `CAP_SYS_ADMIN`), as CI runs; elsewhere the fixture
//! panics saying so, never a silent skip.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
};

pub struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// A tmpfs of `bytes` on a fresh directory under the system's temporary
    /// directory.
    pub fn mount(bytes: u64) -> Self {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-tmpfs-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the mount point");
        run(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o"])
                .arg(format!("size={bytes}"))
                .arg("tmpfs")
                .arg(&dir),
            "mount a tmpfs: the tests that fill a file system or make it read-only need root \
             (or CAP_SYS_ADMIN), as in CI; run them as root",
        );
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Fills the file system with a file of zeros, `name`, until writing
    /// fails: nothing is left for anyone else. Remove it to give the space
    /// back.
    pub fn fill(&self, name: &str) -> PathBuf {
        use std::io::Write;
        let path = self.dir.join(name);
        let mut file = std::fs::File::create(&path).expect("create the filler");
        let block = vec![0u8; 4096];
        while file.write_all(&block).is_ok() {}
        // The last partial block, byte by byte.
        while file.write_all(&[0]).is_ok() {}
        let _ = file.sync_all();
        path
    }

    /// Makes the file system read-only (or writable again).
    pub fn set_read_only(&self, read_only: bool) {
        let mode = if read_only {
            "remount,ro"
        } else {
            "remount,rw"
        };
        run(
            Command::new("mount").args(["-o", mode]).arg(&self.dir),
            "remount the tmpfs",
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily: a process the test started may still hold a file open.
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn run(command: &mut Command, what: &str) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot {what}: {e}"));
    assert!(
        out.status.success(),
        "cannot {what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
