#!/usr/bin/env bash
# Render every diagrams/*.mmd to a PNG beside it, with headless Chromium and the
# mermaid npm package (neither is a project dependency: `apt-get install chromium`,
# `npm install mermaid@11` in MERMAID_DIR).
set -euo pipefail
cd "$(dirname "$0")"
MERMAID_JS=${MERMAID_JS:?path to node_modules/mermaid/dist/mermaid.min.js}
for src in *.mmd; do
  html=$(mktemp --suffix=.html)
  python3 - "$src" "$MERMAID_JS" > "$html" <<'PY'
import json, sys
src, js = open(sys.argv[1]).read(), open(sys.argv[2]).read()
print('<html><head><meta charset="utf-8"></head><body style="margin:0;background:white"><div id="out"></div><script>' + js + '</script><script>'
      'mermaid.initialize({startOnLoad:false,theme:"default",flowchart:{useMaxWidth:false}});'
      'mermaid.render("d", ' + json.dumps(src) + ').then(r => {document.getElementById("out").innerHTML = r.svg;});'
      '</script></body></html>')
PY
  chromium --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --hide-scrollbars --force-device-scale-factor=2 \
    --window-size=2400,2600 --virtual-time-budget=5000 --screenshot="${src%.mmd}.png" "file://$html" 2>/dev/null
  python3 - "${src%.mmd}.png" <<'PY'
import sys
from PIL import Image, ImageChops
p = sys.argv[1]; im = Image.open(p).convert("RGB")
bbox = ImageChops.difference(im, Image.new("RGB", im.size, "white")).getbbox()
if bbox: im.crop((max(bbox[0]-20,0), max(bbox[1]-20,0), bbox[2]+20, bbox[3]+20)).save(p)
PY
  rm -f "$html"; echo "rendered ${src%.mmd}.png"
done
