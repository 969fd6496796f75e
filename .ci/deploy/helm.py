#!/usr/bin/env python3
"""`helm lint --strict` and `helm template` for .ci/deploy-check, without a helm binary.

There is no helm binary for CI to install from the registries it reaches, so this runs
Helm v4's own lint and template engine in-process: the PyPI package helm-python-sdk
(pinned in requirements.txt) bundles Helm's Go SDK, compiled as a C library
(libhelm_c), and calls the same code as `helm lint` and `helm template` do (chart
loading, values.schema.json, the template engine and its functions, the lint rules).

    helm.py lint CHART [-f VALUES]...
        Like `helm lint --strict CHART -f VALUES…`: prints the findings, and exits 1
        on any warning or error (strict).
    helm.py template NAME CHART [-f VALUES]... [--namespace NS] [-o FILE]
        Like `helm template NAME CHART -f VALUES… --namespace NS`: the values checked
        against the chart's values.schema.json, then the manifests, one YAML stream
        with a `# Source:` line before each (NOTES.txt left out, as helm does), in
        the order of their template files (helm sorts them by kind instead).

Run it with the deploy-check venv's python: target/deploy-check/venv/bin/python.
"""

import argparse
import sys
from pathlib import Path

import helm_python
from helm_python import chart as helm_chart
from helm_python.errors import HelmError

SEVERITIES = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}


def merge(base: dict, override: dict) -> dict:
    """Values files in order, the later winning key by key (as helm's -f)."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_values(files: list[Path]) -> dict:
    values: dict = {}
    for path in files:
        # Helm's own YAML reading, so that values mean here what they mean to helm.
        values = merge(values, helm_chart.values_from_yaml(path.read_text()))
    return values


def lint(chart: Path, values_files: list[Path], namespace: str) -> int:
    report = helm_chart.lint(chart, load_values(values_files), strict=True, namespace=namespace)
    worst = 0
    for message in report["messages"]:
        severity = message["severity"]
        worst = max(worst, severity)
        print(f"[{SEVERITIES.get(severity, severity)}] {message['path']}: {message['error']}")
    for error in report["errors"]:
        print(f"[ERROR] {error}")
    failed = bool(report["errors"]) or worst >= 2
    print(f"{report['total_charts_linted']} chart(s) linted, {int(failed)} chart(s) failed"
          f" (Helm {helm_python.helm_sdk_version()}, strict)")
    return 1 if failed else 0


def template(name: str, chart_path: Path, values_files: list[Path], namespace: str) -> str:
    values = load_values(values_files)
    with helm_chart.Chart.load(chart_path) as chart:
        chart.validate_schema(chart.merge_values(values))
        manifests = chart.render(values, name=name, namespace=namespace, is_install=True)
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        out.append(f"---\n# Source: {path}\n{text.strip()}\n")
    return "".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    lint_args = commands.add_parser("lint")
    lint_args.add_argument("chart", type=Path)
    template_args = commands.add_parser("template")
    template_args.add_argument("name")
    template_args.add_argument("chart", type=Path)
    template_args.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    for sub in (lint_args, template_args):
        sub.add_argument("-f", "--values", type=Path, action="append", default=[])
        sub.add_argument("--namespace", default="default")
    args = parser.parse_args()
    try:
        if args.command == "lint":
            return lint(args.chart, args.values, args.namespace)
        rendered = template(args.name, args.chart, args.values, args.namespace)
    except HelmError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if args.output:
        args.output.write_text(rendered)
    else:
        sys.stdout.write(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
