//! `scripts/cluster`, the throwaway RabbitMQ the chaos tests restart: it
//! knows its own nodes whatever their environment holds.

use std::process::{Command, Stdio};

/// A node is known by the `RABBITMQ_NODENAME` in its environment. The check
/// read `/proc/PID/environ` through `tr … | grep -q` under `pipefail`: when
/// the environment was larger than one write of `tr` (a test's, with cargo's
/// and nextest's variables, is), `grep -q` stopped at the name, `tr` died of
/// SIGPIPE, and the node was taken for not running (a chaos run failed
/// "node 1 … is not running" on a node that ran; reproduced here: 58 of 300
/// checks missed). Thirty nodes with a large environment, each found and
/// stopped.
#[test]
fn the_cluster_script_finds_its_node_whatever_its_environment() {
    let dir = std::env::temp_dir().join(format!("onejob-cluster-script-{}", std::process::id()));
    let node = dir.join("node1");
    std::fs::create_dir_all(&node).unwrap();
    let padding = "x".repeat(20_000);
    for round in 0..30 {
        // A stand-in for the node: its name, and a large environment after it
        // (a command sorts its variables by name).
        let mut stand_in = Command::new("sleep");
        stand_in
            .arg("600")
            .env_clear()
            .env("RABBITMQ_NODENAME", "scripttest1@localhost");
        for k in ["ZA", "ZB", "ZC", "ZD", "ZE"] {
            stand_in.env(k, &padding);
        }
        let mut child = stand_in.stdin(Stdio::null()).spawn().unwrap();
        let pid = child.id();
        std::fs::write(node.join("pid"), pid.to_string()).unwrap();
        // Reaped as soon as it exits, so that the script sees it gone.
        let reaper = std::thread::spawn(move || child.wait());
        let out = Command::new("scripts/cluster")
            .args(["kill", "1"])
            .env("ONEJOB_CLUSTER_DIR", &dir)
            .env("ONEJOB_CLUSTER_NAME", "scripttest")
            .env("ONEJOB_CLUSTER_NODES", "1")
            .output()
            .unwrap();
        let stopped = reaper.is_finished();
        if !stopped {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
        reaper.join().unwrap().unwrap();
        assert!(
            out.status.success() && stopped,
            "round {round}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
