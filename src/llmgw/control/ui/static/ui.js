// llmgw dashboard: the one script of its own. It draws the usage plot and a model's autoscaling
// plot (uPlot) from the JSON each element names, and asks before a form whose data-confirm says what
// it takes down (a drain, a restart: one click cut live requests). Everything else is htmx attributes.
(function () {
  "use strict";
  var palette = ["#0550ae", "#a40e26", "#116329", "#7d4e00", "#8250df", "#1b7c83", "#bc4c00", "#57606a"];

  function draw(el) {
    fetch(el.dataset.src, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (data) {
        var keys = Object.keys(data.series);
        var series = [{}].concat(keys.map(function (k, i) {
          return { label: k, stroke: palette[i % palette.length], width: 2 };
        }));
        var rows = [data.days].concat(keys.map(function (k) { return data.series[k]; }));
        el.textContent = "";
        if (!keys.length || !data.days.length) { el.textContent = el.dataset.empty || "No usage in this range."; return; }
        new uPlot({ width: Math.min(el.clientWidth || 900, 1200), height: 300, series: series,
                    axes: [{}, { label: el.dataset.label || "tokens" }], scales: { x: { time: true } } }, rows, el);
        el.dataset.drawn = String(keys.length);
      })
      .catch(function (err) { el.textContent = "The usage plot could not be loaded (" + err + ")."; });
  }

  document.addEventListener("submit", function (e) {
    var ask = e.target && e.target.dataset ? e.target.dataset.confirm : "";
    if (ask && !window.confirm(ask)) { e.preventDefault(); }
  }, true);

  document.addEventListener("DOMContentLoaded", function () {
    var els = [document.getElementById("usage-plot"), document.getElementById("autoscale-plot")];
    els.forEach(function (el) { if (el && window.uPlot) { draw(el); } });
  });
})();
