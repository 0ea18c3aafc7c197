/**
 * LAYERWATCH: the TensorBoard tab of layerwatch.
 *
 * TensorBoard loads this ES module in an iframe and calls render(). Every route (runs, stats,
 * heatmap, layer, events, rankings) is fetched relative to the plugin base. The page: a heatmap
 * of layers x sampled steps for one statistic, rows grouped by the module tree (an attention
 * head's row `<module>#<h>` a child of its module, an expert's slice `<param>[e]` of its fused
 * parameter, folded into it until expanded); a layer's
 * series and histograms when a row is clicked, and an attention module's heads x steps; the
 * run's events and rankings beside it. A run with Mixture-of-Experts routers also gets the experts
 * view: routers x experts coloured by each expert's share of its router's tokens at a chosen step,
 * and each router's imbalance over the sampled steps, both drawn by the heatmap's own view.
 *
 * Values: NaN is a non-finite statistic (a finding), -Infinity is "not measured" (the JSON
 * routes' "NaN" and null are converted to these).
 *
 * The same page runs in a file written by `layerwatch report --html` (share.py): there the
 * routes' answers are inlined in the page (#layerwatch-data) and getJson reads them instead.
 */

const ROOT = '(root)';
const HEAD = /#(\d+)$/; // an attention head's row: <module>#<h> (vocabulary.head_name); a router's expert's, <router>#<e>
const EXPERT = /\[(\d+)\]$/; // an expert's slice of a fused expert parameter: <param>[e] (vocabulary.expert_param_name)
const PART = /(#\d+|\[\d+\])$/; // a head's or an expert's row: a child of its module or parameter
const ACCENT = '#f57c00';
const NAN_CSS = '#ff00ff';
const SPIKE_CSS = '#e53935';  // a loss spike's step: red stands out of viridis
const NOT_MEASURED_CSS = '#e8eaed';
const LABEL_WIDTH = 260;
const LABEL_FONT = '12px Roboto, system-ui, -apple-system, "Segoe UI", Arial, sans-serif';
const INDENT = 12;
const ROW_HEIGHT = {min: 14, max: 26};
const ALL_LABELS_UP_TO = 200; // above this many rows only the rows in view get a label element
const LABEL_OVERSCAN = 20;
const LEGEND_WIDTH = 220;
const LEGEND_FONT = '10px Roboto, system-ui, sans-serif';
const SERIES_HEIGHT = 110;
const HISTOGRAM_BINS = 64;
const MAX_HISTOGRAM_COLUMNS = 4000;
const VIRIDIS = ['#440154', '#482878', '#3e4989', '#31688e', '#26828e', '#1f9e89', '#35b779', '#6ece58',
  '#b5de2b', '#fde725'];
const COUNT_RAMP = ['#ffffff', '#ffe0b2', '#ffb74d', '#f57c00', '#a84300', '#4e2000'];

// ------------------------------------------------------------------------------ colours

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [n >> 16, (n >> 8) & 255, n & 255];
}

// ImageData holds RGBA bytes; read as a Uint32 on a little-endian machine a pixel is 0xAABBGGRR.
function packRgb([r, g, b]) {
  return ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;
}

function pixelCss(pixel) {
  return `rgb(${pixel & 255},${(pixel >> 8) & 255},${(pixel >> 16) & 255})`;
}

function rampLut(stops) {
  const rgb = stops.map(hexToRgb);
  const lut = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    const position = (i / 255) * (rgb.length - 1);
    const k = Math.min(Math.floor(position), rgb.length - 2);
    const f = position - k;
    lut[i] = packRgb([0, 1, 2].map((c) => Math.round(rgb[k][c] + (rgb[k + 1][c] - rgb[k][c]) * f)));
  }
  return lut;
}

const CELL_LUT = rampLut(VIRIDIS);
const COUNT_LUT = rampLut(COUNT_RAMP);
const NAN_PIXEL = packRgb(hexToRgb(NAN_CSS));

// ------------------------------------------------------------------------------ routes

async function getJson(route, params = {}) {
  const query = new URLSearchParams(params).toString();
  const url = `./${route}${query ? `?${query}` : ''}`;
  let response;
  try {
    response = await (INLINE_DATA ? inlineResponse(route, params) : fetch(url));
  } catch (error) {
    throw new Error(`GET ${url}: ${error.message}`);
  }
  if (!response.ok) {
    const detail = errorDetail(await response.text().catch(() => ''));
    throw new Error(`GET ${url}: HTTP ${response.status} ${response.statusText}${detail ? ` (${detail})` : ''}`);
  }
  try {
    return await response.json();
  } catch (error) {
    throw new Error(`GET ${url}: the reply is not JSON (${error.message})`);
  }
}

/** A failed route's message: the `error` of its JSON body, else the start of its text. */
function errorDetail(body) {
  let parsed = null;
  try {
    parsed = JSON.parse(body);
  } catch {
    parsed = null;
  }
  return typeof parsed?.error === 'string' ? parsed.error : body.trim().slice(0, 200);
}

/**
 * Base64 to bytes: Uint8Array.fromBase64 where the browser has it (about 10 ms for 8 MB), else
 * atob and a plain loop (about 50 ms); both beat a data: URL fetch (about 250 ms).
 */
function decodeBase64(base64) {
  if (Uint8Array.fromBase64) return Uint8Array.fromBase64(base64);
  const binary = atob(base64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

function encodeBase64(bytes) {
  if (bytes.toBase64) return bytes.toBase64();
  let binary = '';
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

/** The heatmap's base64 float32 values, little-endian as is every platform a browser runs on. */
function decodeFloat32(base64) {
  const bytes = decodeBase64(base64);
  return new Float32Array(bytes.buffer, 0, bytes.byteLength >> 2);
}

// ------------------------------------------------------------------------------ inline data

/**
 * The answers of a shared file (packing.py has the format): by route, then by the values of
 * its query parameters in the order of their names, each `[status, reason, body]` as the
 * route sends it. Unpacked once, on the first request; a body's arrays are revived on each.
 */
const INLINE_DATA = document.getElementById('layerwatch-data');
let inlineAnswers = null;

async function inlineResponse(route, params) {
  inlineAnswers ??= unpackAnswers(INLINE_DATA.textContent.trim());
  const {answers, bytes} = await inlineAnswers;
  let node = answers[route];
  for (const name of Object.keys(params).sort()) {
    node = node && typeof node === 'object' && Object.hasOwn(node, params[name]) ? node[params[name]] : undefined;
  }
  const [status, reason, body] = Array.isArray(node) ? node
    : [404, 'Not Found', {error: `this file holds no answer to ${route} ${JSON.stringify(params)}`}];
  return new Response(JSON.stringify(revive(body, bytes)), {status, statusText: reason,
    headers: {'Content-Type': 'application/json'}});
}

/** The answers and the bytes their arrays live in (offsets count from the pool's start). */
async function unpackAnswers(base64) {
  const packed = new Blob([decodeBase64(base64)]).stream().pipeThrough(new DecompressionStream('gzip'));
  const buffer = await new Response(packed).arrayBuffer();
  const skeletonLength = new DataView(buffer).getUint32(0, true);
  const answers = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, skeletonLength)));
  const poolStart = Math.ceil((4 + skeletonLength) / 8) * 8;
  return {answers, bytes: {buffer, poolStart}};
}

const POOL_ARRAYS = {f4: Float32Array, f8: Float64Array, i4: Int32Array};

/** A packed body as the route sent it: arrays back to JSON lists ("NaN" and null included), rows back to base64. */
function revive(value, bytes) {
  if (Array.isArray(value)) return value.map((item) => revive(item, bytes));
  if (value === null || typeof value !== 'object') return value;
  if (value.$) return poolList(bytes, ...value.$);
  if (value.$b64) {
    const rows = value.$b64.map(([dtype, offset, length]) => poolView(bytes, dtype, offset, length));
    const joined = new Uint8Array(rows.reduce((sum, row) => sum + row.byteLength, 0));
    let at = 0;
    for (const row of rows) {
      joined.set(new Uint8Array(row.buffer, row.byteOffset, row.byteLength), at);
      at += row.byteLength;
    }
    return encodeBase64(joined);
  }
  return Object.fromEntries(Object.entries(value).map(([key, item]) => [key, revive(item, bytes)]));
}

function poolView({buffer, poolStart}, dtype, offset, length) {
  return new POOL_ARRAYS[dtype](buffer, poolStart + offset, length);
}

/** A pooled array as the JSON list it was: `length` numbers, or `length` rows of `columns`. */
function poolList(bytes, dtype, offset, length, columns) {
  const jsonNumber = (v) => (v === -Infinity ? null : Number.isNaN(v) ? 'NaN' : v);
  if (columns === undefined) return Array.from(poolView(bytes, dtype, offset, length), jsonNumber);
  const rows = length;
  const flat = poolView(bytes, dtype, offset, rows * columns);
  return Array.from({length: rows}, (_, r) => Array.from(flat.subarray(r * columns, (r + 1) * columns), jsonNumber));
}

async function fetchHeatmap(run, stat) {
  const reply = await getJson('heatmap', {run, stat});
  const values = decodeFloat32(reply.values);
  if (values.length !== reply.rows.length * reply.steps.length) {
    throw new Error(`heatmap of ${stat} in ${run}: ${values.length} values for ` +
      `${reply.rows.length} rows x ${reply.steps.length} steps`);
  }
  return {rows: reply.rows, steps: reply.steps, values};
}

/** A JSON value of the routes: a number, "NaN" (non-finite) or null (not measured). */
function jsonValue(value) {
  if (value === null || value === undefined) return -Infinity;
  return typeof value === 'number' ? value : NaN;
}

// ------------------------------------------------------------------------------ numbers

function clamp(value, lo, hi) {
  return Math.min(hi, Math.max(lo, value));
}

/** The first index of the sorted `values` whose value is >= `target`. */
function lowerBound(values, target) {
  let lo = 0;
  let hi = values.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (values[mid] < target) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

function formatNumber(value) {
  if (value === 0) return '0';
  const magnitude = Math.abs(value);
  if (magnitude >= 1e5 || magnitude < 1e-3) {
    const [mantissa, exponent] = value.toExponential(2).split('e');
    return `${+mantissa}e${+exponent}`;
  }
  return String(+value.toPrecision(3));
}

function formatBytes(value) {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let k = 0;
  while (Math.abs(value) >= 1024 && k < units.length - 1) {
    value /= 1024;
    k += 1;
  }
  return `${+value.toPrecision(3)} ${units[k]}`;
}

function formatValue(value, unit) {
  if (Number.isNaN(value) || value === Infinity) return 'NaN/Inf';
  if (value === -Infinity) return 'not measured';
  if (unit === 'bytes') return formatBytes(value);
  if (unit === 'ms') return `${formatNumber(value)} ms`;
  // a factor reads as the report writes it: ×2.5 grew 2.5 times, ÷40 shrank 40 times
  if (unit === 'x') return value >= 1 ? `×${formatNumber(value)}` : `÷${formatNumber(1 / value)}`;
  return formatNumber(value);
}

/** Round tick values covering [lo, hi], about `count` intervals. */
function niceTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw);
  const ticks = [];
  for (let k = Math.floor(lo / step); ; k++) {
    const tick = +(k * step).toPrecision(12);
    ticks.push(tick);
    if (tick >= hi) return ticks;
  }
}

/** niceTicks in the unit's own steps: for bytes, multiples of a power of 1024. */
function unitTicks(lo, hi, count, unit) {
  if (unit !== 'bytes') return niceTicks(lo, hi, count);
  const largest = Math.max(Math.abs(lo), Math.abs(hi), 1);
  const scale = 1024 ** Math.floor(Math.log(largest) / Math.log(1024));
  return niceTicks(lo / scale, hi / scale, count).map((v) => v * scale);
}

/** Powers of ten within [lo, hi], at most `most` of them. */
function decadeTicks(lo, hi, most) {
  const first = Math.ceil(Math.log10(lo) - 1e-9);
  const last = Math.floor(Math.log10(hi) + 1e-9);
  if (last < first) return [];
  const every = Math.ceil((last - first + 1) / most);
  const ticks = [];
  for (let e = first; e <= last; e += every) ticks.push(10 ** e);
  return ticks;
}

/** Smallest and largest finite values (positive ones only when `positiveOnly`), or null. */
function finiteExtent(arrays, positiveOnly) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const values of arrays) {
    for (let i = 0; i < values.length; i++) {
      const v = values[i];
      if (v > -Infinity && v < Infinity && (!positiveOnly || v > 0)) {
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
  }
  return lo <= hi ? [lo, hi] : null;
}

// ------------------------------------------------------------------------------ module tree

/** The parent of a dotted module or parameter name, a head's module, an expert's parameter; `(root)` parents the top-level names. */
function parentName(name) {
  if (name === ROOT) return null;
  const part = PART.exec(name);
  if (part) return name.slice(0, part.index);
  const dot = name.lastIndexOf('.');
  return dot < 0 ? ROOT : name.slice(0, dot);
}

/** Nodes for the heatmap's rows and their ancestors; `row` is -1 for an ancestor with no row. */
function buildTree(rowNames) {
  const nodes = new Map();
  const nodeFor = (name) => {
    let node = nodes.get(name);
    if (!node) {
      node = {name, row: -1, depth: 0, parent: null, children: []};
      nodes.set(name, node);
      const parent = parentName(name);
      if (parent !== null) {
        node.parent = nodeFor(parent);
        node.parent.children.push(node);
        node.depth = node.parent.depth + 1;
      }
    }
    return node;
  };
  rowNames.forEach((name, row) => {
    nodeFor(name).row = row;
  });
  const root = nodeFor(ROOT);
  const countRows = (node) => {
    node.rowCount = (node.row >= 0 ? 1 : 0) + node.children.reduce((sum, child) => sum + countRows(child), 0);
    return node.rowCount;
  };
  countRows(root);
  return {root, nodes};
}

/** A collapsible block: a node other than the root whose subtree holds two rows or more. */
function isGroup(node) {
  return node.rowCount >= 2 && node.name !== ROOT;
}

/** A block of an attention module's heads, or of a fused parameter's experts (folded by default: see foldNewHeads). */
function isHeadGroup(node) {
  return isGroup(node) && node.children.some((child) => PART.test(child.name));
}

/** What a folded block of heads or experts holds: `4 heads`, `8 experts` (a fused parameter's, or a router's: statInfo's `parts`). */
function partsText(node, statInfo) {
  const experts = node.children.filter((child) => EXPERT.test(child.name)).length;
  return experts ? `${experts} experts` : `${node.rowCount} ${partsOf(statInfo)}`;
}

function headGroupNames(tree) {
  return [...tree.nodes.values()].filter(isHeadGroup).map((node) => node.name);
}

/** Indentation level: top-level names and `(root)` at 0. */
function levelOf(node) {
  return Math.max(0, node.depth - 1);
}

function groupNamesAtDepth(tree, depth) {
  return [...tree.nodes.values()].filter((node) => isGroup(node) && node.depth === depth).map((node) => node.name);
}

function deepestGroup(tree) {
  let deepest = 0;
  for (const node of tree.nodes.values()) if (isGroup(node)) deepest = Math.max(deepest, node.depth);
  return deepest;
}

/**
 * The rows to draw, in model order: each node with a row of its own, and each collapsed group
 * (whose descendants are then hidden). A row's `groups` are the groups whose triangle sits on
 * it: those whose first drawn row it is. `spans` holds the drawn rows [from, to) of each
 * expanded block that has no row of its own (they are contiguous: the order is pre-order).
 */
function layoutRows(tree, collapsed, data, collapseRule) {
  const rows = [];
  const spans = new Map();
  let groupsWaiting = [];
  const visit = (node) => {
    const group = isGroup(node);
    const folded = group && collapsed.has(node.name);
    const from = rows.length;
    if (group) groupsWaiting.push(node);
    if (node.row >= 0 || folded) {
      rows.push({
        node,
        level: levelOf(node),
        collapsed: folded,
        groups: groupsWaiting,
        values: nodeValues(node, data, collapseRule),
      });
      groupsWaiting = [];
    }
    if (folded) return;
    node.children.forEach(visit);
    if (node.row < 0 && node !== tree.root) spans.set(node.name, [from, rows.length]);
  };
  visit(tree.root);
  return {rows, spans};
}

/** A node's own row, or for a block without one its children's values combined by the stat's rule. */
function nodeValues(node, data, collapseRule) {
  const n = data.steps.length;
  if (node.row >= 0) return data.values.subarray(node.row * n, (node.row + 1) * n);
  return combineRows(node.children.map((child) => nodeValues(child, data, collapseRule)), collapseRule, n);
}

const COMBINE = {
  rss: {start: 0, add: (acc, v) => acc + v * v, finish: Math.sqrt},
  sum: {start: 0, add: (acc, v) => acc + v, finish: (acc) => acc},
  max: {start: -Infinity, add: Math.max, finish: (acc) => acc},
  min: {start: Infinity, add: Math.min, finish: (acc) => acc},
};

/** Per step: NaN when any part is non-finite, not measured when no part is measured. */
function combineRows(parts, collapseRule, n) {
  const rule = COMBINE[collapseRule] ?? COMBINE.max;
  const out = new Float32Array(n);
  for (let s = 0; s < n; s++) {
    let acc = rule.start;
    let measured = false;
    let nonFinite = false;
    for (const part of parts) {
      const v = part[s];
      if (v === -Infinity) continue;
      measured = true;
      if (Number.isNaN(v)) {
        nonFinite = true;
        break;
      }
      acc = rule.add(acc, v);
    }
    out[s] = nonFinite ? NaN : measured ? rule.finish(acc) : -Infinity;
  }
  return out;
}

// ------------------------------------------------------------------------------ colour scale

/** The colour scale shared by every heatmap drawn: the finite range of their drawn values. */
function makeScale(valueArrays, log, unit) {
  const extent = finiteExtent(valueArrays, log);
  let [lo, hi] = extent ?? (log ? [1, 10] : [0, 1]);
  if (!(hi > lo)) [lo, hi] = log ? [lo / 10, hi * 10] : lo === 0 ? [0, 1] : [lo - Math.abs(lo) / 2, hi + Math.abs(hi) / 2];
  const transform = log ? Math.log10 : (v) => v;
  const a = transform(lo);
  const span = transform(hi) - a;
  const position = (v) => (v <= lo ? 0 : v >= hi ? 1 : (transform(v) - a) / span);
  const decades = log ? decadeTicks(lo, hi, 5) : [];
  const linearTicks = unitTicks(lo, hi, 4, unit).filter((v) => v >= lo && v <= hi);
  const ticks = decades.length >= 2 ? decades : linearTicks.length >= 2 ? linearTicks : [lo, hi];
  return {lo, hi, log, position, ticks, lutIndex: (v) => (position(v) * 255) | 0};
}

/** One pixel per cell: columns are steps, rows are the drawn rows. */
/**
 * One pixel per row and column. With more steps than `columns` (the plot's device pixels), a
 * column covers several steps: it shows NaN/Inf if any of them is (a one-step incident never
 * drops out of the overview), else their largest value, else "not measured".
 */
function paintCells(rows, stepCount, scale, columns = stepCount) {
  const width = Math.max(1, Math.min(stepCount, columns));
  const canvas = document.createElement('canvas');
  canvas.width = width;
  canvas.height = Math.max(1, rows.length);
  if (!rows.length || !stepCount) return canvas;
  const image = new ImageData(width, rows.length);
  const pixels = new Uint32Array(image.data.buffer);
  const starts = Int32Array.from({length: width + 1}, (_, c) => Math.floor((c * stepCount) / width));
  rows.forEach(({values}, r) => {
    const base = r * width;
    for (let c = 0; c < width; c++) {
      let v = -Infinity;
      for (let s = starts[c]; s < starts[c + 1]; s++) {
        const x = values[s];
        if (Number.isNaN(x) || x === Infinity) {
          v = NaN;
          break;
        }
        if (x > v) v = x;
      }
      if (Number.isNaN(v)) pixels[base + c] = NAN_PIXEL;
      else if (v !== -Infinity) pixels[base + c] = CELL_LUT[scale.lutIndex(v)];
    }
  });
  canvas.getContext('2d').putImageData(image, 0, 0);
  return canvas;
}

// ------------------------------------------------------------------------------ DOM helpers

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined && child !== false));
  return node;
}

/** Sizes a canvas for CSS pixels and returns its context drawing in CSS pixels. */
function sizeCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  const [pixelWidth, pixelHeight] = [Math.max(1, Math.round(width * ratio)), Math.max(1, Math.round(height * ratio))];
  if (canvas.width !== pixelWidth || canvas.height !== pixelHeight) {
    canvas.width = pixelWidth;
    canvas.height = pixelHeight;
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext('2d');
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return ctx;
}

function nextFrame() {
  return new Promise((resolve) => requestAnimationFrame(() => resolve()));
}

let tooltipElement = null;

function showTooltip(event, lines) {
  if (!tooltipElement) {
    tooltipElement = el('div', {class: 'lw-tooltip', role: 'tooltip'});
    document.body.append(tooltipElement);
  }
  tooltipElement.replaceChildren(...lines.map((line) => el('div', {}, line)));
  tooltipElement.hidden = false;
  const {offsetWidth: w, offsetHeight: h} = tooltipElement;
  const x = event.clientX + 14 + w > window.innerWidth ? event.clientX - 14 - w : event.clientX + 14;
  const y = event.clientY + 14 + h > window.innerHeight ? event.clientY - 14 - h : event.clientY + 14;
  tooltipElement.style.left = `${Math.max(0, x)}px`;
  tooltipElement.style.top = `${Math.max(0, y)}px`;
}

function hideTooltip() {
  if (tooltipElement) tooltipElement.hidden = true;
}

const measureContext = document.createElement('canvas').getContext('2d');
const fittedNames = new Map();

/** A row label's [prefix, last] fitted into `width` pixels, cutting the prefix from its start first. */
function fittedName(name, width) {
  const key = `${width}|${name}`;
  if (!fittedNames.has(key)) fittedNames.set(key, fitName(...splitName(name), width, LABEL_FONT));
  return fittedNames.get(key);
}

function fitName(prefix, last, width, font) {
  measureContext.font = font;
  const fits = (text) => measureContext.measureText(text).width <= width;
  if (fits(prefix + last)) return [prefix, last];
  for (let cut = 1; cut < prefix.length; cut++) {
    if (fits(`…${prefix.slice(cut)}${last}`)) return [`…${prefix.slice(cut)}`, last];
  }
  for (let cut = 1; cut < last.length; cut++) {
    if (fits(`…${last.slice(cut)}`)) return ['', `…${last.slice(cut)}`];
  }
  return ['', last];
}

/** A name's [prefix, last]: `a.b.` and `c`; a head's module and `#h`; an expert's parameter and `[e]`. */
function splitName(name) {
  const part = PART.exec(name);
  const cut = part ? part.index : name.lastIndexOf('.') + 1;
  return [name.slice(0, cut), name.slice(cut)];
}

// ------------------------------------------------------------------------------ heatmap view

/** Where the run's events land on a heatmap: layers resolved to ranges of drawn rows by `rangeOf`. */
function placeMarks(events, steps, rangeOf) {
  const alertsByRow = new Map();
  for (const alert of events.alerts ?? []) {
    const range = rangeOf(alert.layer);
    if (!range || !steps.length) continue;
    const col = Math.min(lowerBound(steps, alert.step), steps.length - 1);
    for (let row = range[0]; row < range[1]; row++) {
      if (!alertsByRow.has(row)) alertsByRow.set(row, []);
      alertsByRow.get(row).push({col, alert});
    }
  }
  return {
    alertsByRow,
    offender: events.first_offender ? rangeOf(events.first_offender.layer) : null,
    nonfiniteStep: events.first_nonfinite_step ?? null,
    spikeSteps: [...new Set((events.spikes ?? []).map((spike) => spike.step))].sort((a, b) => a - b),
  };
}

function inRange(range, index) {
  return range !== null && index >= range[0] && index < range[1];
}

/** The x of a step's position on an axis of `steps.length` columns `cellWidth` wide (column centres). */
function stepToX(steps, step, cellWidth) {
  const col = lowerBound(steps, step);
  if (col >= steps.length) return steps.length * cellWidth;
  if (col === 0 || steps[col] === step) return (col + 0.5) * cellWidth;
  const previous = steps[col - 1];
  return (col - 0.5 + (step - previous) / (steps[col] - previous)) * cellWidth;
}

/** White lines between rows `first`..`last` (scrolled by `top`) and between steps, where the cells have room. */
function drawCellGrid(ctx, {rowHeight, stepCount, first, last, top, width, height, minRowHeight = 18}) {
  const cellWidth = width / Math.max(1, stepCount);
  ctx.strokeStyle = 'rgba(255,255,255,0.55)';
  ctx.lineWidth = 1;
  ctx.beginPath();
  if (rowHeight >= minRowHeight) {
    for (let r = first + 1; r < last; r++) {
      const y = Math.round(r * rowHeight - top) + 0.5;
      ctx.moveTo(0, y);
      ctx.lineTo(width, y);
    }
  }
  if (cellWidth >= 8) {
    for (let c = 1; c < stepCount; c++) {
      const x = Math.round(c * cellWidth) + 0.5;
      ctx.moveTo(x, 0);
      ctx.lineTo(x, height);
    }
  }
  ctx.stroke();
}

class HeatmapView {
  constructor({canvasId, onSelect, onToggleGroup, onScroll}) {
    this.callbacks = {onSelect, onToggleGroup, onScroll};
    this.canvas = el('canvas', {id: canvasId, class: 'lw-hm-canvas'});
    this.labels = el('div', {class: 'lw-hm-labels'});
    this.cells = el('div', {class: 'lw-hm-cells'}, this.canvas);
    this.body = el('div', {class: 'lw-hm-body'}, this.labels, this.cells);
    this.scroller = el('div', {class: 'lw-hm-scroll'}, this.body);
    this.markStrip = el('div', {class: 'lw-hm-marks'});
    this.axis = el('div', {class: 'lw-hm-axis'});
    this.title = el('div', {class: 'lw-hm-title'});
    this.legendSlot = el('div', {class: 'lw-hm-legend'});
    this.note = el('div', {class: 'lw-hm-note', hidden: true});
    this.element = el('section', {class: 'lw-card lw-hm-card'},
      el('div', {class: 'lw-hm-head'}, this.title, this.legendSlot), this.note, this.markStrip, this.scroller, this.axis);
    this.model = null;
    this.drawQueued = false;
    this.scroller.addEventListener('scroll', () => {
      this.requestDraw();
      this.callbacks.onScroll?.(this.scroller.scrollTop);
    });
    this.canvas.addEventListener('mousemove', (event) => this.hover(event));
    this.canvas.addEventListener('mouseleave', hideTooltip);
    this.canvas.addEventListener('click', (event) => {
      const cell = this.cellAt(event);
      if (cell) this.callbacks.onSelect(cell.row.node.name, cell.col);
    });
    this.labels.addEventListener('click', (event) => this.clickLabel(event));
  }

  /**
   * model: {title, stat, statInfo, steps, rows and spans (from layoutRows), scale, events, selected, maxHeight};
   * optional, for columns other than steps (the experts view): axisTitle, columnText(row, col) and
   * cellLines(row, col) for the tooltip.
   */
  show(model) {
    this.model = model;
    this.note.hidden = true;
    this.scroller.hidden = false;
    this.axis.hidden = false;
    this.rowHeight = clamp(Math.floor(model.maxHeight / Math.max(1, model.rows.length)), ROW_HEIGHT.min, ROW_HEIGHT.max);
    this.image = null; // painted at the next draw, for the plot's width
    this.indexByName = new Map(model.rows.map((row, index) => [row.node.name, index]));
    this.marks = placeMarks(model.events, model.steps, (name) => this.rangeOf(name));
    this.title.replaceChildren(...model.title);
    this.body.style.height = `${model.rows.length * this.rowHeight}px`;
    this.scroller.style.maxHeight = `${model.maxHeight}px`;
    this.describeOnCanvas();
    this.invalidate();
    this.draw();
  }

  /** Labels, axis and marks are rebuilt on the next draw (they depend on the model, not the scroll). */
  invalidate() {
    this.labelsKey = null;
    this.decorWidth = null;
  }

  showMessage(title, text, isError) {
    this.model = null;
    this.title.replaceChildren(...title);
    this.note.replaceChildren(text);
    this.note.className = isError ? 'lw-hm-note lw-error-text' : 'lw-hm-note';
    this.note.hidden = false;
    this.scroller.hidden = true;
    this.axis.hidden = true;
    this.markStrip.hidden = true;
    for (const key of ['rows', 'steps', 'stat', 'firstNonfiniteStep']) delete this.canvas.dataset[key];
  }

  setSelected(name) {
    if (!this.model) return;
    this.model.selected = name;
    this.invalidate();
    this.draw();
  }

  /** Scrolls the first drawn row of `name` into the middle of the view. */
  reveal(name) {
    const range = this.model ? this.rangeOf(name) : null;
    if (!range) return;
    const top = range[0] * this.rowHeight;
    const view = this.scroller.clientHeight;
    if (top < this.scroller.scrollTop || top + this.rowHeight > this.scroller.scrollTop + view) {
      this.scroller.scrollTop = top - (view - this.rowHeight) / 2;
    }
  }

  /**
   * The drawn rows [from, to) that stand for `name`: its own row, the rows of its block when it
   * is an expanded block without a row, else the row of its nearest drawn ancestor (a collapsed
   * block, or the module of a parameter); null when none.
   */
  rangeOf(name) {
    const span = this.model.spans.get(name);
    if (span) return span;
    for (let candidate = name; candidate != null; candidate = parentName(candidate)) {
      const index = this.indexByName.get(candidate);
      if (index !== undefined) return [index, index + 1];
    }
    return null;
  }

  describeOnCanvas() {
    const {dataset} = this.canvas;
    dataset.rows = String(this.model.rows.length);
    dataset.steps = String(this.model.steps.length);
    dataset.stat = this.model.stat;
    if (this.marks.nonfiniteStep === null) delete dataset.firstNonfiniteStep;
    else dataset.firstNonfiniteStep = String(this.marks.nonfiniteStep);
    if (!this.marks.spikeSteps.length) delete dataset.spikeSteps;
    else dataset.spikeSteps = this.marks.spikeSteps.join(',');
  }

  requestDraw() {
    if (this.drawQueued) return;
    this.drawQueued = true;
    requestAnimationFrame(() => {
      this.drawQueued = false;
      this.draw();
    });
  }

  draw() {
    if (!this.model) return;
    const width = Math.max(1, this.cells.clientWidth);
    const height = Math.min(this.scroller.clientHeight, this.model.rows.length * this.rowHeight);
    this.drawCells(width, height);
    this.renderLabels();
    if (this.decorWidth !== width) {
      this.decorWidth = width;
      this.renderAxis(width);
      this.renderMarkStrip(width);
    }
  }

  drawCells(width, height) {
    const {rows, steps} = this.model;
    const ctx = sizeCanvas(this.canvas, width, height);
    const h = this.rowHeight;
    const top = this.scroller.scrollTop;
    const first = Math.floor(top / h);
    const last = Math.min(rows.length, Math.ceil((top + height) / h));
    ctx.fillStyle = NOT_MEASURED_CSS;
    ctx.fillRect(0, 0, width, height);
    const columns = Math.round(width * (window.devicePixelRatio || 1));
    if (!this.image || this.imageColumns !== columns) {
      this.image = paintCells(rows, steps.length, this.model.scale, columns);
      this.imageColumns = columns;
    }
    if (last > first && steps.length) {
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(this.image, 0, first, this.image.width, last - first, 0, first * h - top, width, (last - first) * h);
    }
    this.drawGrid(ctx, {first, last, top, width, height});
    this.drawMarks(ctx, {first, last, top, width, height});
  }

  drawGrid(ctx, {first, last, top, width, height}) {
    drawCellGrid(ctx, {rowHeight: this.rowHeight, stepCount: this.model.steps.length, first, last, top, width, height});
  }

  drawMarks(ctx, {first, last, top, width, height}) {
    const {steps, selected} = this.model;
    const h = this.rowHeight;
    const cellWidth = width / Math.max(1, steps.length);
    const rangeBox = ([from, to], inset) => [inset, from * h - top + inset, width - 2 * inset, (to - from) * h - 2 * inset];
    const visible = (range) => range !== null && range[1] > first && range[0] < last;
    const {alertsByRow, offender, nonfiniteStep, spikeSteps} = this.marks;
    for (const step of steps.length ? spikeSteps : []) {
      const x = clamp(stepToX(steps, step, cellWidth), 1, width - 1);
      ctx.save();
      ctx.strokeStyle = SPIKE_CSS;
      ctx.lineWidth = 2;
      ctx.beginPath();
      ctx.moveTo(x, 0);
      ctx.lineTo(x, height);
      ctx.stroke();
      ctx.restore();
    }
    if (nonfiniteStep !== null && steps.length) {
      const x = clamp(stepToX(steps, nonfiniteStep, cellWidth) - cellWidth / 2, 1, width - 1);
      ctx.save();
      ctx.strokeStyle = '#111';
      ctx.lineWidth = 2;
      ctx.setLineDash([5, 3]);
      ctx.beginPath();
      ctx.moveTo(x, 0);
      ctx.lineTo(x, height);
      ctx.stroke();
      ctx.restore();
    }
    for (const [r, marks] of alertsByRow) {
      if (r < first || r >= last) continue;
      for (const {col} of marks) drawAlertMarker(ctx, (col + 0.5) * cellWidth, r * h - top + h / 2, Math.min(h - 2, 10));
    }
    if (visible(offender)) {
      ctx.strokeStyle = ACCENT;
      ctx.lineWidth = 2;
      ctx.strokeRect(...rangeBox(offender, 1));
    }
    const selectedRange = selected ? this.rangeOf(selected) : null;
    if (visible(selectedRange)) {
      ctx.strokeStyle = '#111';
      ctx.lineWidth = 2;
      ctx.strokeRect(...rangeBox(selectedRange, offender && selectedRange[0] === offender[0] ? 3 : 1));
    }
  }

  renderLabels() {
    const {rows, selected} = this.model;
    let from = 0;
    let to = rows.length;
    if (rows.length > ALL_LABELS_UP_TO) {
      const top = this.scroller.scrollTop;
      from = Math.max(0, Math.floor(top / this.rowHeight) - LABEL_OVERSCAN);
      to = Math.min(rows.length, Math.ceil((top + this.scroller.clientHeight) / this.rowHeight) + LABEL_OVERSCAN);
    }
    if (this.labelsKey === `${from}:${to}`) return;
    this.labelsKey = `${from}:${to}`;
    const selectedRange = selected ? this.rangeOf(selected) : null;
    const labels = [];
    for (let i = from; i < to; i++) labels.push(this.rowLabel(rows[i], i, inRange(selectedRange, i)));
    this.labels.replaceChildren(...labels);
  }

  rowLabel(row, index, isSelected) {
    const {node, level} = row;
    const h = this.rowHeight;
    const isOffender = inRange(this.marks.offender, index);
    const hasOffenderBadge = isOffender && index === this.marks.offender[0];
    const alertCount = this.marks.alertsByRow.get(index)?.length ?? 0;
    const badges = [
      hasOffenderBadge && el('span', {class: 'lw-badge lw-badge-offender', title: 'first offender'}, 'offender'),
      alertCount > 0 && el('span', {class: 'lw-badge lw-badge-alert', title: `${alertCount} alert(s)`}, `▼${alertCount}`),
    ];
    const block = !row.collapsed ? '' : isHeadGroup(node) ? `${partsText(node, this.model.statInfo)} folded`
      : `block of ${node.rowCount} rows`;
    const badgeWidth = (hasOffenderBadge ? 58 : 0) + (alertCount > 0 ? 30 : 0) + (row.collapsed ? 30 : 0);
    const [prefix, last] = fittedName(node.name, LABEL_WIDTH - (level + 1) * INDENT - badgeWidth - 8);
    const twisties = row.groups.map((group) => {
      const folded = group === node && row.collapsed;
      return el('span', {
        class: 'lw-twisty',
        'data-group': group.name,
        title: `${folded ? 'expand' : 'collapse'} ${group.name}`,
        style: `left:${levelOf(group) * INDENT}px`,
      }, folded ? '▸' : '▾');
    });
    const classes = ['lw-row-label', isSelected && 'lw-selected', isOffender && 'lw-offender', row.collapsed && 'lw-block'];
    return el('div', {
      class: classes.filter(Boolean).join(' '),
      'data-name': node.name,
      'data-row': String(index),
      title: [node.name, block].filter(Boolean).join(' · '),
      style: `top:${index * h}px;height:${h}px;line-height:${h}px;padding-left:${(level + 1) * INDENT}px`,
    },
    el('span', {class: 'lw-guides', style: `width:${level * INDENT}px`}),
    ...twisties,
    el('span', {class: 'lw-name'}, el('span', {class: 'lw-name-prefix'}, prefix), last),
    row.collapsed && el('span', {class: 'lw-block-size'}, `×${node.rowCount}`),
    ...badges);
  }

  renderAxis(width) {
    const {steps} = this.model;
    if (!steps.length) return this.axis.replaceChildren();
    const cellWidth = width / steps.length;
    const ticks = niceTicks(steps[0], steps[steps.length - 1], Math.max(2, Math.floor(width / 110)))
      .filter((step) => step >= steps[0] && step <= steps[steps.length - 1]);
    this.axis.replaceChildren(
      ...ticks.map((step) => el('span', {
        class: 'lw-tick',
        style: `left:${LABEL_WIDTH + stepToX(steps, step, cellWidth)}px`,
      }, String(step))),
      el('span', {class: 'lw-axis-title'}, this.model.axisTitle ?? 'step'));
  }

  renderMarkStrip(width) {
    const {steps} = this.model;
    const {nonfiniteStep, spikeSteps} = this.marks;
    this.markStrip.hidden = (nonfiniteStep === null && !spikeSteps.length) || !steps.length;
    if (this.markStrip.hidden) return;
    const cellWidth = width / steps.length;
    const leftward = (x) => x > width - 170;
    const extent = (x, textWidth) => (leftward(x) ? [x - textWidth, x] : [x, x + textWidth]);
    const tiers = [[], []];  // each tier's label extents: a label goes to the first tier it overlaps nothing in
    const labels = [];
    const place = (className, x, textWidth, text) => {
      const [from, to] = extent(x, textWidth);
      const tier = tiers.findIndex((taken) => taken.every(([a, b]) => to <= a || from >= b));
      if (tier < 0) return;  // no room: its line stands alone
      tiers[tier].push([from, to]);
      labels.push(el('span', {
        class: `${className}${leftward(x) ? ' lw-left' : ''}`,
        style: `left:${LABEL_WIDTH + x}px;bottom:${2 + 16 * tier}px`}, text));
    };
    if (nonfiniteStep !== null) {  // first: it outranks the spikes
      const x = clamp(stepToX(steps, nonfiniteStep, cellWidth) - cellWidth / 2, 1, width - 1);
      place('lw-nonfinite-label', x, 160, `first NaN/Inf @ step ${nonfiniteStep}`);
    }
    for (const step of spikeSteps) {
      place('lw-spike-label', clamp(stepToX(steps, step, cellWidth), 1, width - 1), 80, `spike @ ${step}`);
    }
    this.markStrip.style.height = `${tiers[1].length ? 34 : 18}px`;
    this.markStrip.replaceChildren(...labels);
  }

  cellAt(event) {
    if (!this.model || !this.model.steps.length) return null;
    const rect = this.canvas.getBoundingClientRect();
    const index = Math.floor((event.clientY - rect.top + this.scroller.scrollTop) / this.rowHeight);
    const col = Math.floor(((event.clientX - rect.left) / rect.width) * this.model.steps.length);
    if (index < 0 || index >= this.model.rows.length || col < 0 || col >= this.model.steps.length) return null;
    return {index, col, row: this.model.rows[index]};
  }

  hover(event) {
    const cell = this.cellAt(event);
    if (!cell) return hideTooltip();
    const {statInfo, steps} = this.model;
    const {row, col, index} = cell;
    const value = row.values[col];
    const alerts = (this.marks.alertsByRow.get(index) ?? []).filter((mark) => mark.col === col);
    showTooltip(event, [
      el('b', {}, row.node.name),
      this.model.columnText?.(row, col) ?? `step ${steps[col]}`,
      `${statInfo.label}: ${formatValue(value, statInfo.unit)}${Number.isNaN(value) ? ' (non-finite)' : ''}`,
      ...(this.model.cellLines?.(row, col) ?? []),
      row.collapsed && blockDescription(row.node, statInfo),
      ...alerts.map(({alert}) => `▼ ${alert.kind} @ ${alert.step}: ${alert.message ?? alert.layer}`),
    ].filter(Boolean));
  }

  clickLabel(event) {
    const twisty = event.target.closest('.lw-twisty');
    if (twisty) return this.callbacks.onToggleGroup(twisty.dataset.group);
    const label = event.target.closest('.lw-row-label');
    if (label) this.callbacks.onSelect(label.dataset.name);
  }
}

/** What the `#<n>` rows of a statistic are: an attention module's heads, or a router's experts (stats' `parts`). */
function partsOf(statInfo) {
  return statInfo?.parts ?? 'heads';
}

function blockDescription(node, statInfo) {
  if (isHeadGroup(node)) {
    const shown = node.row >= 0 ? 'the whole tensor\'s row' : `the ${statInfo.collapse ?? 'max'} of them`;
    return `${partsText(node, statInfo)} folded, ${shown}`;
  }
  const how = node.row < 0 ? `${statInfo.collapse ?? 'max'} of its children` : 'its own row';
  return `block of ${node.rowCount} rows, ${how}`;
}

function drawAlertMarker(ctx, x, y, size) {
  const half = Math.max(3, size / 2);
  ctx.beginPath();
  ctx.moveTo(x - half, y - half * 0.8);
  ctx.lineTo(x + half, y - half * 0.8);
  ctx.lineTo(x, y + half * 0.9);
  ctx.closePath();
  ctx.fillStyle = '#fff';
  ctx.fill();
  ctx.strokeStyle = '#111';
  ctx.lineWidth = 1.25;
  ctx.stroke();
}

// ------------------------------------------------------------------------------ legend

/** The legend's tick labels, left to right, leaving out any that would overlap the one before. */
function legendTicks(scale, unit) {
  measureContext.font = LEGEND_FONT;
  const labels = [];
  let freeFrom = -Infinity;
  for (const value of scale.ticks) {
    const at = scale.position(value);
    const text = formatValue(value, unit);
    const width = measureContext.measureText(text).width;
    const shift = at < 0.1 ? 0 : at > 0.9 ? -1 : -0.5; // labels at the ends stay inside the bar
    const left = at * LEGEND_WIDTH + shift * width;
    if (left < freeFrom) continue;
    freeFrom = left + width + 6;
    labels.push(el('span', {style: `left:${at * 100}%;transform:translateX(${shift * 100}%)`}, text));
  }
  return labels;
}

/**
 * The colour bar of `scale`, and the swatches of the colours not on it (with the heatmap's marks
 * unless `marks` is false, and any `extra` swatch elements).
 */
function legendElement(scale, statInfo, marks = true, extra = []) {
  const bar = el('canvas', {class: 'lw-legend-bar'});
  const ctx = sizeCanvas(bar, LEGEND_WIDTH, 10);
  for (let x = 0; x < LEGEND_WIDTH; x++) {
    ctx.fillStyle = pixelCss(CELL_LUT[Math.round((x / (LEGEND_WIDTH - 1)) * 255)]);
    ctx.fillRect(x, 0, 1, 10);
  }
  const ticks = legendTicks(scale, statInfo.unit);
  const swatch = (className, text) => el('span', {class: 'lw-swatch'}, el('i', {class: className}), text);
  return el('div', {class: 'lw-legend'},
    el('div', {class: 'lw-legend-scale'},
      el('div', {class: 'lw-legend-caption'}, `${statInfo.unit || statInfo.label}${scale.log ? ' · log scale' : ''}`),
      bar,
      el('div', {class: 'lw-legend-ticks'}, ...ticks)),
    el('div', {class: 'lw-swatches'},
      swatch('lw-sw-nan', 'NaN/Inf'),
      swatch('lw-sw-none', 'not measured'),
      marks && swatch('lw-sw-alert', 'alert'),
      marks && swatch('lw-sw-offender', 'first offender'),
      marks && swatch('lw-sw-nonfinite', 'first NaN/Inf'),
      marks && swatch('lw-sw-spike', 'loss spike'),
      ...extra));
}

// ------------------------------------------------------------------------------ events and rankings

/** A link that selects `layer`. */
function layerLink(layer, onSelect) {
  return el('a', {class: 'lw-layer-link', href: '#', 'data-layer': layer, onclick: (event) => {
    event.preventDefault();
    onSelect(layer);
  }}, layer);
}

function renderEvents(container, events, onSelect) {
  const alerts = [...(events.alerts ?? [])].sort((a, b) => a.step - b.step);
  const offender = events.first_offender;
  const link = (layer) => layerLink(layer, onSelect);
  container.replaceChildren(
    el('h3', {}, 'Events'),
    events.first_nonfinite_step == null
      ? el('div', {class: 'lw-event lw-muted'}, 'No NaN/Inf gradients seen.')
      : el('div', {class: 'lw-event lw-event-nonfinite'}, el('i', {class: 'lw-sw-nan'}),
        `First NaN/Inf gradients at step ${events.first_nonfinite_step}`),
    ...(offender ? [el('div', {class: 'lw-event lw-event-offender'},
      el('div', {}, 'First offender: ', link(offender.layer), ` @ step ${offender.step}`,
        offender.phase ? ` (${offender.phase})` : '',
        offender.replayed_from != null ? el('span', {class: 'lw-badge lw-badge-replayed',
          title: 'found by running this step\'s batch again with every probe armed, before the optimizer step'},
        `replayed from step ${offender.replayed_from}`) : ''),
      offender.text && el('div', {class: 'lw-muted lw-small'}, offender.text))] : []),
    ...spikeEvents(events.spikes ?? [], link),
    el('div', {class: 'lw-subhead'}, `Alerts (${alerts.length})`),
    el('ul', {id: 'lw-alerts', class: 'lw-alerts'},
      ...(alerts.length ? alerts.map((alert) => alertItem(alert, onSelect)) : [el('li', {class: 'lw-muted'}, 'No alerts.')])));
}

/** Each spike of the loss or the gradient norm: its step, how far it stood out, and the layers that grew most by the sample that explains it. */
function spikeEvents(spikes, layerLink) {
  if (!spikes.length) return [el('div', {class: 'lw-event lw-muted'}, 'No loss or gradient norm spikes seen.')];
  const what = (spike) => (spike.what === 'grad_norm' ? 'gradient norm' : spike.what);
  return [el('div', {class: 'lw-subhead'}, `Spikes (${spikes.length})`),
    el('ul', {id: 'lw-spikes', class: 'lw-alerts'}, ...spikes.map((spike) => el('li', {
      class: 'lw-spike', 'data-step': String(spike.step), title: spike.message ?? ''},
    el('div', {class: 'lw-alert-head'},
      el('span', {class: 'lw-kind lw-kind-spike'}, 'spike'),
      el('span', {class: 'lw-alert-layer', title: spike.text ?? ''}, spike.scale === 'log'
        ? `${what(spike)} ${formatNumber(spike.value)}, ×${formatNumber(spike.value / spike.mean)} (z ${formatNumber(spike.z)})`
        : `${what(spike)} ${formatNumber(spike.value)}, z ${formatNumber(spike.z)}`),
      el('span', {class: 'lw-alert-step'}, `@ ${spike.step}`)),
    (spike.origin ?? []).length ? el('div', {class: 'lw-alert-message'}, 'began at ', layerLink(spike.origin[0].layer),
      ` (output ×${formatNumber(spike.origin[0].factor)} its input's)`,
      spike.replayed ? el('span', {class: 'lw-badge lw-badge-replayed',
        title: 'its batch run again with every probe armed, before its optimizer step'}, 'replayed') : '') : '',
    spike.layers.length ? el('div', {class: 'lw-alert-message'}, 'grew most: ',
      ...spike.layers.slice(0, 3).flatMap((grew, i) => [i ? ', ' : '', layerLink(grew.layer),
        ` (${grew.what} ×${formatNumber(grew.factor)})`]),
      spike.sampled_at !== spike.step ? ` (measured at step ${spike.sampled_at})` : '')
      : el('div', {class: 'lw-alert-message lw-muted'}, 'no sample before it to compare the layers with'))))];
}

function alertItem(alert, onSelect) {
  return el('li', {
    class: 'lw-alert',
    'data-layer': alert.layer,
    'data-step': String(alert.step),
    title: alert.message ?? '',
    onclick: () => onSelect(alert.layer),
  },
  el('div', {class: 'lw-alert-head'},
    el('span', {class: `lw-kind${alert.kind === 'nonfinite' || alert.kind === 'spike' ? ` lw-kind-${alert.kind}` : ''}`}, alert.kind),
    el('span', {class: 'lw-alert-layer', title: alert.layer}, alert.layer),
    el('span', {class: 'lw-alert-step'}, `@ ${alert.step}`)),
  alert.message && el('div', {class: 'lw-alert-message'}, alert.message));
}

function renderRankings(container, rankings, onSelect) {
  container.replaceChildren(el('h3', {}, 'Rankings'),
    ...(rankings.length
      ? rankings.map((ranking) => rankingTable(ranking, onSelect))
      : [el('div', {class: 'lw-muted'}, 'No rankings.')]));
}

function rankingTable(ranking, onSelect) {
  const rows = (ranking.rows ?? []).map((row) => ({layer: row.layer, value: jsonValue(row.value)}));
  // a factor ("x") ranks growth either way: its bar is the size of the change, |log(factor)|
  const size = (value) => (ranking.unit === 'x' ? Math.abs(Math.log(value)) : Math.abs(value));
  const top = Math.max(0, ...rows.map((row) => size(row.value)).filter(Number.isFinite));
  const barWidth = (value) => (top > 0 && Number.isFinite(size(value)) ? (size(value) / top) * 100 : 0);
  const body = rows.length
    ? el('table', {class: 'lw-ranking-table'}, ...rows.map((row, i) => el('tr', {
      class: 'lw-rank-row', 'data-layer': row.layer, onclick: () => onSelect(row.layer),
    },
    el('td', {class: 'lw-rank'}, String(i + 1)),
    el('td', {class: 'lw-rank-layer', title: row.layer}, row.layer),
    el('td', {class: 'lw-rank-value'},
      el('span', {class: 'lw-rank-bar', style: `width:${barWidth(row.value)}%`}),
      el('span', {}, formatValue(row.value, ranking.unit))))))
    : el('div', {class: 'lw-missing'}, ranking.missing ?? 'No data.');
  return el('div', {class: 'lw-ranking', 'data-key': ranking.key},
    el('div', {class: 'lw-ranking-title'}, ranking.title ?? ranking.key),
    ranking.note && el('div', {class: 'lw-muted lw-small'}, ranking.note),
    body);
}

// ------------------------------------------------------------------------------ layer detail

const PLOT_MARGIN = {left: 52, right: 8, top: 10, bottom: 18};

function plotBox(width) {
  return {
    left: PLOT_MARGIN.left,
    right: width - PLOT_MARGIN.right,
    top: PLOT_MARGIN.top,
    bottom: SERIES_HEIGHT - PLOT_MARGIN.bottom,
  };
}

/** A series gets a log y axis when its values are positive and span more than two decades. */
function wantsLogAxis(values) {
  const extent = finiteExtent([values], false);
  return extent !== null && extent[0] > 0 && extent[1] / extent[0] > 100;
}

function valueAxis(values, log, unit, pixelLo, pixelHi) {
  const extent = finiteExtent([values], false);
  if (!extent) return {ticks: [], map: () => (pixelLo + pixelHi) / 2};
  let [lo, hi] = extent;
  let ticks;
  if (log) {
    lo = 10 ** Math.floor(Math.log10(lo));
    hi = 10 ** Math.ceil(Math.log10(hi));
    ticks = decadeTicks(lo, hi, 4);
  } else {
    if (lo === hi) [lo, hi] = [lo - (Math.abs(lo) || 1) / 2, hi + (Math.abs(hi) || 1) / 2];
    ticks = unitTicks(lo, hi, 3, unit);
    [lo, hi] = [ticks[0], ticks[ticks.length - 1]];
  }
  const transform = log ? Math.log10 : (v) => v;
  const a = transform(lo);
  const span = transform(hi) - a || 1;
  return {ticks, map: (v) => pixelLo + ((transform(v) - a) / span) * (pixelHi - pixelLo)};
}

/** The first and last step over sorted step lists (the empty ones ignored). */
function stepSpan(...lists) {
  const filled = lists.filter((list) => list.length);
  if (!filled.length) return [0, 0];
  return [Math.min(...filled.map((list) => list[0])), Math.max(...filled.map((list) => list[list.length - 1]))];
}

function stepAxis([first, last], pixelLo, pixelHi) {
  const span = last - first || 1;
  return (step) => pixelLo + ((step - first) / span) * (pixelHi - pixelLo);
}

function drawAxes(ctx, plot, yTicks, yMap, span, xMap, unit) {
  ctx.font = '10px Roboto, system-ui, sans-serif';
  ctx.fillStyle = '#616161';
  ctx.strokeStyle = '#eeeeee';
  ctx.lineWidth = 1;
  ctx.textAlign = 'right';
  ctx.textBaseline = 'middle';
  for (const tick of yTicks) {
    const y = Math.round(yMap(tick)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(plot.left, y);
    ctx.lineTo(plot.right, y);
    ctx.stroke();
    ctx.fillText(formatValue(tick, unit), plot.left - 4, y, plot.left - 6);  // a wider label is narrowed to fit
  }
  ctx.textAlign = 'center';
  ctx.textBaseline = 'top';
  for (const step of niceTicks(span[0], span[1], 3).filter((s) => s >= span[0] && s <= span[1])) {
    ctx.fillText(String(step), xMap(step), plot.bottom + 4);
  }
  ctx.strokeStyle = '#bdbdbd';
  ctx.beginPath();
  ctx.moveTo(plot.left, plot.bottom + 0.5);
  ctx.lineTo(plot.right, plot.bottom + 0.5);
  ctx.stroke();
}

function drawNonfiniteLine(ctx, plot, x) {
  ctx.save();
  ctx.strokeStyle = '#111';
  ctx.setLineDash([4, 3]);
  ctx.beginPath();
  ctx.moveTo(x, plot.top);
  ctx.lineTo(x, plot.bottom);
  ctx.stroke();
  ctx.restore();
}

/** A line chart of one series; NaN points are magenta triangles on the top edge, gaps are not measured. */
function drawSeriesChart(canvas, width, {steps, values, log, unit, nonfiniteStep, spikeSteps = []}) {
  const ctx = sizeCanvas(canvas, width, SERIES_HEIGHT);
  const plot = plotBox(width);
  const span = stepSpan(steps);
  const y = valueAxis(values, log, unit, plot.bottom, plot.top);
  const x = stepAxis(span, plot.left, plot.right);
  drawAxes(ctx, plot, y.ticks, y.map, span, x, unit);
  if (nonfiniteStep != null && nonfiniteStep >= span[0] && nonfiniteStep <= span[1]) {
    drawNonfiniteLine(ctx, plot, x(nonfiniteStep));
  }
  ctx.save();
  ctx.strokeStyle = SPIKE_CSS;
  for (const step of spikeSteps.filter((step) => step >= span[0] && step <= span[1])) {
    ctx.beginPath();
    ctx.moveTo(x(step), plot.top);
    ctx.lineTo(x(step), plot.bottom);
    ctx.stroke();
  }
  ctx.restore();
  ctx.strokeStyle = ACCENT;
  ctx.fillStyle = ACCENT;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  let penDown = false;
  values.forEach((v, i) => {
    if (!Number.isFinite(v)) {
      penDown = false;
      return;
    }
    const [px, py] = [x(steps[i]), y.map(v)];
    if (penDown) ctx.lineTo(px, py);
    else ctx.moveTo(px, py);
    const isolated = !Number.isFinite(values[i - 1]) && !Number.isFinite(values[i + 1]);
    if (isolated) ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
    penDown = true;
  });
  ctx.stroke();
  ctx.fillStyle = NAN_CSS;
  values.forEach((v, i) => {
    if (!Number.isNaN(v) && v !== Infinity) return;
    const px = x(steps[i]);
    ctx.beginPath();
    ctx.moveTo(px - 3.5, plot.top - 6);
    ctx.lineTo(px + 3.5, plot.top - 6);
    ctx.lineTo(px, plot.top);
    ctx.closePath();
    ctx.fill();
  });
}

/**
 * Every histogram's buckets spread onto one value grid (a bucket's count spread evenly over its
 * width), one column per step over `span` at the histograms' own step spacing.
 */
function densityGrid(entries, span) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const entry of entries) {
    for (const [left, right] of entry.buckets) {
      lo = Math.min(lo, left);
      hi = Math.max(hi, right);
    }
  }
  if (!(hi > lo)) [lo, hi] = [lo - 0.5, lo + 0.5];
  const [first, last] = span;
  let spacing = Infinity;
  for (let i = 1; i < entries.length; i++) {
    const gap = entries[i].step - entries[i - 1].step;
    if (gap > 0) spacing = Math.min(spacing, gap);
  }
  if (!Number.isFinite(spacing) || (last - first) / spacing >= MAX_HISTOGRAM_COLUMNS) {
    spacing = Math.max(1, (last - first) / (MAX_HISTOGRAM_COLUMNS - 1));
  }
  const columns = Math.round((last - first) / spacing) + 1;
  const counts = new Float32Array(columns * HISTOGRAM_BINS);
  const present = new Uint8Array(columns);
  const binWidth = (hi - lo) / HISTOGRAM_BINS;
  const binOf = (v) => clamp(Math.floor((v - lo) / binWidth), 0, HISTOGRAM_BINS - 1);
  for (const {step, buckets} of entries) {
    const col = Math.round((step - first) / spacing);
    present[col] = 1;
    for (const [left, right, count] of buckets) {
      if (!(right > left)) {
        counts[col * HISTOGRAM_BINS + binOf(left)] += count;
        continue;
      }
      for (let b = binOf(left); b <= binOf(right); b++) {
        const overlap = Math.min(right, lo + (b + 1) * binWidth) - Math.max(left, lo + b * binWidth);
        if (overlap > 0) counts[col * HISTOGRAM_BINS + b] += (count * overlap) / (right - left);
      }
    }
  }
  return {counts, present, columns, lo, hi};
}

/** A histogram over time: x = step, y = value, colour = count (square-root scale; grey = no histogram). */
function drawHistogramChart(canvas, width, entries, span) {
  const ctx = sizeCanvas(canvas, width, SERIES_HEIGHT);
  const plot = plotBox(width);
  const grid = densityGrid(entries, span);
  let max = 0;
  for (const count of grid.counts) max = Math.max(max, count);
  const image = new ImageData(grid.columns, HISTOGRAM_BINS);
  const pixels = new Uint32Array(image.data.buffer);
  for (let col = 0; col < grid.columns; col++) {
    if (!grid.present[col]) continue;
    for (let b = 0; b < HISTOGRAM_BINS; b++) {
      const level = max > 0 ? Math.sqrt(grid.counts[col * HISTOGRAM_BINS + b] / max) : 0;
      pixels[(HISTOGRAM_BINS - 1 - b) * grid.columns + col] = COUNT_LUT[Math.round(level * 255)];
    }
  }
  const source = document.createElement('canvas');
  source.width = grid.columns;
  source.height = HISTOGRAM_BINS;
  source.getContext('2d').putImageData(image, 0, 0);
  ctx.fillStyle = NOT_MEASURED_CSS;
  ctx.fillRect(plot.left, plot.top, plot.right - plot.left, plot.bottom - plot.top);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(source, plot.left, plot.top, plot.right - plot.left, plot.bottom - plot.top);
  const yMap = (v) => plot.bottom - ((v - grid.lo) / (grid.hi - grid.lo)) * (plot.bottom - plot.top);
  const yTicks = niceTicks(grid.lo, grid.hi, 3).filter((v) => v >= grid.lo && v <= grid.hi);
  drawAxes(ctx, plot, yTicks, yMap, span, stepAxis(span, plot.left, plot.right), '');
}

/** Shows "step s: value" for the point of `pointSteps` nearest the pointer (x axis over `span`). */
function attachReadout(canvas, readout, span, pointSteps, valueText) {
  canvas.addEventListener('mousemove', (event) => {
    if (!pointSteps.length) return;
    const x = event.clientX - canvas.getBoundingClientRect().left;
    const plotWidth = canvas.clientWidth - PLOT_MARGIN.left - PLOT_MARGIN.right;
    const step = span[0] + ((x - PLOT_MARGIN.left) / plotWidth) * (span[1] - span[0]);
    let i = clamp(lowerBound(pointSteps, step), 0, pointSteps.length - 1);
    if (i > 0 && step - pointSteps[i - 1] < pointSteps[i] - step) i -= 1;
    readout.textContent = `step ${pointSteps[i]}: ${valueText(i)}`;
  });
  canvas.addEventListener('mouseleave', () => {
    readout.textContent = '';
  });
}

function chartFigure(title, subtitle) {
  const canvas = el('canvas');
  const readout = el('span', {class: 'lw-readout'});
  const figure = el('figure', {class: 'lw-chart'},
    el('figcaption', {},
      el('span', {class: 'lw-chart-title'}, title),
      subtitle && el('span', {class: 'lw-muted'}, subtitle),
      readout),
    canvas);
  return {figure, canvas, readout};
}

function renderDetailPlaceholder(detail) {
  delete detail.dataset.layer;
  detail.replaceChildren(el('h3', {}, 'Layer'),
    el('p', {class: 'lw-muted'},
      'Click a row of the heatmap (its label or a cell), an alert or a ranking to see that layer’s series and histograms.'));
}

// ------------------------------------------------------------------------------ heads

const HEADS_HEIGHT = 120; // the rows of a module's heads share about this many pixels
const HEAD_ROW_HEIGHT = {min: 3, max: 18};
const HEAD_LABEL_HEIGHT = 11; // a head's label is written when its row has room, else every few rows
const HEADS_AXIS_HEIGHT = 18;

/**
 * One per-head statistic of an attention module: a heatmap of heads x sampled steps on the
 * statistic's own colour scale, with its legend. Hovering a cell reads out its head, step and
 * value; clicking a head (its label or a cell) selects that head's row `<module>#<h>`.
 * `heads`: the layer route's {heads, steps, values}. Returns the figure and its drawing.
 */
function headsFigure(key, heads, info, onSelect) {
  const {heads: names, steps} = heads;
  const rows = heads.values.map((values) => ({values: Float64Array.from(values, jsonValue)}));
  const scale = makeScale(rows.map((row) => row.values), info.scale === 'log', info.unit);
  const rowHeight = clamp(Math.floor(HEADS_HEIGHT / Math.max(1, names.length)), HEAD_ROW_HEIGHT.min, HEAD_ROW_HEIGHT.max);
  const labelEvery = Math.ceil(HEAD_LABEL_HEIGHT / rowHeight);
  const headOf = (name) => HEAD.exec(name)?.[1] ?? name;
  const part = partsOf(info).replace(/s$/, ''); // "head", "expert"
  const labels = names.map((name, h) => el('div', {
    class: 'lw-head-label',
    'data-name': name,
    title: name,
    style: `top:${h * rowHeight}px;height:${rowHeight}px;line-height:${rowHeight}px`,
    onclick: () => onSelect?.(name),
  }, h % labelEvery === 0 ? `#${headOf(name)}` : ''));
  const canvas = el('canvas', {class: 'lw-heads-canvas'});
  const cells = el('div', {class: 'lw-heads-cells'}, canvas);
  const readout = el('span', {class: 'lw-readout'});
  const figure = el('figure', {
    class: 'lw-chart lw-heads', 'data-key': key, 'data-heads': String(names.length), 'data-steps': String(steps.length),
  },
  el('figcaption', {},
    el('span', {class: 'lw-chart-title'}, info.label),
    el('span', {class: 'lw-muted'}, `${names.length} ${partsOf(info)} × ${steps.length} steps`),
    readout),
  el('div', {class: 'lw-heads-map'},
    el('div', {class: 'lw-heads-labels', style: `height:${names.length * rowHeight}px`}, ...labels), cells),
  legendElement(scale, info, false));
  let hovered = null;
  const cellAt = (event) => {
    const rect = canvas.getBoundingClientRect();
    const h = Math.floor((event.clientY - rect.top) / rowHeight);
    const col = Math.floor(((event.clientX - rect.left) / rect.width) * steps.length);
    return h >= 0 && h < names.length && col >= 0 && col < steps.length ? {h, col} : null;
  };
  const hover = (h) => {
    hovered?.classList.remove('lw-hover');
    hovered = h === null ? null : labels[h];
    hovered?.classList.add('lw-hover');
  };
  canvas.addEventListener('mousemove', (event) => {
    const cell = cellAt(event);
    hover(cell ? cell.h : null);
    readout.textContent = cell
      ? `${part} ${headOf(names[cell.h])} · step ${steps[cell.col]}: ${formatValue(rows[cell.h].values[cell.col], info.unit)}`
      : '';
  });
  canvas.addEventListener('mouseleave', () => {
    hover(null);
    readout.textContent = '';
  });
  canvas.addEventListener('click', (event) => {
    const cell = cellAt(event);
    if (cell) onSelect?.(names[cell.h]);
  });
  const draw = () => drawHeads(canvas, cells.clientWidth, {rows, steps, scale, rowHeight});
  return {figure, draw};
}

/** The heads' cells (as the heatmap paints them) and a step axis below. */
function drawHeads(canvas, width, {rows, steps, scale, rowHeight}) {
  const height = rows.length * rowHeight;
  const ctx = sizeCanvas(canvas, width, height + HEADS_AXIS_HEIGHT);
  ctx.fillStyle = NOT_MEASURED_CSS;
  ctx.fillRect(0, 0, width, height);
  if (!steps.length) return;
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(paintCells(rows, steps.length, scale, Math.round(width * (window.devicePixelRatio || 1))), 0, 0, width, height);
  drawCellGrid(ctx, {rowHeight, stepCount: steps.length, first: 0, last: rows.length, top: 0, width, height, minRowHeight: 10});
  const cellWidth = width / steps.length;
  ctx.font = '10px Roboto, system-ui, sans-serif';
  ctx.fillStyle = '#616161';
  ctx.textBaseline = 'top';
  const ticks = niceTicks(steps[0], steps[steps.length - 1], Math.max(2, Math.floor(width / 90)))
    .filter((step) => step >= steps[0] && step <= steps[steps.length - 1]);
  for (const step of ticks) {
    const x = stepToX(steps, step, cellWidth);
    ctx.textAlign = x < 12 ? 'left' : x > width - 12 ? 'right' : 'center';
    ctx.fillText(String(step), x, height + 4);
  }
}

/** An attention module's heads (a router's experts), one heatmap per per-head statistic (the order of `statsInfo`). */
function headsSection(layer, statsInfo, position, onSelect, drawings) {
  const keys = Object.keys(layer.heads ?? {}).filter((key) => layer.heads[key].heads.length)
    .sort((a, b) => position(a) - position(b));
  if (!keys.length) return [];
  const infos = keys.map((key) => statsInfo.get(key) ?? {label: key, unit: '', scale: 'linear'});
  const figures = keys.map((key, i) => {
    const {figure, draw} = headsFigure(key, layer.heads[key], infos[i], onSelect);
    drawings.push(draw);
    return figure;
  });
  const parts = partsOf(infos[0]);
  const part = parts.replace(/s$/, '');
  return [
    el('div', {class: 'lw-subhead'}, parts[0].toUpperCase() + parts.slice(1),
      el('span', {class: 'lw-subhead-note'}, `rows: ${parts} · x: sampled step · click ${part === 'expert' ? 'an' : 'a'} ${part} for its series`)),
    el('div', {id: 'lw-heads', class: 'lw-heads-grid'}, ...figures),
  ];
}

/** Charts are drawn after they are in the page, at the width their grid cell got. */
function renderDetail(detail, layer, statsInfo, nonfiniteStep, spikeSteps = [], onSelect = null) {
  const steps = layer.steps ?? [];
  const order = [...statsInfo.keys()];
  const position = (key) => (order.includes(key) ? order.indexOf(key) : order.length);
  const keys = Object.keys(layer.series ?? {}).sort((a, b) => position(a) - position(b));
  const drawings = [];
  const seriesFigures = keys.map((key) => {
    const info = statsInfo.get(key) ?? {label: key, unit: ''};
    const values = Float64Array.from(layer.series[key], jsonValue);
    const log = wantsLogAxis(values);
    const {figure, canvas, readout} = chartFigure(info.label, [info.unit, log && 'log'].filter(Boolean).join(' · '));
    drawings.push(() => drawSeriesChart(canvas, figure.clientWidth, {steps, values, log, unit: info.unit, nonfiniteStep, spikeSteps}));
    attachReadout(canvas, readout, stepSpan(steps), steps, (i) => formatValue(values[i], info.unit));
    return figure;
  });
  const histograms = Object.entries(layer.histograms ?? {}).filter(([, entries]) => entries.length);
  const histogramFigures = histograms.map(([tag, entries]) => {
    const sorted = [...entries].sort((a, b) => a.step - b.step);
    const entrySteps = sorted.map((entry) => entry.step);
    const span = stepSpan(entrySteps, steps);
    const {figure, canvas, readout} = chartFigure(tag, '');
    drawings.push(() => drawHistogramChart(canvas, figure.clientWidth, sorted, span));
    attachReadout(canvas, readout, span, entrySteps, (i) => histogramSummary(sorted[i].buckets));
    return figure;
  });
  const head = HEAD.exec(layer.name);
  const expert = EXPERT.exec(layer.name);
  detail.replaceChildren(
    el('div', {class: 'lw-detail-head'},
      el('h3', {}, layer.name),
      head && onSelect && el('span', {}, `${partOfRow(layer, statsInfo)} ${head[1]} of `, layerLink(parentName(layer.name), onSelect)),
      expert && onSelect && el('span', {}, `expert ${expert[1]} of `, layerLink(parentName(layer.name), onSelect)),
      el('span', {class: 'lw-muted'}, `${steps.length} sampled steps`)),
    ...headsSection(layer, statsInfo, position, onSelect, drawings),
    el('div', {class: 'lw-subhead'}, 'Series'),
    chartGrid(seriesFigures, `No series recorded for ${layer.name}.`),
    el('div', {class: 'lw-subhead'}, 'Histograms over time',
      el('span', {class: 'lw-subhead-note'}, 'x: step · y: value · colour: count per bin (√ scale) · grey: no histogram')),
    chartGrid(histogramFigures, `No histograms for ${layer.name}.`));
  detail.dataset.layer = layer.name;
  drawings.forEach((draw) => draw());
}

/** "head" or "expert": what a `<name>#<n>` row is, by the statistics it has. */
function partOfRow(layer, statsInfo) {
  const experts = Object.keys(layer.series ?? {}).some((key) => partsOf(statsInfo.get(key)) === 'experts');
  return experts ? 'expert' : 'head';
}

function chartGrid(figures, emptyText) {
  return figures.length ? el('div', {class: 'lw-charts'}, ...figures) : el('div', {class: 'lw-muted'}, emptyText);
}

function histogramSummary(buckets) {
  if (!buckets.length) return 'empty';
  const total = buckets.reduce((sum, bucket) => sum + bucket[2], 0);
  return `${formatNumber(buckets[0][0])} … ${formatNumber(buckets[buckets.length - 1][1])}, ${formatNumber(total)} values`;
}

// ------------------------------------------------------------------------------ experts

/** The experts grid's colour: an expert's share of its router's tokens (the experts route's `shares`). */
const SHARE_INFO = {key: 'share', label: "expert's share", unit: "share of its router's tokens", scale: 'linear',
  collapse: 'max'};
const DEAD_CSS = '#ffffff';

/** The experts route's answer, its base64 rows decoded: `tokens` and `shares` one row an expert, `imbalance` one a router. */
async function fetchExperts(run) {
  const reply = await getJson('experts', {run});
  const n = reply.steps.length;
  const offsets = [];
  let rows = 0;
  for (const count of reply.experts) {
    offsets.push(rows);
    rows += count;
  }
  const decoded = {};
  for (const [key, count] of [['tokens', rows], ['shares', rows], ['imbalance', reply.routers.length]]) {
    decoded[key] = decodeFloat32(reply[key]);
    if (decoded[key].length !== count * n) {
      throw new Error(`experts of ${run}: ${decoded[key].length} ${key} values for ${count} rows x ${n} steps`);
    }
  }
  return {routers: reply.routers, experts: reply.experts, offsets, steps: reply.steps, ...decoded};
}

/** Routers x experts at the step of index `s`: shares (the cells' values) and tokens, -Infinity past a router's experts. */
function expertsAtStep(data, s) {
  const width = Math.max(0, ...data.experts);
  const n = data.steps.length;
  const values = new Float32Array(data.routers.length * width).fill(-Infinity);
  const tokens = new Float32Array(values.length).fill(-Infinity);
  data.routers.forEach((_, r) => {
    for (let e = 0; e < data.experts[r]; e++) {
      values[r * width + e] = data.shares[(data.offsets[r] + e) * n + s];
      tokens[r * width + e] = data.tokens[(data.offsets[r] + e) * n + s];
    }
  });
  return {steps: Array.from({length: width}, (_, e) => e), values, tokens, width};
}

/**
 * The experts grid: the heatmap's view with experts for columns, a dead expert's cell crossed
 * where cells are wide enough for a cross (narrower, its share's colour is the scale's 0).
 */
class ExpertsGridView extends HeatmapView {
  drawMarks(ctx, box) {
    const {first, last, top, width} = box;
    const {rows, steps, deadAt} = this.model;
    const h = this.rowHeight;
    const cellWidth = width / Math.max(1, steps.length);
    const size = Math.min(h, cellWidth) * 0.25;
    if (size < 2) return super.drawMarks(ctx, box);
    ctx.save();
    ctx.strokeStyle = DEAD_CSS;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    for (let r = first; r < last; r++) {
      for (let c = 0; c < steps.length; c++) {
        if (!deadAt(rows[r], c)) continue;
        const [x, y] = [(c + 0.5) * cellWidth, r * h - top + h / 2];
        ctx.moveTo(x - size, y - size);
        ctx.lineTo(x + size, y + size);
        ctx.moveTo(x + size, y - size);
        ctx.lineTo(x - size, y + size);
      }
    }
    ctx.stroke();
    ctx.restore();
    super.drawMarks(ctx, box);
  }
}

/** The experts views and the step chooser between them. */
function buildExpertsViews() {
  const grid = new ExpertsGridView({canvasId: 'lw-experts-grid', onSelect: selectExpertCell, onToggleGroup: toggleGroup});
  const imbalance = new HeatmapView({canvasId: 'lw-experts-imbalance', onSelect: selectImbalanceCell,
    onToggleGroup: toggleGroup});
  const slider = el('input', {id: 'lw-experts-step', type: 'range', min: '0', max: '0', value: '0', step: '1',
    title: 'the sampled step the grid shows'});
  const stepLabel = el('span', {class: 'lw-experts-step-label'});
  const balanced = el('span', {class: 'lw-muted'});
  slider.addEventListener('input', () => {
    app.expertsStep = Number(slider.value);
    refreshExperts();
  });
  grid.element.insertBefore(el('div', {class: 'lw-experts-controls'},
    el('label', {class: 'lw-field'}, el('span', {}, 'Step'), slider), stepLabel, balanced), grid.note);
  const element = el('div', {id: 'lw-experts', class: 'lw-experts', hidden: true}, grid.element, imbalance.element);
  return {element, grid, imbalance, slider, stepLabel, balanced};
}

/** A click in the grid: an expert's cell selects its row `<router>#<e>`; a label or a block, the router or block. */
function selectExpertCell(name, col) {
  const routers = app.experts?.data?.routers ?? [];
  selectLayer(col !== undefined && routers.includes(name) ? `${name}#${col}` : name);
}

/** A click in the imbalance over time: the grid moves to that step, and the router is selected. */
function selectImbalanceCell(name, col) {
  if (col !== undefined) {
    app.expertsStep = col;
    refreshExperts();
  }
  selectLayer(name);
}

/** The run's routers, when its statistics have them (`moe_tokens`); else the views are hidden. */
async function loadExperts(run, stats) {
  const ticket = ++app.tickets.experts;
  app.experts = null;
  if (!stats.some((stat) => stat.key === 'moe_tokens')) return refreshExperts();
  let loaded;
  try {
    const [data, events] = await Promise.all([fetchExperts(run), eventsOf(run)]);
    loaded = {run, data, events, tree: buildTree(data.routers)};
  } catch (error) {
    loaded = {run, error};
  }
  if (ticket !== app.tickets.experts) return;
  app.experts = loaded;
  app.expertsStep = loaded.data ? loaded.data.steps.length - 1 : 0;
  if (loaded.error) showError('Could not load the experts', loaded.error);
  refreshExperts();
}

/** Lays out and draws the experts views (after a load, a step chosen, a collapse or a resize). */
function refreshExperts() {
  const views = app.expertsViews;
  const loaded = app.experts;
  views.element.hidden = !loaded;
  if (!loaded) return;
  if (!loaded.data) {
    views.grid.showMessage(['Experts', loaded.run], `Could not load the experts: ${loaded.error.message}`, true);
    views.imbalance.element.hidden = true;
    return;
  }
  views.imbalance.element.hidden = false;
  const {data, tree, events} = loaded;
  const s = clamp(app.expertsStep, 0, Math.max(0, data.steps.length - 1));
  const step = data.steps[s];
  const atStep = expertsAtStep(data, s);
  const maxHeight = Math.max(140, Math.round(window.innerHeight * 0.4));
  const gridLayout = layoutRows(tree, app.collapsed, atStep, SHARE_INFO.collapse);
  const allShares = data.routers.map((_, r) => data.shares.subarray(data.offsets[r] * data.steps.length,
    (data.offsets[r] + data.experts[r]) * data.steps.length));
  // one scale for every step, so that the colours compare, from 0: a share's colour says how much of its router's tokens
  const gridScale = makeScale([...allShares, [0]], false, SHARE_INFO.unit);
  const own = (row) => row.node.row >= 0 && !row.collapsed;
  const tokensAt = (row, col) => (own(row) ? atStep.tokens[row.node.row * atStep.width + col] : -Infinity);
  const routersWord = `${data.routers.length} router${data.routers.length === 1 ? '' : 's'}`;
  views.grid.show({
    title: [el('span', {class: 'lw-hm-stat'}, 'Experts'), el('span', {class: 'lw-hm-run'}, loaded.run),
      el('span', {class: 'lw-muted'}, `${routersWord} × ${atStep.width} experts, at step ${step ?? '–'}`)],
    stat: SHARE_INFO.key, statInfo: SHARE_INFO, steps: atStep.steps, rows: gridLayout.rows, spans: gridLayout.spans,
    scale: gridScale, events: {}, selected: app.selected, maxHeight, axisTitle: 'expert',
    columnText: (row, col) => `expert ${col} · step ${step}`,
    cellLines: (row, col) => {
      const tokens = tokensAt(row, col);
      if (tokens === -Infinity) return [];
      return [`tokens: ${formatNumber(tokens)}`, tokens === 0 && 'no token: a dead expert at this step'].filter(Boolean);
    },
    deadAt: (row, col) => tokensAt(row, col) === 0,
  });
  views.grid.element.dataset.step = String(step ?? '');
  views.slider.max = String(Math.max(0, data.steps.length - 1));
  views.slider.value = String(s);
  views.stepLabel.textContent = `step ${step ?? '–'} (${s + 1} of ${data.steps.length} samples)`;
  const evenly = [...new Set(data.experts)].map((count) => formatNumber(1 / count)).join(', ');
  views.balanced.textContent = `balanced: every expert ${evenly} · × no token`;
  views.grid.legendSlot.replaceChildren(legendElement(gridScale, SHARE_INFO, false,
    [el('span', {class: 'lw-swatch'}, el('i', {class: 'lw-sw-dead'}), 'dead expert')]));
  refreshImbalance(views.imbalance, loaded, maxHeight);
}

/** Each router's imbalance over the sampled steps: the heatmap's view of `moe_imbalance` over the routers' tree. */
function refreshImbalance(view, {run, data, tree, events}, maxHeight) {
  const info = statInfo('moe_imbalance');
  const layout = layoutRows(tree, app.collapsed, {steps: data.steps, values: data.imbalance}, info.collapse);
  const scale = makeScale(layout.rows.map((row) => row.values), info.scale === 'log', info.unit);
  view.show({
    title: [el('span', {class: 'lw-hm-stat'}, `${info.label} over time`), el('span', {class: 'lw-hm-run'}, run),
      el('span', {class: 'lw-muted'}, `${data.routers.length} router${data.routers.length === 1 ? '' : 's'} × ` +
        `${data.steps.length} steps · click a step to show it above`)],
    stat: info.key, statInfo: info, steps: data.steps, rows: layout.rows, spans: layout.spans, scale, events,
    selected: app.selected, maxHeight,
  });
  view.legendSlot.replaceChildren(legendElement(scale, info));
}

// ------------------------------------------------------------------------------ the app

const app = {
  runs: [],
  run: null,
  compareRun: '',
  stats: [],
  stat: null,
  log: false,
  collapsed: new Set(),
  headsSeen: new Set(), // the head blocks folded once already (see foldNewHeads)
  selected: null,
  main: null, // {run, stat, data, tree, events, layout} of the selected run; {run, stat, error} if it failed
  compare: null, // the same for the compared run ({run, stat, missing} if it lacks the stat), or null
  cache: {stats: new Map(), events: new Map()},
  tickets: {run: 0, heatmap: 0, detail: 0, experts: 0},
  ui: null,
  views: null,
  experts: null, // {run, data, tree, events} of the selected run's routers; {run, error} if they failed; null: none
  expertsStep: 0, // the index of the sampled step the experts grid shows
  expertsViews: null,
};

function statsOf(run) {
  if (!app.cache.stats.has(run)) app.cache.stats.set(run, getJson('stats', {run}));
  return app.cache.stats.get(run);
}

/** The run's events; a failure reads as no events, with the error kept in `error`. */
function eventsOf(run) {
  if (!app.cache.events.has(run)) {
    app.cache.events.set(run, getJson('events', {run})
      .catch((error) => ({alerts: [], first_nonfinite_step: null, first_offender: null, spikes: [], error})));
  }
  return app.cache.events.get(run);
}

function statInfo(key) {
  return app.stats.find((stat) => stat.key === key) ?? {key, label: key, unit: '', collapse: 'max'};
}

function showError(context, error) {
  console.error(error);
  const {error: banner} = app.ui;
  banner.replaceChildren(el('b', {}, `${context}: `), error.message ?? String(error));
  banner.hidden = false;
}

function clearError() {
  app.ui.error.hidden = true;
}

function showPanelError(panel, title, error) {
  showError(`Could not load ${title.toLowerCase()}`, error);
  panel.replaceChildren(el('h3', {}, title), el('div', {class: 'lw-error-text'}, error.message ?? String(error)));
}

function option(value, text) {
  return el('option', {value}, text);
}

function buildShell() {
  const ui = {
    run: el('select', {id: 'lw-run', title: 'run'}),
    compare: el('select', {id: 'lw-compare', title: 'draw a second run below, same colour scale'}),
    stat: el('select', {id: 'lw-stat', title: 'statistic'}),
    log: el('input', {id: 'lw-log', type: 'checkbox'}),
    depth: el('select', {id: 'lw-depth', title: 'collapse the module tree to a depth'}),
    expand: el('button', {id: 'lw-expand-all', type: 'button'}, 'Expand all'),
    error: el('div', {id: 'lw-error', class: 'lw-error', role: 'alert', hidden: true}),
    events: el('section', {id: 'lw-events', class: 'lw-card'}, el('h3', {}, 'Events')),
    rankings: el('section', {id: 'lw-rankings', class: 'lw-card'}, el('h3', {}, 'Rankings')),
    detail: el('section', {id: 'lw-detail', class: 'lw-card'}),
  };
  const view = (canvasId, other) =>
    new HeatmapView({canvasId, onSelect: selectLayer, onToggleGroup: toggleGroup, onScroll: (top) => syncScroll(other, top)});
  const views = {main: view('lw-heatmap', 'compare'), compare: view('lw-heatmap-compare', 'main')};
  views.compare.element.hidden = true;
  const experts = buildExpertsViews();
  const field = (text, control) => el('label', {class: 'lw-field'}, el('span', {}, text), control);
  const toolbar = el('header', {class: 'lw-toolbar'},
    el('span', {class: 'lw-brand'}, 'LAYERWATCH'),
    field('Run', ui.run),
    field('Compare with', ui.compare),
    field('Statistic', ui.stat),
    el('label', {class: 'lw-field lw-check'}, ui.log, el('span', {}, 'log colour scale')),
    field('Rows', ui.depth),
    ui.expand);
  renderDetailPlaceholder(ui.detail);
  const page = el('div', {class: 'lw-app'}, toolbar, ui.error,
    el('div', {class: 'lw-main'},
      el('div', {class: 'lw-column'}, views.main.element, views.compare.element, experts.element, ui.detail),
      el('aside', {class: 'lw-side'}, ui.events, ui.rankings)));
  ui.toolbar = toolbar;
  ui.page = page;
  ui.run.addEventListener('change', () => task('Could not load the run', () => selectRun(ui.run.value)));
  ui.compare.addEventListener('change', () => {
    app.compareRun = ui.compare.value;
    task('Could not load the heatmaps', loadHeatmaps);
  });
  ui.stat.addEventListener('change', () => {
    app.stat = ui.stat.value;
    app.log = statInfo(app.stat).scale === 'log';
    ui.log.checked = app.log;
    task('Could not load the heatmaps', loadHeatmaps);
  });
  ui.log.addEventListener('change', () => {
    app.log = ui.log.checked;
    refreshHeatmaps();
  });
  ui.depth.addEventListener('change', () => collapseToDepth(Number(ui.depth.value)));
  ui.expand.addEventListener('click', expandAll);
  let resizeQueued = false;
  window.addEventListener('resize', () => {
    if (resizeQueued) return;
    resizeQueued = true;
    requestAnimationFrame(() => {
      resizeQueued = false;
      refreshHeatmaps();
    });
  });
  return {ui, views, experts};
}

function task(context, run) {
  run().catch((error) => showError(context, error));
}

function showEmptyState() {
  app.ui.toolbar.querySelectorAll('.lw-field, button').forEach((control) => {
    control.hidden = true;
  });
  app.ui.page.querySelector('.lw-main').replaceChildren(el('div', {id: 'lw-empty', class: 'lw-card lw-empty'},
    el('h2', {}, 'No layerwatch data'),
    el('p', {}, 'This logdir has no layerwatch data: no run in it was written by layerwatch.'),
    el('p', {}, 'To get some, train with ', el('code', {}, 'InspectCallback()'), ' (PyTorch Lightning) or ',
      el('code', {}, 'Inspector(...)'), ' (plain PyTorch), then point ', el('code', {}, 'tensorboard --logdir'),
      ' at the logs it writes.')));
}

async function loadRuns() {
  const reply = await getJson('runs');
  app.runs = reply.runs ?? [];
  if (!app.runs.length) return showEmptyState();
  app.ui.run.replaceChildren(...app.runs.map((run) => option(run.run, run.run)));
  await selectRun(app.runs[0].run);
}

function fillCompareOptions() {
  if (app.compareRun === app.run) app.compareRun = '';
  app.ui.compare.replaceChildren(option('', 'none'),
    ...app.runs.filter((run) => run.run !== app.run).map((run) => option(run.run, run.run)));
  app.ui.compare.value = app.compareRun;
}

async function selectRun(run) {
  const ticket = ++app.tickets.run;
  app.tickets.detail += 1; // a layer's reply still on its way belongs to the previous run
  app.run = run;
  app.ui.run.value = run;
  app.selected = null;
  app.cache.stats.clear();
  app.cache.events.clear();
  clearError();
  renderDetailPlaceholder(app.ui.detail);
  fillCompareOptions();
  loadSidePanels(run);
  app.tickets.experts += 1; // the routers of the previous run, if any, are hidden until this run's are known
  app.experts = null;
  refreshExperts();
  let reply;
  try {
    reply = await statsOf(run);
  } catch (error) {
    if (ticket === app.tickets.run) {
      app.views.main.showMessage([run], `Could not load the statistics of ${run}: ${error.message}`, true);
    }
    throw error;
  }
  if (ticket !== app.tickets.run) return;
  app.stats = reply.stats ?? [];
  if (!app.stats.length) {
    app.ui.stat.replaceChildren();
    app.views.main.showMessage([`${run}`], 'This run has no per-layer statistics yet.', false);
    return;
  }
  if (!app.stats.some((stat) => stat.key === app.stat)) {
    app.stat = app.stats[0].key;
    app.log = app.stats[0].scale === 'log';
  }
  app.ui.stat.replaceChildren(
    ...app.stats.map((stat) => option(stat.key, stat.unit ? `${stat.label} (${stat.unit})` : stat.label)));
  app.ui.stat.value = app.stat;
  app.ui.log.checked = app.log;
  task('Could not load the experts', () => loadExperts(run, app.stats));
  await loadHeatmaps();
}

function loadSidePanels(run) {
  eventsOf(run).then((events) => {
    if (run !== app.run) return;
    if (events.error) showPanelError(app.ui.events, 'Events', events.error);
    else renderEvents(app.ui.events, events, selectLayer);
  });
  getJson('rankings', {run}).then((reply) => {
    if (run === app.run) renderRankings(app.ui.rankings, reply.rankings ?? [], selectLayer);
  }, (error) => {
    if (run === app.run) showPanelError(app.ui.rankings, 'Rankings', error);
  });
}

/** One run's heatmap of the current stat with its events; a failure is kept as `error`. */
async function loadRunHeatmap(run, stat) {
  try {
    if (run !== app.run) {
      const {stats = []} = await statsOf(run);
      if (!stats.some((s) => s.key === stat)) return {run, stat, missing: `${run} has no ${statInfo(stat).label}.`};
    }
    const [data, events] = await Promise.all([fetchHeatmap(run, stat), eventsOf(run)]);
    return {run, stat, data, events, tree: buildTree(data.rows)};
  } catch (error) {
    return {run, stat, error};
  }
}

/** Fetches the heatmaps and draws them; body[data-heatmap-ms] gets the time from fetch to drawn. */
async function loadHeatmaps() {
  const ticket = ++app.tickets.heatmap;
  const started = performance.now();
  app.views.main.title.append(el('span', {class: 'lw-muted lw-loading'}, ' loading…'));
  const [main, compare] = await Promise.all([
    loadRunHeatmap(app.run, app.stat),
    app.compareRun ? loadRunHeatmap(app.compareRun, app.stat) : null,
  ]);
  if (ticket !== app.tickets.heatmap) return;
  app.main = main;
  app.compare = compare;
  foldNewHeads();
  if (main.error) showError('Could not load the heatmap', main.error);
  if (compare?.error) showError('Could not load the compared heatmap', compare.error);
  refreshHeatmaps();
  await nextFrame();
  if (ticket === app.tickets.heatmap && main.data) {
    document.body.dataset.heatmapMs = String(Math.round(performance.now() - started));
  }
}

function heatmapTitle(loaded, role) {
  const parts = [el('span', {class: 'lw-hm-stat'}, statInfo(loaded.stat).label), el('span', {class: 'lw-hm-run'}, loaded.run)];
  if (role === 'compare') parts.unshift(el('span', {class: 'lw-hm-role'}, 'compare'));
  if (loaded.data) {
    const {steps} = loaded.data;
    parts.push(el('span', {class: 'lw-muted'}, `${loaded.layout.rows.length} rows × ${steps.length} steps` +
      (steps.length ? ` (steps ${steps[0]}–${steps[steps.length - 1]})` : '')));
  }
  return parts;
}

/** Lays out, colours and draws the loaded heatmaps (after a load, a collapse, the log toggle or a resize). */
function refreshHeatmaps() {
  refreshExperts(); // the routers' views share the collapsed blocks and the page's width
  if (!app.main) return;
  const info = statInfo(app.main.stat);
  const shown = [app.main, app.compare].filter((loaded) => loaded?.data);
  for (const loaded of shown) loaded.layout = layoutRows(loaded.tree, app.collapsed, loaded.data, info.collapse);
  const scale = makeScale(shown.flatMap((loaded) => loaded.layout.rows.map((row) => row.values)), app.log, info.unit);
  const maxHeight = Math.max(180, Math.round(window.innerHeight * (app.compare ? 0.36 : 0.5)));
  const roles = [['main', app.main], ['compare', app.compare]];
  for (const [role, loaded] of roles) {
    const view = app.views[role];
    view.element.hidden = !loaded;
    if (!loaded) continue;
    if (!loaded.data) {
      const text = loaded.error ? `Could not load the heatmap: ${loaded.error.message}` : loaded.missing;
      view.showMessage(heatmapTitle(loaded, role), text, Boolean(loaded.error));
      continue;
    }
    view.show({
      title: heatmapTitle(loaded, role),
      stat: info.key,
      statInfo: info,
      steps: loaded.data.steps,
      rows: loaded.layout.rows,
      spans: loaded.layout.spans,
      scale,
      events: loaded.events,
      selected: app.selected,
      maxHeight,
    });
  }
  app.views.main.legendSlot.replaceChildren(shown.length ? legendElement(scale, info) : '');
  app.views.compare.legendSlot.replaceChildren(el('span', {class: 'lw-muted lw-small'}, 'same colour scale as above'));
  updateDepthOptions();
}

function updateDepthOptions() {
  const trees = loadedTrees();
  const deepest = Math.max(0, ...trees.map(deepestGroup));
  const current = app.ui.depth.value;
  const depths = Array.from({length: deepest}, (_, i) => i + 1);
  app.ui.depth.replaceChildren(option('', 'all layers'),
    ...depths.map((depth) => option(String(depth), `collapse to depth ${depth}`)));
  app.ui.depth.value = depths.includes(Number(current)) ? current : '';
}

function loadedTrees() {
  return [app.main, app.compare].filter((loaded) => loaded?.tree).map((loaded) => loaded.tree);
}

/** An attention module's heads (a fused parameter's experts) start folded into its row; once seen, they stay as the user leaves them. */
function foldNewHeads() {
  for (const name of loadedTrees().flatMap(headGroupNames)) {
    if (app.headsSeen.has(name)) continue;
    app.headsSeen.add(name);
    app.collapsed.add(name);
  }
}

/** Heads stay folded at every depth (they are not modules); Expand all unfolds them. */
function collapseToDepth(depth) {
  const trees = loadedTrees();
  app.collapsed = new Set(trees.flatMap((tree) => [...(depth > 0 ? groupNamesAtDepth(tree, depth) : []), ...headGroupNames(tree)]));
  refreshHeatmaps();
}

function expandAll() {
  app.collapsed.clear();
  app.ui.depth.value = '';
  refreshHeatmaps();
}

function toggleGroup(name) {
  if (app.collapsed.has(name)) app.collapsed.delete(name);
  else app.collapsed.add(name);
  app.ui.depth.value = '';
  refreshHeatmaps();
}

function syncScroll(role, top) {
  const other = app.views[role];
  const source = app.views[role === 'main' ? 'compare' : 'main'];
  if (other.model && source.model && other.model.rows.length === source.model.rows.length && other.scroller.scrollTop !== top) {
    other.scroller.scrollTop = top;
  }
}

function selectLayer(name) {
  app.selected = name;
  for (const view of [...Object.values(app.views), app.expertsViews.grid, app.expertsViews.imbalance]) {
    view.setSelected(name);
    view.reveal(name);
  }
  task('Could not load the layer', () => loadDetail(name));
}

async function loadDetail(name) {
  const ticket = ++app.tickets.detail;
  const run = app.run;
  const {detail} = app.ui;
  detail.replaceChildren(el('h3', {}, name), el('div', {class: 'lw-muted'}, 'loading…'));
  try {
    const [layer, stats, events] = await Promise.all([getJson('layer', {run, name}), statsOf(run), eventsOf(run)]);
    if (ticket !== app.tickets.detail) return;
    const statsInfo = new Map((stats.stats ?? []).map((stat) => [stat.key, stat]));
    renderDetail(detail, {...layer, name: layer.name ?? name}, statsInfo, events.first_nonfinite_step,
      (events.spikes ?? []).map((spike) => spike.step), selectLayer);
  } catch (error) {
    if (ticket !== app.tickets.detail) return;
    detail.replaceChildren(el('h3', {}, name), el('div', {class: 'lw-error-text'}, `Could not load ${name}: ${error.message}`));
    detail.dataset.layer = name;
    throw error;
  }
}

// ------------------------------------------------------------------------------ style

const STYLE = `
:root { --lw-accent: ${ACCENT}; --lw-border: #e0e0e0; --lw-text: #212121; --lw-muted: #757575; --lw-bg: #f5f5f5; }
html, body { margin: 0; background: var(--lw-bg); color: var(--lw-text);
  font: 13px Roboto, system-ui, -apple-system, "Segoe UI", Arial, sans-serif; }
[hidden] { display: none !important; }
.lw-app { box-sizing: border-box; padding: 0 16px 24px; min-width: 0; }
.lw-toolbar { position: sticky; top: 0; z-index: 5; display: flex; flex-wrap: wrap; align-items: center; gap: 8px 16px;
  padding: 10px 0; margin-bottom: 12px; background: var(--lw-bg); border-bottom: 1px solid var(--lw-border); }
.lw-brand { font-weight: 500; letter-spacing: .08em; color: var(--lw-accent); margin-right: 6px; }
.lw-field { display: inline-flex; align-items: center; gap: 6px; color: var(--lw-muted); }
.lw-field select { font: inherit; color: var(--lw-text); padding: 3px 4px; border: 1px solid #bdbdbd; border-radius: 3px;
  background: #fff; max-width: 200px; }
.lw-check { cursor: pointer; color: var(--lw-text); }
.lw-check input { accent-color: var(--lw-accent); margin: 0; }
button { font: inherit; padding: 4px 10px; border: 1px solid #bdbdbd; border-radius: 3px; background: #fff; cursor: pointer; }
button:hover, .lw-field select:hover { border-color: var(--lw-accent); }
.lw-main { display: grid; grid-template-columns: minmax(0, 1fr) 340px; gap: 16px; align-items: start; }
.lw-column, .lw-side { display: flex; flex-direction: column; gap: 16px; min-width: 0; }
.lw-card { background: #fff; border: 1px solid var(--lw-border); border-radius: 4px; padding: 12px 14px;
  box-shadow: 0 1px 2px rgba(0,0,0,.05); min-width: 0; }
.lw-card h3 { margin: 0 0 8px; font-size: 14px; font-weight: 500; }
.lw-muted { color: var(--lw-muted); }
.lw-small { font-size: 12px; }
.lw-subhead-note { margin-left: 10px; text-transform: none; letter-spacing: 0; font-weight: 400; }
.lw-subhead { margin: 12px 0 6px; font-size: 12px; font-weight: 500; color: var(--lw-muted); text-transform: uppercase; letter-spacing: .04em; }
.lw-error { margin: 0 0 12px; padding: 10px 14px; border: 1px solid #ef9a9a; border-left: 4px solid #c62828;
  background: #ffebee; color: #b71c1c; border-radius: 3px; overflow-wrap: anywhere; }
.lw-error-text { color: #b71c1c; overflow-wrap: anywhere; }
.lw-empty { max-width: 640px; margin: 60px auto; padding: 24px 28px; }
.lw-empty h2 { margin: 0 0 10px; font-size: 18px; font-weight: 500; }
code { font-family: "Roboto Mono", ui-monospace, monospace; font-size: 12px; background: #f1f3f4; padding: 1px 4px; border-radius: 3px; }

.lw-hm-head { display: flex; align-items: flex-start; justify-content: space-between; gap: 16px; margin-bottom: 6px; min-height: 40px; }
.lw-hm-title { display: flex; flex-wrap: wrap; align-items: baseline; gap: 4px 10px; min-width: 0; }
.lw-hm-stat { font-size: 15px; font-weight: 500; }
.lw-hm-run { font-weight: 500; color: var(--lw-accent); overflow-wrap: anywhere; }
.lw-hm-role { font-size: 11px; text-transform: uppercase; letter-spacing: .05em; color: #fff; background: #757575; padding: 1px 6px; border-radius: 8px; }
.lw-hm-note { padding: 24px 0; }
.lw-hm-scroll { overflow-y: auto; overflow-x: hidden; border-top: 1px solid var(--lw-border); border-bottom: 1px solid var(--lw-border); }
.lw-hm-body { position: relative; display: flex; }
.lw-hm-labels { position: relative; flex: 0 0 ${LABEL_WIDTH}px; width: ${LABEL_WIDTH}px; }
.lw-hm-cells { position: relative; flex: 1 1 auto; min-width: 0; }
.lw-hm-canvas { position: sticky; top: 0; display: block; cursor: crosshair; }
.lw-row-label { position: absolute; left: 0; right: 0; box-sizing: border-box; padding-right: 6px; white-space: nowrap;
  overflow: hidden; font: ${LABEL_FONT}; cursor: pointer; display: flex; align-items: center; gap: 4px; }
.lw-row-label:hover { background: #f1f3f4; }
.lw-row-label.lw-selected { background: #fff3e0; font-weight: 500; }
.lw-row-label.lw-offender { box-shadow: inset 3px 0 0 var(--lw-accent); }
.lw-guides { position: absolute; left: 0; top: 0; bottom: 0;
  background: repeating-linear-gradient(to right, transparent 0 5px, #e0e0e0 5px 6px, transparent 6px ${INDENT}px); }
.lw-twisty { position: absolute; top: 0; bottom: 0; width: ${INDENT}px; text-align: center; color: #616161; background: #fff;
  font-size: 10px; cursor: pointer; user-select: none; }
.lw-row-label:hover .lw-twisty, .lw-selected .lw-twisty { background: transparent; }
.lw-twisty:hover { color: var(--lw-accent); }
.lw-name { overflow: hidden; text-overflow: ellipsis; min-width: 0; }
.lw-name-prefix { color: #9e9e9e; }
.lw-block .lw-name { font-style: italic; }
.lw-block-size { color: var(--lw-muted); font-size: 11px; }
.lw-badge { font-size: 10px; line-height: 14px; padding: 0 5px; border-radius: 7px; flex: none; }
.lw-badge-offender { background: var(--lw-accent); color: #fff; }
.lw-badge-replayed { margin-left: 6px; border: 1px solid var(--lw-accent); color: var(--lw-accent); }
.lw-badge-alert { color: #424242; border: 1px solid #9e9e9e; }
.lw-hm-axis { position: relative; height: 18px; font-size: 11px; color: var(--lw-muted); }
.lw-tick { position: absolute; top: 3px; transform: translateX(-50%); white-space: nowrap; }
.lw-tick::before { content: ""; position: absolute; left: 50%; top: -4px; height: 3px; border-left: 1px solid #bdbdbd; }
.lw-axis-title { position: absolute; left: 0; top: 3px; }
.lw-hm-marks { position: relative; height: 18px; }
.lw-nonfinite-label { position: absolute; bottom: 2px; white-space: nowrap; font-size: 11px; font-weight: 500;
  padding: 0 6px; border-left: 2px dashed #111; color: #111; }
.lw-nonfinite-label.lw-left { transform: translateX(-100%); border-left: 0; border-right: 2px dashed #111; }

.lw-legend { display: flex; gap: 16px; align-items: flex-start; flex: none; }
.lw-legend-scale { width: ${LEGEND_WIDTH}px; }
.lw-legend-caption { font-size: 11px; color: var(--lw-muted); margin-bottom: 2px; }
.lw-legend-bar { display: block; border-radius: 1px; }
.lw-legend-ticks { position: relative; height: 14px; font: ${LEGEND_FONT}; color: #616161; }
.lw-legend-ticks span { position: absolute; top: 1px; white-space: nowrap; }
.lw-swatches { display: grid; grid-template-columns: auto auto; gap: 2px 12px; font-size: 11px; color: #424242; }
.lw-swatch { display: inline-flex; align-items: center; gap: 5px; white-space: nowrap; }
.lw-swatch i, .lw-event i { display: inline-block; width: 12px; height: 10px; box-sizing: border-box; flex: none; }
.lw-sw-nan { background: ${NAN_CSS}; }
.lw-sw-none { background: ${NOT_MEASURED_CSS}; border: 1px solid #cfd2d6; }
.lw-sw-alert { width: 10px !important; background: #111; clip-path: polygon(0 0, 100% 0, 50% 100%); }
.lw-sw-offender { border: 2px solid var(--lw-accent); }
.lw-sw-nonfinite { width: 2px !important; border-left: 2px dashed #111; }
.lw-sw-spike { width: 2px !important; border-left: 2px solid ${SPIKE_CSS}; }
.lw-spike-label { position: absolute; bottom: 2px; white-space: nowrap; font-size: 11px; font-weight: 500;
  padding: 0 6px; border-left: 2px solid ${SPIKE_CSS}; color: ${SPIKE_CSS}; }
.lw-spike-label.lw-left { transform: translateX(-100%); border-left: 0; border-right: 2px solid ${SPIKE_CSS}; }

.lw-event { margin: 4px 0 8px; display: flex; flex-direction: column; gap: 2px; }
.lw-event-nonfinite { flex-direction: row; align-items: center; gap: 6px; font-weight: 500; }
.lw-layer-link { color: var(--lw-accent); text-decoration: none; font-weight: 500; }
.lw-layer-link:hover { text-decoration: underline; }
.lw-alerts { list-style: none; margin: 0; padding: 0; max-height: 260px; overflow-y: auto; }
.lw-alerts li { padding: 5px 6px; border-top: 1px solid #f0f0f0; }
.lw-alert { cursor: pointer; }
.lw-alert:hover { background: #fff3e0; }
.lw-alert-head { display: flex; gap: 6px; align-items: baseline; min-width: 0; }
.lw-alert-layer { font-weight: 500; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; min-width: 0; }
.lw-alert-step { flex: none; margin-left: auto; color: var(--lw-muted); white-space: nowrap; }
.lw-alert-message { font-size: 12px; color: #616161; margin-top: 1px; }
.lw-kind { flex: none; font-size: 10px; text-transform: uppercase; letter-spacing: .04em; padding: 0 5px; border-radius: 7px;
  background: #ffe0b2; color: #8a3b00; }
.lw-kind-nonfinite { background: ${NAN_CSS}; color: #fff; }
.lw-kind-spike { background: ${SPIKE_CSS}; color: #fff; }

.lw-ranking { margin-top: 10px; }
.lw-ranking:first-of-type { margin-top: 0; }
.lw-ranking-title { font-weight: 500; }
.lw-ranking-table { width: 100%; border-collapse: collapse; margin-top: 4px; table-layout: fixed; font-size: 12px; }
.lw-rank-row { cursor: pointer; }
.lw-rank-row:hover { background: #fff3e0; }
.lw-ranking-table td { padding: 2px 4px; border-top: 1px solid #f0f0f0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.lw-rank { width: 18px; color: var(--lw-muted); text-align: right; }
.lw-rank-value { width: 92px; text-align: right; position: relative; }
.lw-rank-value span:last-child { position: relative; }
.lw-rank-bar { position: absolute; left: 0; top: 2px; bottom: 2px; background: #ffe9cc; border-radius: 1px; }
.lw-missing { font-style: italic; color: var(--lw-muted); font-size: 12px; margin-top: 4px; }

.lw-detail-head { display: flex; align-items: baseline; gap: 10px; }
.lw-detail-head h3 { margin: 0; color: var(--lw-accent); overflow-wrap: anywhere; }
.lw-charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 10px 14px; }
.lw-chart { margin: 0; min-width: 0; }
.lw-chart figcaption { display: flex; gap: 6px; align-items: baseline; font-size: 12px; white-space: nowrap; overflow: hidden; }
.lw-chart-title { font-weight: 500; overflow: hidden; text-overflow: ellipsis; flex-shrink: 0; max-width: 100%; }
.lw-chart figcaption > .lw-muted { min-width: 0; overflow: hidden; text-overflow: ellipsis; }
.lw-readout { margin-left: auto; color: #424242; font-size: 11px; }
.lw-chart canvas { display: block; }
.lw-heads-grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(360px, 1fr)); gap: 10px 14px; }
.lw-heads-map { display: flex; margin: 2px 0 4px; }
.lw-heads-labels { position: relative; flex: 0 0 40px; }
.lw-head-label { position: absolute; left: 0; right: 4px; text-align: right; font-size: 11px; color: #616161;
  cursor: pointer; overflow: hidden; }
.lw-head-label:hover, .lw-head-label.lw-hover { background: #fff3e0; color: var(--lw-text); }
.lw-heads-cells { flex: 1 1 auto; min-width: 0; }
.lw-heads-canvas { cursor: crosshair; }
.lw-experts { display: flex; flex-direction: column; gap: 16px; min-width: 0; }
.lw-experts-controls { display: flex; flex-wrap: wrap; align-items: center; gap: 4px 12px; margin: 0 0 6px; font-size: 12px; }
.lw-experts-controls input[type=range] { width: 260px; accent-color: var(--lw-accent); margin: 0; }
.lw-experts-step-label { font-weight: 500; }
.lw-sw-dead { background: ${VIRIDIS[0]}; position: relative; }
.lw-sw-dead::after { content: "×"; position: absolute; left: 2px; top: -3px; color: ${DEAD_CSS}; font-size: 12px; font-style: normal; }
.lw-tooltip { position: fixed; z-index: 20; pointer-events: none; max-width: 360px; padding: 6px 8px; border-radius: 3px;
  background: rgba(33,33,33,.94); color: #fff; font-size: 12px; line-height: 1.45; box-shadow: 0 2px 6px rgba(0,0,0,.25); }
`;

// ------------------------------------------------------------------------------ entry point

export async function render() {
  document.head.append(el('style', {}, STYLE));
  const {ui, views, experts} = buildShell();
  app.ui = ui;
  app.views = views;
  app.expertsViews = experts;
  document.body.replaceChildren(ui.page);
  try {
    await loadRuns();
  } catch (error) {
    showError('Could not load the runs', error);
    views.main.showMessage(['No runs'],
      'The list of runs could not be loaded (see the error above); reload the page to try again.', true);
  }
}
