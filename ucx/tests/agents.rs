//! Agents reading each other's registered memory through the real UCX library: in one process
//! (two contexts and workers), across two processes (this test binary started again as the
//! serving side), and against a peer that went away (a bounded error, not a hang).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_ucx::{Agent, Remote};

const LIMIT: Duration = Duration::from_secs(20);

fn pattern(n: usize, seed: u8) -> Bytes {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

/// An offer's blocks: slices of one exported buffer are registered where they lie; blocks
/// from separate buffers are copied into one first. Either way a reader sees them back to back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_register_as_one_region_in_place_or_copied() {
    let owner = Agent::new("ucx-owner").expect("UCX starts");
    let reader = Agent::new("ucx-reader").expect("UCX starts");
    let all = pattern(8 * 4096, 5);
    let slices: Vec<Bytes> = (0..8)
        .map(|i| all.slice(i * 4096..(i + 1) * 4096))
        .collect();
    let region = owner.register_blocks(slices).await.expect("registers");
    assert_eq!(
        region.remote().addr,
        all.as_ptr() as u64,
        "registered in place"
    );
    let got = reader
        .get(region.remote(), 0, all.len(), LIMIT)
        .await
        .expect("reads");
    assert!(got == all[..]);

    let apart: Vec<Bytes> = (0..3).map(|i| pattern(1000, i)).collect();
    let region = owner
        .register_blocks(apart.clone())
        .await
        .expect("registers");
    assert_eq!(region.remote().len, 3000);
    let got = reader
        .get(region.remote(), 0, 3000, LIMIT)
        .await
        .expect("reads");
    assert!(got == apart.concat());
    assert!(
        owner.register_blocks(Vec::new()).await.is_err(),
        "nothing to register"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_region_is_read_whole_and_in_part_by_another_agent() {
    let owner = Agent::new("ucx-owner").expect("UCX starts");
    let reader = Agent::new("ucx-reader").expect("UCX starts");
    let data = pattern(4 << 20, 7);
    let region = owner.register(data.clone()).await.expect("registers");
    let remote = region.remote().clone();
    assert_eq!(remote.len, data.len() as u64);
    assert_eq!(remote.worker, owner.address());

    let whole = reader
        .get(&remote, 0, data.len(), LIMIT)
        .await
        .expect("reads");
    assert!(whole == data[..], "the whole region");
    let part = reader
        .get(&remote, 1000, 123_457, LIMIT)
        .await
        .expect("reads");
    assert!(part == data[1000..1000 + 123_457], "a range inside it");
    // Into a buffer of the caller's, its old contents replaced.
    let reused = reader
        .get_into(&remote, 4096, part, 8192, LIMIT)
        .await
        .expect("reads");
    assert!(reused == data[4096..4096 + 8192], "into a reused buffer");
    // Several reads at once, over the endpoint the first one opened.
    let reads = (0..16u64).map(|i| reader.get(&remote, (i * 256) << 10, 256 << 10, LIMIT));
    for (i, r) in futures::future::join_all(reads)
        .await
        .into_iter()
        .enumerate()
    {
        let off = i * (256 << 10);
        assert!(
            r.expect("reads") == data[off..off + (256 << 10)],
            "block {i}"
        );
    }
    // A range past the region is refused before anything is posted.
    let e = reader
        .get(&remote, data.len() as u64 - 10, 11, LIMIT)
        .await
        .expect_err("outside");
    assert!(e.to_string().contains("outside the region"), "{e}");
    let e = reader
        .get(&remote, u64::MAX - 2, 4, LIMIT)
        .await
        .expect_err("past the end of the address space");
    assert!(e.to_string().contains("outside the region"), "{e}");
    assert!(
        owner.register(Bytes::new()).await.is_err(),
        "an empty region"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_an_agent_that_is_gone_fails_within_its_limit() {
    let owner = Agent::new("ucx-owner").expect("UCX starts");
    let reader = Agent::new("ucx-reader").expect("UCX starts");
    let region = owner
        .register(pattern(1 << 20, 3))
        .await
        .expect("registers");
    let remote = region.remote().clone();
    reader
        .get(&remote, 0, 4096, LIMIT)
        .await
        .expect("reads while there");
    // The owner's worker is destroyed once its agent and regions are gone.
    drop(region);
    drop(owner);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let limit = Duration::from_secs(3);
    let started = Instant::now();
    let r = reader.get(&remote, 0, 1 << 20, limit).await;
    assert!(
        r.is_err(),
        "a read from a destroyed worker's memory must fail"
    );
    assert!(started.elapsed() < limit + Duration::from_secs(2));
    // The reader still works for others.
    let other = Agent::new("ucx-other").expect("UCX starts");
    let data = pattern(8192, 9);
    let region = other.register(data.clone()).await.expect("registers");
    let got = reader
        .get(region.remote(), 0, data.len(), LIMIT)
        .await
        .expect("reads from a live peer after a dead one");
    assert!(got == data[..]);
}

/// The serving side of the two-process test: registers a region, prints where it is, and
/// keeps it until its standard input closes. Does nothing unless started by that test.
#[test]
fn serve_a_region_for_the_two_process_test() {
    let Ok(size) = std::env::var("DYN_UCX_TEST_SERVE") else {
        return;
    };
    let owner = Agent::new("ucx-child").expect("UCX starts");
    let data = pattern(size.parse().unwrap(), 5);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let region = rt.block_on(owner.register(data)).expect("registers");
    let r = region.remote();
    println!("REMOTE {r}");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_reads_a_region_and_sees_it_end_with_its_owner() {
    let size = 16 << 20;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "serve_a_region_for_the_two_process_test",
            "--nocapture",
        ])
        .env("DYN_UCX_TEST_SERVE", size.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starts the serving process");
    // The child's line is read on a thread of its own, so a child that never prints is a
    // failure after a bound (sized for a loaded machine) that says so, not a hung test.
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.trim().strip_prefix("REMOTE ") {
                let _ = tx.send(rest.to_owned());
                break;
            }
        }
    });
    let rest = match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(rest) => rest,
        Err(e) => {
            let _ = child.kill();
            panic!(
                "the serving process printed no remote within 120 s ({e}): it ended early or hung starting UCX"
            );
        }
    };
    let remote: Remote = rest.parse().expect("a remote");
    assert_eq!(remote.to_string(), rest, "its line reads back as written");
    let reader = Agent::new("ucx-parent").expect("UCX starts");
    let want = pattern(size, 5);
    let got = reader.get(&remote, 0, size, LIMIT).await.expect("reads");
    assert!(got == want[..], "the other process's bytes");
    let got = reader
        .get(&remote, 12345, 1 << 20, LIMIT)
        .await
        .expect("reads");
    assert!(got == want[12345..12345 + (1 << 20)]);
    // The owner process dies: a read fails within its limit.
    child.kill().unwrap();
    child.wait().unwrap();
    let limit = Duration::from_secs(3);
    let started = Instant::now();
    assert!(reader.get(&remote, 0, size, limit).await.is_err());
    assert!(started.elapsed() < limit + Duration::from_secs(2));
}
