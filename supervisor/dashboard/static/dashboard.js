/* trainwarden dashboard: live charts (uPlot), table refresh, the rollback form and the
   hosts page's cordon/uncordon dialog.
   Plain script, no build step.  Polls a cheap run fingerprint with If-None-Match and
   refetches charts and tables only when it changed. */
(function () {
  "use strict";

  var TOKEN_KEY = "trainwarden.operator_token";
  var COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d",
                "#4d7c0f", "#78716c"];
  var MAX_ATTEMPT_SERIES = 6;
  var skew = 0;  // server clock minus browser clock, seconds

  function $(sel, el) { return (el || document).querySelector(sel); }

  function fmtAge(s) {
    s = Math.max(0, s);
    if (s < 90) return Math.round(s) + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return (s / 86400).toFixed(1) + " d";
  }

  function tickAges() {
    var now = Date.now() / 1000 + skew;
    document.querySelectorAll("time[data-t]").forEach(function (el) {
      if (/ ago$/.test(el.textContent)) {
        el.textContent = fmtAge(now - parseFloat(el.dataset.t)) + " ago";
      }
    });
  }

  // Conditional GET with a per-URL cache of the last body.
  var cache = {};
  function getCached(url, kind) {
    var c = cache[url];
    var headers = {};
    if (c) headers["If-None-Match"] = c.etag;
    return fetch(url, {headers: headers, cache: "no-store", credentials: "same-origin"})
      .then(function (r) {
        if (r.status === 304 && c) return {data: c.data, changed: false};
        if (!r.ok) throw new Error(url + ": HTTP " + r.status);
        var body = kind === "json" ? r.json() : r.text();
        return body.then(function (data) {
          var etag = r.headers.get("ETag");
          if (etag) cache[url] = {etag: etag, data: data};
          return {data: data, changed: true};
        });
      });
  }

  function num(x) {
    if (x === null || x === undefined) return null;
    if (typeof x === "string") return null;  // "NaN", "Infinity"
    return x;
  }

  // ---------------------------------------------------------------- chart data

  // The keys of the attempts of some points: the newest few, and "older" for the rest.
  function attemptKeys(points) {
    var attempts = [];
    points.forEach(function (p) { if (attempts.indexOf(p.attempt) < 0) attempts.push(p.attempt); });
    attempts.sort(function (a, b) { return a - b; });
    var shown = attempts.slice(-MAX_ATTEMPT_SERIES);
    return {shown: shown, keys: (attempts.length > shown.length ? ["older"] : []).concat(shown)};
  }

  function attemptKey(shown, p) { return shown.indexOf(p.attempt) >= 0 ? p.attempt : "older"; }

  // points sorted by step; one series per key (keyOf(point)), aligned on one x axis.
  function byKey(points, keys, keyOf, value) {
    var xs = [];
    var rows = {};
    points.forEach(function (p, i) {
      var x = p.step_from;
      if (!(x in rows)) { rows[x] = {}; xs.push(x); }
      var v = value(p, i);
      if (v !== null && v !== undefined && isFinite(v)) rows[x][keyOf(p, i)] = v;
    });
    xs.sort(function (a, b) { return a - b; });
    var data = [xs];
    keys.forEach(function (k) {
      data.push(xs.map(function (x) { return k in rows[x] ? rows[x][k] : null; }));
    });
    return {keys: keys, data: data};
  }

  // The final lineage's points (one per step): one series per attempt (the newest few).
  function byAttempt(points, value) {
    var a = attemptKeys(points);
    return byKey(points, a.keys, function (p) { return attemptKey(a.shown, p); }, value);
  }

  // The loss chart: the final lineage's points by attempt, and the superseded attempts'
  // points (the steps a restart trained again or threw away) as thin lines of their own,
  // keyed "s:" + attempt, never merged into the lineage's.
  function lossSeries(points, superseded) {
    var a = attemptKeys(points), s = attemptKeys(superseded);
    var keys = a.keys.concat(s.keys.map(function (k) { return "s:" + k; }));
    var n = points.length;
    return byKey(points.concat(superseded), keys, function (p, i) {
      return i < n ? attemptKey(a.shown, p) : "s:" + attemptKey(s.shown, p);
    }, function (p) { return num(p.loss_mean); });
  }

  function throughputOf(points) {
    var last = {};
    var out = [];
    points.forEach(function (p, i) {
      var prev = last[p.attempt];
      var v = null;
      if (prev && p.t > prev.t) v = p.samples / (p.t - prev.t);
      last[p.attempt] = p;
      out[i] = v;
    });
    return out;
  }

  // ---------------------------------------------------------------- charts

  // Loss y axis.  Log by default: a spike of 1e4 over losses of about 1 leaves the normal
  // curve a readable band instead of a line at zero.  A log axis cannot show a loss <= 0 or
  // a non-finite one: non-finite losses are never drawn (their steps are shaded as
  // "nonfinite" spikes), and when any finite loss is <= 0 the chart uses a linear axis with
  // a range robust to outliers instead (the 2nd..98th percentile, padded), with the peak it
  // clips annotated.  The note under the chart says which.
  function lossScale(data) {
    var vals = [], peak = null;
    for (var s = 1; s < data.length; s++) {
      for (var i = 0; i < data[s].length; i++) {
        var v = data[s][i];
        if (v === null || v === undefined || !isFinite(v)) continue;
        vals.push(v);
        if (peak === null || v > peak.value) peak = {step: data[0][i], value: v};
      }
    }
    var nonpos = vals.filter(function (v) { return v <= 0; }).length;
    if (vals.length === 0 || nonpos === 0) return {log: true, nonpos: 0};
    vals.sort(function (a, b) { return a - b; });
    var q = function (f) { return vals[Math.min(vals.length - 1, Math.floor(f * (vals.length - 1)))]; };
    var lo = q(0.02), hi = q(0.98);
    var pad = Math.max((hi - lo) * 0.15, Math.abs(hi) * 0.01, 1e-9);
    var range = [Math.min(lo - pad, vals[0]), hi + pad];
    var clipped = peak.value > range[1] ? peak : null;
    if (!clipped) range[1] = Math.max(range[1], vals[vals.length - 1]);
    return {log: false, nonpos: nonpos, range: range, clipped: clipped};
  }

  function fmtLoss(v) {
    return Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(1)
      : String(+v.toPrecision(3));
  }

  function lossNote(sc) {
    var el = document.getElementById("chart-loss-note");
    if (!el) return;
    el.textContent = sc.log
      ? "log axis: a loss <= 0 cannot be drawn on it (the chart switches to a linear axis " +
        "if one appears); non-finite losses are not drawn, their steps are shaded."
      : "linear axis (" + sc.nonpos + " losses <= 0 rule out a log axis), range robust to " +
        "outliers" + (sc.clipped ? "; the peak " + fmtLoss(sc.clipped.value) + " at step " +
        sc.clipped.step + " is off the top" : "") + "; non-finite losses are not drawn.";
  }

  // Marker labels as boxes in a layer over the plot (not on the canvas), laid out so that no
  // two overlap: each takes the first row from the top where it fits (right of its line,
  // else left of it) beside the labels already there; when the rows (60% of the plot height)
  // are full it is left out and counted in the layer's "+N more" box (every marker is in the
  // tables below).  The plot shows the short form ("restart #3"), the title the whole label.
  var LABEL_ROW_PX = 14, LABEL_GAP_PX = 4;

  function layoutLabels(u, layer, items) {
    layer.textContent = "";
    var width = u.over.clientWidth || u.bbox.width / (window.devicePixelRatio || 1);
    var height = u.over.clientHeight || u.bbox.height / (window.devicePixelRatio || 1);
    var maxRows = Math.max(1, Math.floor(height * 0.6 / LABEL_ROW_PX));
    var rows = [];  // per row: the boxes [left, right] placed in it
    var hidden = 0;
    items.sort(function (a, b) { return a.x - b.x; });
    function fits(row, l, r) {
      return row.every(function (b) { return r + LABEL_GAP_PX <= b[0] || l >= b[1] + LABEL_GAP_PX; });
    }
    function place(text, x, cls, title) {
      var el = document.createElement("span");
      el.className = "chart-label " + cls;
      el.textContent = text;
      el.title = title || text;
      layer.appendChild(el);
      var w = el.offsetWidth;
      // right of its line, else left of it, in the first row where one of them fits
      var spots = [x + 3, x - 3 - w].filter(function (l) { return l >= 0 && l + w <= width; });
      if (!spots.length) spots = [Math.max(0, Math.min(x + 3, width - w))];
      for (var r = 0; r < maxRows; r++) {
        if (r === rows.length) rows.push([]);
        for (var i = 0; i < spots.length; i++) {
          var l = spots[i];
          if (fits(rows[r], l, l + w)) {
            rows[r].push([l, l + w]);
            el.style.left = l + "px";
            el.style.top = (r * LABEL_ROW_PX) + "px";
            return true;
          }
        }
      }
      layer.removeChild(el);
      return false;
    }
    items.forEach(function (it) { if (!place(it.short, it.x, it.cls, it.label)) hidden++; });
    if (hidden) {
      // in the first free spot of any row, else over the newest label of the last row
      var text = "+" + hidden + " more (see the tables)";
      if (!place(text, 0, "more", text)) {
        var last = layer.lastChild;
        if (last) { last.textContent = text; last.className = "chart-label more"; }
      }
    }
    layer.dataset.hidden = String(hidden);
  }

  function markersPlugin(getMarkers, getScale) {
    var layer = null;
    return {
      hooks: {
        init: [function (u) {
          layer = document.createElement("div");
          layer.className = "chart-labels";
          u.over.appendChild(layer);
        }],
        draw: [function (u) {
          var ctx = u.ctx;
          var dpr = window.devicePixelRatio || 1;
          var min = u.scales.x.min, max = u.scales.x.max;
          var labels = [];
          ctx.save();
          getMarkers().forEach(function (m) {
            if (m.to < min || m.from > max) return;
            var x0 = u.valToPos(Math.max(m.from, min), "x", true);
            var x1 = u.valToPos(Math.min(m.to, max), "x", true);
            if (m.type === "spike") {
              ctx.fillStyle = m.kind === "nonfinite" ? "rgba(220,38,38,0.18)"
                : m.kind === "loss_spike_transient" ? "rgba(148,163,184,0.22)"
                : "rgba(245,158,11,0.25)";
              ctx.fillRect(x0 - dpr, u.bbox.top, Math.max(x1 - x0, 0) + 2 * dpr, u.bbox.height);
            } else {
              ctx.strokeStyle = "#7c3aed";
              ctx.lineWidth = 1.5 * dpr;
              ctx.setLineDash([5 * dpr, 4 * dpr]);
              ctx.beginPath();
              ctx.moveTo(x0, u.bbox.top);
              ctx.lineTo(x0, u.bbox.top + u.bbox.height);
              ctx.stroke();
              ctx.setLineDash([]);
            }
            // the short form on the plot ("restart #3"), the whole label on hover
            // a spike's hover says what it cost against a rollback
            labels.push({label: m.cost ? m.label + "; " + m.cost : m.label,
                         short: m.label.replace(/ \(.*\)$/, ""),
                         x: u.valToPos(Math.max(m.from, min), "x"),
                         cls: m.type === "spike" ? "spike" : "restart"});
          });
          ctx.restore();
          var sc = getScale();
          if (sc && sc.clipped && sc.clipped.step >= min && sc.clipped.step <= max) {
            var peak = "peak " + fmtLoss(sc.clipped.value) + " \u2191 (off scale)";
            labels.push({label: peak, short: peak,
                         x: u.valToPos(sc.clipped.step, "x"), cls: "peak"});
          }
          if (layer) layoutLabels(u, layer, labels);
        }]
      }
    };
  }

  var charts = {};
  var markers = [];
  var lossScaleNow = null;
  window.trainwardenCharts = charts;  // for the browser tests and the console

  function draw(id, keys, data, label, opts) {
    var el = document.getElementById(id);
    if (!el || typeof uPlot === "undefined") return;
    var sig = keys.join("|") + (opts && opts.sig ? "#" + opts.sig : "");
    var c = charts[id];
    if (c && c.sig === sig) { c.u.setData(data); return; }
    if (c) c.u.destroy();
    el.textContent = "";
    if (data[0].length === 0) { el.innerHTML = '<p class="muted">no data yet</p>'; charts[id] = null; return; }
    var height = (opts && opts.height) || 240;
    var series = [{label: "step"}].concat(keys.map(function (k, i) {
      var s = {label: label(k, i), stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
               points: {show: data[0].length < 60}};
      if (opts && opts.style) Object.assign(s, opts.style(k, i));
      return s;
    }));
    var u = new uPlot({
      width: Math.max(300, el.clientWidth - 4), height: height,
      scales: Object.assign({x: {time: false}}, opts && opts.scales),
      axes: [{label: "step", size: 40}, {size: 60}],
      series: series,
      legend: {live: true},
      plugins: opts && opts.markers ? [markersPlugin(function () { return markers; },
                                                     function () { return lossScaleNow; })] : [],
    }, data, el);
    charts[id] = {u: u, sig: sig, height: height};
  }

  function attemptLabel(k) {
    var off = typeof k === "string" && k.indexOf("s:") === 0;
    var a = off ? k.slice(2) : k;
    var name = String(a) === "older" ? "earlier attempts" : "attempt " + a;
    return off ? name + " (superseded)" : name;
  }

  function drawSteps(body, mfu) {
    var points = body.points, superseded = body.superseded || [];
    var loss = lossSeries(points, superseded);
    var sc = lossScale(loss.data);
    lossScaleNow = sc;
    lossNote(sc);
    var yScale = sc.log ? {distr: 3, log: 10}
      : {range: function () { return lossScaleNow.range; }};
    // A superseded attempt is drawn thin and dashed, in its lineage series' colour.
    var style = function (k) {
      if (typeof k !== "string" || k.indexOf("s:") !== 0) return {};
      var at = loss.keys.indexOf(k.slice(2) === "older" ? "older" : Number(k.slice(2)));
      return {width: 1, dash: [4, 4], stroke: at >= 0 ? COLORS[at % COLORS.length] : "#9ca3af",
              points: {show: false}};
    };
    draw("chart-loss", loss.keys, loss.data, attemptLabel,
         {markers: true, sig: sc.log ? "log" : "linear", scales: {y: yScale}, height: 320,
          style: style});
    var tp = throughputOf(points);
    var thr = byAttempt(points, function (p, i) { return tp[i]; });
    draw("chart-throughput", thr.keys, thr.data, attemptLabel);
    if (mfu) {
      // The same throughput in the declared unit, times FLOPs / (ranks x peak), in percent.
      var rate = mfu.unit === "tokens" ? throughputOf(points.map(function (p) {
        return {attempt: p.attempt, t: p.t, samples: p.tokens};
      })) : tp;
      var m = byAttempt(points, function (p, i) {
        return rate[i] === null ? null : 100 * rate[i] * mfu.factor;
      });
      draw("chart-mfu", m.keys, m.data, attemptLabel);
    }
  }

  function drawRanks(ranks) {
    var keys = ranks.series.map(function (s) { return s.rank; }).concat(["median"]);
    var data = [ranks.steps].concat(ranks.series.map(function (s) { return s.values; }),
                                    [ranks.median]);
    draw("chart-ranks", keys, data, function (k, i) {
      if (k === "median") return "median of all ranks";
      var s = ranks.series[i];
      return "rank " + s.rank + (s.node ? " (" + s.node + ")" : "") + " score " + s.score.toFixed(2);
    }, {style: function (k) {
      return k === "median" ? {stroke: "#111827", width: 2, dash: [6, 4]} : {};
    }});
  }

  // ---------------------------------------------------------------- goodput bar

  // The wall time since the run started as one stacked bar: productive, then each badput
  // cause (seconds; a cause the supervisor cannot measure is listed as such).
  var GOODPUT_PARTS = [
    ["productive", "productive steps"], ["lost_progress", "lost progress"],
    ["detection", "detection latency"], ["restart", "restart"],
    ["requeue", "requeue wait"], ["startup", "startup"],
    ["checkpoint", "checkpoint stalls"], ["data_wait", "data wait"],
    ["straggler", "straggler slowdown"], ["capacity", "fewer nodes (shrunk world)"],
    ["idle", "idle"], ["other", "other"]];

  function fmtSecs(s) { return s < 90 ? s.toFixed(1) + " s" : fmtAge(s); }

  function drawGoodput(g) {
    var el = document.getElementById("goodput");
    if (!el) return;
    el.textContent = "";
    if (!g || !g.wall_s) {
      var p = document.createElement("p");
      p.className = "muted";
      p.textContent = "not accounted yet (the evaluator accounts a run from its first tick)";
      el.appendChild(p);
      return;
    }
    var head = document.createElement("p");
    head.className = "goodput-head";
    head.textContent = "ETTR " + (g.ettr === null ? "n/a" : (100 * g.ettr).toFixed(1) + "%") +
      " of " + fmtSecs(g.wall_s) + " (" + g.steps_final + " steps on the final lineage, " +
      g.steps_lost + " lost)";
    el.appendChild(head);
    var bar = document.createElement("div");
    bar.className = "goodput-bar";
    var list = document.createElement("ul");
    list.className = "goodput-legend";
    GOODPUT_PARTS.forEach(function (part) {
      var key = part[0];
      var secs = key === "productive" ? g.productive_s : g.badput_s[key];
      var li = document.createElement("li");
      var sw = document.createElement("span");
      sw.className = "swatch seg-" + key;
      li.appendChild(sw);
      if (secs === null || secs === undefined) {
        li.appendChild(document.createTextNode(part[1] + ": not measured"));
        li.title = (g.not_measured || {})[key] || "";
        li.className = "muted";
      } else {
        var pct = 100 * secs / g.wall_s;
        li.appendChild(document.createTextNode(part[1] + ": " + fmtSecs(secs) + " (" +
                                               pct.toFixed(1) + "%)"));
        if (secs > 0) {
          var seg = document.createElement("span");
          seg.className = "seg seg-" + key;
          seg.dataset.part = key;
          seg.style.width = pct + "%";
          seg.title = li.textContent;
          bar.appendChild(seg);
        }
      }
      list.appendChild(li);
    });
    el.appendChild(bar);
    el.appendChild(list);
  }

  // ---------------------------------------------------------------- run page

  function runPage(root) {
    var run = root.dataset.run;
    var enc = encodeURIComponent(run);
    var pollMs = parseInt(root.dataset.pollMs || "2000", 10);
    skew = parseFloat(root.dataset.now) - Date.now() / 1000;
    var stateTag = null;
    var busy = false;

    function refresh() {
      var steps = getCached("/api/v1/runs/" + enc + "/steps?max_points=1000", "json");
      var series = getCached("/dashboard/api/runs/" + enc + "/series", "json");
      var tables = getCached("/runs/" + enc + "/tables", "text");
      return Promise.all([steps, series, tables]).then(function (res) {
        markers = res[1].data.markers;
        if (res[0].changed || res[1].changed) drawSteps(res[0].data, res[1].data.mfu);
        if (res[1].changed) { drawRanks(res[1].data.ranks); drawGoodput(res[1].data.goodput); }
        if (res[2].changed) {
          var open = {};
          document.querySelectorAll("#tables details[open]").forEach(function (d, i) { open[i] = true; });
          $("#tables").innerHTML = res[2].data;
          // The "Why it failed" block rendered with the tables goes to the top of the page.
          var fresh = $("#failure-fresh"), slot = $("#failure-slot");
          if (fresh && slot) slot.innerHTML = fresh.innerHTML;
          document.querySelectorAll("#tables details").forEach(function (d, i) { if (open[i]) d.open = true; });
        }
        root.dataset.loaded = "1";
      });
    }

    function poll() {
      if (busy) return;
      busy = true;
      var headers = {};
      if (stateTag) headers["If-None-Match"] = stateTag;
      fetch("/dashboard/api/runs/" + enc + "/state",
            {headers: headers, cache: "no-store", credentials: "same-origin"})
        .then(function (r) {
          if (r.status === 304) return null;
          if (!r.ok) throw new Error("state: HTTP " + r.status);
          stateTag = r.headers.get("ETag");
          return r.json().then(function (st) {
            skew = st.now - Date.now() / 1000;
            return refresh();
          });
        })
        .catch(function (e) { console.warn(e); })
        .then(function () { busy = false; tickAges(); });
    }

    poll();
    setInterval(poll, pollMs);
    window.addEventListener("resize", function () {
      Object.keys(charts).forEach(function (id) {
        var c = charts[id], el = document.getElementById(id);
        if (c && el) c.u.setSize({width: Math.max(300, el.clientWidth - 4), height: c.height});
      });
    });
    rollback(run, enc, refresh);
  }

  // ---------------------------------------------------------------- rollback

  function parseSkip(text) {
    var out = [];
    (text || "").split(",").forEach(function (part) {
      var m = part.trim().match(/^(\d+)\s*-\s*(\d+)$/);
      if (m) out.push([parseInt(m[1], 10), parseInt(m[2], 10)]);
      else if (part.trim()) throw new Error("skip range '" + part.trim() + "' is not FROM-TO");
    });
    return out;
  }

  function rollback(run, enc, refresh) {
    var dlg = $("#rollback-dialog");
    var form = $("#rollback-form");
    var box = $("#rollback-progress");
    if (!dlg || !form) return;

    document.addEventListener("submit", function (ev) {
      var f = ev.target.closest && ev.target.closest("form.rollback");
      if (!f) return;
      ev.preventDefault();
      form.elements.checkpoint.value = f.dataset.checkpoint;
      $("[data-field=checkpoint-label]", form).textContent =
        "#" + f.dataset.checkpoint + " (step " + f.dataset.step + ")";
      $("[data-field=error]", form).textContent = "";
      form.elements.operator_token.value = sessionStorage.getItem(TOKEN_KEY) || "";
      dlg.showModal();
    });

    dlg.addEventListener("close", function () {
      if (dlg.returnValue !== "confirm") return;
      var el = form.elements;
      var body;
      try {
        body = {
          checkpoint: parseInt(el.checkpoint.value, 10),
          skip: parseSkip(el.skip.value),
          lr_scale: parseFloat(el.lr_scale.value),
          lr_scale_steps: parseInt(el.lr_scale_steps.value, 10),
          lr_ramp_steps: parseInt(el.lr_ramp_steps.value, 10),
          reason: el.reason.value,
        };
      } catch (e) {
        $("[data-field=error]", form).textContent = e.message;
        dlg.showModal();
        return;
      }
      var token = el.operator_token.value.trim();
      sessionStorage.setItem(TOKEN_KEY, token);
      show("sending rollback to checkpoint #" + body.checkpoint + " ...");
      fetch("/api/v1/runs/" + enc + "/rollback", {
        method: "POST", credentials: "omit", cache: "no-store",
        headers: {"Content-Type": "application/json", "Authorization": "Bearer " + token},
        body: JSON.stringify(body),
      }).then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (j) {
          if (r.status !== 202 && r.status !== 200) {
            if (r.status === 401 || r.status === 403) sessionStorage.removeItem(TOKEN_KEY);
            throw new Error("rollback refused (HTTP " + r.status + "): " + (j.detail || ""));
          }
          follow(j.action_id, token);
        });
      }).catch(function (e) { show(e.message, true); });
    });

    function show(text, bad) {
      box.hidden = false;
      box.textContent = text;
      box.className = "progress" + (bad ? " error" : "");
    }

    function follow(id, token) {
      var final = {resumed: 1, failed: 1, superseded: 1, done: 1};
      function step() {
        fetch("/api/v1/actions/" + id, {cache: "no-store", credentials: "same-origin",
                                         headers: {"Authorization": "Bearer " + token}})
          .then(function (r) { if (!r.ok) throw new Error("action " + id + ": HTTP " + r.status); return r.json(); })
          .then(function (a) {
            var p = a.progress || {};
            var done = ["queued", "delivered", "restarted", "resumed"].filter(function (k) { return p[k]; });
            show("action #" + id + " (" + a.kind + "): " + a.status + " [" + done.join(" > ") + "]" +
                 (a.resumed_step !== null && a.resumed_step !== undefined ? ", resumed at step " + a.resumed_step : ""),
                 a.status === "failed");
            box.dataset.status = a.status;
            refresh();
            if (!final[a.status]) setTimeout(step, 1000);
          })
          .catch(function (e) { show(e.message, true); });
      }
      step();
    }
  }

  // ---------------------------------------------------------------- hosts: cordon, uncordon

  function hostsPage() {
    var dlg = $("#host-dialog");
    var form = $("#host-form");
    if (!dlg || !form) return;
    var WHAT = {
      cordon: "Fence the node off: replaced at its run's next restart, never chosen as a member until uncordoned.",
      uncordon: "Put the node on probation: healthy again once it passes a preflight.",
    };
    var target = null;

    function open(err) {
      $("[data-field=error]", form).textContent = err || "";
      dlg.showModal();
    }

    document.addEventListener("submit", function (ev) {
      var f = ev.target.closest && ev.target.closest("form.host-change");
      if (!f) return;
      ev.preventDefault();
      target = {node: f.dataset.node, action: f.dataset.action};
      $("[data-field=action]", form).textContent = target.action;
      $("[data-field=node]", form).textContent = target.node;
      $("[data-field=what]", form).textContent = WHAT[target.action] || "";
      form.elements.reason.value = "";
      form.elements.operator_token.value = sessionStorage.getItem(TOKEN_KEY) || "";
      open("");
    });

    dlg.addEventListener("close", function () {
      if (dlg.returnValue !== "confirm" || !target) return;
      var token = form.elements.operator_token.value.trim();
      sessionStorage.setItem(TOKEN_KEY, token);
      // a node's name may hold slashes (rack1/n0): the route takes them as they are
      var path = target.node.split("/").map(encodeURIComponent).join("/");
      fetch("/api/v1/hosts/" + path + "/" + target.action, {
        method: "POST", credentials: "omit", cache: "no-store",
        headers: {"Content-Type": "application/json", "Authorization": "Bearer " + token},
        body: JSON.stringify({reason: form.elements.reason.value}),
      }).then(function (r) {
        return r.json().catch(function () { return {}; }).then(function (j) {
          if (r.status !== 200) {
            if (r.status === 401 || r.status === 403) sessionStorage.removeItem(TOKEN_KEY);
            throw new Error(target.action + " refused (HTTP " + r.status + "): " + (j.detail || ""));
          }
          window.location.reload();
        });
      }).catch(function (e) { open(e.message); });
    });
  }

  // ---------------------------------------------------------------- runs list

  function runsPage(table) {
    setInterval(function () {
      fetch("/", {cache: "no-store", credentials: "same-origin"})
        .then(function (r) { return r.ok ? r.text() : null; })
        .then(function (html) {
          if (!html) return;
          var doc = new DOMParser().parseFromString(html, "text/html");
          var fresh = doc.getElementById("runs");
          if (fresh) table.replaceWith(fresh), table = fresh;
        })
        .catch(function (e) { console.warn(e); });
    }, 5000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var root = document.getElementById("run");
    if (root) runPage(root);
    var runs = document.getElementById("runs");
    if (runs) runsPage(runs);
    if (document.getElementById("hosts")) hostsPage();
    setInterval(tickAges, 1000);
  });
})();
