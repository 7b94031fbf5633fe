//! The library's modules import one another one way only: down its layers, one
//! folder each ([`LAYERS`] orders them; a module's layer is its folder), with
//! no cycle, and the roles (intake,
//! attempts, reconciler) never import one another, the fleet that composes them,
//! or the operator CLI. Read from the source itself (every `crate::module` a
//! module names outside comments), so a change that adds a cycle or an upward
//! import fails the build's tests.

use std::collections::{BTreeMap, BTreeSet};

/// The folders of `src/` that group modules (`crate::shared::runtime` is
/// `src/shared/runtime/`, the module `runtime`, in the layer `shared`).
const GROUPS: &[&str] = &["operator", "roles", "shared", "edges", "policy", "settings"];

/// The import graph, module → the modules it names, and each module's
/// folder (its layer). A module is a file or a folder of files (`src/edges/store/`,
/// `src/shared/runtime/`: every file beneath it, however deep); the group
/// folders ([`GROUPS`]) are not modules but hold them, and are their layer. A
/// module beside `lib.rs` (`fleet.rs`, `mock/`) is its own layer.
/// The core crate's modules (`core/src/`) are in the layer `core`, named as
/// `onejob` re-exports them.
type Graph = BTreeMap<String, BTreeSet<String>>;

fn imports() -> (Graph, BTreeMap<String, String>) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut modules = Vec::new();
    for (src, core) in [(root.join("src"), false), (root.join("core/src"), true)] {
        for path in entries(&src) {
            let name = stem(&path);
            if path.is_dir() && GROUPS.contains(&name.as_str()) {
                let inside = entries(&path).into_iter().filter(|p| stem(p) != "mod");
                modules.extend(inside.map(|p| (p, name.clone())));
            } else if name != "bin" && name != "lib" {
                let layer = if core { "core".to_owned() } else { name };
                modules.push((path, layer));
            }
        }
    }
    let folders = modules
        .iter()
        .map(|(path, layer)| (stem(path), layer.clone()))
        .collect();
    let mut graph = BTreeMap::new();
    for (path, _) in modules {
        let module = stem(&path);
        let deps: &mut BTreeSet<String> = graph.entry(module.clone()).or_default();
        for file in rust_files(&path) {
            let text = std::fs::read_to_string(&file).expect("read a module");
            for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let segment = |from: usize| -> String {
                        line[from..]
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect()
                    };
                    // A group folder is not a module: `crate::shared::runtime`
                    // names `runtime`.
                    let mut name = segment(i + 7);
                    if GROUPS.contains(&name.as_str()) {
                        name = segment(i + 7 + name.len() + 2);
                    }
                    if !name.is_empty() && name != module {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    (graph, folders)
}

fn entries(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .expect("a source directory")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

fn stem(path: &std::path::Path) -> String {
    path.file_stem().unwrap().to_string_lossy().into_owned()
}

/// The Rust files of a module: the file, or every file beneath the folder.
fn rust_files(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    if !path.is_dir() {
        return vec![path.to_owned()];
    }
    entries(path).iter().flat_map(|p| rust_files(p)).collect()
}

/// The layers, top first: each is a folder of `src/` (or the one file
/// `fleet.rs`, or the core crate), and every module in a folder is in that
/// folder's layer. A module imports only from the layers below its own, or
/// from its own where the layer allows it (never among the roles). A new
/// module takes its folder's layer; a new folder fails
/// [`every_folder_is_a_layer`] until it is placed here.
const LAYERS: &[(&str, bool)] = &[
    ("operator", true),
    ("fleet", false),
    ("roles", false),
    ("shared", true),
    ("edges", true),
    ("policy", true),
    ("settings", true),
    ("core", true),
    ("mock", false),
];

/// A module's layer: the folder it lives in.
fn layer_of(module: &str, folders: &BTreeMap<String, String>) -> (usize, bool) {
    let folder = &folders[module];
    let i = LAYERS
        .iter()
        .position(|(name, _)| name == folder)
        .unwrap_or_else(|| panic!("{folder} is not a layer"));
    (i, LAYERS[i].1)
}

/// Every folder of `src/` (and every file beside `lib.rs`) is a layer, and
/// every layer is there.
#[test]
fn every_folder_is_a_layer() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut there: BTreeSet<String> = entries(&root.join("src"))
        .iter()
        .map(|p| stem(p))
        .filter(|n| n != "lib" && n != "bin")
        .collect();
    there.insert("core".to_owned());
    let listed: BTreeSet<String> = LAYERS.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(
        there, listed,
        "the folders of src/ and the layers in tests/layering.rs differ: place a new folder in LAYERS and in the code map (ARCHITECTURE.md)"
    );
    let groups: BTreeSet<&str> = GROUPS.iter().copied().collect();
    for group in groups {
        assert!(listed.contains(group), "the group {group} is not a layer");
    }
}

#[test]
fn modules_import_downward_only() {
    let (graph, folders) = imports();
    for (module, deps) in &graph {
        let (mine, within) = layer_of(module, &folders);
        for dep in deps {
            let Some(_) = folders.get(dep) else {
                continue;
            };
            let (theirs, _) = layer_of(dep, &folders);
            assert!(
                theirs > mine || (theirs == mine && within),
                "{module} ({}/) imports {dep} ({}/): imports go down the layers only\n\n{}",
                LAYERS[mine].0,
                LAYERS[theirs].0,
                show(&graph)
            );
        }
    }
}

fn show(graph: &Graph) -> String {
    graph
        .iter()
        .map(|(m, d)| format!("{m} → {}", d.iter().cloned().collect::<Vec<_>>().join(" ")))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn modules_import_one_way_only() {
    let (graph, _) = imports();
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
    let (graph, _) = imports();
    for role in ["intake", "attempts", "reconciler"] {
        let deps = &graph[role];
        for above in [
            "intake",
            "attempts",
            "reconciler",
            "fleet",
            "console",
            "cli",
        ] {
            assert!(
                !deps.contains(above),
                "{role} imports {above}\n\n{}",
                show(&graph)
            );
        }
    }
}

#[test]
fn only_the_fleet_names_the_roles() {
    let (graph, _) = imports();
    for (module, deps) in &graph {
        for role in ["intake", "attempts", "reconciler"] {
            assert!(
                module == "fleet" || module == role || !deps.contains(role),
                "{module} imports the role {role}: only fleet names the roles\n\n{}",
                show(&graph)
            );
        }
    }
}

/// No import circle inside a folder either: the files beside one another
/// (siblings, `super::name` of each other) import one way only.
#[test]
fn no_import_circle_among_the_files_of_a_folder() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut circles = Vec::new();
    let mut folders = vec![src];
    while let Some(folder) = folders.pop() {
        let files: Vec<_> = entries(&folder);
        folders.extend(files.iter().filter(|p| p.is_dir()).cloned());
        let names: BTreeSet<String> = files
            .iter()
            .map(|p| stem(p))
            .filter(|n| n != "mod" && n != "lib")
            .collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for path in files.iter().filter(|p| names.contains(&stem(p))) {
            let deps = graph.entry(stem(path)).or_default();
            for file in rust_files(path) {
                let text = std::fs::read_to_string(&file).expect("read a module");
                for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
                    for name in &names {
                        if *name != stem(path)
                            && (line.contains(&format!("super::{name}::"))
                                || line.contains(&format!("super::{name};")))
                        {
                            deps.insert(name.clone());
                        }
                    }
                }
            }
        }
        for (a, deps) in &graph {
            for b in deps {
                if a < b && graph.get(b).is_some_and(|d| d.contains(a)) {
                    circles.push(format!("{}: {a} <-> {b}", folder.display()));
                }
            }
        }
    }
    assert!(circles.is_empty(), "import circles: {circles:?}");
}

/// The code map's `src/` section, from ARCHITECTURE.md.
fn code_map() -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let start = text
        .find("### `src/` (onejob)")
        .expect("the map's src/ section");
    let end = text[start..]
        .find("\n### ")
        .map_or(text.len(), |e| start + e);
    text[start..end].to_owned()
}

/// The code map lists the layers top first, in the order they are enforced.
#[test]
fn the_code_map_lists_the_layers_in_order() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let map = code_map();
    // It lists the layers top first, in the order they are enforced.
    let at = |layer: &str| {
        let spelled = if src.join(format!("{layer}.rs")).is_file() {
            format!("\n- `{layer}.rs`")
        } else {
            format!("\n- `{layer}/`")
        };
        map.find(&spelled)
            .unwrap_or_else(|| panic!("the code map has no entry {spelled:?}"))
    };
    let order: Vec<&str> = LAYERS
        .iter()
        .map(|(l, _)| *l)
        .filter(|l| *l != "core")
        .collect();
    for pair in order.windows(2) {
        assert!(
            at(pair[0]) < at(pair[1]),
            "the code map lists {} after {}: list the layers top first, as LAYERS does",
            pair[0],
            pair[1]
        );
    }
}

/// The code map is written once, in ARCHITECTURE.md: its `src/` section names
/// every module of the library (each file and folder of `src/` and of its
/// group folders) and names nothing that is not there.
#[test]
fn the_code_map_names_every_module_and_nothing_else() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let map = &code_map();
    let named = |path: &std::path::Path| {
        let name = stem(path);
        let spelled = if path.is_dir() {
            format!("`{name}/`")
        } else {
            format!("`{name}.rs`")
        };
        map.contains(&spelled)
    };
    let mut modules = Vec::new();
    for path in entries(&src) {
        if stem(&path) == "lib" {
            continue;
        }
        if path.is_dir() && GROUPS.contains(&stem(&path).as_str()) {
            modules.extend(entries(&path).into_iter().filter(|p| stem(p) != "mod"));
        }
        modules.push(path);
    }
    let missing: Vec<String> = modules
        .iter()
        .filter(|p| !named(p))
        .map(|p| p.display().to_string())
        .collect();
    assert!(missing.is_empty(), "not in the code map: {missing:?}");
    // Every file or folder it names is somewhere under src/.
    let mut everything = BTreeSet::from(["src/".to_owned()]);
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a folder") {
            let path = entry.expect("entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                everything.insert(format!("{name}/"));
                stack.push(path);
            } else {
                everything.insert(name);
            }
        }
    }
    let gone: Vec<&str> = map
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            let bare = t.trim_end_matches('/').trim_end_matches(".rs");
            (t.ends_with(".rs") || t.ends_with('/'))
                && !bare.is_empty()
                && bare.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        })
        .filter(|t| !everything.contains(*t))
        .collect();
    assert!(
        gone.is_empty(),
        "the code map names what is not there: {gone:?}"
    );
}

/// No module is re-exported under a flatter name than where it lives: an
/// import path says where a module is. Neither the crate's root nor a group
/// folder re-exports anything (the core crate's modules are re-exported
/// whole, under their own names: another crate's). A module's own items,
/// gathered at its root from its files, are its surface, not a flattening.
#[test]
fn no_module_is_re_exported_under_a_flatter_name() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut roots = vec![src.join("lib.rs")];
    roots.extend(GROUPS.iter().map(|g| src.join(g).join("mod.rs")));
    let mut flattening = Vec::new();
    for file in roots {
        let text = std::fs::read_to_string(&file).expect("read a module");
        for line in text.lines().map(str::trim_start) {
            let re_export = line.starts_with("pub") && line.contains(" use ");
            if re_export && line != "pub use onejob_core::{broker, domain, intent, trace};" {
                flattening.push(format!("{}: {line}", file.display()));
            }
        }
    }
    assert!(
        flattening.is_empty(),
        "re-exports:\n{}",
        flattening.join("\n")
    );
}

/// Small rooms: no source file over 600 lines, no function over 80, in every
/// crate, test and benchmark (`scripts/sizes` counts them, and lists what is
/// over).
#[test]
fn every_file_and_function_is_small() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(root.join("scripts/sizes"))
        .arg("--check")
        .current_dir(root)
        .output()
        .expect("python3 runs scripts/sizes");
    assert!(
        out.status.success(),
        "over the limits:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every console action goes through the one extractor that checks the
/// session, the CSRF token and the reason and audits first
/// (`console/action.rs`, `Acting`): no other console file names an actor or
/// writes an audit row itself.
#[test]
fn every_console_action_goes_through_acting() {
    let console = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/operator/console");
    let mut bypasses = Vec::new();
    for file in rust_files(&console) {
        if stem(&file) == "action" {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("read a console file");
        let mut code_only = String::new();
        for (n, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            code_only.push_str(code);
            for bypass in ["Actor::operator(", "Actor {"] {
                if code.contains(bypass) {
                    bypasses.push(format!("{}:{}: {code}", file.display(), n + 1));
                }
            }
        }
        // An audit row begun by hand, however the call is laid out.
        let compact: String = code_only.split_whitespace().collect();
        if compact.contains(".audit().begin(") {
            bypasses.push(format!("{}: begins an audit row itself", file.display()));
        }
    }
    assert!(
        bypasses.is_empty(),
        "console actions that bypass Acting:\n{}",
        bypasses.join("\n")
    );
}

/// A `channel.open` whose reply never comes would hold its caller for good, a
/// role neither working nor stopping: the programs open every channel through
/// `broker::open_channel`, which waits within a time.
#[test]
fn every_channel_opens_within_a_time() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut unbounded = Vec::new();
    for dir in ["src", "core/src", "worker/src", "producer/src"] {
        for file in rust_files(&root.join(dir)) {
            if file.ends_with("core/src/broker/channel.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&file).expect("read a source file");
            let code: String = text
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<String>()
                .split_whitespace()
                .collect();
            let opened = code.matches(".create_channel(").count();
            if opened > 0 {
                unbounded.push(format!("{}: {opened}", file.display()));
            }
        }
    }
    assert!(
        unbounded.is_empty(),
        "channels opened without a time limit (use broker::open_channel):\n{}",
        unbounded.join("\n")
    );
}
