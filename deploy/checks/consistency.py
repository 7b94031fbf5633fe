#!/usr/bin/env python3
"""Checks compose.yaml and deploy/kubernetes against the code they run.

Usage: consistency.py REPO_ROOT BIN_DIR   (scripts/deploy-check runs it)

Schemas say a file is well formed; this says it is right for onejob:

- every command and flag a service or container runs exists: the command is run
  with `--help` appended, which clap refuses (exit 2) on an unknown flag or a
  bad value before it prints the help;
- worker roles run apart (every onejob-worker names its --role), every role
  and every configured provider's attempts run somewhere, and --role attempts
  names a configured --provider;
- each probe asks a path the listener it reaches really serves (the routes are
  read from the routers' source), on the port that listener's flag binds;
- grace periods outlast what a stopping process may still do: a worker's
  shutdown grace (as `onejob config check --json` computes it from the
  configuration the deployment mounts), a gateway's --body-timeout +
  --receipt-timeout (from its flags, or the defaults its --help prints), plus
  any pre_stop sleep, plus MARGIN;
- the configuration is valid (`onejob config check`), mounted where
  ONEJOB_CONFIG says, and its provider's host is a service of the deployment;
- Kubernetes references resolve: Secret keys, ConfigMap, Service selectors and
  target ports, PodDisruptionBudget selectors, KEDA scale targets and
  authentication, and each KEDA trigger watches the queue its target consumes
  (the names are read from onejob-core);
- kustomization.yaml lists every manifest beside it.

Prints one line per problem and exits 1 if there is any.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse

import yaml

MARGIN = 5  # seconds a grace period must leave over what it must outlast
LISTEN_FLAGS = {
    "onejob-worker": {"--http": "probes"},
    "onejob-producer serve": {"--listen": "public", "--http": "probes"},
    "onejob-mock-provider": {"--listen": "mock"},
}

problems = []


def problem(where, text):
    problems.append(f"{where}: {text}")


def seconds(text):
    """'45s', '1m30s', '500ms', 45 → seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    total, units = 0.0, {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text.replace(" ", ""))
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"not a duration: {text!r}")
    for number, unit in parts:
        total += float(number) * units[unit]
    return total


# ---- what the code says ----------------------------------------------------

def fn_body(path, name):
    """The body of `fn name` in a Rust file, by its braces (string literals skipped)."""
    text = open(path).read()
    m = re.search(r"fn\s+" + name + r"\b", text)
    if not m:
        raise SystemExit(f"consistency: no fn {name} in {path}")
    code = re.sub(r'"(\\.|[^"\\])*"', lambda s: '"' + " " * (len(s.group(0)) - 2) + '"', text)
    start = code.index("{", m.end())
    depth = 0
    for i in range(start, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return text[start:i + 1]
    raise SystemExit(f"consistency: fn {name} in {path} never closes")


def routes(path, name):
    return set(re.findall(r'\.route\(\s*"([^"]+)"', fn_body(path, name)))


def served_paths(root):
    """Paths each listener serves, read from the routers."""
    health = os.path.join(root, "src/shared/runtime/health.rs")
    gateway = os.path.join(root, "producer/src/gateway/serve.rs")
    probes = routes(gateway, "probes")
    return {
        ("onejob-worker", "probes"): routes(health, "health_router"),
        ("onejob-producer serve", "probes"): probes | routes(gateway, "probes_router"),
        ("onejob-producer serve", "public"): probes | routes(gateway, "router"),
        ("onejob-mock-provider", "mock"): set(),
    }


def queue_names(root):
    core = open(os.path.join(root, "core/src/broker/mod.rs")).read()
    intents = re.search(r'pub const INTENTS_QUEUE: &str = "([^"]+)";', core).group(1)
    topology = open(os.path.join(root, "core/src/broker/topology.rs")).read()
    pattern = re.search(r'fn attempts_queue\(provider: &str\) -> String \{\s*format!\("([^"]+)"\)', topology).group(1)
    return intents, lambda provider: pattern.replace("{provider}", provider)


class Binaries:
    def __init__(self, bin_dir):
        self.bin_dir = bin_dir

    def run(self, argv, env=None):
        path = os.path.join(self.bin_dir, argv[0])
        full_env = dict(os.environ, **(env or {}))
        return subprocess.run([path] + argv[1:], capture_output=True, text=True, env=full_env, timeout=60)

    def accepts(self, where, argv):
        """Whether clap takes argv (with --help appended)."""
        if not os.path.exists(os.path.join(self.bin_dir, argv[0])):
            problem(where, f"{argv[0]} is not a onejob binary (none in {self.bin_dir})")
            return False
        out = self.run(argv + ["--help"])
        if out.returncode != 0:
            first = (out.stderr.strip().splitlines() or ["?"])[0]
            problem(where, f"`{' '.join(argv)}` is refused: {first}")
            return False
        return True

    def default(self, argv, flag):
        out = self.run(argv[:2] + ["--help"]).stdout
        m = re.search(re.escape(flag) + r" <[^>]+>\n(?:.*\n)*?.*\[default: ([^\]]+)\]", out)
        if not m:
            raise SystemExit(f"consistency: `{' '.join(argv[:2])} --help` shows no default for {flag}")
        return m.group(1)

    def config_check(self, where, toml_text):
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(toml_text)
        try:
            out = self.run(["onejob", "--config", f.name, "config", "check", "--json"])
        finally:
            os.unlink(f.name)
        if out.returncode != 0:
            problem(where, f"onejob config check refuses the configuration: {out.stderr.strip()}")
            return None
        config = json.loads(out.stdout)
        if "shutdown_grace_seconds" not in config:
            raise SystemExit(f"consistency: {self.bin_dir}/onejob config check --json prints no "
                             "shutdown_grace_seconds: the binaries are older than this check")
        return config


# ---- one process, wherever it is declared ---------------------------------

def program(argv):
    """'onejob-worker', 'onejob-producer serve', … for an argv."""
    if argv and argv[0] == "onejob-producer" and len(argv) > 1 and argv[1] == "serve":
        return "onejob-producer serve"
    return argv[0] if argv else ""


def flag_values(argv, flag):
    values = []
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif arg.startswith(flag + "="):
            values.append(arg.split("=", 1)[1])
    return values


def listeners(argv):
    """{port: listener kind} for the flags argv binds with."""
    out = {}
    for flag, kind in LISTEN_FLAGS.get(program(argv), {}).items():
        for value in flag_values(argv, flag):
            out[int(value.rsplit(":", 1)[1])] = kind
    return out


def check_roles(where, argv, providers, seen):
    if program(argv) != "onejob-worker":
        return
    roles = flag_values(argv, "--role")
    if not roles:
        problem(where, "onejob-worker runs every role: name its --role, so that each role scales apart")
    chosen = flag_values(argv, "--provider")
    if "attempts" in roles and not chosen:
        problem(where, "--role attempts needs a --provider")
    for p in chosen:
        if p not in providers:
            problem(where, f"--provider {p} is not a configured provider ({', '.join(providers)})")
    for role in roles:
        if role == "attempts":
            seen.update(("attempts", p) for p in chosen)
        else:
            seen.add((role, None))


def check_all_roles_run(where, seen, providers):
    for role in ("intake", "reconciler"):
        if (role, None) not in seen:
            problem(where, f"no process runs the {role} role")
    for p in providers:
        if ("attempts", p) not in seen:
            problem(where, f"no process runs the attempts of provider {p}")


def worker_grace_needed(argv, config, pre_stop, binaries):
    """What a stopping process of argv may still do, in seconds."""
    name = program(argv)
    if name == "onejob-worker":
        return pre_stop + config["shutdown_grace_seconds"], (
            f"{pre_stop:g}s preStop + shutdown grace {config['shutdown_grace_seconds']:g}s")
    if name == "onejob-producer serve":
        body = seconds((flag_values(argv, "--body-timeout") or [binaries.default(argv, "--body-timeout")])[-1])
        receipt = seconds((flag_values(argv, "--receipt-timeout") or [binaries.default(argv, "--receipt-timeout")])[-1])
        return pre_stop + body + receipt, (
            f"{pre_stop:g}s preStop + --body-timeout {body:g}s + --receipt-timeout {receipt:g}s")
    return None, None


def check_grace(where, argv, grace, config, pre_stop, binaries):
    needed, why = worker_grace_needed(argv, config, pre_stop, binaries)
    if needed is None:
        return
    if grace is None:
        problem(where, f"no grace period: it must be at least {needed + MARGIN:g}s ({why} + {MARGIN}s)")
    elif grace < needed + MARGIN:
        problem(where, f"grace period {grace:g}s is shorter than {needed + MARGIN:g}s ({why} + {MARGIN}s)")


def check_provider_host(where, config_text, services):
    for name, p in tomllib.loads(config_text).get("providers", {}).items():
        host = urllib.parse.urlsplit(p.get("base_url", "")).hostname
        if host not in services:
            problem(where, f"providers.{name}.base_url names host {host!r}, which is none of its services ({', '.join(sorted(services))})")


# ---- compose.yaml ------------------------------------------------------------

def check_compose(root, binaries, served):
    where = "compose.yaml"
    doc = yaml.safe_load(open(os.path.join(root, "compose.yaml")))
    services = doc["services"]
    toml_text = doc["configs"]["onejob_toml"]["content"]
    config = binaries.config_check(f"{where}: configs.onejob_toml", toml_text)
    if config is None:
        return
    check_provider_host(f"{where}: configs.onejob_toml", toml_text, set(services))
    seen = set()
    for name, svc in services.items():
        if svc.get("build") != ".":
            continue
        here = f"{where}: services.{name}"
        argv = list(svc.get("entrypoint") or []) + list(svc.get("command") or [])
        if not binaries.accepts(here, argv):
            continue
        check_roles(here, argv, config["providers"], seen)
        check_compose_config_mount(here, svc)
        check_compose_probe(here, argv, svc, served)
        check_compose_ports(here, argv, svc)
        grace = seconds(svc["stop_grace_period"]) if "stop_grace_period" in svc else None
        if "profiles" not in svc:
            check_grace(here + ".stop_grace_period", argv, grace, config, 0, binaries)
    check_all_roles_run(where, seen, config["providers"])


def check_compose_config_mount(where, svc):
    env = svc.get("environment") or {}
    path = env.get("ONEJOB_CONFIG") if isinstance(env, dict) else None
    if path is None:
        return
    targets = [c.get("target") for c in svc.get("configs") or [] if isinstance(c, dict)]
    if path not in targets:
        problem(where, f"ONEJOB_CONFIG={path} but no config is mounted there ({targets})")


def check_compose_probe(where, argv, svc, served):
    ports = listeners(argv)
    test = " ".join((svc.get("healthcheck") or {}).get("test") or [])
    if "probes" in ports.values() and not test:
        problem(where, "serves probes on --http but has no healthcheck")
    for port, path in re.findall(r"/dev/tcp/127\.0\.0\.1/(\d+).*?GET (\S+)", test):
        kind = ports.get(int(port))
        if kind is None:
            problem(where, f"the healthcheck connects to port {port}, which no listen flag of `{' '.join(argv)}` binds")
        elif path not in served[(program(argv), kind)]:
            problem(where, f"the healthcheck asks {path}, which the {kind} listener does not serve")


def check_compose_ports(where, argv, svc):
    ports = listeners(argv)
    for mapping in svc.get("ports") or []:
        container = int(str(mapping).rsplit(":", 1)[-1].split("/")[0])
        if container not in ports:
            problem(where, f"publishes container port {container}, which no listen flag binds ({sorted(ports)})")


# ---- deploy/kubernetes -------------------------------------------------------

def load_manifests(root, directory):
    docs = []
    for dirpath, _, files in os.walk(directory):
        for f in sorted(files):
            if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml":
                path = os.path.join(dirpath, f)
                for d in yaml.safe_load_all(open(path)):
                    if d:
                        docs.append((os.path.relpath(path, root), d))
    return docs


def check_kustomizations(root, directory):
    for dirpath, _, files in os.walk(directory):
        if "kustomization.yaml" not in files:
            continue
        k = yaml.safe_load(open(os.path.join(dirpath, "kustomization.yaml")))
        listed = set(k.get("resources") or [])
        present = {f for f in files if f.endswith(".yaml") and f not in ("kustomization.yaml", "secret.example.yaml")}
        where = os.path.relpath(os.path.join(dirpath, "kustomization.yaml"), root)
        for f in sorted(present - listed):
            problem(where, f"does not list {f}")
        for f in sorted(listed - present):
            problem(where, f"lists {f}, which is not there")


def by_kind(docs, kind):
    return {d["metadata"]["name"]: (path, d) for path, d in docs if d.get("kind") == kind}


def matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_kubernetes(root, binaries, served):
    directory = os.path.join(root, "deploy/kubernetes")
    docs = load_manifests(root, directory)
    check_kustomizations(root, directory)
    configmaps, secrets = by_kind(docs, "ConfigMap"), by_kind(docs, "Secret")
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    config_text = configmaps["onejob-config"][1]["data"]["onejob.toml"]
    config = binaries.config_check("deploy/kubernetes/configmap.yaml", config_text)
    if config is None:
        return
    check_provider_host("deploy/kubernetes/configmap.yaml", config_text, set(services))
    seen = set()
    for name, (path, dep) in deployments.items():
        check_deployment(f"{path}: Deployment {name}", dep, binaries, served, config, seen, (configmaps, secrets))
    check_all_roles_run("deploy/kubernetes", seen, config["providers"])
    check_services(services, deployments)
    check_pdbs(by_kind(docs, "PodDisruptionBudget"), deployments)
    check_keda(root, docs, deployments, secrets)


def check_deployment(where, dep, binaries, served, config, seen, refs):
    spec = dep["spec"]["template"]["spec"]
    if not matches(dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"]):
        problem(where, "its selector does not match its pod's labels")
    for c in spec["containers"]:
        here = f"{where}, container {c['name']}"
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        if not binaries.accepts(here, argv):
            continue
        check_roles(here, argv, config["providers"], seen)
        check_container_ports(here, argv, c, served)
        check_container_refs(here, c, spec, refs)
        for kind in ("requests", "limits"):
            if "memory" not in (c.get("resources") or {}).get(kind, {}):
                problem(here, f"no memory {kind}")
        pre_stop = c.get("lifecycle", {}).get("pre_stop", {}).get("exec", {}).get("command") or []
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        grace = spec.get("terminationGracePeriodSeconds", 30)
        check_grace(here + ": terminationGracePeriodSeconds", argv, grace, config, sleep, binaries)


def check_container_ports(where, argv, c, served):
    bound = listeners(argv)
    named = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
    numbers = set(named.values())
    for port in sorted(set(bound) - numbers):
        problem(where, f"binds port {port} but declares no containerPort for it")
    for port in sorted(numbers - set(bound)):
        problem(where, f"declares containerPort {port}, which no listen flag of `{' '.join(argv)}` binds")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c.get(probe)
        if p is None:
            if bound and probe != "startupProbe":
                problem(where, f"no {probe}")
            continue
        action = p.get("httpGet") or p.get("tcpSocket") or {}
        port = named.get(action.get("port"), action.get("port"))
        kind = bound.get(port)
        if kind is None:
            problem(where, f"{probe} reaches port {action.get('port')}, which no listen flag binds")
        elif "httpGet" in p and p["httpGet"]["path"] not in served[(program(argv), kind)]:
            problem(where, f"{probe} asks {p['httpGet']['path']}, which the {kind} listener does not serve "
                           f"({', '.join(sorted(served[(program(argv), kind)]))})")


def check_container_refs(where, c, spec, refs):
    configmaps, secrets = refs
    env = {e["name"]: e for e in c.get("env") or []}
    for e in env.values():
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["key"] not in secrets.get(ref["name"], (None, {}))[1].get("stringData", {}):
            problem(where, f"env {e['name']} reads key {ref['key']} of Secret {ref['name']}, which the example does not have")
    config_path = env.get("ONEJOB_CONFIG", {}).get("value")
    if config_path is None:
        return
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    for m in c.get("volumeMounts") or []:
        cm = volumes.get(m["name"], {}).get("configMap")
        if cm and os.path.dirname(config_path) == m["mountPath"].rstrip("/"):
            data = configmaps.get(cm["name"], (None, {}))[1].get("data", {})
            if os.path.basename(config_path) not in data:
                problem(where, f"ONEJOB_CONFIG={config_path}, but ConfigMap {cm['name']} has no {os.path.basename(config_path)}")
            return
    problem(where, f"ONEJOB_CONFIG={config_path}, but no ConfigMap is mounted at {os.path.dirname(config_path)}")


def check_services(services, deployments):
    for name, (path, svc) in services.items():
        targets = [d for _, d in deployments.values()
                   if matches(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        if len(targets) != 1:
            problem(f"{path}: Service {name}", f"selects {len(targets)} Deployments, not one")
            continue
        ports = {p.get("name"): p["containerPort"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports") or []}
        for p in svc["spec"]["ports"]:
            if p["targetPort"] not in ports and p["targetPort"] not in ports.values():
                problem(f"{path}: Service {name}", f"targetPort {p['targetPort']} is no port of its pods")


def check_pdbs(pdbs, deployments):
    covered = set()
    for name, (path, pdb) in pdbs.items():
        targets = [n for n, (_, d) in deployments.items()
                   if matches(pdb["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])]
        if len(targets) != 1:
            problem(f"{path}: PodDisruptionBudget {name}", f"selects {len(targets)} Deployments, not one")
            continue
        covered.add(targets[0])
        replicas = deployments[targets[0]][1]["spec"].get("replicas", 1)
        if pdb["spec"].get("minAvailable") not in (None, 0) and replicas <= pdb["spec"]["minAvailable"]:
            problem(f"{path}: PodDisruptionBudget {name}", f"minAvailable {pdb['spec']['minAvailable']} with {replicas} replica(s) blocks every drain")
    for name in sorted(set(deployments) - covered):
        if "mock" not in name:
            problem("deploy/kubernetes", f"Deployment {name} has no PodDisruptionBudget")


def check_keda(root, docs, deployments, secrets):
    intents, attempts_queue = queue_names(root)
    auths = by_kind(docs, "TriggerAuthentication")
    for name, (path, auth) in auths.items():
        for ref in auth["spec"].get("secretTargetRef") or []:
            if ref["key"] not in secrets.get(ref["name"], (None, {}))[1].get("stringData", {}):
                problem(f"{path}: TriggerAuthentication {name}", f"reads key {ref['key']} of Secret {ref['name']}, which the example does not have")
    for name, (path, so) in by_kind(docs, "ScaledObject").items():
        where = f"{path}: ScaledObject {name}"
        target = deployments.get(so["spec"]["scaleTargetRef"]["name"])
        if target is None:
            problem(where, f"scales {so['spec']['scaleTargetRef']['name']}, which is no Deployment")
            continue
        argv = [a for c in target[1]["spec"]["template"]["spec"]["containers"][:1]
                for a in list(c.get("command") or []) + list(c.get("args") or [])]
        roles, providers = flag_values(argv, "--role"), flag_values(argv, "--provider")
        consumed = ({intents} if "intake" in roles else set()) | (
            {attempts_queue(p) for p in providers} if "attempts" in roles else set())
        for t in so["spec"]["triggers"]:
            if t["type"] == "rabbitmq" and t["metadata"]["queueName"] not in consumed:
                problem(where, f"watches queue {t['metadata']['queueName']}, which its target does not consume ({', '.join(sorted(consumed)) or 'none'})")
            if t["type"] == "prometheus":
                waiting = re.search(r'onejob_provider_work_waiting\{provider="([^"]+)"\}', t["metadata"].get("query", ""))
                if not waiting or attempts_queue(waiting.group(1)) not in consumed:
                    problem(where, f"queries {t['metadata'].get('query')!r}, not the work waiting for a provider its target consumes ({', '.join(sorted(consumed)) or 'none'})")
            ref = (t.get("authenticationRef") or {}).get("name")
            if ref and ref not in auths:
                problem(where, f"authenticationRef {ref} is no TriggerAuthentication")


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.splitlines()[2])
    root, bin_dir = sys.argv[1], sys.argv[2]
    binaries, served = Binaries(bin_dir), served_paths(root)
    check_compose(root, binaries, served)
    check_kubernetes(root, binaries, served)
    for p in problems:
        print(f"deploy consistency: {p}")
    if problems:
        sys.exit(1)
    print("deploy consistency: compose.yaml and deploy/kubernetes match the code "
          "(commands and flags, roles, probe paths and ports, grace periods, configuration, references, queues)")


if __name__ == "__main__":
    main()
