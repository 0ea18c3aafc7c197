#!/usr/bin/env bash
# Regenerates docs/img/*.png from two demo runs, with TensorBoard and headless Chromium
# (Debian: apt-get install -y chromium). Run from the repository root with the venv active.
set -euo pipefail
work=$(mktemp -d)
layerwatch demo --logdir "$work/runs"
layerwatch demo --logdir "$work/runs" --inject-nan 4000
layerwatch demo --logdir "$work/runs" --steps 1000 --inject-spike 630
tensorboard --logdir "$work/runs" --host 127.0.0.1 --port 6123 --load_fast false >/dev/null 2>&1 & all=$!
tensorboard --logdir "$work/runs/demo/version_0" --host 127.0.0.1 --port 6124 --load_fast false >/dev/null 2>&1 & one=$!
tensorboard --logdir "$work/runs/demo/version_1" --host 127.0.0.1 --port 6125 --load_fast false >/dev/null 2>&1 & nan=$!
trap 'kill $all $one $nan' EXIT
sleep 10
shot() {
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --hide-scrollbars \
    --window-size="$3" --virtual-time-budget=20000 --screenshot="docs/img/$1" "$2"
}
shot grads-norm.png "http://127.0.0.1:6123/#scalars&tagFilter=grads_norm%2Fencoder&_smoothingWeight=0" 1500,1000
shot histograms.png "http://127.0.0.1:6124/#histograms&tagFilter=weights%2Fencoder.%5B02%5D.weight%7Cgrads%2Fencoder.0.weight" 1500,900
shot nan-incident.png "http://127.0.0.1:6123/#scalars&tagFilter=weights_nonfinite%2Fencoder.0.weight%7Cgrads_nonfinite%2Fencoder.0.weight%7Clayerwatch%2Fgrad_norm&_smoothingWeight=0" 1500,700
shot structure.png "http://127.0.0.1:6124/#text&tagFilter=layerwatch%2Fstructure" 1500,800
shot alerts.png "http://127.0.0.1:6125/#text&tagFilter=layerwatch%2Falerts" 1500,560
python docs/tab_screenshots.py http://127.0.0.1:6123 docs/img
python docs/hf_screenshot.py docs/img
python docs/heads_screenshot.py docs/img  # the per-head view (layer-view.md): its own run and TensorBoard
python docs/moe_screenshot.py docs/img  # the experts view (moe.md): two tiny Mixtrals, one collapsing, and TensorBoard
python docs/share_screenshot.py docs/img  # the one-file report open from file:// (layer-view.md): its own run
python docs/divergence_screenshots.py --out docs/img  # the divergence benchmark's pictures (reading-charts.md): its own runs and TensorBoard
