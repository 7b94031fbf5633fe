//! The library's modules import one another one way only: no cycle, and the
//! roles (intake, attempts, reconciler) never import one another, the fleet that
//! composes them, or the operator CLI. Read from the source itself (every
//! `crate::module` a module names outside comments), so a change that adds a
//! cycle fails the build's tests.

use std::collections::{BTreeMap, BTreeSet};

/// module → the modules it names.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&src).expect("src/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let module = path.file_stem().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).expect("read a module");
        let mut deps = BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let name: String = line[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && name != module {
                    deps.insert(name);
                }
            }
        }
        graph.insert(module, deps);
    }
    graph
}

fn show(graph: &BTreeMap<String, BTreeSet<String>>) -> String {
    graph
        .iter()
        .map(|(m, d)| format!("{m} → {}", d.iter().cloned().collect::<Vec<_>>().join(" ")))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn modules_import_one_way_only() {
    let graph = imports();
    assert!(graph.len() > 10, "read the modules:\n{}", show(&graph));
    // Depth-first search; a grey module met again closes a cycle.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<&'a str, bool>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        match state.get(m) {
            Some(true) => return None,
            Some(false) => {
                let start = path.iter().position(|p| *p == m).unwrap_or(0);
                let mut cycle: Vec<String> = path[start..].iter().map(|s| s.to_string()).collect();
                cycle.push(m.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        state.insert(m, false);
        path.push(m);
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(m, true);
        None
    }
    let mut state = BTreeMap::new();
    for m in graph.keys() {
        let mut path = Vec::new();
        if let Some(cycle) = visit(m, &graph, &mut state, &mut path) {
            panic!("import cycle: {}\n\n{}", cycle.join(" → "), show(&graph));
        }
    }
}

#[test]
fn roles_stand_apart() {
    let graph = imports();
    for role in ["intake", "attempts", "reconciler"] {
        let deps = &graph[role];
        for above in ["intake", "attempts", "reconciler", "fleet", "cli"] {
            assert!(
                !deps.contains(above),
                "{role} imports {above}\n\n{}",
                show(&graph)
            );
        }
    }
}
