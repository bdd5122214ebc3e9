// Says when live refresh fails (and why), and when it last worked. htmx keeps the last good fragment.
(function () {
  "use strict";
  function say(text, bad) {
    var el = document.getElementById("live-status");
    if (!el) return;
    el.textContent = text;
    el.classList.toggle("bad", !!bad);
  }
  document.addEventListener("htmx:afterSwap", function () {
    say("Live: updated " + new Date().toLocaleTimeString(), false);
  });
  document.addEventListener("htmx:responseError", function (e) {
    var status = e.detail.xhr.status;
    say("Live refresh failed (HTTP " + status + ")" + (status === 401 ? ": sign in again" : ""), true);
  });
  document.addEventListener("htmx:sendError", function () {
    say("Live refresh failed: the server does not answer", true);
  });
})();
