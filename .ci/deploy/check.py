#!/usr/bin/env python3
"""The checks of .ci/deploy-check that need more than a schema: run by it, in its venv.

- metrics: every metric and label the alert rules and the dashboard use is exported
  by fleetgate, as scraped from a running gateway (--scrape), and that scrape holds
  every family src/metrics.rs registers, each with a sample (so that its labels are
  known);
- the alert rules carry a severity, a summary and a description, and each one has a
  firing case in alerts_test.yml;
- the dashboard: panel ids, data sources, variables; its queries are written out
  (--dashboard-rules) for `promtool check rules`;
- the Compose file, the Kubernetes manifests, the systemd unit and the Dockerfile
  agree with each other and with fleetgate: files they name exist, ports match the
  configs' listeners, names refer to things defined, stop time-outs cover
  fleetgate's shutdown, and each config is accepted by fleetgate itself (--bin-dir);
- Kubernetes: every file under deploy/kubernetes against the schemas and in a
  kustomization; then the rendered sets (the kustomization alone and with its
  components, `helm template` of the chart with its defaults and with everything on),
  each against the schemas and checked as above, plus: no Secret in any (secrets are
  referenced by name), no Prometheus Operator kind by default, pods under a
  ServiceAccount without a token, spread over zones and nodes, the autoscaler, the
  Ingress's TLS and backend, the alert rules equal to alerts.yml, and the chart's
  default config equal to the kustomization's.

Prints one line per check group and every problem found; exits 1 on any.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Prometheus adds these to every scraped series.
TARGET_LABELS = {"job", "instance"}
# Series Prometheus makes itself, not fleetgate.
PROMETHEUS_SERIES = {"up": TARGET_LABELS}
# Kubernetes versions the manifests are validated for: an old one still in use, and
# the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]

problems: list[str] = []


def problem(where: str, message: str) -> None:
    problems.append(f"{where}: {message}")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def load_yaml_docs(path: Path) -> list:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


# ---------------------------------------------------------------- fleetgate's facts


def source_constant(path: str, pattern: str, what: str) -> int:
    """A number in fleetgate's source, so that the checks follow the code."""
    text = (ROOT / path).read_text()
    m = re.search(pattern, text)
    if not m:
        sys.exit(f"deploy-check: cannot find {what} in {path} (pattern {pattern!r}); update .ci/deploy/check.py")
    return int(m.group(1).replace("_", ""))


def default_fn(name: str) -> int:
    return source_constant("src/config/schema.rs", rf"fn {name}\(\) -> \w+ \{{\s*([\d_]+)\s*\}}", name)


DEFAULT_SHUTDOWN_GRACE_MS = default_fn("default_shutdown_grace_ms")
DEFAULT_MAX_OPEN = default_fn("default_max_open_connections")
DRAIN_CUT_WAIT_S = source_constant("src/server.rs", r"DRAIN_CUT_WAIT: Duration = Duration::from_secs\((\d+)\)", "DRAIN_CUT_WAIT")
SETTLE_WAIT_S = source_constant("src/server.rs", r"SETTLE_WAIT: Duration = Duration::from_secs\((\d+)\)", "SETTLE_WAIT")


def stop_budget_s(shutdown_grace_ms: int) -> float:
    """The longest a SIGTERMed fleetgate takes to exit (src/server.rs): the grace
    period, the wait for cut connections, then the request tasks' settlements and the
    ledger's last rows, each bounded by SETTLE_WAIT."""
    return shutdown_grace_ms / 1000 + DRAIN_CUT_WAIT_S + 2 * SETTLE_WAIT_S


def seconds(value) -> float:
    """A duration as systemd or Compose writes it: 75, 75s, 1m30s, 1min."""
    if isinstance(value, (int, float)):
        return float(value)
    total = 0.0
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", str(value))
    if not parts:
        raise ValueError(f"not a duration: {value!r}")
    for number, unit in parts:
        total += float(number) * units[unit or "s"]
    return total


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def fleetgate_accepts(where: str, config: Path, env: dict[str, str], bin_dir: Path) -> None:
    """fleetgate loads `config` with `env` as a deployment would (unknown keys and bad
    values are errors). The database is swapped for a scratch SQLite file, since the
    deployment's server is not here; nothing is served."""
    with tempfile.TemporaryDirectory() as scratch:
        run_env = {k: v for k, v in os.environ.items()
                   if not k.startswith("FLEETGATE_") and k not in ("RUST_BACKTRACE", "RUST_LIB_BACKTRACE")}
        run_env.update(env)
        run_env["FLEETGATE_DATABASE_URL"] = f"sqlite://{scratch}/check.db"
        result = subprocess.run(
            [str(bin_dir / "fleetgate"), "keys", "list", "--config", str(config)],
            env=run_env, capture_output=True, text=True, timeout=60,
        )
        if result.returncode != 0:
            problem(where, f"fleetgate rejects the config {config.name}: {(result.stderr or result.stdout).strip()}")


# ---------------------------------------------------------------- metrics


def parse_exposition(text: str):
    """Families {name: type} and samples {sample name: (label names, {label: values})}."""
    families: dict[str, str] = {}
    samples: dict[str, tuple[set[str], dict[str, set[str]]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            families[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
            if not m:
                problem("scrape", f"unparsed line {line!r}")
                continue
            names, values = samples.setdefault(m.group(1), (set(), {}))
            for label, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""):
                names.add(label)
                values.setdefault(label, set()).add(value)
    return families, samples


def family_of(sample: str, families: dict[str, str]) -> str | None:
    for suffix in ("", "_total", "_bucket", "_sum", "_count"):
        if suffix and not sample.endswith(suffix):
            continue
        base = sample[: len(sample) - len(suffix)] if suffix else sample
        if base in families:
            return base
    return None


def registered_families() -> set[str]:
    text = (ROOT / "src/metrics.rs").read_text()
    prefix = re.search(r'Registry::with_prefix\("(\w+)"\)', text)
    names = re.findall(r'registry\.register\(\s*"(\w+)"', text)
    if not prefix or not names:
        sys.exit("deploy-check: cannot find the registry's prefix or registrations in src/metrics.rs; update .ci/deploy/check.py")
    return {f"{prefix.group(1)}_{name}" for name in names}


def check_scrape(families, samples) -> None:
    exported = {f for f in families if f.startswith("fleetgate_")}
    # The text format names a counter's family with its _total.
    registered = {f"{name}_total" if families.get(f"{name}_total") == "counter" else name
                  for name in registered_families()}
    for name in sorted(registered - exported):
        problem("scrape", f"{name} is registered in src/metrics.rs but not in the gateway's /metrics")
    for name in sorted(exported - registered):
        problem("scrape", f"{name} is in /metrics but no registration was found in src/metrics.rs")
    with_samples = {family_of(s, families) for s in samples}
    for name in sorted(exported - with_samples):
        problem("scrape", f"{name} has no sample in the scrape, so its labels are unknown: make .ci/deploy-check's traffic produce one")


def string_literals_in_source() -> set[str]:
    found = set()
    for path in (ROOT / "src").rglob("*.rs"):
        found.update(re.findall(r'"([a-z_0-9]+)"', path.read_text()))
    return found


def check_queries(queries: list[tuple[str, str]], node_dir: Path, families, samples) -> None:
    """queries: (where, PromQL). Metric names, matcher labels, equality matchers'
    values and grouping labels against the scrape."""
    result = subprocess.run(
        ["node", str((node_dir / "promql.mjs").resolve())], input=json.dumps([q for _, q in queries]),
        capture_output=True, text=True, check=True, cwd=node_dir,
    )
    analyses = json.loads(result.stdout)
    literals = string_literals_in_source()
    known = {name: labels for name, (labels, _) in samples.items()}
    known.update(PROMETHEUS_SERIES)
    for (where, query), analysis in zip(queries, analyses):
        for error in analysis["errors"]:
            problem(where, f"{error} in {query!r}")
        for selector in analysis["selectors"]:
            name = selector["name"]
            if name is None:
                problem(where, f"a selector without a metric name in {query!r}")
                continue
            if name not in known:
                hint = " (a family name: use its sample name, e.g. _total or _bucket)" if name in families else ""
                problem(where, f"{name} is not a series fleetgate exports{hint}")
                continue
            labels = known[name] | TARGET_LABELS
            for matcher in selector["matchers"]:
                label = matcher["label"]
                if label not in labels:
                    problem(where, f"{name} has no label {label!r} (it has {sorted(known[name])})")
                elif (matcher["op"] in ("=", "!=") and label not in TARGET_LABELS and name in samples
                      and matcher["value"] and "$" not in matcher["value"] and matcher["value"] not in literals
                      and matcher["value"] not in samples[name][1].get(label, set())):
                    problem(where, f'{name}{{{label}="{matcher["value"]}"}}: fleetgate never sets that value (not a string in src/, not in the scrape)')
        for grouping in analysis["groupings"]:
            available = set(TARGET_LABELS)
            for name in grouping["scope"]:
                available |= known.get(name, set())
            for label in grouping["labels"]:
                if label not in available:
                    problem(where, f"{grouping['kind']} ({label}): no series in its scope has that label ({sorted(grouping['scope'])})")


# ---------------------------------------------------------------- alerts and dashboard


def alert_rules() -> list[dict]:
    doc = load_yaml_docs(DEPLOY / "prometheus/alerts.yml")[0]
    return [rule for group in doc["groups"] for rule in group["rules"]]


def check_alerts() -> list[tuple[str, str]]:
    where = "deploy/prometheus/alerts.yml"
    rules = alert_rules()
    tests = load_yaml_docs(DEPLOY / "prometheus/alerts_test.yml")[0]["tests"]
    fired = {case["alertname"] for test in tests for case in test.get("alert_rule_test", []) if case.get("exp_alerts")}
    names = set()
    for rule in rules:
        name = rule.get("alert")
        if not name:
            problem(where, f"a rule without an alert name (recording rules belong elsewhere): {rule.get('record')}")
            continue
        if name in names:
            problem(where, f"{name} is defined twice")
        names.add(name)
        if rule.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
            problem(where, f"{name}: severity must be critical, warning or info")
        for annotation in ("summary", "description"):
            if not rule.get("annotations", {}).get(annotation):
                problem(where, f"{name}: no {annotation} annotation")
        if name not in fired:
            problem("deploy/prometheus/alerts_test.yml", f"no test where {name} fires")
    for name in sorted(fired - names):
        problem("deploy/prometheus/alerts_test.yml", f"tests an alert {name} that alerts.yml does not define")
    return [(f"{where}: {rule['alert']}", rule["expr"]) for rule in rules if "alert" in rule]


GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")


def grafana_to_promql(query: str) -> str:
    """Grafana's interval variables as a duration; the others stay inside strings."""
    return GRAFANA_INTERVALS.sub("5m", query)


def check_dashboard(rules_out: Path) -> list[tuple[str, str]]:
    where = "deploy/grafana/fleetgate.json"
    path = DEPLOY / "grafana/fleetgate.json"
    try:
        dashboard = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        problem(where, f"not valid JSON: {err}")
        return []
    for key in ("title", "uid", "schemaVersion", "panels", "templating"):
        if key not in dashboard:
            problem(where, f"no {key!r}")
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource":
        problem(where, "needs a data source variable `datasource`, so that it imports into any Grafana")
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    queries: list[tuple[str, str]] = []

    def used_variables(text: str) -> set[str]:
        return {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", text)} - {"__rate_interval", "__interval", "__range"}

    for name, variable in variables.items():
        if variable.get("type") != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        if not m:
            problem(where, f"variable {name}: only label_values(selector, label) is checked, got {query!r}")
            continue
        queries.append((f"{where}: variable {name}", m.group(1)))
        queries.append((f"{where}: variable {name}", f"sum by ({m.group(2)}) ({m.group(1)})"))
        if variable.get("datasource") != datasource:
            problem(where, f"variable {name}: datasource must be {datasource}")

    ids = set()

    def walk(panels):
        for panel in panels:
            title = panel.get("title", "?")
            if panel.get("id") in ids:
                problem(where, f"panel id {panel.get('id')} ({title}) is used twice")
            ids.add(panel.get("id"))
            if "gridPos" not in panel:
                problem(where, f"panel {title}: no gridPos")
            if panel.get("type") == "row":
                walk(panel.get("panels", []))
                continue
            if panel.get("datasource") != datasource:
                problem(where, f"panel {title}: datasource must be {datasource}")
            targets = panel.get("targets", [])
            if not targets:
                problem(where, f"panel {title}: no query")
            for target in targets:
                expr = target.get("expr")
                if not expr:
                    problem(where, f"panel {title}: target {target.get('refId')} has no expr")
                    continue
                if target.get("datasource") != datasource:
                    problem(where, f"panel {title}: target {target.get('refId')}'s datasource must be {datasource}")
                for var in used_variables(expr) - set(variables):
                    problem(where, f"panel {title}: ${var} is not a variable of the dashboard")
                queries.append((f"{where}: panel {title!r} {target.get('refId')}", grafana_to_promql(expr)))

    walk(dashboard.get("panels", []))
    # For `promtool check rules`: the queries as recording rules, with the variables'
    # values as a Grafana would interpolate them.
    rules = [{"record": f"dashboard:query_{i}", "expr": re.sub(r"\$\{?\w+\}?", "x", q)} for i, (_, q) in enumerate(queries)]
    rules_out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return queries


# ---------------------------------------------------------------- Dockerfile


def dockerfile():
    text = (ROOT / "Dockerfile").read_text()
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
    return text, stages


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (or a directory above it) out of the build
    context: its patterns are globs from the context's root; `**` matches any depth."""
    parts = path.strip("/").split("/")
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        for depth in range(1, len(parts) + 1):
            if re.fullmatch(regex, "/".join(parts[:depth])):
                excluded = not negate
                break
    return excluded


def check_docker(bin_dir: Path) -> None:
    where = "Dockerfile"
    text, _ = dockerfile()
    ignore_file = ROOT / ".dockerignore"
    patterns = [line.strip() for line in ignore_file.read_text().splitlines()
                if line.strip() and not line.startswith("#")] if ignore_file.exists() else []
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        for source in line.split()[:-1]:
            if not (ROOT / source).exists():
                problem(where, f"COPY {source}: no such file in the repository")
            elif dockerignored(source, patterns):
                problem(".dockerignore", f"excludes {source}, which the Dockerfile copies")
    final = text[[m.start() for m in re.finditer(r"^FROM ", text, re.M)][-1]:]
    config_path = DEPLOY / "docker/fleetgate.toml"
    m = re.search(r"^COPY (\S+) /etc/fleetgate/fleetgate.toml", final, re.M)
    if not m or m.group(1) != "deploy/docker/fleetgate.toml":
        problem(where, "the image's config should be deploy/docker/fleetgate.toml")
    config = tomllib.loads(config_path.read_text())
    fleetgate_accepts(rel(config_path), config_path, {}, bin_dir)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", final, re.M) for p in line.split()}
    for key in ("listen", "ops_listen"):
        if port_of(config[key]) not in exposed:
            problem(where, f"EXPOSE lacks the port of {key} ({config[key]})")
        if not config[key].startswith("0.0.0.0:"):
            problem(rel(config_path), f"{key} must listen on 0.0.0.0 in a container")
    health = re.search(r"^HEALTHCHECK .*?/dev/tcp/127\.0\.0\.1/(\d+).*?GET (\S+) ", final, re.M | re.S)
    if not health:
        problem(where, "no HEALTHCHECK against /dev/tcp/127.0.0.1/PORT")
    else:
        if int(health.group(1)) != port_of(config["ops_listen"]):
            problem(where, f"HEALTHCHECK asks port {health.group(1)}, ops_listen is {config['ops_listen']}")
        if health.group(2) != "/ready":
            problem(where, f"HEALTHCHECK asks {health.group(2)}, not /ready")
    volume = re.search(r'^VOLUME \["([^"]+)"\]', final, re.M)
    database = config["database_url"].removeprefix("sqlite://")
    if not volume or os.path.dirname(database) != volume.group(1):
        problem(where, f"VOLUME should be the directory of the SQLite store ({database})")
    user = re.search(r"^USER (\d+):(\d+)$", final, re.M)
    if not user:
        problem(where, "USER should be numeric uid:gid (Kubernetes' runAsNonRoot checks it)")
    for upstream in (u for model in config["models"] for u in model["upstreams"]):
        if urlsplit(upstream["url"]).hostname in ("127.0.0.1", "localhost", "::1"):
            problem(rel(config_path), f"upstream {upstream['url']} is the container itself")


def image_user() -> tuple[int, int] | None:
    text, _ = dockerfile()
    final = text[[m.start() for m in re.finditer(r"^FROM ", text, re.M)][-1]:]
    m = re.search(r"^USER (\d+):(\d+)$", final, re.M)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ---------------------------------------------------------------- Compose


def check_compose(bin_dir: Path) -> None:
    compose_dir = DEPLOY / "compose"
    path = compose_dir / "compose.yaml"
    where = rel(path)
    compose = load_yaml_docs(path)[0]
    services = compose["services"]
    _, stages = dockerfile()
    named_volumes = set(compose.get("volumes", {}) or {})
    listen_ports: dict[str, set[int]] = {}
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = (compose_dir / build["context"]).resolve()
            if not (context / build.get("dockerfile", "Dockerfile")).is_file():
                problem(where, f"{name}: no {build.get('dockerfile', 'Dockerfile')} in {context}")
            if context == ROOT and "target" in build and build["target"] not in stages:
                problem(where, f"{name}: build target {build['target']!r} is not a stage of the Dockerfile ({sorted(stages)})")
        for dep in service.get("depends_on", []) or []:
            if dep not in services:
                problem(where, f"{name} depends on an unknown service {dep}")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                if not (compose_dir / source).exists():
                    problem(where, f"{name}: mounts {source}, which does not exist")
            elif source not in named_volumes:
                problem(where, f"{name}: volume {source} is not declared under volumes:")
        command = service.get("command") or []
        for arg in command if isinstance(command, list) else command.split():
            if arg.startswith("--listen="):
                listen_ports.setdefault(name, set()).add(port_of(arg.split("=", 1)[1]))

    # The replicas: their config is accepted, with the environment compose gives them.
    budget = stop_budget_s(DEFAULT_SHUTDOWN_GRACE_MS)
    replicas = {n: s for n, s in services.items() if s.get("image", "").startswith("fleetgate:")}
    if len(replicas) < 2:
        problem(where, "expected two fleetgate replicas")
    for name, service in replicas.items():
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}
        config_path = (compose_dir / mounts.get("/etc/fleetgate/fleetgate.toml", "missing")).resolve()
        if not config_path.is_file():
            problem(where, f"{name}: no config mounted at /etc/fleetgate/fleetgate.toml")
            continue
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        fleetgate_accepts(f"{where} {name}", config_path, env, bin_dir)
        config = tomllib.loads(config_path.read_text())
        listen_ports.setdefault(name, set()).update(port_of(config[k]) for k in ("listen", "ops_listen") if k in config)
        for key, url in env.items():
            if key.endswith("_URL"):
                host = urlsplit(url).hostname
                if host not in services:
                    problem(where, f"{name}: {key} names {host}, which is not a service")
        for upstream in (u for model in config["models"] for u in model["upstreams"]):
            url = urlsplit(upstream["url"])
            if url.hostname not in services:
                problem(rel(config_path), f"upstream {upstream['url']}: {url.hostname} is not a compose service")
            elif url.port not in listen_ports.get(url.hostname, set()):
                problem(rel(config_path), f"upstream {upstream['url']}: {url.hostname} listens on {sorted(listen_ports.get(url.hostname, []))}")
        grace = seconds(service.get("stop_grace_period", 10))
        if grace < budget:
            problem(where, f"{name}: stop_grace_period {grace:.0f}s is below fleetgate's {budget:.0f}s shutdown (shutdown_grace_ms + settlements)")
        for port in service.get("ports", []):
            if not str(port).startswith("127.0.0.1:"):
                problem(where, f"{name}: publishes {port} beyond 127.0.0.1 with sample secrets")

    # Prometheus scrapes services that exist, on ports they listen on.
    prometheus = load_yaml_docs(compose_dir / "prometheus.yml")[0]
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    if "fleetgate" not in jobs:
        problem("deploy/compose/prometheus.yml", 'the alert rules and the dashboard expect job "fleetgate"')
    scraped = set()
    for job in jobs.values():
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped.add(host)
                if host not in services:
                    problem("deploy/compose/prometheus.yml", f"target {target}: no service {host}")
                elif int(port) not in listen_ports.get(host, set()):
                    problem("deploy/compose/prometheus.yml", f"target {target}: {host} listens on {sorted(listen_ports.get(host, []))}")
    for name in replicas:
        if name not in scraped:
            problem("deploy/compose/prometheus.yml", f"{name} is not scraped")
    sources = load_yaml_docs(compose_dir / "grafana/datasources.yml")[0]["datasources"]
    for source in sources:
        if urlsplit(source["url"]).hostname not in services:
            problem("deploy/compose/grafana/datasources.yml", f"{source['url']}: no such service")
    load_yaml_docs(compose_dir / "grafana/dashboards.yml")


# ---------------------------------------------------------------- Kubernetes


def strict(schema):
    """A CRD schema as kubectl's strict field validation reads it: unknown fields are
    errors (the API server would prune them silently). Go's inline flags after `^`
    (`^(?i)…`) are moved to the front, where Python's re takes them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if isinstance(schema.get("pattern"), str) and "(?i)" in schema["pattern"]:
            schema["pattern"] = "(?i)" + schema["pattern"].replace("(?i)", "")
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schemas() -> dict:
    """The Prometheus Operator's kinds: their CRDs' schemas, vendored."""
    return {
        ("monitoring.coreos.com/v1", kind): strict(json.loads((ROOT / f".ci/deploy/schemas/{kind.lower()}-v1.json").read_text()))
        for kind in ("ServiceMonitor", "PrometheusRule")
    }


CRD_SCHEMAS: dict = {}


def validate_schemas(where: str, doc: dict) -> None:
    """One resource against the schemas of KUBERNETES_VERSIONS (strict), or its CRD's."""
    if not CRD_SCHEMAS:
        CRD_SCHEMAS.update(crd_schemas())
    crd_schema = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd_schema:
        try:
            jsonschema.validate(doc, crd_schema)
        except jsonschema.ValidationError as err:
            problem(where, f"{doc['kind']}: {err.message} at {'/'.join(map(str, err.absolute_path))}")
        return
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            problem(where, f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: Kubernetes {version}: {err.message} at {'.'.join(map(str, err.path))}")
        except kubernetes_validate.SchemaNotFoundError:
            problem(where, f"Kubernetes {version} has no {doc.get('apiVersion')} {doc.get('kind')}")


K8S = DEPLOY / "kubernetes"
SAMPLE_SECRET = K8S / "secret.yaml"


def check_kubernetes_files() -> None:
    """Every manifest under deploy/kubernetes against the schemas, and each one in the
    kustomization or one of its components (the sample Secret aside)."""
    listed = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        for entry in load_yaml_docs(kustomization)[0].get("resources", []):
            listed.add((kustomization.parent / entry).resolve())
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_docs(path):
            validate_schemas(rel(path), doc)
        if path != SAMPLE_SECRET and path.resolve() not in listed:
            problem(rel(path), "is in no kustomization.yaml: list it in deploy/kubernetes/kustomization.yaml, "
                               "or, if it needs something a cluster may lack, in a component of its own (as monitoring/)")


def sample_secret() -> tuple[str, dict[str, str]]:
    """secret.yaml: the Secret's name and its sample variables."""
    doc = load_yaml_docs(SAMPLE_SECRET)[0]
    where = rel(SAMPLE_SECRET)
    values = doc.get("stringData", {})
    for key in values:
        if not key.startswith("FLEETGATE_"):
            problem(where, f"{key} is not a FLEETGATE_ variable")
    if not values.get("FLEETGATE_DATABASE_URL", "").startswith("postgres"):
        problem(where, "several replicas need PostgreSQL")
    return doc["metadata"]["name"], values


def plain_config() -> dict:
    doc = load_yaml_docs(K8S / "configmap.yaml")[0]
    return tomllib.loads(doc["data"]["fleetgate.toml"])


def within(selector: dict, labels: dict) -> bool:
    return not (selector.items() - labels.items())


def check_manifest_set(where: str, path: Path, bin_dir: Path, kinds_wanted: set[str], plain: bool) -> dict | None:
    """A rendered set of resources (kubectl kustomize, helm template): each against the
    schemas, and the cross-references between them and with fleetgate. `plain`: the
    kustomization's, whose Deployment takes the sample Secret whole (envFrom).
    Returns the config the set's pods get."""
    docs = load_yaml_docs(path)
    for doc in docs:
        validate_schemas(where, doc)
    kinds = {doc["kind"] for doc in docs}
    for kind in sorted(kinds_wanted - kinds):
        problem(where, f"no {kind}")
    if "Secret" in kinds:
        problem(where, "holds a Secret: secrets are created apart and referenced by name")
    if not kinds_wanted & {"ServiceMonitor", "PrometheusRule"}:
        for doc in docs:
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                problem(where, f"{doc['kind']} by default: a cluster without the Prometheus Operator refuses it")
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    named = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}

    def one(kind: str) -> dict | None:
        found = by_kind.get(kind, [])
        if len(found) > 1:
            problem(where, f"expected one {kind}, found {len(found)}")
        return found[0] if len(found) == 1 else None

    deployment = one("Deployment")
    if not deployment:
        problem(where, "no Deployment")
        return None
    pod = deployment["spec"]["template"]
    pod_spec = pod["spec"]
    pod_labels = pod["metadata"]["labels"]
    if not within(deployment["spec"]["selector"]["matchLabels"], pod_labels):
        problem(where, "the Deployment's selector does not match its pods' labels")
    container = next(c for c in pod_spec["containers"] if c["name"] == "fleetgate")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The config: from the ConfigMap mounted where FLEETGATE_CONFIG points.
    env = {e["name"]: e for e in container.get("env", [])}
    config_file = Path(env.get("FLEETGATE_CONFIG", {}).get("value", "/etc/fleetgate/fleetgate.toml"))
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    config_text = None
    for volume in pod_spec.get("volumes", []):
        if "configMap" in volume and mounts.get(volume["name"]) == str(config_file.parent):
            found = named.get(("ConfigMap", volume["configMap"]["name"]))
            if not found:
                problem(where, f"volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
            else:
                config_text = found["data"].get(config_file.name)
    if config_text is None:
        problem(where, f"no ConfigMap with {config_file.name} is mounted at {config_file.parent}")
        return None
    config = tomllib.loads(config_text)

    # Secrets by reference only; the config checked with the sample Secret's values.
    secret_name, sample = sample_secret()
    from_secrets: set[str] = set()
    for source in container.get("envFrom", []):
        name = source.get("secretRef", {}).get("name")
        if name and plain and name != secret_name:
            problem(where, f"envFrom: Secret {name} is not the one {rel(SAMPLE_SECRET)} describes ({secret_name})")
        if name:
            from_secrets.update(sample)
    for name, entry in env.items():
        if "secretKeyRef" in entry.get("valueFrom", {}):
            from_secrets.add(name)
        elif name.endswith(("_URL", "_TOKEN")):
            problem(where, f"{name} has a value of its own: a store URL or a token comes from a Secret")
    replicated = "HorizontalPodAutoscaler" in kinds or deployment["spec"].get("replicas", 1) > 1
    for needed in ("FLEETGATE_DATABASE_URL",) + (("FLEETGATE_REDIS_URL",) if replicated else ()):
        if needed not in from_secrets:
            problem(where, f"{needed} does not come from a Secret (several replicas need PostgreSQL and Redis)")
    with tempfile.TemporaryDirectory() as scratch:
        config_path = Path(scratch) / config_file.name
        config_path.write_text(config_text)
        fleetgate_accepts(where, config_path, {k: v for k, v in sample.items() if k in from_secrets}, bin_dir)

    for key, port_name in (("listen", "http"), ("ops_listen", "ops"), ("admin_listen", "admin")):
        if key not in config:
            if key != "admin_listen":
                problem(where, f"the config has no {key}")
        elif ports.get(port_name) != port_of(config[key]):
            problem(where, f"container port {port_name} ({ports.get(port_name)}) is not {key}'s ({config[key]})")
    for probe, wanted in (("startupProbe", "/live"), ("livenessProbe", "/live"), ("readinessProbe", "/ready")):
        get_ = container.get(probe, {}).get("httpGet")
        if not get_:
            problem(where, f"no {probe} (httpGet)")
            continue
        if get_.get("port") != "ops":
            problem(where, f"{probe} should ask the ops port (ops_listen)")
        if get_.get("path") != wanted:
            problem(where, f"{probe} should be {wanted}")
    grace_ms = config.get("shutdown_grace_ms", DEFAULT_SHUTDOWN_GRACE_MS)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
    termination = pod_spec.get("terminationGracePeriodSeconds", 30)
    if termination < pre_stop_s + stop_budget_s(grace_ms):
        problem(where, f"terminationGracePeriodSeconds {termination} < preStop {pre_stop_s:.0f}s + fleetgate's shutdown {stop_budget_s(grace_ms):.0f}s")
    user = image_user()
    security = pod_spec.get("securityContext", {})
    if user and (security.get("runAsUser"), security.get("runAsGroup")) != user:
        problem(where, f"runAsUser/runAsGroup should be the image's {user}")

    # No API token in the pods, under a ServiceAccount of their own.
    account = pod_spec.get("serviceAccountName")
    if not account or ("ServiceAccount", account) not in named:
        problem(where, f"the pods' serviceAccountName ({account}) is no ServiceAccount of the set")
    if pod_spec.get("automountServiceAccountToken") is not False:
        problem(where, "the pods should have automountServiceAccountToken: false")
    for sa in by_kind.get("ServiceAccount", []):
        if sa.get("automountServiceAccountToken") is not False:
            problem(where, f"ServiceAccount {sa['metadata']['name']}: automountServiceAccountToken should be false")

    spread = {c["topologyKey"]: c for c in pod_spec.get("topologySpreadConstraints", [])}
    for key in ("topology.kubernetes.io/zone", "kubernetes.io/hostname"):
        if key not in spread:
            problem(where, f"no topology spread over {key}")
        elif not within(spread[key].get("labelSelector", {}).get("matchLabels", {}), pod_labels) \
                or not spread[key].get("labelSelector", {}).get("matchLabels"):
            problem(where, f"the topology spread over {key} does not select the pods")

    hpa = one("HorizontalPodAutoscaler")
    if hpa:
        target = hpa["spec"]["scaleTargetRef"]
        if (target["kind"], target["name"]) != ("Deployment", deployment["metadata"]["name"]):
            problem(where, f"the HorizontalPodAutoscaler scales {target['kind']} {target['name']}, not the Deployment")
        if "replicas" in deployment["spec"]:
            problem(where, "the Deployment sets replicas beside its HorizontalPodAutoscaler: each apply would reset the count")
        if not container.get("resources", {}).get("requests", {}).get("cpu"):
            problem(where, "the HorizontalPodAutoscaler scales on CPU, but the container requests none")

    service = one("Service")
    if service:
        if not within(service["spec"]["selector"], pod_labels):
            problem(where, "the Service's selector does not match the Deployment's pods")
        for port in service["spec"]["ports"]:
            if port["targetPort"] not in ports:
                problem(where, f"Service targetPort {port['targetPort']} is not a container port ({sorted(ports)})")
        monitor = one("ServiceMonitor")
        if monitor:
            if not within(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]):
                problem(where, "the ServiceMonitor's selector does not match the Service's labels")
            # The operator's job label: the Service's name, or the value of its label jobLabel.
            job = service["metadata"]["labels"].get(monitor["spec"].get("jobLabel", ""), service["metadata"]["name"])
            if job != "fleetgate":
                problem(where, f'the ServiceMonitor gives job="{job}"; the alerts and the dashboard expect "fleetgate"')
            for endpoint in monitor["spec"]["endpoints"]:
                target = next((p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]), None)
                if not target or target["targetPort"] != "ops":
                    problem(where, f"ServiceMonitor endpoint port {endpoint['port']} is not the Service's ops port")
        for ingress in by_kind.get("Ingress", []):
            hosts = set()
            for rule in ingress["spec"].get("rules", []):
                hosts.add(rule.get("host"))
                for http_path in rule.get("http", {}).get("paths", []):
                    backend = http_path["backend"]["service"]
                    port = backend["port"].get("name") or backend["port"].get("number")
                    api = next(p for p in service["spec"]["ports"] if p["targetPort"] == "http")
                    if backend["name"] != service["metadata"]["name"] or port not in (api["name"], api["port"]):
                        problem(where, f"Ingress {ingress['metadata']['name']}: the backend should be the Service's API port")
            tls_hosts = {h for tls in ingress["spec"].get("tls", []) for h in tls.get("hosts") or []}
            if hosts - tls_hosts:
                problem(where, f"Ingress {ingress['metadata']['name']}: no TLS for {sorted(h for h in hosts - tls_hosts if h)}")
    for rule in by_kind.get("PrometheusRule", []):
        if rule["spec"].get("groups") != load_yaml_docs(DEPLOY / "prometheus/alerts.yml")[0]["groups"]:
            problem(where, f"PrometheusRule {rule['metadata']['name']}: its groups are not those of deploy/prometheus/alerts.yml")
    pdb = one("PodDisruptionBudget")
    if pdb and not within(pdb["spec"]["selector"]["matchLabels"], pod_labels):
        problem(where, "the PodDisruptionBudget's selector does not match the Deployment's pods")
    policy = one("NetworkPolicy")
    if policy:
        if not within(policy["spec"]["podSelector"]["matchLabels"], pod_labels):
            problem(where, "the NetworkPolicy's podSelector does not match the Deployment's pods")
        for entry in policy["spec"].get("ingress", []):
            for port in entry.get("ports", []):
                if isinstance(port.get("port"), str) and port["port"] not in ports:
                    problem(where, f"the NetworkPolicy opens port {port['port']}, not a container port ({sorted(ports)})")
    return config


# The resources each rendered set must have.
BASE_KINDS = {"ServiceAccount", "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler",
              "PodDisruptionBudget", "NetworkPolicy"}
MONITORING_KINDS = {"ServiceMonitor", "PrometheusRule"}


def check_kustomize(default: Path, components: Path, bin_dir: Path) -> None:
    check_manifest_set("kubectl kustomize deploy/kubernetes", default, bin_dir, BASE_KINDS, plain=True)
    check_manifest_set("deploy/kubernetes with its components", components, bin_dir,
                       BASE_KINDS | MONITORING_KINDS | {"Ingress"}, plain=True)


HELM_CHART = DEPLOY / "helm/fleetgate"


def check_helm(default: Path, everything: Path, bin_dir: Path) -> None:
    config = check_manifest_set("helm template (default values)", default, bin_dir, BASE_KINDS, plain=False)
    if config is not None and config != plain_config():
        problem("deploy/helm/fleetgate/values.yaml", "config is not the config of deploy/kubernetes/configmap.yaml")
    check_manifest_set("helm template (.ci/deploy/helm-values-all.yaml)", everything, bin_dir,
                       BASE_KINDS | MONITORING_KINDS | {"Ingress"}, plain=False)
    copy = HELM_CHART / "files/alerts.yml"
    if not copy.exists() or copy.read_text() != (DEPLOY / "prometheus/alerts.yml").read_text():
        problem(rel(copy), "differs from deploy/prometheus/alerts.yml: cp deploy/prometheus/alerts.yml deploy/helm/fleetgate/files/")


# ---------------------------------------------------------------- systemd


def check_systemd() -> None:
    path = DEPLOY / "systemd/fleetgate.service"
    where = rel(path)
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())

    def one(key: str) -> str | None:
        values = settings.get(key)
        if not values:
            problem(where, f"no {key}=")
            return None
        return values[-1]

    nofile = one("LimitNOFILE")
    if nofile and int(nofile.split(":")[-1]) < 2 * DEFAULT_MAX_OPEN:
        problem(where, f"LimitNOFILE={nofile} is below twice connections.max_open ({DEFAULT_MAX_OPEN}): a client and an upstream connection each")
    timeout = one("TimeoutStopSec")
    budget = stop_budget_s(DEFAULT_SHUTDOWN_GRACE_MS)
    if timeout and seconds(timeout) <= budget:
        problem(where, f"TimeoutStopSec={timeout} is not above fleetgate's {budget:.0f}s shutdown (shutdown_grace_ms + settlements)")
    if one("KillSignal") not in ("SIGTERM", "TERM", "15"):
        problem(where, "KillSignal should be SIGTERM (fleetgate's graceful shutdown)")
    if one("Restart") != "on-failure":
        problem(where, "Restart should be on-failure")
    state = one("StateDirectory")
    if state and one("WorkingDirectory") != f"/var/lib/{state}":
        problem(where, "WorkingDirectory should be the StateDirectory, where a relative SQLite path lands")
    exec_start = (one("ExecStart") or "").split()
    if exec_start[1:2] != ["serve"] or "--config" not in exec_start:
        problem(where, "ExecStart should run `fleetgate serve --config …`")


# ---------------------------------------------------------------- PrometheusRule

PROMETHEUS_RULE_HEADER = """\
# The alert rules of deploy/prometheus/alerts.yml for the Prometheus Operator (its
# comments, on what to tune, are there). Needs the PrometheusRule CRD; many installs
# select rules by a label such as `release: <helm release>`: add it below if yours does.
# GENERATED: edit alerts.yml, then, after .ci/deploy-check has installed its venv,
#   target/deploy-check/venv/bin/python .ci/deploy/check.py --print-prometheusrule \\
#     > deploy/kubernetes/monitoring/prometheusrule.yaml
# .ci/deploy-check fails while the two differ.
"""


def prometheus_rule() -> str:
    groups = load_yaml_docs(DEPLOY / "prometheus/alerts.yml")[0]["groups"]
    resource = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "fleetgate", "labels": {"app.kubernetes.io/name": "fleetgate"}},
        "spec": {"groups": groups},
    }

    class Dumper(yaml.SafeDumper):
        pass

    def string(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, string)
    return PROMETHEUS_RULE_HEADER + yaml.dump(resource, Dumper=Dumper, sort_keys=False, width=10**6)


def check_prometheus_rule() -> None:
    path = K8S / "monitoring/prometheusrule.yaml"
    if not path.exists() or path.read_text() != prometheus_rule():
        problem(rel(path), "differs from deploy/prometheus/alerts.yml: regenerate it (see its header)")


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrape", type=Path, help="a running fleetgate's /metrics")
    parser.add_argument("--bin-dir", type=Path, help="where the built fleetgate is")
    parser.add_argument("--node-dir", type=Path, help="where promql.mjs and its node_modules are")
    parser.add_argument("--dashboard-rules", type=Path, help="where to write the dashboard's queries as rules")
    parser.add_argument("--kustomize-default", type=Path, help="`kubectl kustomize deploy/kubernetes`")
    parser.add_argument("--kustomize-components", type=Path, help="the same with every component of deploy/kubernetes")
    parser.add_argument("--helm-default", type=Path, help="`helm template` of deploy/helm/fleetgate, default values")
    parser.add_argument("--helm-all", type=Path, help="the same with .ci/deploy/helm-values-all.yaml")
    parser.add_argument("--print-prometheusrule", action="store_true",
                        help="print deploy/kubernetes/monitoring/prometheusrule.yaml as generated from the alert rules, and stop")
    args = parser.parse_args()
    if args.print_prometheusrule:
        sys.stdout.write(prometheus_rule())
        return 0
    if None in (args.scrape, args.bin_dir, args.node_dir, args.dashboard_rules, args.kustomize_default,
                args.kustomize_components, args.helm_default, args.helm_all):
        parser.error("every option but --print-prometheusrule is needed")

    families, samples = parse_exposition(args.scrape.read_text())
    groups = [
        ("metrics exported", lambda: check_scrape(families, samples)),
        ("alert rules and dashboard queries against them",
         lambda: check_queries(check_alerts() + check_dashboard(args.dashboard_rules), args.node_dir, families, samples)),
        ("Dockerfile and the image's config", lambda: check_docker(args.bin_dir)),
        ("compose setup", lambda: check_compose(args.bin_dir)),
        ("Kubernetes manifest files", check_kubernetes_files),
        ("kustomizations as rendered", lambda: check_kustomize(args.kustomize_default, args.kustomize_components, args.bin_dir)),
        ("Helm chart as rendered", lambda: check_helm(args.helm_default, args.helm_all, args.bin_dir)),
        ("PrometheusRule matches the alert rules", check_prometheus_rule),
        ("systemd unit settings", check_systemd),
    ]
    for title, check in groups:
        before = len(problems)
        check()
        print(f"{'ok  ' if len(problems) == before else 'FAIL'} {title}")
    for line in problems:
        print(f"  {line}")
    if not problems:
        exported = sorted(f for f in families if f.startswith("fleetgate_"))
        print(f"     ({len(exported)} metric families, {len(alert_rules())} alert rules, "
              f"Kubernetes {' and '.join(KUBERNETES_VERSIONS)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
