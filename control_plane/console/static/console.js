// Fleet console charts: every <figure class="chart" data-src data-key> gets a uPlot chart of
// data[key] from its JSON source ({x: [unix s], series: {label: [values]}}), refreshed every
// few seconds. A series named by data-guard is the guard's threshold: drawn dashed red.
(function () {
  "use strict";
  var COLORS = ["#1f5fbf", "#e07b00", "#2e8b57", "#8e44ad", "#00838f", "#6d4c41"];
  var REFRESH_MS = 3000;
  var X_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];

  function options(fig, labels, width) {
    var guard = fig.dataset.guard;
    var unit = fig.dataset.unit || "";
    var n = 0;
    var series = [{}].concat(labels.map(function (label) {
      if (label === guard) {
        return { label: label, stroke: "#c62828", width: 2, dash: [8, 6], points: { show: false } };
      }
      return { label: label, stroke: COLORS[n++ % COLORS.length], width: 2, spanGaps: false };
    }));
    return {
      width: width, height: 220, series: series,
      scales: { x: { time: true } },
      axes: [{ incrs: X_STEPS, space: 70 }, { label: unit, size: 60 }],
      legend: { live: true }
    };
  }

  function draw(fig, body) {
    var block = body && body[fig.dataset.key];
    var holder = fig.querySelector(".plot");
    if (!holder) {
      holder = document.createElement("div");
      holder.className = "plot";
      fig.insertBefore(holder, fig.firstChild);
    }
    if (!block || !block.x || block.x.length === 0 || Object.keys(block.series).length === 0) {
      if (fig._plot) { fig._plot.destroy(); fig._plot = null; }
      holder.textContent = "No data yet.";
      holder.className = "plot empty";
      return;
    }
    var labels = Object.keys(block.series);
    var data = [block.x].concat(labels.map(function (l) { return block.series[l]; }));
    var signature = labels.join("\u0000");
    if (fig._plot && fig._signature === signature) {
      fig._plot.setData(data);
      return;
    }
    if (fig._plot) { fig._plot.destroy(); }
    holder.textContent = "";
    holder.className = "plot";
    var width = Math.max(300, fig.clientWidth - 34);
    fig._plot = new uPlot(options(fig, labels, width), data, holder);
    fig._signature = signature;
    fig.dataset.series = signature.split("\u0000").join("|");
  }

  function refresh() {
    var figures = Array.prototype.slice.call(document.querySelectorAll("figure.chart[data-src]"));
    var sources = {};
    figures.forEach(function (fig) { (sources[fig.dataset.src] = sources[fig.dataset.src] || []).push(fig); });
    Object.keys(sources).forEach(function (src) {
      fetch(src, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          sources[src].forEach(function (fig) {
            draw(fig, body);
            fig.dataset.updated = String(Date.now());
            fig._body = body;
          });
        })
        .catch(function () { /* the next refresh tries again */ });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    if (typeof uPlot === "undefined") { return; }
    refresh();
    setInterval(refresh, REFRESH_MS);
  });
})();
