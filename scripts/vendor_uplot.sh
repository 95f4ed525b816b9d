#!/usr/bin/env bash
# Vendor uPlot (MIT, https://github.com/leeoniya/uPlot), the charting library of the dashboards,
# into dlrover/master/static: its minified browser build, its stylesheet and its licence, exactly
# as the npm registry ships them. Needs npm. Run from anywhere: scripts/vendor_uplot.sh
set -euo pipefail
VERSION=1.6.32
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf "uplot-$VERSION.tgz")
static=dlrover/master/static
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" "$static/"
cp "$work/package/LICENSE" "$static/uPlot.LICENSE"
echo "uPlot $VERSION" > "$static/uPlot.VERSION"
echo "vendored uPlot $VERSION into $static"
