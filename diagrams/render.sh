#!/usr/bin/env bash
# Render diagrams/*.mmd (or the .mmd files named as arguments) to a PNG beside each, with
# mermaid-cli (`mmdc`) driving a headless Chromium. Neither is a project dependency and no
# test needs them. Setup on Debian (as root):
#   apt-get install -y chromium
#   PUPPETEER_SKIP_DOWNLOAD=1 npm install -g @mermaid-js/mermaid-cli   # no bundled browser
# mmdc is then pointed at the system Chromium through a puppeteer config written below
# (`executablePath`, `args: ["--no-sandbox"]`, which Chromium needs when run as root);
# CHROMIUM=/path/to/chrome picks another browser. Every diagram gets the same mermaid
# config: the default theme, labels wrapped at 400 px, rendered at twice the scale.
set -euo pipefail
cd "$(dirname "$0")"
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
command -v mmdc >/dev/null || { echo "error: mmdc not found (npm install -g @mermaid-js/mermaid-cli)" >&2; exit 2; }
[ -x "$CHROMIUM" ] || { echo "error: no Chromium found (apt-get install chromium, or set CHROMIUM)" >&2; exit 2; }
conf=$(mktemp -d)
trap 'rm -rf "$conf"' EXIT
printf '{"executablePath": "%s", "args": ["--no-sandbox", "--disable-gpu"]}\n' "$CHROMIUM" > "$conf/puppeteer.json"
printf '{"theme": "default", "flowchart": {"useMaxWidth": false, "wrappingWidth": 400}}\n' > "$conf/mermaid.json"
sources=("$@")
[ ${#sources[@]} -gt 0 ] || sources=(*.mmd)
for src in "${sources[@]}"; do
  mmdc --quiet --puppeteerConfigFile "$conf/puppeteer.json" --configFile "$conf/mermaid.json" \
    --input "$src" --output "${src%.mmd}.png" --scale 2 --backgroundColor white
  echo "rendered ${src%.mmd}.png"
done
