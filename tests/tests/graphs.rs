//! Every graph in `graphs/` validates through the real binary; every graph in
//! `graphs/invalid/` fails with exit code 78 and the error its first line announces.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is a failure report

use dyn_tests::{root, run};

fn yaml_files(dir: &str) -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(root().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| p.strip_prefix(root()).unwrap().display().to_string())
        .collect();
    files.sort();
    files
}

#[test]
fn every_graph_validates() {
    let files = yaml_files("graphs");
    assert!(!files.is_empty());
    for f in &files {
        let out = run(&["graph", "validate", f]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{f}:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = run(&["graph", "plan", f, "--format", "json"]);
        assert!(out.status.success(), "plan {f}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("plan is JSON");
    }
}

#[test]
fn every_invalid_graph_fails_with_its_expected_error() {
    let files = yaml_files("graphs/invalid");
    assert!(files.len() >= 10);
    let mut rendered = String::new();
    for f in &files {
        let text = std::fs::read_to_string(root().join(f)).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect-error: "))
            .unwrap_or_else(|| panic!("{f} must begin with `# expect-error: …`"));
        let out = run(&["graph", "validate", f]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{f}: {stderr}");
        assert!(
            stderr.contains(expect),
            "{f}: expected {expect:?} in:\n{stderr}"
        );
        assert!(
            stderr.starts_with(&format!("{f}:")),
            "{f}: errors start with FILE:LINE:COL:\n{stderr}"
        );
        rendered.push_str(&stderr);
    }
    insta::assert_snapshot!(rendered);
}

#[test]
fn validate_reports_every_file_and_fails_if_any_is_bad() {
    let out = run(&[
        "graph",
        "validate",
        "graphs/echo.yaml",
        "graphs/invalid/cycle.yaml",
    ]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stdout).contains("graphs/echo.yaml: valid"));
}

#[test]
fn plan_formats_and_overrides() {
    let out = run(&[
        "graph",
        "plan",
        "graphs/echo.yaml",
        "--format",
        "mermaid",
        "--set",
        "echo.replicas=3",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("flowchart LR"), "{text}");
    assert!(text.contains("process echo ×3"), "{text}");
    let out = run(&[
        "graph",
        "plan",
        "graphs/echo.yaml",
        "--set",
        "echo.split=sideways",
    ]);
    assert_eq!(out.status.code(), Some(78));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--set echo.split=sideways:1:4: node 'echo'")
    );
}

#[test]
fn version_and_help() {
    let out = run(&["--version"]);
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("dyn "));
    let out = run(&["graph", "--help"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("Examples:"));
    let out = run(&["graph", "validate", "graphs/does-not-exist.yaml"]);
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read graph"));
}
