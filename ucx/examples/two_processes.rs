//! UCX reads from another process, against memcpy of the same bytes in this one:
//! `cargo run --release -p dyn-ucx --example two_processes [ROUNDS]`. The program starts itself
//! again as the serving process (which registers 256 blocks of 256 KiB and prints where they
//! are), then reads 1, 16 and 256 blocks as one contiguous run each, ROUNDS times (default
//! 200, 20 for 256 blocks), into a reused buffer, and prints each size's p50 and throughput.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a measurement: a panic is a failure report

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dyn_ucx::{Agent, Remote};

const BLOCK: usize = 256 << 10;

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::var_os("DYN_UCX_SERVE").is_some() {
        let owner = Agent::new("ucx-serve").unwrap();
        let data: Vec<u8> = (0..256 * BLOCK).map(|i| (i % 251) as u8).collect();
        let region = owner.register(Bytes::from(data)).await.unwrap();
        let r = region.remote();
        println!("{r}");
        std::io::stdout().flush().unwrap();
        let _ = std::io::stdin().read_line(&mut String::new());
        return;
    }
    let rounds: usize = std::env::args().nth(1).map_or(200, |s| s.parse().unwrap());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("DYN_UCX_SERVE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let remote: Remote = line.trim().parse().unwrap();
    let reader = Agent::new("ucx-read").unwrap();
    let src: Vec<u8> = (0..256 * BLOCK).map(|i| (i % 251) as u8).collect();
    println!(
        "| blocks | bytes | UCX read p50 (µs) | UCX GB/s | memcpy p50 (µs) | memcpy GB/s | UCX / memcpy |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for n in [1usize, 16, 256] {
        let bytes = n * BLOCK;
        let rounds = if n == 256 {
            rounds.clamp(3, 20)
        } else {
            rounds
        };
        let mut buf = Vec::with_capacity(bytes);
        let (mut ucx, mut copy) = (Vec::new(), Vec::new());
        let mut dst = vec![0u8; bytes];
        for _ in 0..rounds + 2 {
            let t = Instant::now();
            buf = reader
                .get_into(&remote, 0, buf, bytes, Duration::from_secs(30))
                .await
                .unwrap();
            ucx.push(t.elapsed());
            let t = Instant::now();
            dst.copy_from_slice(&src[..bytes]);
            copy.push(t.elapsed());
        }
        assert!(buf == src[..bytes], "the other process's bytes");
        let (u, c) = (p50(ucx[2..].to_vec()), p50(copy[2..].to_vec()));
        let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        println!(
            "| {n} | {bytes} | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} |",
            u.as_secs_f64() * 1e6,
            gbs(u),
            c.as_secs_f64() * 1e6,
            gbs(c),
            c.as_secs_f64() / u.as_secs_f64()
        );
    }
    drop(child.stdin.take());
    child.wait().unwrap();
}
