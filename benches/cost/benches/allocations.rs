//! Heap allocations per request, counted by a global allocator of this
//! binary's own: each path of `paths` (the layer on the memory store,
//! beside the bare router) run 200 times after its warm-up, and the
//! allocations of one request printed beside the bare router's — the
//! layer's own are the difference.
//!
//! Run with: `cargo bench -p tower-idempotency-cost --bench allocations`.

mod paths;

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicU64, Ordering},
};

/// Counts every allocation (and reallocation) it passes to the system's.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

const RUNS: u64 = 200;

/// Allocations of one request of `kind` (size `size`), averaged over
/// `RUNS` fresh set-ups; the set-up itself is not counted.
fn per_request(kind: &str, size: usize, layered: bool) -> f64 {
    let mut counted = 0;
    for _ in 0..RUNS {
        let path = paths::setup(kind, size, layered);
        let before = ALLOCATIONS.load(Ordering::Relaxed);
        std::hint::black_box(path.run());
        counted += ALLOCATIONS.load(Ordering::Relaxed) - before;
    }
    counted as f64 / RUNS as f64
}

fn main() {
    println!("allocations per request, memory store ({RUNS} runs each)");
    println!("| path | layered | bare | the layer's own |");
    println!("|---|---:|---:|---:|");
    for (kind, size) in [
        ("first", 200),
        ("first", 16 * 1024),
        ("replay", 200),
        ("replay", 16 * 1024),
        ("conflict", 200),
        ("mismatch", 200),
        ("missing_key", 200),
    ] {
        let layered = per_request(kind, size, true);
        // The bare router answers every path as a first execution.
        let bare = per_request("first", size, false);
        println!(
            "| {kind} {} | {layered:.1} | {bare:.1} | {:.1} |",
            if size == 200 { "200 B" } else { "16 KiB" },
            layered - bare
        );
    }
}
