// crabd's operator view (crabd/ui): plain DOM, no framework, no build step.
// Data comes from the REST API with the tab's bearer token; the page follows
// the event stream (GET /v1/events, server-sent events read through fetch,
// which can send the token) and refreshes what an event touches.
// Every text from the daemon goes in through textContent (el()): names and
// command lines are agent-controlled and never become markup.
'use strict';

const PAGE = 100;          // rows per page of the host table, time line, diff
const DIFF_CHOICES = 50;   // checkpoints offered in the diff's two selects (newest first)
const TURN_LOAD = 200;     // the sandbox's newest events loaded for the time line; more on demand
const TREE_VIEW = 24;      // checkpoint tree rows in view: the tree is a scrolled window of its rows
const TREE_OVERSCAN = 6;   // rows drawn above and below the view (smooth scrolling)
const TREE_ROW_PX = 30;    // a tree row's height until the first drawn row is measured
const MAX_LANES = 12;      // branch lanes drawn in the tree's gutter
const state = { route: null, host: null, sb: null, events: [], lastSeq: 0, hostPage: 0, filter: '',
                turnPage: 0, tree: null, treeTop: 0, rowPx: TREE_ROW_PX, diff: null, diffPage: 0 };

// ---- helpers ------------------------------------------------------------------------------
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const k of kids.flat(Infinity)) {
    if (k === null || k === undefined || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}
function token() {
  const t = sessionStorage.getItem('crabd_token');
  if (t) return t;
  const m = /(?:^|;\s*)crabd_token=([^;]+)/.exec(document.cookie);
  return m ? decodeURIComponent(m[1]) : null;
}
function headers(extra) {
  const h = Object.assign({ Accept: 'application/json' }, extra || {});
  const t = token();
  if (t) h.Authorization = 'Bearer ' + t;
  return h;
}
class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super((e.code || status) + ': ' + (e.message || 'request failed'));
    this.status = status; this.code = e.code; this.fix = e.fix;
  }
}
async function api(method, path, body) {
  const opts = { method, headers: headers(body ? { 'Content-Type': 'application/json' } : {}) };
  if (body) opts.body = JSON.stringify(body);
  const r = await fetch(path, opts);
  let data = null;
  try { data = await r.json(); } catch (_) { /* an empty or non-JSON body */ }
  if (r.status === 401) { location.href = '/ui/login'; throw new ApiError(401, data); }
  if (!r.ok) throw new ApiError(r.status, data);
  return data;
}
function bytes(n) {
  if (n === null || n === undefined) return '–';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB']; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + ' ' + u[i];
}
function ms(s) { return s === null || s === undefined ? '–' : (s * 1000).toFixed(1) + ' ms'; }
function when(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : '–'; }
function plan(p) { return p ? el('span', { class: 'plan plan-' + p }, p) : '–'; }
function link(href, text) { return el('a', { href }, text); }
function errorBox(e) {
  return el('div', { class: 'error', role: 'alert' }, e.message, e.fix ? '\nfix: ' + e.fix : '');
}
function pager(page, total, size, go) {
  const pages = Math.max(1, Math.ceil(total / size));
  return el('div', { class: 'pager' },
    el('button', { onclick: () => go(page - 1), disabled: page <= 0 }, '‹ prev'),
    el('span', { class: 'muted' }, `page ${page + 1} of ${pages} (${total})`),
    el('button', { onclick: () => go(page + 1), disabled: page >= pages - 1 }, 'next ›'));
}
function replace(id, node) {
  const old = document.getElementById(id);
  node.id = id;
  if (old) old.replaceWith(node);
  return node;
}
let timers = {};
function soon(key, fn, wait) {   // at most one pending refresh per key
  if (timers[key]) return;
  timers[key] = setTimeout(() => { delete timers[key]; fn(); }, wait);
}

// ---- routing ------------------------------------------------------------------------------
function route() {
  const h = location.hash.replace(/^#/, '') || '/';
  const m = /^\/sb\/([^/]+)$/.exec(h);
  state.route = m ? { view: 'sandbox', id: decodeURIComponent(m[1]) } : { view: 'host' };
  document.getElementById('main').replaceChildren();  // a view builds its own sections
  const crumbs = document.getElementById('crumbs');
  crumbs.replaceChildren(link('#/', 'host'), m ? ' / ' : '', m ? el('span', {}, state.route.id) : '');
  if (state.route.view === 'host') { state.hostPage = 0; return showHost(); }
  state.turnPage = 0; state.treeTop = 0; state.diff = null;
  return showSandbox(state.route.id);
}

// ---- host view ----------------------------------------------------------------------------
async function showHost() {
  // A refresh the event stream queued on the host view may fire after the
  // operator went on to a sandbox: it must not draw over that view.
  if (state.route.view !== 'host') return;
  const main = document.getElementById('main');
  if (!document.getElementById('host-table')) {
    main.replaceChildren(el('div', { id: 'host-stats', class: 'card' }, 'loading…'),
      el('div', { class: 'card' }, el('h2', {}, 'Sandboxes'),
        el('div', { class: 'toolbar' },
          el('input', { id: 'filter', placeholder: 'filter: name, image, state, owner', value: state.filter,
                        oninput: (e) => { state.filter = e.target.value; state.hostPage = 0; renderHostTable(); } })),
        el('div', { id: 'host-table' })),
      el('div', { class: 'card' }, el('h2', {}, 'Events'), el('ul', { id: 'events', class: 'events' })));
    renderEvents();
  }
  try { state.host = await api('GET', '/v1/host'); }
  catch (e) { replace('host-stats', el('div', { class: 'card' }, errorBox(e))); return; }
  performance.mark('crabd:host-data');
  if (state.route.view !== 'host') return;
  renderHostStats(); renderHostTable();
  performance.mark('crabd:host-rendered');  // bench/ui.py reads these marks
}
function renderHostStats() {
  const h = state.host, s = h.sandboxes;
  const dead = s.filter((x) => x.state !== 'running').length;
  const stat = (label, value, cls) => el('div', { class: 'stat ' + (cls || '') }, el('b', {}, value), label);
  replace('host-stats', el('div', { class: 'card stats' },
    stat('sandboxes', s.length), stat('not running', dead, dead ? 'state-dead' : ''),
    stat('checkpoints', s.reduce((a, x) => a + x.checkpoints, 0)),
    stat('bytes', bytes(s.reduce((a, x) => a + x.bytes, 0))),
    stat('standbys ready', s.filter((x) => x.standby).length),
    stat('jobs queued', h.scheduler.queued_total ?? h.scheduler.queued.length),
    stat('jobs running', `${h.scheduler.running_total ?? h.scheduler.running.length} / ${h.scheduler.max_concurrency}`),
    stat('turns stalled', `${h.stalls.stalled} / ${h.stalls.turns}`),
    stat('stall total', ms(h.stalls.total_s)),
    stat(`checkpoints last ${h.throughput.window_s} s`, `${h.throughput.checkpoints} (${bytes(h.throughput.bytes)})`)));
}
function renderHostTable() {
  if (!state.host) return;
  const f = state.filter.toLowerCase();
  const rows = state.host.sandboxes.filter((s) => !f ||
    [s.id, s.name, s.image, s.state, s.owner].some((v) => String(v || '').toLowerCase().includes(f)));
  const start = state.hostPage * PAGE;
  const body = rows.slice(start, start + PAGE).map((s) => el('tr', { class: s.state === 'running' ? '' : 'dead',
      'data-sandbox': s.id },
    el('td', {}, link('#/sb/' + encodeURIComponent(s.id), s.name), s.name !== s.id ? el('span', { class: 'muted' }, ' ' + s.id) : ''),
    el('td', { class: 'state-' + s.state }, s.state), el('td', {}, s.image), el('td', {}, s.turn),
    el('td', {}, s.branch), el('td', {}, plan(s.last_plan)), el('td', {}, s.checkpoints), el('td', {}, bytes(s.bytes)),
    el('td', {}, s.standby ? '✓ ' + s.standby : '–'), el('td', {}, s.owner || '–'),
    el('td', {}, s.forked_from || '')));
  replace('host-table', el('div', {},
    pager(state.hostPage, rows.length, PAGE, (p) => { state.hostPage = p; renderHostTable(); }),
    el('table', {}, el('thead', {}, el('tr', {}, ['sandbox', 'state', 'image', 'turns', 'branch', 'last plan',
      'checkpoints', 'bytes', 'standby', 'owner', 'forked from'].map((c) => el('th', {}, c)))),
      el('tbody', {}, body))));
}
function renderEvents() {
  const ul = document.getElementById('events');
  if (!ul) return;
  ul.replaceChildren(...state.events.slice(-50).reverse().map((e) => el('li', {},
    `${when(e.ts)} #${e.seq} ${e.kind} ${e.sandbox_id || ''} `,
    el('span', { class: 'muted' }, JSON.stringify(e.data)))));
}

// ---- sandbox view -------------------------------------------------------------------------
async function loadSandbox(id) {
  const enc = encodeURIComponent(id);
  // One request (GET /v1/sandboxes/{id}/view): the sandbox, its tree
  // (compact arrays, with the forks made from it), budget, effects and the
  // time line: the turn.ended events among the sandbox's newest TURN_LOAD
  // events, older ones on demand. Its `recent` events are the event
  // stream's backlog on a first load.
  const v = await api('GET', `/v1/sandboxes/${enc}/view?turns=${TURN_LOAD}`);
  performance.mark('crabd:sandbox-data');
  if (!state.lastSeq && v.recent.last_seq) {
    for (const e of v.recent.events) onEvent(e, true);
    state.lastSeq = v.recent.last_seq;
  }
  const tree = v.tree, f = tree.fields, evs = v.events;
  const checkpoints = tree.checkpoints.map((r) => {
    const c = {};
    for (let i = 0; i < f.length; i++) c[f[i]] = r[i];
    c.durations = { pause: c.pause };
    return c;
  });
  return { id, info: v.info, checkpoints, budget: v.budget, effects: v.effects, forks: tree.forks,
           turns: evs.events.filter((e) => e.kind === 'turn.ended'),
           olderBefore: evs.more && evs.events.length ? evs.events[0].seq : null };
}
async function loadOlderTurns() {
  const sb = state.sb;
  if (!sb || !sb.olderBefore) return;
  const p = await api('GET', `/v1/events?follow=false&sandbox=${encodeURIComponent(sb.id)}&order=desc` +
                             `&before=${sb.olderBefore}&limit=${TURN_LOAD}`);
  const older = p.events.filter((e) => e.kind === 'turn.ended').reverse();   // newest first -> oldest first
  sb.turns = older.concat(sb.turns);
  sb.olderBefore = p.more && p.events.length ? p.events[p.events.length - 1].seq : null;
  renderTurns();
}
async function showSandbox(id) {
  const main = document.getElementById('main');
  let sb;
  try { sb = await loadSandbox(id); }
  catch (e) { main.replaceChildren(el('div', { class: 'card' }, errorBox(e))); return; }
  if (state.route.view !== 'sandbox' || state.route.id !== id) return;
  state.sb = sb;
  if (!document.getElementById('sb-tree')) {
    main.replaceChildren(el('div', { id: 'sb-head' }), el('div', { id: 'sb-tree' }), el('div', { id: 'sb-turns' }),
      el('div', { id: 'sb-diff' }), el('div', { class: 'grid2' }, el('div', { id: 'sb-effects' }), el('div', { id: 'sb-budget' })),
      el('div', { class: 'card' }, el('h2', {}, 'Events'), el('ul', { id: 'events', class: 'events' })));
    renderDiff();
  }
  renderSbHead(); renderTree(); renderTurns(); renderEffects(); renderBudget(); renderEvents();
  performance.mark('crabd:sandbox-rendered');
}
function renderSbHead() {
  const i = state.sb.info;
  const kv = (k, v) => el('div', { class: 'stat' }, el('b', {}, v), k);
  replace('sb-head', el('div', { class: 'card stats' },
    kv('sandbox', i.name), kv('state', el('span', { class: 'state-' + i.state, id: 'sb-state' }, i.state)),
    kv('status', i.status), kv('image', i.image), kv('turn', i.turn), kv('branch', i.branch), kv('head', i.head || '–'),
    kv('owner', i.owner || '–'), kv('forked from', i.forked_from || '–')));
}

// The tree: one row per checkpoint, newest first; one lane per branch (a
// rollback starts a branch); a branch's first row says where it split off.
// Only the rows in view (and TREE_OVERSCAN around them) are in the DOM: a
// thousand-turn tree costs what two dozen rows do, at load and per scroll.
function renderTree() {
  const cks = state.sb.checkpoints, head = state.sb.info.head;
  const byId = new Map(cks.map((c) => [c.id, c]));
  const lanes = new Map(), span = new Map();
  for (const c of cks) {
    if (!lanes.has(c.branch)) lanes.set(c.branch, lanes.size);
    const s = span.get(c.branch) || [c.seq, c.seq];
    span.set(c.branch, [Math.min(s[0], c.parent && byId.has(c.parent) ? byId.get(c.parent).seq : c.seq), Math.max(s[1], c.seq)]);
  }
  const nl = Math.min(lanes.size, MAX_LANES);
  const laneSpan = [];   // lane -> [first seq, last seq] of its branch (from its split point)
  for (const [b, l] of lanes) if (l < nl) laneSpan[l] = span.get(b);
  const onHead = new Set();
  for (let id = head; id && byId.has(id) && !onHead.has(id); id = byId.get(id).parent) onHead.add(id);
  const forksAt = new Map();
  for (const f of state.sb.forks) forksAt.set(f.forked_from, (forksAt.get(f.forked_from) || []).concat([f]));
  // `drawn`: rows built so far, by checkpoint, reused while scrolling (until the data changes).
  state.tree = { ordered: cks.slice().reverse(), byId, lanes, nl, laneSpan, onHead, forksAt, head, drawn: new Map() };
  const box = el('div', { id: 'tree-box', class: 'tree-box', onscroll: () => {
    if (state.treeFrame) return;
    state.treeFrame = requestAnimationFrame(() => { state.treeFrame = 0; renderTreeWindow(); });
  } }, el('table', { class: 'tree' }, el('tbody', { id: 'tree-rows' })));
  replace('sb-tree', el('div', { class: 'card' },
    el('h2', {}, `Checkpoint tree (${cks.length} checkpoints, ${lanes.size} branches, ${state.sb.forks.length} forks)`),
    box));
  renderTreeWindow(state.treeTop);
  // Layout is read only in the next frame (the browser lays out for it
  // anyway): reading it here would force a layout of the whole page.
  requestAnimationFrame(() => {
    if (state.treeTop) box.scrollTop = state.treeTop;
    const row = box.querySelector('tr[data-checkpoint]');
    if (row && row.offsetHeight && Math.abs(row.offsetHeight - state.rowPx) > 1) {
      state.rowPx = row.offsetHeight; renderTreeWindow(state.treeTop);
    }
  });
}
function treeRow(c) {
  const t = state.tree, head = t.head;
  const lane = t.lanes.get(c.branch);
  let g = '';
  for (let l = 0; l < t.nl; l++) {
    const s = t.laneSpan[l];
    g += l === lane ? '●' : (s[0] <= c.seq && c.seq <= s[1] ? '│' : ' ');
  }
  if (lane >= MAX_LANES) g += ` [${c.branch}]`;
  const p = c.parent && t.byId.get(c.parent);
  const split = p && p.branch !== c.branch ? `↰ branch ${c.branch} from #${p.seq}` : '';
  const fk = (t.forksAt.get(c.id) || []).map((f) => [' ', link('#/sb/' + encodeURIComponent(f.id), 'fork → ' + f.name)]);
  const done = c.state === 'committed';
  return el('tr', { class: (c.id === head ? 'head ' : '') + (t.onHead.has(c.id) ? '' : 'gone'), 'data-checkpoint': c.id },
    el('td', { class: 'gutter' }, g), el('td', {}, '#' + c.seq), el('td', {}, c.id === head ? (state.sb.info.branch !== c.branch ? `★ head → b${state.sb.info.branch}` : '★ head') : ''),
    el('td', {}, 'turn ' + c.turn), el('td', {}, 'b' + c.branch), el('td', {}, plan(c.plan)),
    el('td', {}, c.state === 'committed' ? bytes(c.bytes) : c.state),
    el('td', {}, ms(c.durations && c.durations.pause)), el('td', { class: 'kept' }, (c.kept || []).join(', ')),
    el('td', {}, split, ' ', fk),
    el('td', {}, el('button', { disabled: !done || c.id === head, onclick: () => confirmRollback(c) }, 'rollback'), ' ',
      el('button', { disabled: !done, onclick: () => confirmFork(c) }, 'fork…'), ' ',
      el('button', { onclick: () => { pickDiff(c); } }, 'diff')));
}
// `at`: the scroll offset to draw for (default: the box's own, on a scroll).
function renderTreeWindow(at) {
  const box = document.getElementById('tree-box'), body = document.getElementById('tree-rows');
  if (!box || !body || !state.tree) return;
  const all = state.tree.ordered, px = state.rowPx;
  state.treeTop = at === undefined ? box.scrollTop : at;
  const first = Math.max(0, Math.floor(state.treeTop / px) - TREE_OVERSCAN);
  const last = Math.min(all.length, Math.floor(state.treeTop / px) + TREE_VIEW + TREE_OVERSCAN);
  const pad = (n) => (n > 0 ? [el('tr', { class: 'pad', 'aria-hidden': 'true' }, el('td', {}))] : []);
  const top = pad(first), bottom = pad(all.length - last);
  const drawn = state.tree.drawn;
  const rows = all.slice(first, last).map((c) => drawn.get(c.id) || drawn.set(c.id, treeRow(c)).get(c.id));
  body.replaceChildren(...top, ...rows, ...bottom);
  // Spacers stand for the rows not drawn, so the scroll bar is the whole tree's.
  if (top.length) top[0].firstChild.style.height = (first * px) + 'px';
  if (bottom.length) bottom[0].firstChild.style.height = ((all.length - last) * px) + 'px';
  box.style.maxHeight = (TREE_VIEW * px) + 'px';
}
function renderTurns() {
  const byCk = new Map(state.sb.checkpoints.map((c) => [c.id, c]));
  const turns = state.sb.turns.slice().reverse();
  const start = state.turnPage * PAGE;
  const rows = turns.slice(start, start + PAGE).map((e) => {
    const d = e.data, c = byCk.get(d.checkpoint);
    return el('tr', { 'data-turn': d.turn },
      el('td', {}, when(e.ts)), el('td', {}, d.turn), el('td', {}, 'b' + d.branch),
      el('td', { class: 'wrap' }, el('code', { class: 'cmd', title: d.cmd }, d.cmd), d.cmd_truncated ? '…' : ''),
      el('td', { class: d.exit_code === 0 ? '' : 'state-dead' }, d.error || d.exit_code),
      el('td', {}, ms(d.duration_s)), el('td', {}, ms(d.stall_ms / 1000)),
      el('td', {}, plan(c ? c.plan : null)), el('td', { class: 'wrap muted' }, c ? c.reasons.join('; ') : 'retired'),
      el('td', {}, c ? bytes(c.bytes) : '–'), el('td', {}, ms(c && c.durations ? c.durations.pause : null)));
  });
  replace('sb-turns', el('div', { class: 'card' }, el('h2', {}, `Turns (${turns.length}${state.sb.olderBefore ? ' newest' : ''})`),
    pager(state.turnPage, turns.length, PAGE, (p) => { state.turnPage = p; renderTurns(); }),
    state.sb.olderBefore ? el('button', { id: 'older-turns', onclick: (ev) => { ev.target.disabled = true;
      loadOlderTurns().catch((e) => replace('sb-turns', el('div', { class: 'card' }, errorBox(e)))); } }, 'load older turns') : '',
    el('table', {}, el('thead', {}, el('tr', {}, ['ended', 'turn', 'branch', 'command', 'exit', 'duration', 'stall',
      'plan', 'reasons', 'bytes', 'pause'].map((c) => el('th', {}, c)))), el('tbody', {}, rows))));
}
function diffOption(c, selected) {
  return el('option', { value: c.id, selected }, `#${c.seq} turn ${c.turn} b${c.branch}`);
}
function pickDiff(c) {
  const to = document.getElementById('diff-to'), from = document.getElementById('diff-from');
  if (!to || !from) return;
  for (const sel of [to, from]) if (![...sel.options].some((o) => o.value === c.id)) sel.append(diffOption(c, false));
  from.value = to.value; to.value = c.id;
}
// The selects offer the newest DIFF_CHOICES checkpoints (a select of a
// thousand options costs the page a long layout); the tree's "diff" button
// adds any other.
function renderDiff() {
  const cks = state.sb.checkpoints.filter((c) => c.state === 'committed');
  const head = state.sb.info.head, hc = cks.find((c) => c.id === head);
  const from = hc && hc.parent ? hc.parent : (cks[0] && cks[0].id);
  const newest = cks.slice(-DIFF_CHOICES).reverse();
  const opts = (sel) => {
    const out = newest.map((c) => diffOption(c, c.id === sel));
    const picked = cks.find((c) => c.id === sel);
    if (picked && !newest.includes(picked)) out.push(diffOption(picked, true));
    return out;
  };
  replace('sb-diff', el('div', { class: 'card' }, el('h2', {}, 'Diff between two checkpoints'),
    el('div', { class: 'toolbar' }, 'from', el('select', { id: 'diff-from' }, opts(from)), 'to',
      el('select', { id: 'diff-to' }, opts(head)), el('button', { onclick: runDiff }, 'show')),
    el('div', { id: 'diff-out' })));
}
async function runDiff() {
  const a = document.getElementById('diff-from').value, b = document.getElementById('diff-to').value;
  try {
    state.diff = await api('GET', `/v1/checkpoints/${encodeURIComponent(a)}/diff/${encodeURIComponent(b)}?limit=10000`);
    state.diffPage = 0; renderDiffOut();
  } catch (e) { replace('diff-out', el('div', {}, errorBox(e))); }
}
function renderDiffOut() {
  const d = state.diff, start = state.diffPage * PAGE;
  const count = (k) => d.changes.filter((c) => c.kind === k).length;
  replace('diff-out', el('div', {},
    el('p', {}, `${d.total} changes: ${count('added')} added, ${count('modified')} modified, ${count('deleted')} deleted`,
      d.truncated ? ` (first ${d.changes.length} shown)` : ''),
    pager(state.diffPage, d.changes.length, PAGE, (p) => { state.diffPage = p; renderDiffOut(); }),
    el('table', {}, el('tbody', {}, d.changes.slice(start, start + PAGE).map((c) => el('tr', {},
      el('td', {}, c.kind), el('td', { class: 'wrap mono' }, c.path.startsWith('/') ? c.path : '/' + c.path), el('td', {}, c.type || ''),
      el('td', {}, c.size !== undefined ? bytes(c.size) : '')))))));
}
function renderEffects() {
  const fx = state.sb.effects;
  replace('sb-effects', el('div', { class: 'card' }, el('h2', {}, `Effects ledger (${fx.length})`),
    fx.length ? el('table', {}, el('thead', {}, el('tr', {}, ['op', 'state', 'turn', 'sandbox', 'key'].map((c) => el('th', {}, c)))),
      el('tbody', {}, fx.slice(-PAGE).reverse().map((f) => el('tr', {}, el('td', { class: 'mono' }, f.op),
        el('td', { class: f.state === 'committed' || f.state === 'unknown' ? 'state-dead' : '' }, f.state),
        el('td', {}, f.turn ?? '–'), el('td', {}, f.sandbox_id || ''), el('td', { class: 'wrap mono' }, f.key || '')))))
      : el('p', { class: 'muted' }, 'no external effects recorded'),
    el('p', { class: 'muted' }, 'A rollback restores files and processes; committed and unknown external effects ' +
      'after its target are not undone (the confirmation lists them).')));
}
function renderBudget() {
  const b = state.sb.budget;
  replace('sb-budget', el('div', { class: 'card' }, el('h2', {}, 'Budget (lineage ' + b.lineage + ')'),
    el('table', {}, el('tbody', {}, Object.keys(b.used).map((k) => el('tr', {}, el('td', {}, k),
      el('td', {}, typeof b.used[k] === 'number' ? +b.used[k].toFixed(3) : b.used[k]),
      el('td', { class: 'muted' }, b.limits[k] === null ? 'no limit' : 'of ' + b.limits[k])))))));
}

// ---- actions ------------------------------------------------------------------------------
function dialog(...kids) {
  const d = document.getElementById('dialog');
  d.replaceChildren(el('div', { class: 'card', role: 'dialog', 'aria-modal': 'true' }, ...kids));
  d.hidden = false;
}
function closeDialog() { document.getElementById('dialog').hidden = true; }
function effectList(fx) {
  return fx.length ? el('ul', {}, fx.map((f) => el('li', {}, el('code', {}, f.op || f.id), ' ', f.state || '',
    f.turn !== undefined ? ` (turn ${f.turn})` : '', f.key ? ' key ' + f.key : ''))) : el('p', { class: 'muted' }, 'none');
}
async function confirmRollback(c) {
  const sid = state.sb.id;
  let pv;
  try { pv = await api('GET', `/v1/sandboxes/${encodeURIComponent(sid)}/rollback/preview?checkpoint=${encodeURIComponent(c.id)}`); }
  catch (e) { dialog(errorBox(e), el('button', { onclick: closeDialog }, 'close')); return; }
  const notUndone = (pv.ledger.committed_after || []).concat(pv.ledger.unknown || []);
  const seen = pv.effects_not_undone || [];
  const out = el('div', { id: 'action-result' });
  dialog(el('h2', {}, `Roll ${state.sb.info.name} back to #${c.seq} (turn ${c.turn})?`),
    el('p', {}, `Files and processes return to checkpoint ${c.id}; a new branch starts there.`),
    el('h3', {}, `Left behind on the current line: ${pv.lost.length} checkpoint(s)`),
    pv.lost.length ? el('p', { class: 'mono' }, pv.lost.slice(0, 30).map((l) => `#${l.seq} (turn ${l.turn}, ${l.plan})`).join(', '),
      pv.lost.length > 30 ? ` and ${pv.lost.length - 30} more` : '') : el('p', { class: 'muted' }, 'nothing'),
    el('h3', {}, `External effects NOT undone: ${notUndone.length} in the ledger, ${seen.length} turn(s) seen by the inspector`),
    effectList(notUndone),
    seen.length ? el('ul', { id: 'seen-not-undone' }, seen.map((s) => el('li', {}, `turn ${s.turn} (${s.checkpoint}): `,
      s.unknown ? 'may have reached the outside (not observable)' : 'reached the outside', s.reasons.length ? ': ' + s.reasons.join('; ') : ''))) : '',
    el('div', { class: 'toolbar' },
      el('button', { class: 'danger', id: 'confirm', onclick: async (ev) => {
        ev.target.disabled = true;
        try {
          const r = await api('POST', `/v1/sandboxes/${encodeURIComponent(sid)}/rollback`, { checkpoint: c.id });
          out.replaceChildren(el('p', {}, `rolled back to ${r.checkpoint || c.id}; branch ${r.branch ?? ''}`));
          closeDialog(); showSandbox(sid);
        } catch (e) { out.replaceChildren(errorBox(e)); ev.target.disabled = false; }
      } }, 'roll back'),
      el('button', { onclick: closeDialog }, 'cancel')), out);
}
function confirmFork(c) {
  const out = el('div', { id: 'action-result' });
  const n = el('input', { id: 'fork-count', type: 'number', min: 1, max: 64, value: 1 });
  dialog(el('h2', {}, `Fork from #${c.seq} (turn ${c.turn})?`),
    el('p', {}, `New sandboxes start from checkpoint ${c.id} with its files and processes; ${state.sb.info.name} ` +
      'itself is not changed, nothing of it is lost.'),
    el('p', {}, 'External effects recorded up to this checkpoint happened once; the forks do not repeat or undo them ' +
      '(their ledger shares this lineage).'),
    el('div', { class: 'toolbar' }, el('label', {}, 'how many ', n),
      el('button', { class: 'danger', id: 'confirm', onclick: async (ev) => {
        ev.target.disabled = true;
        try {
          const r = await api('POST', `/v1/checkpoints/${encodeURIComponent(c.id)}/fork`, { count: Number(n.value) });
          out.replaceChildren(el('p', {}, 'forked: ', r.sandboxes.map((s) => link('#/sb/' + encodeURIComponent(s.id || s), (s.name || s) + ' '))));
          showSandbox(state.sb.id);
        } catch (e) { out.replaceChildren(errorBox(e)); ev.target.disabled = false; }
      } }, 'fork'),
      el('button', { onclick: closeDialog }, 'close')), out);
}

// ---- live: the event stream -----------------------------------------------------------------
function onEvent(e, backlog) {
  state.lastSeq = Math.max(state.lastSeq, e.seq);
  state.events.push(e);
  if (state.events.length > 500) state.events.splice(0, state.events.length - 500);
  soon('events', renderEvents, 100);
  if (backlog) return;   // already in what the view loaded
  const r = state.route;
  if (r.view === 'host') soon('host', showHost, 1000);   // one summary a second at most, however busy the host
  else if (r.view === 'sandbox' && state.sb && (e.sandbox_id === state.sb.id || e.kind === 'sandbox.created'))
    soon('sb', () => showSandbox(r.id), 300);
}
async function follow() {
  const live = document.getElementById('live');
  for (;;) {
    try {
      if (!state.lastSeq) {
        const p = await api('GET', '/v1/events?follow=false&latest=50');
        for (const e of p.events) onEvent(e, true);
        state.lastSeq = p.last_seq || 0;
      }
      const r = await fetch(`/v1/events?follow=true&since=${state.lastSeq}`, { headers: headers({ Accept: 'text/event-stream' }) });
      if (!r.ok) throw new Error('events: HTTP ' + r.status);
      live.textContent = 'live'; live.className = 'live';
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
          const block = buf.slice(0, i); buf = buf.slice(i + 2);
          const data = block.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6)).join('\n');
          if (data) onEvent(JSON.parse(data));
        }
      }
    } catch (err) { console.warn(err); }
    live.textContent = 'reconnecting'; live.className = 'live off';
    await new Promise((res) => setTimeout(res, 1000));
  }
}

window.addEventListener('hashchange', route);
// The stream starts once the first view is drawn: its backlog would compete with the view's data.
window.addEventListener('DOMContentLoaded', () => { route().finally(follow); });
