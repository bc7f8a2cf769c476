// The Gate console: signs in, polls the shared snapshot once a second, draws the
// chosen deal, and sends the operator's confirmed actions with the CSRF token.
"use strict";
(function () {
  const HISTORY_POINTS = 300;      // five minutes at one snapshot a second
  const LEDGER_EVERY_MS = 5000;
  const $ = (id) => document.getElementById(id);
  let csrf = null;
  let selected = null;              // deal id being watched
  let deals = new Map();
  let history = new Map();          // deal id -> [{available, held, sold}]
  let pollTimer = null;
  let lastLedger = 0;
  let lastSnapshot = null;

  async function api(method, path, body) {
    const headers = {};
    const init = { method, headers, credentials: "same-origin", cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    if (method !== "GET" && csrf) headers["X-CSRF-Token"] = csrf;
    const r = await fetch("/console/api/" + path, init);
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (r.status === 401 && path !== "session") { signedOut(); }
    return { status: r.status, data };
  }

  function text(el, value) { el.textContent = value === null || value === undefined ? "–" : String(value); }

  function signedIn(view) {
    csrf = view.csrf_token;
    $("who").textContent = "Signed in as " + view.actor;
    $("sign-out").hidden = false;
    $("signin").hidden = true;
    $("console").hidden = false;
    $("token").value = "";
    poll();
  }

  function signedOut(message) {
    csrf = null;
    if (pollTimer) { clearTimeout(pollTimer); pollTimer = null; }
    $("who").textContent = "";
    $("sign-out").hidden = true;
    $("console").hidden = true;
    $("signin").hidden = false;
    if (message) $("signin-error").textContent = message;
  }

  async function poll() {
    if (pollTimer) { clearTimeout(pollTimer); pollTimer = null; }
    let delay = 1000;
    try {
      const r = await api("GET", "snapshot");
      if (r.status === 401) return;
      if (r.status === 200) {
        lastSnapshot = r.data;
        render(r.data);
        delay = Math.max(1000, (r.data.refresh_seconds || 1) * 1000);
        $("status").textContent = "Live · updated " + r.data.generated_at;
      } else {
        $("status").textContent = "Snapshot unavailable (" + r.status + "); retrying.";
      }
    } catch (e) {
      $("status").textContent = "Gate unreachable; retrying.";
    }
    if (csrf) pollTimer = setTimeout(poll, delay);
  }

  function render(snap) {
    deals = new Map(snap.deals.map((d) => [d.id, d]));
    const anyQueue = snap.deals.some((d) => d.queue !== undefined);
    const anyRoom = snap.deals.some((d) => d.waiting_room !== undefined);
    document.querySelectorAll("#deals .opt-queue").forEach((el) => { el.hidden = !anyQueue; });
    document.querySelectorAll("#deals .opt-room").forEach((el) => { el.hidden = !anyRoom; });
    // Rows are kept and updated in place, so that a focused control keeps its focus
    // (keyboard users) while the numbers change every second.
    const body = document.querySelector("#deals tbody");
    const rows = new Map([...body.children].map((tr) => [Number(tr.dataset.deal), tr]));
    const shown = [];
    for (const d of snap.deals) {
      const h = history.get(d.id) || [];
      h.push({ available: d.available, held: d.held, sold: d.sold });
      if (h.length > HISTORY_POINTS) h.shift();
      history.set(d.id, h);
      let tr = rows.get(d.id);
      if (!tr) tr = newRow(d);
      rows.delete(d.id);
      tr.setAttribute("aria-selected", String(d.id === selected));
      const cells = [d.status, (d.starts_at || "open") + " → " + (d.ends_at || "open"),
        d.total, d.sold, d.held, d.available, d.buckets,
        queueSummary(d.queue), roomSummary(d.waiting_room),
        !d.invariant.checked ? "not checked yet" : d.invariant.ok ? "hold" : d.invariant.breaches + " breach(es)"];
      const tds = tr.querySelectorAll("td.v");
      cells.forEach((c, i) => { if (tds[i].textContent !== String(c)) tds[i].textContent = c; });
      tds[7].hidden = !anyQueue;
      tds[8].hidden = !anyRoom;
      tds[9].className = "v " + (d.invariant.ok ? "ok" : "bad");
      shown.push(tr);
    }
    for (const gone of rows.values()) gone.remove();
    shown.forEach((tr, i) => { if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null); });
    if (selected !== null) renderDetail(snap);
    renderWebhooks((snap.panels || {}).webhooks);
    renderPauses(snap.deals);
  }

  // The banner: every paused deal, with why (the invariant monitor's breaches, or
  // the operator's reason), until it is resumed.
  function renderPauses(list) {
    const paused = list.filter((d) => d.paused);
    const banner = $("pause-banner");
    const words = paused.map((d) => "Deal #" + d.id + " is PAUSED since " + d.paused.since +
      ": " + d.paused.reason).join(" · ");
    if (banner.textContent !== words) banner.textContent = words;
    banner.hidden = paused.length === 0;
  }

  // The webhooks panel (gate/webhooks/console_panel.py): redrawn only when it changed,
  // so a focused Retry button keeps its focus.
  let lastWebhooks = "";
  function renderWebhooks(w) {
    const panel = $("webhooks-panel");
    panel.hidden = !w || w.endpoints.length === 0;
    const drawn = JSON.stringify(w || null);
    if (!w || drawn === lastWebhooks) return;
    lastWebhooks = drawn;
    const body = document.querySelector("#webhooks tbody");
    body.replaceChildren();
    for (const e of w.endpoints) {
      const tr = document.createElement("tr");
      const rate = e.success_rate_24h === null ? "–" : (e.success_rate_24h * 100).toFixed(1) + " % of " + e.attempts_24h;
      const status = e.status + (e.disabled_reason ? " (" + e.disabled_reason + ")" : "")
        + (e.failing_since ? ", failing since " + e.failing_since : "");
      for (const value of [e.url + (e.description ? " — " + e.description : ""), status, rate, e.pending, e.failed]) {
        const td = document.createElement("td");
        td.textContent = String(value);
        tr.append(td);
      }
      body.append(tr);
    }
    const list = $("webhooks-failed");
    list.replaceChildren();
    for (const f of w.failed) {
      const li = document.createElement("li");
      li.textContent = "#" + f.id + " " + f.type + " (" + f.event_id + "): " + (f.last_error || ("HTTP " + f.last_status)) + " ";
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = "Retry";
      button.setAttribute("aria-label", "Retry delivery " + f.id);
      button.addEventListener("click", async () => {
        const r = await api("POST", "panels/webhooks/retry", { endpoint_id: f.endpoint_id, delivery_id: f.id });
        $("webhooks-result").textContent = r.status === 200
          ? "Delivery #" + f.id + " will be sent again now."
          : "Refused (" + r.status + "): " + ((r.data && r.data.detail) || "error");
        $("webhooks-result").className = r.status === 200 ? "ok" : "error";
      });
      li.append(button);
      list.append(li);
    }
  }

  function queueSummary(q) {
    if (!q) return "–";
    const retry = q.dead_letters_waiting;
    return q.mode + ", depth " + q.depth + (retry ? ", " + retry + " dead letter(s) to retry" : "");
  }

  function roomSummary(r) {
    if (!r) return "–";
    return r.waiting + " waiting" + (r.message ? " · message" : "");
  }

  function newRow(d) {
    const tr = document.createElement("tr");
    tr.dataset.deal = d.id;
    const first = document.createElement("td");
    const pick = document.createElement("button");
    pick.type = "button";
    pick.className = "pick";
    pick.textContent = "#" + d.id + " " + d.title;
    pick.setAttribute("aria-label", "Watch deal " + d.id + ": " + d.title);
    pick.addEventListener("click", () => select(d.id));
    first.append(pick);
    tr.append(first);
    for (let i = 0; i < 10; i++) {
      const td = document.createElement("td");
      td.className = "v" + (i >= 2 && i <= 6 ? " num" : "");
      tr.append(td);
    }
    return tr;
  }

  function select(id) {
    selected = id;
    lastLedger = 0;
    $("detail").hidden = false;
    document.querySelectorAll("#deals tbody tr").forEach((tr) => {
      tr.setAttribute("aria-selected", String(Number(tr.dataset.deal) === id));
    });
    if (lastSnapshot) renderDetail(lastSnapshot);
    loadAdvice();
    $("detail-title").setAttribute("tabindex", "-1");
    $("detail-title").focus();
  }

  function renderDetail(snap) {
    const d = deals.get(selected);
    if (!d) return;
    $("detail-title").textContent = "Deal #" + d.id + ": " + d.title + " (" + d.status + ")";
    text($("n-available"), d.available);
    text($("n-held"), d.held);
    text($("n-sold"), d.sold);
    text($("n-total"), d.total);
    const inv = $("n-invariant");
    inv.textContent = !d.invariant.checked ? "not checked yet" : d.invariant.ok ? "hold" : d.invariant.breaches + " breach(es)";
    inv.className = d.invariant.ok ? "ok" : "bad";
    const g = snap.gate;
    for (const k of ["created", "sold_out", "rate_limited", "unavailable"]) text($("r-" + k), g.reservations_per_second[k]);
    const ms = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(1) + " ms");
    $("r-latency").textContent = ms(g.latency_seconds.p50) + " / " + ms(g.latency_seconds.p99);
    text($("r-commits"), g.db_commits_per_second);
    $("r-locks").textContent = (g.db_lock_waits_per_second ?? "–") + " (" + (g.db_lock_waits_now ?? "–") + ")";
    $("room-panel").hidden = !d.waiting_room;
    $("queue-panel").hidden = !d.queue;
    if (d.waiting_room) renderRoom(d.waiting_room);
    if (d.queue) renderQueue(d.queue);
    drawChart(history.get(d.id) || []);
    drawBars(d.bucket_rows);
    if (Date.now() - lastLedger > LEDGER_EVERY_MS) loadLedger();
  }

  function renderRoom(r) {
    text($("room-waiting"), r.waiting);
    text($("room-admitted-rate"), r.admitted_per_second);
    text($("room-lapses"), r.lapses);
    text($("room-unspent"), r.unspent);
    // An automatic rate: the rate chosen and why (gate/room/steering.py's reasons).
    const a = r.auto;
    text($("room-aps"), a ? "auto: " + (a.rate === null ? "–" : a.rate + "/s") + " (cap " + r.admit_per_second + "/s)" : r.admit_per_second + "/s");
    text($("room-why"), a ? (a.reason || "–") + (a.detail ? " " + JSON.stringify(a.detail) : "") : "fixed");
    text($("room-bits"), r.challenge_bits === null ? "no challenge" : r.challenge_bits);
    text($("room-message"), r.message ? r.message.level + ": " + r.message.text : "none");
  }

  function renderQueue(q) {
    text($("queue-mode"), q.mode);
    text($("queue-depth"), q.depth);
    text($("queue-age"), q.oldest_age_seconds + " s");
    text($("queue-dead"), q.dead_letters);
    text($("queue-dead-waiting"), q.dead_letters_waiting);
    $("retry-button").disabled = q.dead_letters_waiting === 0;
  }

  function drawChart(points) {
    const svg = $("chart");
    const W = 600, H = 200, pad = 4;
    const max = Math.max(1, ...points.map((p) => Math.max(p.available, p.held, p.sold)));
    const line = (key, cls) => {
      const n = Math.max(points.length - 1, 1);
      const xy = points.map((p, i) => [pad + (i / n) * (W - 2 * pad), H - pad - (p[key] / max) * (H - 2 * pad)]);
      const el = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
      el.setAttribute("points", xy.map((q) => q[0].toFixed(1) + "," + q[1].toFixed(1)).join(" "));
      el.setAttribute("fill", "none");
      el.setAttribute("stroke-width", "2");
      el.setAttribute("stroke", getComputedStyle(document.documentElement).getPropertyValue(cls).trim());
      return el;
    };
    const desc = svg.querySelector("desc");
    svg.replaceChildren(desc, line("available", "--avail"), line("held", "--held"), line("sold", "--sold"));
  }

  function drawBars(rows) {
    const bars = $("bars");
    bars.replaceChildren();
    const max = Math.max(1, ...rows.map((r) => r.available));
    const mean = rows.reduce((a, r) => a + r.available, 0) / Math.max(rows.length, 1);
    for (const r of rows) {
      const bar = document.createElement("div");
      bar.className = "bar";
      // Unbalanced: a bucket far from the mean (empty while others are not, or hoarding).
      if (mean > 0 && Math.abs(r.available - mean) > 0.5 * mean) bar.classList.add("hot");
      bar.style.height = Math.max(1, (r.available / max) * 100) + "%";
      bar.setAttribute("role", "listitem");
      const label = "bucket " + r.bucket + ": " + r.available + " available, " + r.held + " held, " + r.sold + " sold" +
        (r.redis_available !== undefined && r.redis_available !== null ? " (Redis " + r.redis_available + ")" : "");
      bar.setAttribute("aria-label", label);
      bar.title = label;
      bar.dataset.bucket = r.bucket;
      bar.dataset.available = r.available;
      bars.append(bar);
    }
  }

  async function loadLedger() {
    if (selected === null) return;
    lastLedger = Date.now();
    const r = await api("GET", "deals/" + selected + "/ledger");
    if (r.status !== 200) return;
    const body = document.querySelector("#ledger tbody");
    body.replaceChildren();
    for (const row of r.data.items) {
      const tr = document.createElement("tr");
      for (const c of [row.id, row.bucket, row.reason, row.actor, row.delta.available, row.delta.total, row.note || ""]) {
        const td = document.createElement("td");
        td.textContent = c;
        tr.append(td);
      }
      body.append(tr);
    }
  }

  async function loadAdvice() {
    if (selected === null) return;
    const r = await api("GET", "deals/" + selected + "/advice");
    if (r.status === 200) {
      $("advice").textContent = "Advice (" + r.data.source + "): " + r.data.suggested +
        " bucket(s) for now (currently " + r.data.current + "). " + (r.data.rule || "");
    }
  }

  function confirmAction(message) {
    const dialog = $("confirm");
    $("confirm-text").textContent = message;
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.returnValue = "";
      dialog.showModal();
      $("confirm-cancel").focus();
    });
  }

  function formBody(form) {
    if (form.dataset.action === "resume") {
      const note = form.querySelector("input[name=note]").value.trim();
      return note === "" ? {} : { note };
    }
    if (form.dataset.action === "room_message") {
      // {"message": {"text", "level"}}, or null (an empty text) to remove it.
      const words = form.querySelector("input[name=text]").value.trim();
      const level = form.querySelector("select[name=level]").value;
      return { message: words === "" ? null : { text: words, level } };
    }
    const body = {};
    for (const input of form.querySelectorAll("input")) {
      if (input.type === "number") body[input.name] = input.value === "" ? null : Number(input.value);
      else body[input.name] = input.value.trim() === "" ? null : input.value.trim();
    }
    return body;
  }

  async function act(event) {
    event.preventDefault();
    const form = event.currentTarget;
    if (selected === null) return;
    const action = form.dataset.action;
    const body = formBody(form);
    const ok = await confirmAction("Deal #" + selected + ": " + action + " " + JSON.stringify(body) + "?");
    if (!ok) { $("action-result").textContent = "Cancelled."; return; }
    const r = await api("POST", "deals/" + selected + "/" + action, body);
    if (r.status === 200) {
      const retried = r.data && r.data.retried !== undefined
        ? " " + r.data.retried + " dead letter(s) retried, " + r.data.resubmitted + " re-submitted." : "";
      $("action-result").textContent = "Done: " + action + " on deal #" + selected + "." + retried;
      $("action-result").className = "ok";
      form.reset();
      lastLedger = 0;
      loadAdvice();
      poll();
    } else {
      $("action-result").textContent = "Refused (" + r.status + "): " + ((r.data && r.data.detail) || "error");
      $("action-result").className = "error";
    }
  }

  document.addEventListener("DOMContentLoaded", async () => {
    $("signin-form").addEventListener("submit", async (event) => {
      event.preventDefault();
      $("signin-error").textContent = "";
      const r = await api("POST", "session", { token: $("token").value });
      if (r.status === 200) signedIn(r.data);
      else $("signin-error").textContent = (r.data && r.data.detail) || "Sign-in failed.";
    });
    $("sign-out").addEventListener("click", async () => {
      await api("DELETE", "session");
      signedOut("Signed out.");
    });
    for (const id of ["buckets-form", "stock-form", "window-form", "pause-form", "resume-form",
      "room-message-form", "retry-form"]) {
      $(id).addEventListener("submit", act);
    }
    const r = await api("GET", "session");
    if (r.status === 200) signedIn(r.data);
    else signedOut();
  });
})();
