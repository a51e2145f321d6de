/* fxprep graph view. Reads the graph description embedded in the page (script#fxprep-data), folds
 * nodes into their module hierarchy, lays the visible boxes out in layers (inputs at the top, data
 * flowing down), and draws them as SVG. No network, no libraries: the page works from a file.
 *
 * Layout: a small Sugiyama-style layered layout. Boxes get a layer by the longest path from the
 * inputs (constants are pulled down next to their first user), are ordered within a layer by the
 * mean position of their neighbours (a few sweeps down and up), and placed left to right close to
 * their predecessors. A big graph opens folded (top-level modules as single boxes) so it fits a
 * screen; clicking a module box unfolds it, the module tree and the search unfold what they reveal.
 */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("fxprep-data").textContent);
  var nodes = data.nodes;
  var byName = new Map();
  nodes.forEach(function (n, i) { n.index = i; n.users = []; byName.set(n.name, n); });
  nodes.forEach(function (n) {
    n.inputs.forEach(function (s) { var src = byName.get(s); if (src) src.users.push(n.name); });
  });

  // How each kind is drawn: fill, stroke, dash, shape. Labels and meanings come from Python (data.kinds).
  var STYLE = {
    input: { fill: "#bee3f8", stroke: "#2b6cb0", shape: "pill" },
    module: { fill: "#ffffff", stroke: "#4a5568", shape: "rect" },
    added: { fill: "#c6f6d5", stroke: "#2f855a", shape: "round" },
    unrolled: { fill: "#feebc8", stroke: "#c05621", shape: "rect", dash: "6 2" },
    opaque: { fill: "url(#hatch)", stroke: "#c53030", shape: "rect", width: 2 },
    left: { fill: "#fefcbf", stroke: "#b7791f", shape: "hex", dash: "3 2" },
    functional: { fill: "#edf2f7", stroke: "#a0aec0", shape: "pill" },
    attr: { fill: "#e2e8f0", stroke: "#718096", shape: "rect" },
    group: { fill: "#f7fafc", stroke: "#2d3748", shape: "group", width: 2 }
  };
  var BADGE_KINDS = ["added", "unrolled", "opaque", "left"];

  // --- the module hierarchy ------------------------------------------------------------------------
  var groups = new Map();
  function group(path) {
    var g = groups.get(path);
    if (g) return g;
    g = { path: path, name: path.split(".").pop(), children: [], nodes: [], total: 0, counts: {}, first: Infinity };
    groups.set(path, g);
    if (path !== "") {
      var parent = group(path.lastIndexOf(".") < 0 ? "" : path.slice(0, path.lastIndexOf(".")));
      parent.children.push(g);
      g.parent = parent;
    }
    return g;
  }
  group("");
  nodes.forEach(function (n) {
    var g = group(n.scope || "");
    g.nodes.push(n);
    for (var a = g; a; a = a.parent) {
      a.total += 1;
      a.counts[n.kind] = (a.counts[n.kind] || 0) + 1;
      a.first = Math.min(a.first, n.index);
    }
  });
  groups.forEach(function (g) { g.children.sort(function (a, b) { return a.first - b.first; }); });
  function groupClass(path) { // containers fx rebuilt as plain Modules say nothing: not shown
    var cls = (data.modules || {})[path] || "";
    return cls === "Module" ? "" : cls;
  }

  var expanded = new Set([""]);
  function ancestors(scope) {
    var out = [];
    if (!scope) return out;
    var parts = scope.split("."), path = "";
    parts.forEach(function (p) { path = path ? path + "." + p : p; out.push(path); });
    return out;
  }
  function repOf(n) { // the visible box a node is drawn in: itself, or its outermost folded module
    var chain = ancestors(n.scope);
    for (var i = 0; i < chain.length; i++) if (!expanded.has(chain[i])) return "g:" + chain[i];
    return "n:" + n.name;
  }
  function visibleCount() {
    var seen = new Set();
    nodes.forEach(function (n) { seen.add(repOf(n)); });
    return seen.size;
  }
  function autoExpand(limit) { // unfold whole levels of the hierarchy while the screen stays readable
    expanded = new Set([""]);
    var count = visibleCount(), level = groups.get("").children.slice();
    while (level.length) {
      var delta = level.reduce(function (s, g) { return s + g.nodes.length + g.children.length - 1; }, 0);
      if (count + delta > limit) break;
      level.forEach(function (g) { expanded.add(g.path); });
      count += delta;
      level = level.reduce(function (next, g) { return next.concat(g.children); }, []);
    }
  }

  // --- the visible graph ----------------------------------------------------------------------------
  function short(dtype) {
    return ({ float32: "f32", float16: "f16", bfloat16: "bf16", float64: "f64", int64: "i64", int32: "i32", bool: "bool" })[dtype] || dtype;
  }
  function valuesText(values) {
    if (!values || !values.length) return "";
    return values.map(function (v) { return (v.shape.length ? v.shape.join("\u00d7") : "scalar") + " " + short(v.dtype); }).join(", ");
  }
  function clip(text, n) { return text.length > n ? text.slice(0, n - 1) + "\u2026" : text; }

  function buildItems() {
    var items = new Map(), edges = new Map();
    nodes.forEach(function (n) {
      var id = repOf(n), item = items.get(id);
      if (!item) {
        if (id[0] === "g") {
          var g = groups.get(id.slice(2));
          item = { id: id, group: g, kind: "group", first: g.first,
                   line1: "\u25b8 " + g.path, line2: (groupClass(g.path) ? groupClass(g.path) + " \u00b7 " : "") + g.total + " nodes" };
        } else {
          item = { id: id, node: n, kind: n.kind, first: n.index,
                   line1: n.op === "call_module" ? n.module : n.name, line2: n.label };
        }
        items.set(id, item);
      }
    });
    nodes.forEach(function (n) {
      var b = repOf(n);
      n.inputs.forEach(function (s) {
        var src = byName.get(s);
        if (!src) return;
        var a = repOf(src);
        if (a === b) return;
        var key = a + "\u2192" + b, e = edges.get(key);
        if (!e) { e = { key: key, from: a, to: b, sources: new Set() }; edges.set(key, e); }
        e.sources.add(src.name);
      });
    });
    items.forEach(function (it) {
      var chars = Math.max(it.line1.length, it.line2.length);
      it.w = Math.max(70, Math.min(280, chars * 6.4 + 22));
      it.h = it.kind === "group" ? 46 : (it.kind === "attr" || it.kind === "functional" ? 32 : 36);
      it.line1 = clip(it.line1, Math.floor((it.w - 16) / 6.4));
      it.line2 = clip(it.line2 || "", Math.floor((it.w - 16) / 6.4));
    });
    return { items: Array.from(items.values()).sort(function (a, b) { return a.first - b.first; }), edges: Array.from(edges.values()) };
  }

  function layout(graph) {
    var items = graph.items, rank = new Map();
    items.forEach(function (it, i) { rank.set(it.id, i); it.preds = []; it.succs = []; });
    graph.edges.forEach(function (e) {
      var a = rank.get(e.from), b = rank.get(e.to);
      e.back = a > b;
      var lo = items[Math.min(a, b)], hi = items[Math.max(a, b)];
      hi.preds.push(lo); lo.succs.push(hi);
    });
    items.forEach(function (it) { // longest path from the inputs
      it.layer = 0;
      it.preds.forEach(function (p) { it.layer = Math.max(it.layer, p.layer + 1); });
    });
    for (var i = items.length - 1; i >= 0; i--) { // constants next to their first user
      var it = items[i];
      if (!it.preds.length && it.succs.length && it.kind !== "input") {
        it.layer = Math.min.apply(null, it.succs.map(function (s) { return s.layer; })) - 1;
      }
    }
    var layers = [];
    items.forEach(function (it) { (layers[it.layer] = layers[it.layer] || []).push(it); });
    layers = layers.filter(Boolean);
    layers.forEach(function (layer, li) { layer.forEach(function (it, k) { it.layer = li; it.pos = k; }); });
    function sweep(layer, neighbours) {
      layer.forEach(function (it) {
        var ns = neighbours(it);
        it.bary = ns.length ? ns.reduce(function (s, n) { return s + n.pos; }, 0) / ns.length : it.pos;
      });
      layer.sort(function (a, b) { return a.bary - b.bary || a.first - b.first; });
      layer.forEach(function (it, k) { it.pos = k; });
    }
    for (var round = 0; round < 4; round++) {
      layers.forEach(function (layer) { sweep(layer, function (it) { return it.preds; }); });
      for (var l = layers.length - 1; l >= 0; l--) sweep(layers[l], function (it) { return it.succs; });
    }
    var GAP = 28, y = 30;
    layers.forEach(function (layer) {
      var height = Math.max.apply(null, layer.map(function (it) { return it.h; }));
      var x = 0;
      layer.forEach(function (it) { it.x = x + it.w / 2; x += it.w + GAP; it.y = y + height / 2; });
      y += height + 44;
    });
    function place(layer, neighbours) { // near the neighbours' centre, keeping order and gaps
      var want = layer.map(function (it) {
        var ns = neighbours(it);
        return ns.length ? ns.reduce(function (s, n) { return s + n.x; }, 0) / ns.length : it.x;
      });
      var xs = [];
      layer.forEach(function (it, k) {
        xs[k] = k === 0 ? want[k] : Math.max(want[k], xs[k - 1] + layer[k - 1].w / 2 + GAP + it.w / 2);
      });
      var shift = 0;
      layer.forEach(function (it, k) { shift += want[k] - xs[k]; });
      shift /= layer.length;
      layer.forEach(function (it, k) { it.x = xs[k] + shift; });
    }
    for (var r = 0; r < 3; r++) {
      layers.forEach(function (layer) { place(layer, function (it) { return it.preds; }); });
      for (var m = layers.length - 1; m >= 0; m--) place(layers[m], function (it) { return it.succs.length ? it.succs : it.preds; });
    }
    var minX = Infinity, maxX = -Infinity;
    items.forEach(function (it) { minX = Math.min(minX, it.x - it.w / 2); maxX = Math.max(maxX, it.x + it.w / 2); });
    items.forEach(function (it) { it.x -= minX - 30; });
    graph.width = maxX - minX + 60;
    graph.height = y;
    return graph;
  }

  // --- drawing --------------------------------------------------------------------------------------
  function el(tag, attrs, parent) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs || {}).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(e);
    return e;
  }
  function shape(kind, w, h, parent) {
    var s = STYLE[kind] || STYLE.module, e;
    if (s.shape === "pill") e = el("rect", { width: w, height: h, rx: h / 2 }, parent);
    else if (s.shape === "round") e = el("rect", { width: w, height: h, rx: 10 }, parent);
    else if (s.shape === "hex") {
      var d = 10;
      e = el("polygon", { points: [d + ",0", (w - d) + ",0", w + "," + h / 2, (w - d) + "," + h, d + "," + h, "0," + h / 2].join(" ") }, parent);
    } else if (s.shape === "group") { // a stack of cards: a folded module
      el("rect", { x: 4, y: 4, width: w, height: h, rx: 4, fill: "#e2e8f0", stroke: "#a0aec0" }, parent);
      e = el("rect", { width: w, height: h, rx: 4 }, parent);
    } else e = el("rect", { width: w, height: h, rx: 2 }, parent);
    e.setAttribute("fill", s.fill);
    e.setAttribute("stroke", s.stroke);
    e.setAttribute("stroke-width", s.width || 1.3);
    if (s.dash) e.setAttribute("stroke-dasharray", s.dash);
    e.setAttribute("class", "box");
    return e;
  }

  var svg = document.getElementById("graph"), viewport = document.getElementById("viewport");
  var current = null, selected = null, view = { x: 0, y: 0, k: 1 };
  var boxOf = new Map(), edgeEls = [];

  function render() {
    current = layout(buildItems());
    while (viewport.firstChild) viewport.removeChild(viewport.firstChild);
    boxOf = new Map(); edgeEls = [];
    var byId = new Map(current.items.map(function (it) { return [it.id, it]; }));
    var edgeLayer = el("g", {}, viewport), nodeLayer = el("g", {}, viewport);
    current.edges.forEach(function (e) {
      var a = byId.get(e.from), b = byId.get(e.to);
      var x1 = a.x, y1 = a.y + a.h / 2, x2 = b.x, y2 = b.y - b.h / 2;
      if (e.back) { y1 = a.y - a.h / 2; y2 = b.y + b.h / 2; }
      var dy = Math.max(30, Math.abs(y2 - y1) / 2) * (y2 >= y1 ? 1 : -1);
      var g = el("g", { "class": "edge" + (e.back ? " back" : "") }, edgeLayer);
      el("path", { d: "M" + x1 + "," + y1 + " C" + x1 + "," + (y1 + dy) + " " + x2 + "," + (y2 - dy) + " " + x2 + "," + y2,
                   "marker-end": "url(#arrow)" }, g);
      var text = "";
      if (e.sources.size === 1) text = valuesText(byName.get(Array.from(e.sources)[0]).values);
      else text = e.sources.size + " values";
      if (text) { // at the middle; near the target when the source fans out (labels would pile up)
        var at = a.succs.length > 1 ? 0.72 : 0.5, u = 1 - at;
        var lx = u * u * u * x1 + 3 * u * u * at * x1 + 3 * u * at * at * x2 + at * at * at * x2;
        var ly = u * u * u * y1 + 3 * u * u * at * (y1 + dy) + 3 * u * at * at * (y2 - dy) + at * at * at * y2;
        var t = el("text", { x: lx + 4, y: ly + 3 }, g);
        t.textContent = clip(text, 44);
        el("title", {}, g).textContent = Array.from(e.sources).map(function (s) {
          return s + ": " + (valuesText(byName.get(s).values) || "shape not recorded");
        }).join("\n");
      }
      g.dataset.from = e.from; g.dataset.to = e.to;
      edgeEls.push(g);
    });
    current.items.forEach(function (it) {
      var g = el("g", { "class": "node kind-" + it.kind, transform: "translate(" + (it.x - it.w / 2) + "," + (it.y - it.h / 2) + ")" }, nodeLayer);
      g.dataset.id = it.id;
      shape(it.kind, it.w, it.h, g);
      var t1 = el("text", { x: 8, y: it.kind === "group" ? 16 : 15 }, g);
      t1.textContent = it.line1;
      var t2 = el("text", { x: 8, y: it.kind === "group" ? 30 : 28, "class": "sub" }, g);
      t2.textContent = it.line2;
      if (it.group) {
        var bx = 8;
        BADGE_KINDS.forEach(function (k) {
          var c = it.group.counts[k];
          if (!c) return;
          el("circle", { cx: bx + 4, cy: 39, r: 4, fill: STYLE[k].fill.indexOf("url") === 0 ? "#fc8181" : STYLE[k].fill, stroke: STYLE[k].stroke }, g);
          var bt = el("text", { x: bx + 11, y: 42, "class": "sub" }, g);
          bt.textContent = String(c);
          bx += 16 + 6 * String(c).length;
        });
      }
      var tip = it.group ? it.group.path + " (" + (groupClass(it.group.path) || "module") + "): " + it.group.total + " nodes; click to unfold"
        : (it.node.name + " \u2014 " + (data.kinds[it.kind] || {}).label + (it.node.detail ? ": " + it.node.detail : ""));
      el("title", {}, g).textContent = tip;
      g.addEventListener("click", function (ev) {
        ev.stopPropagation();
        if (it.group) unfold(it.group.path);
        else select(it.node, false);
      });
      boxOf.set(it.id, g);
    });
    svg.setAttribute("data-visible", String(current.items.length));
    if (selected) highlight(selected);
    applyView();
  }

  // --- pan and zoom ---------------------------------------------------------------------------------
  function applyView() { viewport.setAttribute("transform", "translate(" + view.x + "," + view.y + ") scale(" + view.k + ")"); }
  function fit(all) { // the whole graph, or (a tall one) readable from its top
    var r = svg.getBoundingClientRect(), w = r.width || 800, h = r.height || 600;
    var k = Math.min(1, (w - 20) / current.width, (h - 20) / current.height);
    if (all !== true && k < 0.6) k = Math.min(0.75, (w - 20) / current.width);
    view.k = Math.max(0.02, k);
    view.x = (w - current.width * view.k) / 2;
    view.y = 10;
    applyView();
  }
  function centerOn(it) {
    var r = svg.getBoundingClientRect();
    view.k = Math.max(view.k, 0.8);
    view.x = (r.width || 800) / 2 - it.x * view.k;
    view.y = (r.height || 600) / 2 - it.y * view.k;
    applyView();
  }
  svg.addEventListener("wheel", function (ev) { // the wheel scrolls; with Ctrl (or a pinch) it zooms
    ev.preventDefault();
    if (!ev.ctrlKey && !ev.metaKey) {
      view.x -= ev.shiftKey ? ev.deltaY : ev.deltaX;
      view.y -= ev.shiftKey ? 0 : ev.deltaY;
      applyView();
      return;
    }
    var r = svg.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
    var k = Math.min(4, Math.max(0.03, view.k * Math.exp(-ev.deltaY * 0.0015)));
    view.x = mx - (mx - view.x) * k / view.k;
    view.y = my - (my - view.y) * k / view.k;
    view.k = k;
    applyView();
  }, { passive: false });
  var drag = null;
  svg.addEventListener("mousedown", function (ev) { drag = { x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y }; svg.classList.add("dragging"); });
  window.addEventListener("mousemove", function (ev) {
    if (!drag) return;
    view.x = drag.vx + ev.clientX - drag.x;
    view.y = drag.vy + ev.clientY - drag.y;
    applyView();
  });
  window.addEventListener("mouseup", function () { drag = null; svg.classList.remove("dragging"); });

  // --- selection, unfolding, details ----------------------------------------------------------------
  function unfold(path) {
    ancestors(path).forEach(function (p) { expanded.add(p); });
    render();
    var g = groups.get(path), first = g && nodes[g.first];
    var it = first && current.items.find(function (i) { return i.id === repOf(first); });
    if (it) centerOn(it);
    renderTree();
  }
  function fold(path) {
    Array.from(expanded).forEach(function (p) { if (p === path || p.indexOf(path + ".") === 0) expanded.delete(p); });
    render();
    renderTree();
  }
  function highlight(n) {
    document.querySelectorAll(".node.selected").forEach(function (e) { e.classList.remove("selected"); });
    var id = repOf(n), box = boxOf.get(id);
    if (box) box.classList.add("selected");
    edgeEls.forEach(function (e) { e.classList.toggle("hot", e.dataset.from === id || e.dataset.to === id); });
  }
  function ref(name) {
    var a = document.createElement("a");
    a.className = "ref"; a.textContent = name;
    a.addEventListener("click", function () { reveal(name); });
    return a;
  }
  function row(table, key, value) {
    var tr = table.insertRow(), k = tr.insertCell(), v = tr.insertCell();
    k.textContent = key;
    if (value instanceof Node) v.appendChild(value); else v.textContent = value;
  }
  function refs(names) {
    var span = document.createElement("span");
    names.forEach(function (s, i) { if (i) span.appendChild(document.createTextNode(", ")); span.appendChild(ref(s)); });
    if (!names.length) span.textContent = "\u2014";
    return span;
  }
  function select(n, center) {
    selected = n;
    highlight(n);
    var d = document.getElementById("details");
    d.textContent = "";
    var h = document.createElement("h3");
    h.textContent = n.op === "call_module" ? n.module : n.name;
    d.appendChild(h);
    var table = document.createElement("table");
    var kind = data.kinds[n.kind] || { label: n.kind, meaning: "" };
    row(table, "what", kind.label + (n.detail ? ": " + n.detail : ""));
    row(table, "node", n.name + " (" + n.op + ")");
    row(table, n.op === "call_module" ? "class" : "target", n.label || "");
    row(table, "in module", n.scope || "(root)");
    row(table, "value", valuesText(n.values) || "shape not recorded");
    row(table, "inputs", refs(n.inputs));
    row(table, "used by", refs(n.users));
    d.appendChild(table);
    if (n.scope) {
      var b = document.createElement("button");
      b.textContent = "fold " + n.scope;
      b.addEventListener("click", function () { fold(n.scope); });
      d.appendChild(b);
    }
    if (center) {
      var it = current.items.find(function (i) { return i.id === repOf(n); });
      if (it) centerOn(it);
    }
  }
  function describeGroup(g) { // a module found by name: what it holds, and a way to fold it again
    var d = document.getElementById("details");
    d.textContent = "";
    var h = document.createElement("h3");
    h.textContent = g.path;
    d.appendChild(h);
    var table = document.createElement("table");
    row(table, "what", "module" + (groupClass(g.path) ? " (" + groupClass(g.path) + ")" : "") + ", " + g.total + " nodes inside");
    Object.keys(data.kinds).forEach(function (k) { if (g.counts[k]) row(table, data.kinds[k].label, String(g.counts[k])); });
    d.appendChild(table);
    var b = document.createElement("button");
    b.textContent = "fold " + g.path;
    b.addEventListener("click", function () { fold(g.path); });
    d.appendChild(b);
  }
  function reveal(name) {
    var n = byName.get(name);
    if (!n) {
      var g = groups.get(name);
      if (g) { unfold(name); describeGroup(g); }
      return;
    }
    ancestors(n.scope).forEach(function (p) { expanded.add(p); });
    render();
    renderTree();
    select(n, true);
  }

  // --- search ---------------------------------------------------------------------------------------
  var search = document.getElementById("search"), results = document.getElementById("results");
  function matches(q) {
    q = q.toLowerCase();
    var out = [];
    groups.forEach(function (g) {
      if (g.path && (g.path.toLowerCase().indexOf(q) >= 0 || groupClass(g.path).toLowerCase().indexOf(q) >= 0))
        out.push({ name: g.path, text: g.path + "  (" + (groupClass(g.path) || "module") + ", " + g.total + " nodes)" });
    });
    nodes.forEach(function (n) {
      var hay = (n.name + " " + (n.module || "") + " " + (n.label || "")).toLowerCase();
      if (hay.indexOf(q) >= 0) out.push({ name: n.name, text: (n.module || n.name) + "  \u2014 " + n.label + " [" + (data.kinds[n.kind] || {}).label + "]" });
    });
    return out;
  }
  function showResults() {
    var q = search.value.trim();
    results.textContent = "";
    if (!q) { results.classList.remove("open"); return; }
    var found = matches(q);
    found.slice(0, 60).forEach(function (m, i) {
      var div = document.createElement("div");
      div.textContent = m.text;
      if (i === 0) div.className = "active";
      div.addEventListener("mousedown", function (ev) { ev.preventDefault(); results.classList.remove("open"); reveal(m.name); });
      results.appendChild(div);
    });
    if (!found.length) { var none = document.createElement("div"); none.className = "none"; none.textContent = "no module or node matches"; results.appendChild(none); }
    else if (found.length > 60) { var more = document.createElement("div"); more.className = "none"; more.textContent = (found.length - 60) + " more: type more of the name"; results.appendChild(more); }
    results.classList.add("open");
    results.dataset.count = String(found.length);
    return found;
  }
  search.addEventListener("input", showResults);
  search.addEventListener("keydown", function (ev) {
    if (ev.key === "Enter") { var found = showResults(); if (found && found.length) { results.classList.remove("open"); reveal(found[0].name); } }
    if (ev.key === "Escape") { results.classList.remove("open"); search.blur(); }
  });
  search.addEventListener("blur", function () { results.classList.remove("open"); });
  document.addEventListener("keydown", function (ev) {
    if (ev.key === "/" && document.activeElement !== search) { ev.preventDefault(); search.focus(); }
  });

  // --- side panels: module tree, report, legend ---------------------------------------------------------
  function badges(counts, parent) {
    BADGE_KINDS.forEach(function (k) {
      if (!counts[k]) return;
      var b = document.createElement("span");
      b.className = "badge";
      b.style.background = STYLE[k].fill.indexOf("url") === 0 ? "#fed7d7" : STYLE[k].fill;
      b.style.borderColor = STYLE[k].stroke;
      b.title = counts[k] + " " + data.kinds[k].label;
      b.textContent = counts[k];
      parent.appendChild(b);
    });
  }
  function renderTree() {
    var host = document.getElementById("tree");
    host.textContent = "";
    function branch(g) {
      var ul = document.createElement("ul");
      g.children.forEach(function (c) {
        var li = document.createElement("li"), tw = document.createElement("span"), nm = document.createElement("span");
        tw.className = "tw";
        var open = expanded.has(c.path);
        tw.textContent = c.children.length || c.nodes.length ? (open ? "\u25be" : "\u25b8") : "";
        tw.addEventListener("click", function () { if (expanded.has(c.path)) fold(c.path); else unfold(c.path); });
        nm.className = "nm"; nm.textContent = c.name;
        nm.addEventListener("click", function () { unfold(c.path); });
        li.appendChild(tw); li.appendChild(nm);
        var cls = document.createElement("span");
        cls.className = "cls"; cls.textContent = " " + (groupClass(c.path) || "") + " \u00b7 " + c.total;
        li.appendChild(cls);
        badges(c.counts, li);
        if (open && c.children.length) li.appendChild(branch(c));
        ul.appendChild(li);
      });
      return ul;
    }
    host.appendChild(branch(groups.get("")));
  }
  function renderReport() {
    var host = document.getElementById("report");
    host.textContent = "";
    var r = data.report;
    function section(title, list, line) {
      if (!list || !list.length) return;
      var h = document.createElement("h4");
      h.textContent = title + " (" + list.length + ")";
      host.appendChild(h);
      var ul = document.createElement("ul");
      list.slice(0, 500).forEach(function (x) { var li = document.createElement("li"); line(x, li); ul.appendChild(li); });
      host.appendChild(ul);
    }
    function nodeFor(module) { return nodes.find(function (n) { return n.module === module || n.module === module.replace(/\./g, "_"); }); }
    function link(module, li) { var n = nodeFor(module); li.appendChild(n ? ref(n.name) : document.createTextNode(module)); if (n) li.lastChild.textContent = module; }
    if (r) {
      section("opaque parts", Object.keys(r.leaves || {}), function (k, li) { link(k, li); li.appendChild(document.createTextNode(": " + r.leaves[k])); });
      section("ops left functional", r.left_functional, function (x, li) { li.appendChild(ref(x.node)); li.appendChild(document.createTextNode(" = " + x.target + ": " + x.reason)); });
      section("unrolled", r.unrolled, function (u, li) { link(u.original, li); li.appendChild(document.createTextNode(" \u2192 " + u.copies.join(", "))); });
      section("modules added", r.added, function (a, li) { link(a.name, li); li.appendChild(document.createTextNode(" (" + a.cls + "): " + a.reason)); });
    }
    var h = document.createElement("h4");
    h.textContent = "report";
    host.appendChild(h);
    var pre = document.createElement("pre");
    pre.textContent = data.report_text || "no report was saved with this graph";
    host.appendChild(pre);
  }
  function renderLegend() {
    var host = document.getElementById("legend");
    var counts = groups.get("").counts;
    Object.keys(data.kinds).forEach(function (k) {
      var rowEl = document.createElement("div");
      rowEl.className = "legend-row";
      var s = document.createElementNS(SVG, "svg");
      s.setAttribute("width", 44); s.setAttribute("height", 24);
      var g = el("g", { transform: "translate(2,2)" }, s);
      shape(k, 38, 18, g);
      rowEl.appendChild(s);
      var text = document.createElement("div"), b = document.createElement("b"), sp = document.createElement("span");
      b.textContent = data.kinds[k].label + " (" + (counts[k] || 0) + ")";
      sp.textContent = data.kinds[k].meaning;
      text.appendChild(b); text.appendChild(sp);
      rowEl.appendChild(text);
      host.appendChild(rowEl);
    });
    var grow = document.createElement("div");
    grow.className = "legend-row";
    var gs = document.createElementNS(SVG, "svg");
    gs.setAttribute("width", 44); gs.setAttribute("height", 26);
    shape("group", 36, 18, el("g", {}, gs));
    grow.appendChild(gs);
    var gt = document.createElement("div");
    gt.innerHTML = "<b>folded module</b><span>click to unfold; dots count what fxprep did inside. Edges are labelled with the shape and dtype flowing on them.</span>";
    grow.appendChild(gt);
    host.appendChild(grow);
  }
  document.querySelectorAll(".tabs button").forEach(function (b) {
    b.addEventListener("click", function () {
      document.querySelectorAll(".tabs button, .panel").forEach(function (e) { e.classList.remove("on"); });
      b.classList.add("on");
      document.getElementById(b.dataset.panel).classList.add("on");
    });
  });
  document.getElementById("fit").addEventListener("click", function () { fit(true); });
  document.getElementById("unfold-all").addEventListener("click", function () { groups.forEach(function (g, p) { expanded.add(p); }); render(); renderTree(); fit(); });
  document.getElementById("fold-all").addEventListener("click", function () { expanded = new Set([""]); render(); renderTree(); fit(); });
  document.getElementById("shapes").addEventListener("change", function (ev) { svg.classList.toggle("hide-shapes", !ev.target.checked); });

  // --- start ------------------------------------------------------------------------------------------
  var modules = nodes.filter(function (n) { return n.op === "call_module"; }).length;
  document.getElementById("node-count").textContent = nodes.length + " nodes";
  var summary = document.getElementById("summary");
  summary.textContent = modules + " module calls";
  if (data.report) {
    var v = data.report.verification || {};
    summary.appendChild(document.createTextNode(" \u00b7 tracer " + (data.report.tracer || "?") + " \u00b7 verification "));
    var vs = document.createElement("span");
    vs.className = v.status || "";
    vs.textContent = (v.status || "?") + (v.max_abs_diff != null ? " (max |diff| " + Number(v.max_abs_diff).toPrecision(2) + ")" : "");
    summary.appendChild(vs);
  }
  autoExpand(40);
  render();
  renderTree();
  renderReport();
  renderLegend();
  fit();
  var hash = decodeURIComponent(location.hash.slice(1));
  if (hash.indexOf("find=") === 0) {
    search.value = hash.slice(5);
    var found = matches(search.value);
    if (found.length) reveal(found[0].name);
  }
  window.fxprepView = { reveal: reveal, unfold: unfold, fold: fold, matches: matches };
  document.body.setAttribute("data-ready", "1");
})();
