// ringd's dashboard. It polls /cluster/status of the node that served it and draws
// the ring; a chat box streams from that node's /v1/chat/completions (a follower
// forwards it to the leader). All URLs are relative: the page talks to no other host.
// It knows nothing of how nodes elect or plan; it shows what the status document says.
"use strict";

(() => {
  const POLL_INTERVAL_MS = 1000;
  // A node gathers /cluster/status waiting up to 2 s for each peer (status.py); a
  // node that does not answer in this long is treated as lost and asked again.
  const STATUS_TIMEOUT_MS = 8000;
  // Messages of the conversation sent with each new one: enough for a short chat.
  const HISTORY_MESSAGES = 20;
  // How often the running stream's own tokens/s is refreshed on screen.
  const RATE_REFRESH_MS = 250;
  const KEY_STORAGE = "ringd.apiKey";
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);

  // --- building DOM without innerHTML (names and errors come from the network) ---------

  function build(ns, tag, attrs, kids) {
    const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return node;
  }
  const h = (tag, attrs, ...kids) => build(null, tag, attrs, kids);
  const s = (tag, attrs, ...kids) => build(SVG_NS, tag, attrs, kids);

  function setText(id, text) {
    const node = $(id);
    if (node.textContent !== text) node.textContent = text;
  }

  // --- formatting -----------------------------------------------------------------------

  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const DASH = "—";

  function fmtBytes(n) {
    if (!isNum(n)) return DASH;
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return i === 0 ? `${n} B` : `${n.toFixed(n < 10 ? 2 : n < 100 ? 1 : 0)} ${units[i]}`;
  }

  function fmtRate(x) {
    if (!isNum(x)) return DASH;
    return x < 10 ? x.toFixed(2) : x < 1000 ? x.toFixed(1) : String(Math.round(x));
  }

  function fmtSeconds(x) {
    if (!isNum(x)) return DASH;
    if (x < 1) return `${Math.round(x * 1000)} ms`;
    if (x < 10) return `${x.toFixed(2)} s`;
    if (x < 120) return `${Math.round(x)} s`;
    return `${Math.round(x / 60)} min`;
  }

  const fmtCount = (n) => (isNum(n) ? n.toLocaleString() : DASH);
  const fmtRange = (r) => (Array.isArray(r) && r.length === 2 ? `[${r[0]}, ${r[1]})` : "no layers");
  const sameRange = (a, b) => Array.isArray(a) && Array.isArray(b) && a[0] === b[0] && a[1] === b[1];

  // --- the API key ---------------------------------------------------------------------

  function storedKey() {
    try {
      return localStorage.getItem(KEY_STORAGE) || "";
    } catch {
      return "";  // storage disabled: the key lives as long as the field
    }
  }

  function apiKey() {
    return $("api-key").value.trim() || storedKey();
  }

  function authHeaders() {
    const key = apiKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  // The message of an OpenAI-shaped error body, or the HTTP status.
  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error) return typeof body.error === "string" ? body.error : body.error.message || JSON.stringify(body.error);
    } catch {
      // not JSON: the status says enough
    }
    return `${response.status} ${response.statusText}`.trim();
  }

  // --- what the status document says ----------------------------------------------------

  const view = {
    doc: null,        // the last /cluster/status that answered
    entries: new Map(),
    stages: [],       // [{node, addr, start, end}] in ring order
    outside: [],      // names of linked nodes not in the plan
    leader: null,
    model: null,
    failing: null,    // why the last poll failed, or null
    failingSince: null,
  };

  // A node's health: its kind (ready, waiting, error), what it says, and a word for the drawing.
  function health(entry) {
    if (!entry) return { kind: "error", text: "no status from this node", note: "no status" };
    if (entry.error) return { kind: "error", text: String(entry.error), note: "no answer" };
    if (entry.report && entry.report.error) return { kind: "error", text: String(entry.report.error), note: "stage error" };
    if (entry.ready) return { kind: "ready", text: "ready", note: null };
    return { kind: "waiting", text: entry.reason || (entry.report && entry.report.state) || "not ready", note: "not ready" };
  }

  function roleOf(name) {
    if (name === view.leader) return "leader";
    const entry = view.entries.get(name);
    return (entry && entry.role) || "unknown";
  }

  function leaderEntry() {
    return view.leader ? view.entries.get(view.leader) : undefined;
  }

  function absorb(doc) {
    const entries = Array.isArray(doc.nodes) ? doc.nodes.filter((n) => n && typeof n.node === "string") : [];
    const plan = doc.plan && Array.isArray(doc.plan.stages) ? doc.plan : null;
    // A tensor-parallel group's stage is drawn as its first member; the caption names them all.
    const members = (node, group) => [node, ...(Array.isArray(group) ? group.filter(Array.isArray).map((m) => String(m[0])) : [])];
    const stages = plan ? plan.stages.filter(Array.isArray).map(([node, addr, start, end, group]) => ({ node, addr, start, end, members: members(node, group) })) : [];
    const inRing = new Set(stages.flatMap((st) => st.members));
    view.doc = doc;
    view.entries = new Map(entries.map((n) => [n.node, n]));
    view.stages = stages;
    view.outside = entries.map((n) => n.node).filter((name) => !inRing.has(name));
    view.leader = doc.leader || (plan && plan.leader) || null;
    const withModel = [leaderEntry(), ...entries].find((n) => n && typeof n.model === "string" && n.model);
    view.model = withModel ? withModel.model : view.model;
  }

  // A ring link a -> b: up when each side that answered lists the other among its links.
  function linkState(a, b) {
    const ea = view.entries.get(a), eb = view.entries.get(b);
    const la = ea && ea.links && typeof ea.links === "object" ? ea.links : null;
    const lb = eb && eb.links && typeof eb.links === "object" ? eb.links : null;
    if (!la && !lb) return { up: "unknown", encrypted: false, number: null };
    const ab = la ? la[b] : undefined, ba = lb ? lb[a] : undefined;
    const up = (la ? !!ab : true) && (lb ? !!ba : true);
    const info = ab || ba || {};
    return { up: up ? "true" : "false", encrypted: !!info.encrypted, number: isNum(info.number) ? info.number : null };
  }

  // --- the ring ------------------------------------------------------------------------

  // The ring's drawing, in SVG units: room above the top node for the leader's crown.
  const RING_WIDTH = 520;
  const RING_CX = 260;
  const RING_CY = 236;
  const RING_R = 158;
  const RING_BOTTOM = RING_CY + RING_R + 80;
  const OUTSIDE_ROW_H = 120;

  const round1 = (v) => Math.round(v * 10) / 10;
  const polar = (angle, r) => [round1(RING_CX + r * Math.cos(angle)), round1(RING_CY + r * Math.sin(angle))];
  const pt = ([x, y]) => `${x.toFixed(1)},${y.toFixed(1)}`;

  function crown(x, y) {
    return s("path", { class: "crown", d: "M-11,7 L-13,-6 L-6,0 L0,-9 L6,0 L13,-6 L11,7 Z", transform: `translate(${x.toFixed(1)},${y.toFixed(1)})` });
  }

  function lock(x, y) {
    return s("g", { class: "lock", transform: `translate(${x.toFixed(1)},${y.toFixed(1)})` },
      s("circle", { class: "lock-bg", r: 11 }),
      s("path", { d: "M-3.5,-1 v-3 a3.5,3.5 0 0 1 7,0 v3" }),
      s("rect", { x: -5.5, y: -1, width: 11, height: 8, rx: 1.5 }));
  }

  // A ring of memory around a node: its weights, then its KV in use, as parts of its budget.
  function gauge(x, y, r, entry) {
    const circumference = 2 * Math.PI * r;
    const parts = [s("circle", { class: "gauge-track", cx: x, cy: y, r })];
    const progress = entry && entry.progress;
    const rotate = `rotate(-90 ${x.toFixed(1)} ${y.toFixed(1)})`;
    if (progress && isNum(progress.bytes) && isNum(progress.total_bytes) && progress.total_bytes > 0) {
      const len = Math.min(1, progress.bytes / progress.total_bytes) * circumference;
      parts.push(s("circle", { class: "gauge-progress", cx: x, cy: y, r, transform: rotate, "stroke-dasharray": `${len.toFixed(1)} ${circumference.toFixed(1)}` }));
      return parts;
    }
    const budget = entry && entry.budget;
    if (!isNum(budget) || budget <= 0) return parts;
    // Anything held shows at least as a sliver.
    const length = (b) => (isNum(b) && b > 0 ? Math.max(2, Math.min(1, b / budget) * circumference) : 0);
    const weights = length(entry.parameter_bytes), kv = length(entry.kv_bytes);
    if (weights) parts.push(s("circle", { class: "gauge-weights", cx: x, cy: y, r, transform: rotate, "stroke-dasharray": `${weights.toFixed(1)} ${circumference.toFixed(1)}` }));
    if (kv) parts.push(s("circle", { class: "gauge-kv", cx: x, cy: y, r, transform: rotate, "stroke-dasharray": `${kv.toFixed(1)} ${circumference.toFixed(1)}`, "stroke-dashoffset": (-weights).toFixed(1) }));
    return parts;
  }

  function nodeTitle(name, entry, range) {
    const lines = [`${name} (${roleOf(name)})`, `layers ${fmtRange(range)}`, health(entry).text];
    if (entry && isNum(entry.budget)) lines.push(`weights ${fmtBytes(entry.parameter_bytes)}, KV ${fmtBytes(entry.kv_bytes)} of ${fmtBytes(entry.kv_capacity)}, budget ${fmtBytes(entry.budget)}`);
    if (entry && entry.addr) lines.push(`ring ${entry.addr}, http ${entry.http || DASH}`);
    return lines.join("\n");
  }

  // progress.py names its phases "download", "fetch" and "load".
  const PHASE_VERBS = { download: "downloading", fetch: "fetching from peers", load: "loading" };
  const phaseVerb = (phase) => PHASE_VERBS[phase] || (phase ? String(phase) : "loading");

  function progressNote(entry) {
    const p = entry && entry.progress;
    if (!p || typeof p !== "object") return null;
    if (!isNum(p.total_bytes) || p.total_bytes <= 0) return phaseVerb(p.phase);
    return `${phaseVerb(p.phase)} ${Math.floor((100 * (p.bytes || 0)) / p.total_bytes)}%`;
  }

  function ringNode(name, x, y, r, range, inRing) {
    const entry = view.entries.get(name);
    const state = health(entry);
    const role = roleOf(name);
    const drained = (leaderEntry() && Array.isArray(leaderEntry().drained) && leaderEntry().drained.includes(name));
    const note = progressNote(entry) || state.note;
    const outsideNote = inRing ? null : drained ? "drained" : "not in the plan";
    return s("g", {
      class: inRing ? "ring-node" : "ring-node outside",
      "data-node": name,
      "data-role": role,
      "data-health": state.kind,
      "data-in-ring": String(inRing),
    },
      s("title", {}, nodeTitle(name, entry, range)),
      gauge(x, y, r + 6, entry),
      s("circle", { class: "node-disc", cx: x, cy: y, r }),
      role === "leader" ? crown(x, y - r - 20) : null,
      s("text", { class: "name", x, y: y - r / 22 - 1 }, name),
      s("text", { class: "layers", x, y: y + r / 3 + 1 }, inRing ? fmtRange(range) : outsideNote),
      note ? s("text", { class: "note", x, y: y + r + 22 }, note) : null);
  }

  function linkArc(i, n, nodeR) {
    const a = view.stages[i].node, b = view.stages[(i + 1) % n].node;
    const step = (2 * Math.PI) / n;
    const from = -Math.PI / 2 + i * step, to = from + step;
    // Leave room for the discs and their gauges.
    const gap = Math.min(step / 3, (nodeR + 16) / RING_R);
    const start = polar(from + gap, RING_R), end = polar(to - gap, RING_R);
    const large = to - from - 2 * gap > Math.PI ? 1 : 0;
    const mid = (from + to) / 2;
    const [mx, my] = polar(mid, RING_R);
    const state = linkState(a, b);
    const description = `${a} → ${b}: ${state.up === "true" ? "up" : state.up === "false" ? "down" : "unknown"}` +
      (state.number !== null ? `, link #${state.number}` : "") + (state.encrypted ? ", encrypted" : "");
    const degrees = (mid * 180) / Math.PI + 90;
    return s("g", { class: "link", "data-from": a, "data-to": b, "data-up": state.up, "data-encrypted": String(state.encrypted) },
      s("title", {}, description),
      s("path", { class: "arc", d: `M${pt(start)} A${RING_R},${RING_R} 0 ${large} 1 ${pt(end)}` }),
      // Which way hidden states flow: clockwise, from stage i to stage i+1.
      s("path", { class: "arrow", d: "M-6,-6 L7,0 L-6,6 Z", transform: `translate(${mx.toFixed(1)},${my.toFixed(1)}) rotate(${degrees.toFixed(1)})` }),
      state.encrypted ? lock(...polar(mid, RING_R + 22)) : null);
  }

  let ringSignature = "";

  function drawRing() {
    const n = view.stages.length;
    const outside = view.outside;
    const signature = JSON.stringify([view.doc && view.doc.plan, view.leader, [...view.entries.values()].map(ringFacts)]);
    if (signature === ringSignature) return;
    ringSignature = signature;

    const svg = $("ring");
    const height = RING_BOTTOM + (outside.length ? OUTSIDE_ROW_H : 0);
    svg.setAttribute("viewBox", `0 0 ${RING_WIDTH} ${height}`);
    const nodeR = n <= 4 ? 44 : Math.max(22, Math.min(44, RING_R * Math.sin(Math.PI / n) - 14));
    const parts = [s("circle", { class: "track", cx: RING_CX, cy: RING_CY, r: RING_R })];

    if (n >= 2) for (let i = 0; i < n; i += 1) parts.push(linkArc(i, n, nodeR));
    view.stages.forEach((st, i) => {
      const [x, y] = polar(-Math.PI / 2 + (i * 2 * Math.PI) / Math.max(n, 1), RING_R);
      parts.push(ringNode(st.node, x, y, nodeR, [st.start, st.end], true));
    });

    const plan = view.doc && view.doc.plan;
    const overall = view.doc ? (view.doc.ready ? { kind: "ready", text: "serving" } : { kind: view.doc.reason ? "waiting" : "error", text: view.doc.reason || "not serving" }) : { kind: "error", text: "" };
    parts.push(
      s("text", { class: "center-title", x: RING_CX, y: RING_CY - 10 }, view.model || "ringd"),
      s("text", { class: "center-sub", x: RING_CX, y: RING_CY + 12 },
        plan ? `${plan.num_layers ?? "?"} layers · ${n} stage${n === 1 ? "" : "s"} · term ${plan.term ?? "?"}` : "no plan yet"),
      s("text", { class: `center-state ${overall.kind}`, x: RING_CX, y: RING_CY + 32 }, s("title", {}, overall.text), truncate(overall.text, 40)));

    if (outside.length) {
      const top = RING_BOTTOM;
      parts.push(s("line", { class: "outside-line", x1: 40, x2: RING_WIDTH - 40, y1: top, y2: top }));
      parts.push(s("text", { class: "outside-title", x: RING_CX, y: top + 18 }, "linked, outside the ring"));
      const r = 32, spacing = Math.min(130, (RING_WIDTH - 40) / outside.length);
      outside.forEach((name, i) => {
        const x = RING_CX + (i - (outside.length - 1) / 2) * spacing;
        const entry = view.entries.get(name);
        parts.push(ringNode(name, x, top + 64, r, entry && entry.layers, false));
      });
    }
    svg.replaceChildren(...parts);
    const label = (st) => st.members.join("+");
    setText("ring-caption", n ? view.stages.map(label).join(" → ") + (n > 1 ? ` → ${label(view.stages[0])}` : "") : "");
  }

  // What of a node the ring drawing shows (so it is redrawn only when that changes).
  function ringFacts(e) {
    return [e.node, e.role, e.ready, e.reason, e.error, e.layers, e.links, e.budget, e.parameter_bytes, e.kv_bytes, e.progress, e.report && e.report.error];
  }

  function truncate(text, n) {
    text = String(text || "");
    return text.length > n ? `${text.slice(0, n - 1)}…` : text;
  }

  // --- node cards ----------------------------------------------------------------------

  function lockIcon() {
    return s("svg", { viewBox: "-7 -9 14 17", "aria-hidden": "true" },
      s("g", { class: "lock" }, s("path", { d: "M-3.5,-1 v-3 a3.5,3.5 0 0 1 7,0 v3" }), s("rect", { x: -5.5, y: -1, width: 11, height: 8, rx: 1.5 })));
  }

  function bar(segments) {
    const el = h("div", { class: "bar" });
    for (const [cls, fraction, title] of segments) {
      const seg = h("span", { class: cls, title });
      seg.style.width = `${(Math.max(0, Math.min(1, fraction)) * 100).toFixed(3)}%`;
      // Anything held shows at least as a sliver.
      if (fraction > 0) seg.style.minWidth = "2px";
      el.append(seg);
    }
    return el;
  }

  function memory(entry) {
    const budget = entry.budget;
    if (!isNum(budget) || budget <= 0) {
      if (!isNum(entry.parameter_bytes)) return null;
      return h("div", { class: "mem-legend" }, `weights ${fmtBytes(entry.parameter_bytes)} · KV ${fmtBytes(entry.kv_bytes)} · no budget known`);
    }
    const weights = isNum(entry.parameter_bytes) ? entry.parameter_bytes : 0;
    const kv = isNum(entry.kv_bytes) ? entry.kv_bytes : 0;
    const capacity = isNum(entry.kv_capacity) ? entry.kv_capacity : null;
    const free = capacity !== null ? Math.max(0, capacity - kv) : 0;
    return h("div", { class: "mem" },
      bar([
        ["bar-weights", weights / budget, `weights ${fmtBytes(weights)}`],
        ["bar-kv", kv / budget, `KV cache in use ${fmtBytes(kv)}`],
        ["bar-kv-free", free / budget, `KV capacity left ${fmtBytes(free)}`],
      ]),
      h("div", { class: "mem-legend" },
        h("span", { class: "weights-label", "data-bytes": weights }, h("span", { class: "swatch weights" }), "weights ", h("b", {}, fmtBytes(weights))),
        h("span", { class: "kv-label", "data-bytes": kv }, h("span", { class: "swatch kv" }), "KV ", h("b", {}, fmtBytes(kv)), capacity !== null ? ` of ${fmtBytes(capacity)}` : ""),
        h("span", { class: "budget-label", "data-bytes": budget }, "budget ", h("b", {}, fmtBytes(budget)))));
  }

  function progress(entry) {
    const p = entry.progress;
    if (!p || typeof p !== "object") return null;
    const total = isNum(p.total_bytes) && p.total_bytes > 0 ? p.total_bytes : null;
    const done = isNum(p.bytes) ? p.bytes : 0;
    const files = isNum(p.files_total) && p.files_total > 1 ? ` (${p.files_done ?? 0} of ${p.files_total} files)` : "";
    const label = [
      Array.isArray(p.layers) ? `${phaseVerb(p.phase)} layers ${fmtRange(p.layers)}` : phaseVerb(p.phase),
      p.file ? `${p.file}${files}` : files.trim() || null,
      total ? `${fmtBytes(done)} of ${fmtBytes(total)} (${Math.floor((100 * done) / total)}%)` : fmtBytes(done),
    ];
    if (isNum(p.rate_bytes_s)) label.push(`${fmtBytes(p.rate_bytes_s)}/s`);  // 0 B/s: stalled
    if (isNum(p.rate_bytes_s) && p.rate_bytes_s > 0 && total) label.push(`about ${fmtSeconds((total - done) / p.rate_bytes_s)} left`);
    return h("div", { class: "progress", "data-phase": p.phase || "" },
      h("div", { class: "progress-label" }, label.filter(Boolean).join(" · ")),
      bar([["bar-progress", total ? done / total : 0, ""]]));
  }

  function links(entry) {
    if (!entry.links || typeof entry.links !== "object") return null;
    const peers = Object.keys(entry.links);
    if (!peers.length) return h("div", { class: "links muted" }, "no links");
    return h("div", { class: "links" }, peers.map((peer) => {
      const link = entry.links[peer] || {};
      return h("span", { class: "chip", "data-peer": peer, title: `link #${link.number ?? "?"}${link.encrypted ? ", encrypted" : ""}` },
        peer, link.encrypted ? lockIcon() : null);
    }));
  }

  function card(name, range, stage, inRing) {
    const entry = view.entries.get(name) || { node: name };
    const state = health(entry);
    const role = roleOf(name);
    const device = entry.device || {};
    const held = entry.layers;
    const foot = [
      device.chip, isNum(device.gpu_cores) ? `${device.gpu_cores} GPU cores` : isNum(device.cpu_cores) ? `${device.cpu_cores} cores` : null,
      isNum(entry.speed) ? `speed ${entry.speed}` : null, entry.addr ? `ring ${entry.addr}` : null, entry.http ? `http ${entry.http}` : null,
    ].filter(Boolean);
    return h("article", { class: "node-card", "data-node": name, "data-role": role, "data-health": state.kind, "data-in-ring": String(inRing) },
      h("header", {},
        role === "leader" ? s("svg", { viewBox: "-14 -11 28 20", "aria-hidden": "true" }, crown(0, 0)) : null,
        h("h3", {}, name),
        h("span", { class: "role" }, role),
        h("span", { class: "stage" }, inRing ? `stage ${stage}` : "outside the ring")),
      h("div", { class: "layers-row" },
        h("span", { class: "layers" }, inRing ? fmtRange(range) : fmtRange(held)),
        h("span", { class: "muted" }, view.doc && view.doc.plan && isNum(view.doc.plan.num_layers) ? `of ${view.doc.plan.num_layers} layers` : ""),
        inRing && held && !sameRange(held, range) ? h("span", { class: "muted" }, `holds ${fmtRange(held)}`) : null),
      h("div", { class: "health" }, state.text),
      progress(entry),
      memory(entry),
      links(entry),
      foot.length ? h("div", { class: "node-foot" }, foot.map((f) => h("span", {}, f))) : null);
  }

  const cardSignatures = new Map();

  function drawCards() {
    const wanted = [
      ...view.stages.flatMap((st, i) => st.members.map((name) => [name, [st.start, st.end], i, true])),
      ...view.outside.map((name) => [name, null, null, false]),
    ];
    const container = $("nodes");
    const old = new Map([...container.children].map((el) => [el.dataset.node, el]));
    const next = wanted.map(([name, range, stage, inRing]) => {
      const signature = JSON.stringify([view.entries.get(name), range, stage, inRing, view.leader, view.doc.plan && view.doc.plan.num_layers]);
      const previous = old.get(name);
      if (previous && cardSignatures.get(name) === signature) return previous;
      cardSignatures.set(name, signature);
      return card(name, range, stage, inRing);
    });
    // Only touch the DOM when something changed, so a selection in a card survives polling.
    if (next.length !== container.children.length || next.some((el, i) => container.children[i] !== el)) container.replaceChildren(...next);
    const ready = [...view.entries.values()].filter((e) => e.ready).length;
    setText("nodes-caption", `${view.entries.size} node${view.entries.size === 1 ? "" : "s"}, ${ready} ready`);
  }

  // --- models: the leader's instances, each a ring of its own ----------------------------

  // How long the model names offered in the load box are reused before /v1/models is asked again.
  const MODEL_NAMES_MAX_AGE_MS = 15000;

  // How long a load or unload that was answered waits for the status to show it (a poll
  // already under way when the answer came still shows the model as it was).
  const SETTLE_MS = 10000;

  // What this page asked for and the status cannot show yet.
  const models = {
    loading: new Map(),    // name typed -> when its load call was answered (null: not yet)
    unloading: new Map(),  // model name -> when its unload call was answered (null: not yet)
    namesAt: 0,            // when /v1/models was last asked
  };

  // The leader's instances, or null when its entry in the status lists none (no leader, or no answer from it).
  function instanceRows() {
    const leader = leaderEntry();
    if (!leader || !Array.isArray(leader.instances)) return null;
    return leader.instances.filter((row) => row && typeof row === "object" && typeof row.instance === "string");
  }

  const namesOf = (row) => [row.model, row.source, row.instance].filter((n) => typeof n === "string" && n);

  // An instance's state: serving, loading (with the ring's reason) or unloading (asked from here).
  function instanceState(row) {
    if (models.unloading.has(row.model)) return { kind: "unloading", word: "unloading", reason: "" };
    if (row.ready) return { kind: "ready", word: "serving", reason: "" };
    return { kind: "loading", word: "loading", reason: row.reason || "" };
  }

  function fmtIn(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 60) return `${seconds} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${seconds % 60} s`;
    return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
  }

  // When an idle instance unloads: changes every second, so kept out of the row's signature.
  function expiresText(row) {
    if (row.pinned) return "never unloads";
    if (!isNum(row.expires_at)) return "stays until unloaded";
    const at = new Date(row.expires_at * 1000).toLocaleTimeString();
    return `unloads at ${at} if idle (in ${fmtIn(row.expires_at - Date.now() / 1000)})`;
  }

  function ringPath(stages) {
    if (!stages.length) return h("span", { class: "muted" }, "no plan yet");
    return stages.map(([node, start, end], i) => [
      i ? h("span", { class: "hop-arrow", "aria-hidden": "true" }, "→") : null,
      h("span", { class: "hop", "data-node": node }, h("span", { class: "hop-node" }, node), " ", h("span", { class: "layers" }, fmtRange([start, end]))),
    ]);
  }

  function instanceRow(row, state) {
    const stages = Array.isArray(row.stages) ? row.stages.filter((st) => Array.isArray(st) && st.length === 3) : [];
    const replica = row.instance.includes("#") ? row.instance.slice(row.instance.lastIndexOf("#")) : null;
    const facts = [
      row.pinned ? "configured" : null,
      row.source && row.source !== row.model ? `from ${row.source}` : null,
      isNum(row.layers) ? `${row.layers} layers` : null,
      isNum(row.weights) ? fmtBytes(row.weights) : null,
      isNum(row.loaded_at) ? `loaded ${new Date(row.loaded_at * 1000).toLocaleTimeString()}` : null,
    ].filter(Boolean);
    const busy = models.unloading.has(row.model);
    return h("tr", { class: "instance", "data-instance": row.instance, "data-model": row.model, "data-state": state.kind, "data-pinned": String(!!row.pinned) },
      h("td", { class: "model-cell" },
        h("div", { class: "model-name" }, h("b", {}, row.model || DASH), replica ? h("span", { class: "replica", title: "a replica: a ring of its own over other nodes" }, replica) : null),
        h("div", { class: "model-facts muted" }, facts.join(" · "))),
      h("td", { class: "state-cell" },
        h("span", { class: "state" }, state.word),
        state.reason ? h("div", { class: "reason" }, state.reason) : null),
      h("td", { class: "ring-path", title: isNum(row.term) ? `plan term ${row.term}` : "" }, ringPath(stages)),
      h("td", { class: "requests" },
        h("span", { class: "active", title: "active" }, fmtCount(row.active)), " / ",
        h("span", { class: "queued", title: "queued" }, fmtCount(row.queued)), " / ",
        h("span", { class: "served", title: "served" }, fmtCount(row.served))),
      h("td", { class: "keep-cell" },
        h("div", { class: "keep-alive" }, row.keep_alive || DASH),
        h("div", { class: "expires muted" }, expiresText(row))),
      h("td", { class: "actions" }, row.pinned ? null :
        h("button", { type: "button", class: "unload", "data-model": row.model, disabled: busy, title: `unload ${row.model} (every replica of it)` }, busy ? "Unloading…" : "Unload")));
  }

  // A load asked for from this page that no instance shows yet.
  function pendingRow(name) {
    return h("tr", { class: "instance pending", "data-model": name, "data-state": "loading", "data-pending": "true" },
      h("td", { class: "model-cell" }, h("div", { class: "model-name" }, h("b", {}, name))),
      h("td", { class: "state-cell" }, h("span", { class: "state" }, "loading"), h("div", { class: "reason" }, "asked for; placing it on the nodes")),
      h("td", { class: "ring-path" }, h("span", { class: "muted" }, "no plan yet")),
      h("td", { class: "requests" }, DASH),
      h("td", { class: "keep-cell" }, DASH),
      h("td", { class: "actions" }));
  }

  const rowSignatures = new Map();

  function drawModels() {
    const rows = instanceRows();
    const shown = new Set((rows || []).flatMap(namesOf));
    const now = Date.now();
    for (const [name, at] of models.loading) if (at !== null && (shown.has(name) || now - at > SETTLE_MS)) models.loading.delete(name);
    for (const [name, at] of models.unloading) if (at !== null && (!shown.has(name) || now - at > SETTLE_MS)) models.unloading.delete(name);
    const body = $("models");
    const old = new Map([...body.children].map((el) => [el.dataset.key, el]));
    const next = [];
    for (const row of rows || []) {
      const state = instanceState(row);
      const key = `i:${row.instance}`;
      const { expires_at: _expires, ...rest } = row;
      const signature = JSON.stringify([rest, state]);
      let el = old.get(key);
      if (!el || rowSignatures.get(key) !== signature) {
        el = instanceRow(row, state);
        el.dataset.key = key;
        rowSignatures.set(key, signature);
      }
      const expires = el.querySelector(".expires");
      const text = expiresText(row);
      if (expires && expires.textContent !== text) expires.textContent = text;
      next.push(el);
    }
    for (const name of models.loading.keys()) {
      if (shown.has(name)) continue;
      const key = `p:${name}`;
      let el = old.get(key);
      if (!el) {
        el = pendingRow(name);
        el.dataset.key = key;
      }
      next.push(el);
    }
    if (next.length !== body.children.length || next.some((el, i) => body.children[i] !== el)) body.replaceChildren(...next);
    if (!rows) setText("models-caption", !view.leader ? "no leader yet" : leaderEntry() && !leaderEntry().error ? `${view.leader} lists no instances` : `no status from the leader (${view.leader})`);
    else {
      const serving = rows.filter((r) => r.ready).length;
      setText("models-caption", `${rows.length} loaded, ${serving} serving`);
    }
  }

  function loadStatus(kind, text) {
    const el = $("load-status");
    el.dataset.kind = kind;
    if (el.textContent !== text) el.textContent = text;
  }

  // Ollama's calls, which every node answers (a follower forwards them to the leader):
  // {"model", "prompt": ""} loads a model and answers once it serves; {"model", "keep_alive": 0}
  // unloads it. Errors come back as {"error": "..."} with a status (404 not in the list, 503 no room).
  async function ollamaGenerate(body) {
    const response = await fetch("api/generate", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ ...body, stream: false }),
    });
    if (!response.ok) throw new Error(`${response.status}: ${await errorMessage(response)}`);
    const answer = await response.json();
    if (answer && answer.error) throw new Error(String(answer.error));
    return answer;
  }

  // A keep_alive as Ollama takes it: a number is seconds, anything else a duration ("10m", "1h").
  function keepAliveValue(text) {
    return /^-?\d+(\.\d+)?$/.test(text) ? Number(text) : text;
  }

  async function loadModel() {
    const name = $("load-model").value.trim();
    if (!name || models.loading.has(name)) return;
    const keepAlive = $("load-keep-alive").value.trim();
    models.loading.set(name, null);
    loadStatus("loading", `loading ${name}…`);
    drawModels();
    try {
      await ollamaGenerate({ model: name, prompt: "", ...(keepAlive ? { keep_alive: keepAliveValue(keepAlive) } : {}) });
      models.loading.set(name, Date.now());
      loadStatus("ok", `${name} serves`);
      if ($("load-model").value.trim() === name) $("load-model").value = "";
    } catch (e) {
      models.loading.delete(name);
      loadStatus("error", `${name}: ${e && e.message ? e.message : String(e)}`);
    }
    models.namesAt = 0;
    poll();
  }

  async function unloadModel(model) {
    if (!model || models.unloading.has(model)) return;
    models.unloading.set(model, null);
    drawModels();
    try {
      await ollamaGenerate({ model, keep_alive: 0 });
      models.unloading.set(model, Date.now());
      loadStatus("ok", `${model} unloaded`);
    } catch (e) {
      models.unloading.delete(model);
      loadStatus("error", `${model}: ${e && e.message ? e.message : String(e)}`);
    }
    models.namesAt = 0;
    poll();
  }

  // The names the load box offers: the node's model list, each with whether it is loaded or fits.
  async function fetchModelNames() {
    if (Date.now() - models.namesAt < MODEL_NAMES_MAX_AGE_MS) return;
    models.namesAt = Date.now();
    try {
      const response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
      if (!response.ok) return;  // asked again on the box's next focus, at most every MODEL_NAMES_MAX_AGE_MS
      const body = await response.json();
      const data = body && Array.isArray(body.data) ? body.data.filter((m) => m && typeof m.id === "string") : [];
      const options = data.map((m) => h("option", { value: m.id, label: m.loaded ? "loaded" : m.fits === false ? `does not fit: ${m.fit || "too large"}` : null }));
      $("model-names").replaceChildren(...options);
    } catch {
      // the node is away: the polling says so; asked again as above
    }
  }

  // --- live figures -------------------------------------------------------------------

  function drawFigures() {
    const leader = leaderEntry();
    const stats = leader && leader.stats && typeof leader.stats === "object" ? leader.stats : null;
    const streamRate = chat.stream ? chat.stream.rate() : null;
    let tps = DASH, source = "";
    if (stats && isNum(stats.tokens_per_s)) {
      tps = fmtRate(stats.tokens_per_s);
      source = "the ring, all requests";
    } else if (isNum(streamRate)) {
      tps = fmtRate(streamRate);
      source = "this chat's stream";
    } else if (chat.lastRate !== null) {
      source = `last chat: ${fmtRate(chat.lastRate)} tok/s`;
    }
    setText("tokens-per-s", tps);
    setText("tokens-per-s-source", source);
    setText("ttft", stats && isNum(stats.ttft_s) ? fmtSeconds(stats.ttft_s) : DASH);
    const pick = (key) => (stats && isNum(stats[key]) ? stats[key] : leader && isNum(leader[key]) ? leader[key] : null);
    setText("active-requests", fmtCount(pick("active_requests")));
    setText("queued-requests", fmtCount(pick("queued_requests")));
    setText("requests-total", fmtCount(stats ? stats.requests_total : null));
    setText("tokens-out-total", fmtCount(stats ? stats.tokens_out_total : null));
    setText("micro-batches", fmtCount(stats ? stats.micro_batches : null));
    setText("draft-acceptance", stats && isNum(stats.draft_acceptance) ? `${Math.round(stats.draft_acceptance * 100)}%` : DASH);
  }

  function drawSummary() {
    const doc = view.doc;
    const pill = $("cluster-ready");
    let state, text;
    if (view.failing && view.failing.kind === "auth") [state, text] = ["auth", "API key needed"];
    else if (view.failing) [state, text] = ["lost", "connection lost"];
    else if (!doc) [state, text] = ["unknown", "connecting…"];
    else if (doc.ready) [state, text] = ["ready", "serving"];
    else [state, text] = ["waiting", "not serving"];
    pill.dataset.state = state;
    pill.textContent = text;
    pill.title = doc && !doc.ready ? doc.reason || "" : "";
    setText("cluster-model", view.model || DASH);
    setText("cluster-leader", view.leader || "none");
    setText("cluster-term", doc && doc.plan && isNum(doc.plan.term) ? String(doc.plan.term) : DASH);
    setText("served-by", doc && doc.node ? doc.node : DASH);
    document.title = view.model ? `ringd · ${view.model}${view.leader ? ` · ${view.leader} leads` : ""}` : "ringd";
  }

  function showBanner(kind, text) {
    const banner = $("banner");
    if (!kind) {
      banner.hidden = true;
      delete banner.dataset.kind;
      return;
    }
    banner.dataset.kind = kind;
    if (banner.textContent !== text) banner.textContent = text;
    banner.hidden = false;
  }

  function drawAll() {
    if (view.doc) {
      drawRing();
      drawCards();
      drawModels();
    }
    drawFigures();
    drawSummary();
    document.body.classList.toggle("stale", !!view.failing && !!view.doc);
  }

  // --- polling -------------------------------------------------------------------------

  let pollTimer = null;
  let askedForKey = false;

  function fail(kind, message) {
    if (!view.failing) view.failingSince = new Date();
    view.failing = { kind, message };
    const since = view.failingSince.toLocaleTimeString();
    if (kind === "auth") {
      showBanner("auth", `This node asks for an API key (${message}). Enter it in the "API key" field above; it is kept in this browser only.`);
      $("key-form").classList.add("attention");
      if (!askedForKey) {
        askedForKey = true;
        $("api-key").focus();
      }
    } else if (kind === "lost") {
      showBanner("lost", `Lost the connection to this node since ${since} (${message}). Retrying every second; the figures below are the last ones seen.`);
    } else {
      showBanner("error", `This node's status is failing since ${since}: ${message}. Retrying every second.`);
    }
  }

  async function poll() {
    clearTimeout(pollTimer);
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), STATUS_TIMEOUT_MS);
    try {
      const response = await fetch("cluster/status", { headers: authHeaders(), cache: "no-store", signal: abort.signal });
      if (response.status === 401) {
        fail("auth", await errorMessage(response));
      } else if (!response.ok) {
        fail("error", await errorMessage(response));
      } else {
        const doc = await response.json();
        if (!doc || typeof doc !== "object") throw new Error("the status is not a JSON object");
        absorb(doc);
        view.failing = null;
        view.failingSince = null;
        askedForKey = false;
        $("key-form").classList.remove("attention");
        showBanner(null);
        setText("updated", `updated ${new Date().toLocaleTimeString()}`);
        if (!models.namesAt) fetchModelNames();
      }
    } catch (e) {
      fail("lost", abort.signal.aborted ? `no answer within ${STATUS_TIMEOUT_MS / 1000} s` : e && e.message ? e.message : String(e));
    } finally {
      clearTimeout(timer);
      drawAll();
      pollTimer = setTimeout(poll, POLL_INTERVAL_MS);
    }
  }

  // --- chat ----------------------------------------------------------------------------

  const chat = {
    history: [],      // [{role, content}] of finished turns
    stream: null,     // the stream running now
    lastRate: null,   // tokens/s of the last finished stream
  };

  // One streamed answer: counts its token chunks over time.
  class Stream {
    constructor() {
      this.started = performance.now();
      this.first = null;
      this.last = null;
      this.tokens = 0;
      this.abort = new AbortController();
    }

    token() {
      const now = performance.now();
      if (this.first === null) this.first = now;
      this.last = now;
      this.tokens += 1;
    }

    // Tokens/s since the first token; while running, measured to now, so a stall shows.
    rate(finished = false) {
      if (this.first === null || this.tokens < 2) return null;
      const end = finished ? this.last : performance.now();
      const seconds = (end - this.first) / 1000;
      return seconds > 0 ? (this.tokens - 1) / seconds : null;
    }

    ttft() {
      return this.first === null ? null : (this.first - this.started) / 1000;
    }
  }

  function scrollChat() {
    const out = $("chat-output");
    out.scrollTop = out.scrollHeight;
  }

  function message(role, text) {
    const empty = $("chat-output").querySelector(".empty");
    if (empty) empty.remove();
    const el = h("div", { class: `msg ${role}`, "data-role": role }, h("div", { class: "text" }, text));
    $("chat-output").append(el);
    scrollChat();
    return el;
  }

  // The model to ask for: the one the status names, else the one /v1/models names.
  async function modelId() {
    if (view.model) return view.model;
    const response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    const id = body && Array.isArray(body.data) && body.data[0] && body.data[0].id;
    if (!id) throw new Error("this node names no model yet");
    return id;
  }

  function setStreaming(on) {
    $("chat-send").disabled = on;
    $("chat-stop").hidden = !on;
    $("chat-clear").disabled = on;
  }

  function drawStreamMeta(stream, meta, finished) {
    const rate = stream.rate(finished);
    setText("chat-tokens-per-s", fmtRate(rate));
    const parts = [`${stream.tokens} token${stream.tokens === 1 ? "" : "s"}`];
    if (isNum(rate)) parts.push(`${fmtRate(rate)} tok/s`);
    if (isNum(stream.ttft())) parts.push(`first token ${fmtSeconds(stream.ttft())}`);
    meta.textContent = parts.join(" · ");
    drawFigures();
  }

  async function send() {
    const input = $("chat-input");
    const text = input.value.trim();
    if (!text || chat.stream) return;
    const request = { model: null, messages: null, stream: true, max_tokens: Math.max(1, Math.floor(Number($("chat-max-tokens").value) || 200)) };
    // Left empty, the node's default sampling; 0 is greedy (the same answer every time).
    const temperature = $("chat-temperature").value.trim();
    if (temperature !== "" && Number.isFinite(Number(temperature))) request.temperature = Number(temperature);
    input.value = "";
    message("user", text);
    const answer = message("assistant", "");
    answer.classList.add("streaming");
    const body = answer.querySelector(".text");
    const meta = answer.appendChild(h("div", { class: "meta" }));
    const messages = [...chat.history, { role: "user", content: text }].slice(-HISTORY_MESSAGES);

    const stream = (chat.stream = new Stream());
    setStreaming(true);
    const refresh = setInterval(() => drawStreamMeta(stream, meta, false), RATE_REFRESH_MS);
    let error = null, done = false;
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
        body: JSON.stringify({ ...request, model: await modelId(), messages }),
        signal: stream.abort.signal,
      });
      if (!response.ok) {
        error = `${response.status}: ${await errorMessage(response)}`;
        if (response.status === 401) {
          fail("auth", "the chat was refused without a valid key");
          drawSummary();
        }
      } else {
        done = await readEvents(response, (event) => {
          if (event.error) {
            error = typeof event.error === "string" ? event.error : event.error.message || JSON.stringify(event.error);
            return;
          }
          const choice = event.choices && event.choices[0];
          const delta = choice && choice.delta;
          // The first chunk only names the role; every later one carries one token.
          if (!delta || delta.role !== undefined || typeof delta.content !== "string") return;
          stream.token();
          if (delta.content) body.append(delta.content);
          scrollChat();
        });
        if (!done && !error && !stream.abort.signal.aborted) error = "the stream ended without data: [DONE]";
      }
    } catch (e) {
      if (!stream.abort.signal.aborted) error = e && e.message ? e.message : String(e);
    } finally {
      clearInterval(refresh);
      chat.stream = null;
      answer.classList.remove("streaming");
      drawStreamMeta(stream, meta, true);
      if (stream.abort.signal.aborted) meta.append(" · stopped");
      chat.lastRate = stream.rate(true);
      setStreaming(false);
      drawFigures();
    }
    if (error) answer.append(h("div", { class: "error" }, error));
    const said = body.textContent;
    if (said || !error) {
      // Keep what was shown, even a stopped answer, as the conversation so far.
      chat.history.push({ role: "user", content: text }, { role: "assistant", content: said });
      chat.history = chat.history.slice(-HISTORY_MESSAGES);
    } else {
      answer.dataset.failed = "true";
      if (!input.value) input.value = text;  // nothing came back: let it be sent again
    }
    answer.dataset.done = "true";
  }

  // Server-sent events: calls onEvent with each data object; true once data: [DONE] came.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = done ? "" : events.pop();
      for (const raw of events) {
        const data = raw.split(/\r?\n/).filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart()).join("\n");
        if (!data) continue;  // a comment or keep-alive
        if (data === "[DONE]") return true;
        try {
          onEvent(JSON.parse(data));
        } catch (e) {
          onEvent({ error: `an unreadable event: ${truncate(data, 120)}` });
        }
      }
      if (done) return false;
    }
  }

  function clearChat() {
    if (chat.stream) return;
    chat.history = [];
    $("chat-output").replaceChildren(h("p", { class: "muted empty" }, "A new conversation."));
    setText("chat-tokens-per-s", DASH);
  }

  // --- wiring --------------------------------------------------------------------------

  function start() {
    $("api-key").value = storedKey();
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("api-key").value.trim();
      try {
        if (key) localStorage.setItem(KEY_STORAGE, key);
        else localStorage.removeItem(KEY_STORAGE);
      } catch {
        // storage disabled: the field still holds the key for this page
      }
      models.namesAt = 0;  // the list again, with this key, once the status answers
      poll();
    });
    $("chat-form").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $("chat-stop").addEventListener("click", () => chat.stream && chat.stream.abort.abort());
    $("chat-clear").addEventListener("click", clearChat);
    $("load-form").addEventListener("submit", (e) => {
      e.preventDefault();
      loadModel();
    });
    $("load-model").addEventListener("focus", fetchModelNames);
    $("models").addEventListener("click", (e) => {
      const button = e.target instanceof Element ? e.target.closest("button.unload") : null;
      if (button && !button.disabled) unloadModel(button.dataset.model);
    });
    poll();
  }

  start();
})();
