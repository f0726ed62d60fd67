//! The official `lm_eval` harness (EleutherAI's lm-evaluation-harness, from PyPI, run
//! unmodified) scores SmolLM2 served by `dyn graph up graphs/chat.yaml` on a small local
//! multiple-choice task (tests/py/lm_eval_task.py writes it), twice: with the harness's
//! defaults, where `local-completions` finds dyn's tokenizer endpoints (`/tokenizer_info`,
//! `/tokenize`, `/detokenize`), tokenizes with them and sends token-id lists; and with
//! `tokenized_requests=False`, where it sends the same text as strings. Both score every
//! question by loglikelihood (`echo` with `logprobs`) and must agree.
//!
//! The test command (`scripts/test`) installs `lm-eval` into a venv cached outside the clone
//! and points `DYN_LMEVAL_PYTHON` at its interpreter; without it, or without the model
//! (`DYN_SMOLLM2_GGUF`), this test says so and skips.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dyn_tests::{Graph, metric, root, scratch_dir};
use serde_json::Value;

/// A bound that only ends a hang (lm_eval retries a failed request for minutes): one run has
/// taken under a minute on a loaded 2-core machine.
const RUN_WITHIN: Duration = Duration::from_secs(600);

/// What one `lm_eval` run left: its results file and its per-question samples.
struct Run {
    results: Value,
    samples: Vec<Value>,
    log: String,
}

/// `python -m lm_eval` on task `dyn_mc` (in `task_dir`) against the graph at `base`, with
/// `model_args` after `base_url`; it must succeed.
fn lm_eval(python: &Path, task_dir: &Path, base: &str, extra_args: &str, name: &str) -> Run {
    let out = task_dir.join(format!("out-{name}"));
    let log_path = task_dir.join(format!("{name}.log"));
    let log_file = std::fs::File::create(&log_path).unwrap();
    let model_args = format!("base_url={base}/v1/completions{extra_args}");
    let mut child = Command::new(python)
        .args(["-m", "lm_eval", "--model", "local-completions"])
        .args(["--model_args", &model_args])
        .args(["--tasks", "dyn_mc", "--include_path"])
        .arg(task_dir)
        .arg("--output_path")
        .arg(&out)
        .arg("--log_samples")
        .current_dir(task_dir)
        // The task's data is a local file: nothing is to come from the Hugging Face Hub, and
        // its caches stay in the scratch directory.
        .env("HF_HOME", task_dir.join("hf"))
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > RUN_WITHIN {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "lm_eval ({name}) did not finish in {RUN_WITHIN:?}; its log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        status.success(),
        "lm_eval ({name}) failed ({status}):\n{log}"
    );
    let results = find(&out, "results_");
    let samples = find(&out, "samples_dyn_mc_");
    let results = serde_json::from_str(&std::fs::read_to_string(results).unwrap()).unwrap();
    let samples = std::fs::read_to_string(samples)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    Run {
        results,
        samples,
        log,
    }
}

/// The one file under `dir` (at any depth: lm_eval adds a folder named after the model) whose
/// name starts with `prefix`.
fn find(dir: &Path, prefix: &str) -> PathBuf {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
            {
                found.push(p);
            }
        }
    }
    assert_eq!(
        found.len(),
        1,
        "{prefix}* under {}: {found:?}",
        dir.display()
    );
    found.pop().unwrap()
}

/// Completions dyn answered, by status.
fn completions(g: &Graph, status: &str) -> u64 {
    metric(
        &g.get("/metrics"),
        &[
            "dyn_frontend_requests_total",
            "endpoint=\"completions\"",
            &format!("status=\"{status}\""),
        ],
    )
}

/// Each question's loglikelihood per choice, in question order.
fn loglikelihoods(run: &Run) -> Vec<Vec<f64>> {
    let mut samples = run.samples.clone();
    samples.sort_by_key(|s| s["doc_id"].as_u64().unwrap());
    samples
        .iter()
        .map(|s| {
            s["filtered_resps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r[0].as_str().unwrap().parse().unwrap())
                .collect()
        })
        .collect()
}

/// Whether each question was answered right, in question order.
fn correct(run: &Run) -> Vec<f64> {
    let mut samples = run.samples.clone();
    samples.sort_by_key(|s| s["doc_id"].as_u64().unwrap());
    samples.iter().map(|s| s["acc"].as_f64().unwrap()).collect()
}

#[test]
fn lm_eval_scores_smollm2_alike_from_token_ids_and_from_strings() {
    let (Some(python), Some(gguf)) = (
        std::env::var_os("DYN_LMEVAL_PYTHON"),
        std::env::var("DYN_SMOLLM2_GGUF").ok(),
    ) else {
        dyn_tests::skip(
            "DYN_LMEVAL_PYTHON or DYN_SMOLLM2_GGUF is not set (scripts/test sets both)",
        );
        return;
    };
    let python = PathBuf::from(python);
    let dir = scratch_dir("lm-eval");
    let made = Command::new(&python)
        .arg(root().join("tests/py/lm_eval_task.py"))
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let questions: u64 = String::from_utf8_lossy(&made.stdout)
        .trim()
        .parse()
        .unwrap();
    let choices = 4 * questions;

    let g = Graph::up_with_ingress(
        "graphs/chat.yaml",
        "http",
        &["--set", &format!("model.path={gguf}")],
    );
    let base = g.url("");

    // The harness's defaults: its tokenizer backend `auto` finds dyn's tokenizer endpoints and
    // takes them; requests go out as token-id lists, one loglikelihood request per choice.
    let ids = lm_eval(&python, &dir, &base, "", "token-ids");
    assert!(
        ids.log
            .contains("Auto-detected remote tokenizer support. Using remote tokenizer backend."),
        "lm_eval did not take dyn's tokenizer:\n{}",
        ids.log
    );
    assert_eq!(completions(&g, "success"), choices);
    // The same, with each prompt sent as its text (lm_eval detokenizes with dyn, and dyn
    // tokenizes the text again).
    let strings = lm_eval(&python, &dir, &base, ",tokenized_requests=False", "strings");
    assert_eq!(completions(&g, "success"), 2 * choices);
    assert_eq!(completions(&g, "error"), 0);

    for run in [&ids, &strings] {
        assert_eq!(
            run.results["n-samples"]["dyn_mc"]["effective"], questions,
            "{}",
            run.results
        );
        assert_eq!(run.samples.len() as u64, questions);
    }
    let acc = |run: &Run| {
        run.results["results"]["dyn_mc"]["acc,none"]
            .as_f64()
            .unwrap()
    };
    eprintln!(
        "lm_eval accuracy on {questions} questions: {} from token ids, {} from strings",
        acc(&ids),
        acc(&strings)
    );
    assert_eq!(acc(&ids), acc(&strings));
    assert_eq!(correct(&ids), correct(&strings));
    // Above chance (a quarter): the log-probabilities are the continuation's, not shifted.
    assert!(acc(&ids) > 0.5, "accuracy {}", acc(&ids));
    // Both runs sent the same tokens to the same engine, one request at a time, so the scores
    // agree to float noise (they have been bitwise equal).
    for (q, (a, b)) in loglikelihoods(&ids)
        .iter()
        .zip(loglikelihoods(&strings))
        .enumerate()
    {
        assert_eq!(a.len(), 4);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() < 1e-4,
                "question {q}: {a:?} from token ids, {b:?} from strings"
            );
        }
    }
}
