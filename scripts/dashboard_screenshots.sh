#!/usr/bin/env bash
# Re-take the dashboard screenshots docs/metrics.md shows (docs/images/dashboard-*.png): the
# browser test of the extras stage, run with DLROVER_SCREENSHOTS pointing there. Needs Debian's
# chromium and `pip install playwright`. Run from anywhere: scripts/dashboard_screenshots.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DLROVER_SCREENSHOTS=docs/images python -m pytest -q -p no:randomly -m extras \
    "tests/e2e/test_metrics_extras.py::test_the_dashboards_chart_a_job_with_a_failure_and_checkpoints"
ls -l docs/images/dashboard-*.png
