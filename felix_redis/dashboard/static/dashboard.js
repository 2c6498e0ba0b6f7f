// felix-redis dashboard: refreshes the page's numbers in place and sends the actions.
// The pages are complete without it (server-rendered); nothing here holds a secret:
// requests ride on the same-origin session cookie.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var status = document.getElementById("live-status");
  var interval = Math.max(1, parseFloat(live.getAttribute("data-interval")) || 5) * 1000;
  var pending = null;  // the action waiting for its confirmation
  var shown = null;  // the last action's result, shown again after each refresh for a while

  function say(text, bad) {
    if (!status) { return; }
    status.textContent = text;
    status.className = bad ? "error-text" : "muted";
  }

  function busy() {
    // never swap the page under a person choosing records or confirming
    if (pending) { return true; }
    if (live.querySelector("input.pick:checked")) { return true; }
    var a = document.activeElement;
    return !!(a && live.contains(a) && (a.tagName === "INPUT" || a.tagName === "SELECT"));
  }

  function refresh() {
    if (busy()) { return Promise.resolve(); }
    return fetch(window.location.href, {headers: {"X-Felix-Fragment": "1"}, credentials: "same-origin",
                                        cache: "no-store"})
      .then(function (r) {
        return r.text().then(function (html) {
          if (busy()) { return; }
          live.innerHTML = html;
          showResult();
          if (r.ok) { say("live · " + new Date().toLocaleTimeString(), false); }
          else { say("error " + r.status + " · retrying", true); }
        });
      })
      .catch(function () { say("dashboard unreachable · retrying", true); });
  }

  function showResult() {
    // the result sits in the part refreshed in place: put it back after each swap
    var out = document.getElementById("action-result");
    if (!out || !shown) { return; }
    if (Date.now() > shown.until) { shown = null; return; }
    out.textContent = shown.text;
    out.className = shown.ok ? "ok-text" : "error-text";
  }

  function picked() {
    return Array.prototype.map.call(live.querySelectorAll("input.pick:checked"), function (c) { return c.value; });
  }

  function syncButtons() {
    var n = picked().length;
    Array.prototype.forEach.call(live.querySelectorAll("button[data-scope=selected]"), function (b) {
      b.disabled = n === 0;
    });
  }

  document.addEventListener("change", function (e) {
    var t = e.target;
    if (t && t.id === "select-all") {
      Array.prototype.forEach.call(live.querySelectorAll("input.pick"), function (c) { c.checked = t.checked; });
    }
    syncButtons();
  });

  document.addEventListener("click", function (e) {
    var t = e.target;
    if (!t || t.tagName !== "BUTTON") { return; }
    var box = document.getElementById("confirm");
    if (t.hasAttribute("data-verb")) {
      var verb = t.getAttribute("data-verb");
      var all = t.getAttribute("data-scope") === "all";
      var records = all ? null : picked();
      if (!all && !records.length) { return; }
      var api = t.closest(".actions").getAttribute("data-api");
      pending = {url: api + "/" + verb, body: all ? {all: true} : {records: records}, verb: verb};
      document.getElementById("confirm-text").textContent =
        (verb === "redrive" ? "Redrive " : "Discard ") +
        (all ? "every dead letter of this group" : records.length + " dead letter" + (records.length > 1 ? "s" : "") +
          " (" + records.slice(0, 5).join(", ") + (records.length > 5 ? ", …" : "") + ")") +
        (verb === "redrive" ? "? They are handed out again, attempts starting over." :
          "? They are dropped for good (the records stay in the log).");
      box.hidden = false;
      document.getElementById("confirm-yes").focus();
    } else if (t.id === "confirm-no") {
      pending = null;
      box.hidden = true;
    } else if (t.id === "confirm-yes" && pending) {
      var act = pending;
      t.disabled = true;
      fetch(act.url, {method: "POST", credentials: "same-origin", headers: {"Content-Type": "application/json"},
                      body: JSON.stringify(act.body)})
        .then(function (r) { return r.json().then(function (doc) { return [r.ok, doc]; }); })
        .then(function (res) {
          pending = null;
          var doc = res[1];
          var text = res[0] ? (act.verb === "redrive" ? "redriven: " + doc.redriven : "discarded: " + doc.discarded)
                             : "refused: " + doc.error;
          Array.prototype.forEach.call(live.querySelectorAll("input.pick"), function (c) { c.checked = false; });
          shown = {text: text, ok: res[0], until: Date.now() + 30000};
          return refresh().then(showResult);
        })
        .catch(function () {
          pending = null;
          say("the action could not be sent", true);
        });
    }
  });

  say("live", false);
  window.setInterval(refresh, interval);
})();
