// Sluice console: refreshes the page's live part in place (no reload), so
// the page stays readable and its forms untouched. Polls the same URL with
// the header x-console-fragment: live; on errors the interval doubles up to
// 30 s and returns to normal on the first success. Nothing else: every page
// works without this script, only not live.
(function () {
  "use strict";
  var region = document.getElementById("live");
  var status = document.getElementById("live-status");
  if (!region || !window.fetch) {
    return;
  }
  var every = parseInt(region.getAttribute("data-refresh-ms"), 10) || 0;
  if (every <= 0) {
    return;
  }
  var longest = 30000;
  var delay = every;

  function say(text, healthy) {
    if (!status) {
      return;
    }
    status.textContent = text;
    status.className = healthy ? "healthy" : "trouble";
  }

  function schedule(ms) {
    window.setTimeout(refresh, ms);
  }

  function refresh() {
    if (document.hidden) {
      schedule(every);
      return;
    }
    window.fetch(window.location.href, {
      headers: { "x-console-fragment": "live" },
      cache: "no-store",
      credentials: "same-origin"
    }).then(function (response) {
      return response.text().then(function (body) {
        // Error answers carry a rendered explanation: show it, back off.
        region.innerHTML = body;
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
      });
    }).then(function () {
      delay = every;
      region.setAttribute("data-refreshed-at", String(Date.now()));
      say("live · " + new Date().toLocaleTimeString(), true);
      schedule(delay);
    }).catch(function (error) {
      delay = Math.min(delay * 2, longest);
      say("not refreshing (" + error.message + "), next try in " + Math.round(delay / 1000) + " s", false);
      schedule(delay);
    });
  }

  say("live", true);
  schedule(every);
})();
