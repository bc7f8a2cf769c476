// The waiting room's buyer page (gate/room/page.py; docs/waiting-room.md, "The buyer
// page"). The shop links here with #token=<buyer token>&return=<shop URL>; the
// fragment is read once and removed from the address bar. The token goes only to
// this gate's API, as Authorization: Bearer; the admission token only to `return`,
// in its fragment, and only when return's origin is one the room lists.
"use strict";

(() => {
  const STRINGS = {
    en: {
      heading: "Waiting room",
      starting: "Starting…",
      solving: "Getting you a place in line…",
      joining: "Joining the line…",
      waiting: "You are in line.",
      admitted: "It's your turn! Taking you back to the shop…",
      sold_out: "Sold out for now. Keep this page open: if units come back, you keep your place.",
      unlikely:
        "You are unlikely to get one: the buyers ahead of you will probably take every unit" +
        " left. You keep your place, and you are let in if units come back; or leave the line.",
      chance: "Your chance of getting one",
      chance_value: "about {n} %",
      chance_low: "less than 1 %",
      closed: "This sale has ended.",
      paused: "The sale is paused for a moment. You keep your place; the line moves again when it resumes.",
      not_active: "The line is not open right now. This page tries again shortly.",
      position: "Your place in line",
      eta: "Estimated wait",
      progress: "Progress through the line",
      eta_seconds: "{n} s",
      eta_minutes: "about {n} min",
      code_label: "Access code",
      code_submit: "Join",
      code_required: "This sale is invite-only: enter your access code.",
      code_invalid: "That access code is not valid.",
      code_used: "That access code is already used by another buyer.",
      err_token: "This link lacks your sign-in. Go back to the shop and open the waiting room again.",
      err_return:
        "This link's return address is not one the shop has registered, so it is not used." +
        " Go back to the shop and open the waiting room from there.",
      err_auth:
        "Your sign-in was not accepted (it may have expired). Go back to the shop and open" +
        " the waiting room again.",
      err_not_found: "There is no waiting room here.",
      err_retry: "Connection trouble; trying again…",
      err_insecure: "This browser cannot compute the entry check here (it needs a secure connection).",
      err_other: "Something went wrong. Go back to the shop and open the waiting room again.",
      keep_open: "Keep this page open: you move forward automatically.",
      leave: "Leave the line",
      left: "You have left the line. Your place went to the buyers behind you.",
      rejoin: "Join the line again (at the back)",
      help: "Help",
      logo_alt: "The shop's logo",
    },
    "zh-CN": {
      heading: "排队等候",
      starting: "正在启动…",
      solving: "正在为您取号…",
      joining: "正在加入队列…",
      waiting: "您已在队列中。",
      admitted: "轮到您了！正在返回商店…",
      sold_out: "暂时售罄。请保持本页面打开：如有商品释放，您的排位保持不变。",
      unlikely: "您很可能抢不到：排在您前面的买家大概率会买完剩余的全部商品。您的排位保持不变，如有商品释放仍会按顺序放行；您也可以离开队列。",
      chance: "您抢到的可能性",
      chance_value: "约 {n}%",
      chance_low: "不到 1%",
      closed: "本次活动已结束。",
      paused: "销售暂时暂停。您的排位保持不变，恢复后队列将继续前进。",
      not_active: "队列暂未开放，本页面稍后会自动重试。",
      position: "您的排位",
      eta: "预计等待",
      progress: "排队进度",
      eta_seconds: "{n} 秒",
      eta_minutes: "约 {n} 分钟",
      code_label: "邀请码",
      code_submit: "加入",
      code_required: "本次活动仅限受邀用户：请输入邀请码。",
      code_invalid: "邀请码无效。",
      code_used: "该邀请码已被其他用户使用。",
      err_token: "链接缺少您的登录信息。请返回商店，重新进入排队页面。",
      err_return: "链接中的返回地址未经商店登记，不会被使用。请返回商店，从商店重新进入排队页面。",
      err_auth: "您的登录未被接受（可能已过期）。请返回商店，重新进入排队页面。",
      err_not_found: "此处没有排队页面。",
      err_retry: "网络异常，正在重试…",
      err_insecure: "此浏览器无法在此完成入场校验（需要安全连接）。",
      err_other: "出现问题。请返回商店，重新进入排队页面。",
      keep_open: "请保持本页面打开：轮到您时会自动跳转。",
      leave: "离开队列",
      left: "您已离开队列，您的排位已让给后面的买家。",
      rejoin: "重新排队（排到队尾）",
      help: "帮助",
      logo_alt: "商店标志",
    },
  };

  // Simplified Chinese for zh, zh-CN, zh-SG and zh-Hans; English otherwise.
  function pickLanguage(tags) {
    for (const tag of tags) {
      const t = String(tag).toLowerCase();
      if (t === "zh" || /^zh-(cn|sg|hans)\b/.test(t)) return "zh-CN";
      if (t === "en" || t.startsWith("en-")) return "en";
    }
    return "en";
  }

  const languages = navigator.languages && navigator.languages.length
    ? navigator.languages : [navigator.language || "en"];
  const lang = pickLanguage(languages);
  const text = (key, n) => (STRINGS[lang][key] || STRINGS.en[key]).replace("{n}", String(n));
  const $ = (id) => document.getElementById(id);

  // Read the fragment once, then take it out of the address bar and history.
  const fragment = new URLSearchParams(location.hash.replace(/^#/, ""));
  const token = fragment.get("token") || "";
  const returnTo = fragment.get("return") || "";
  if (location.hash) history.replaceState(null, "", location.pathname + location.search);

  const match = /^\/room\/([0-9]{1,19})\/?$/.exec(location.pathname);
  const dealId = match ? match[1] : null;
  const queuePath = `/v1/deals/${dealId}/queue`;
  const RETRY_MS = 2000;
  const RETRY_MAX_MS = 30000;
  const NOT_ACTIVE_MS = 10000;
  const CHALLENGE_TRIES_MAX = 3;

  let config = null;
  let returnUrl = null;
  let accessCode = null;
  let firstPosition = 0;
  let failures = 0;
  let challengeTries = 0;
  let stopped = false;
  // Left the line (DELETE …/queue): answers still in flight are not shown.
  let hasLeft = false;
  let rejoining = false;
  // The states in which the buyer is in line and may leave it.
  const IN_LINE = ["waiting", "sold_out", "unlikely"];

  function applyLanguage() {
    document.documentElement.lang = lang;
    document.title = text("heading");
    for (const el of document.querySelectorAll("[data-text]")) {
      el.textContent = text(el.dataset.text);
    }
  }

  function setText(id, value) {
    const el = $(id);
    // Unchanged text is not written again: the live region announces changes only.
    if (el.textContent !== value) el.textContent = value;
  }

  function showState(key) {
    setText("state", text(key));
    $("state").dataset.state = key;
  }

  function showError(key) {
    const el = $("error");
    el.hidden = !key;
    el.dataset.error = key || "";
    setText("error", key ? text(key) : "");
  }

  function fail(key) {
    stopped = true;
    $("numbers").hidden = true;
    $("progress").hidden = true;
    $("leave-row").hidden = true;
    showState("closed");
    $("state").hidden = true;
    showError(key);
  }

  function formatEta(seconds) {
    if (seconds < 60) return text("eta_seconds", Math.max(0, seconds));
    return text("eta_minutes", Math.ceil(seconds / 60));
  }

  function showMessage(message) {
    const el = $("message");
    if (!message || !message.text) {
      el.hidden = true;
      return;
    }
    el.className = "message " + (message.level === "warning" ? "warning" : "info");
    el.dataset.level = message.level === "warning" ? "warning" : "info";
    setText("message", message.text);
    el.hidden = false;
  }

  // The chance of finding a unit (null while the room has too little to go on).
  function showChance(chance) {
    const row = $("chance-row");
    if (!row) return;
    row.hidden = !chance;
    if (!chance) return;
    const pct = Math.round(100 * chance.p);
    setText("chance", pct < 1 ? text("chance_low") : text("chance_value", pct));
  }

  function showTicket(ticket) {
    showState(ticket.state);
    // "unlikely" is still waiting in line: the same numbers, and the chance.
    const waiting = (ticket.state === "waiting" || ticket.state === "unlikely") && ticket.position;
    $("numbers").hidden = !waiting;
    $("progress").hidden = !(waiting || ticket.state === "admitted");
    if (waiting) {
      firstPosition = Math.max(firstPosition, ticket.position);
      setText("position", String(ticket.position));
      setText("eta", ticket.eta_seconds === null ? "–" : formatEta(ticket.eta_seconds));
      const done = Math.round((100 * (firstPosition - ticket.position)) / firstPosition);
      $("progress").value = done;
      $("progress").setAttribute("aria-valuetext", `${ticket.position}`);
    } else if (ticket.state === "admitted") {
      $("progress").value = 100;
    }
    showChance(waiting ? ticket.chance : null);
    showMessage(ticket.message);
    $("paused").hidden = !(ticket.paused && IN_LINE.includes(ticket.state));
    $("leave-row").hidden = !IN_LINE.includes(ticket.state);
  }

  // The return address if its origin is one the room lists, exactly; else null.
  function allowedReturn(address, origins) {
    if (!Array.isArray(origins) || origins.length === 0 || !address) return null;
    let url;
    try {
      url = new URL(address);
    } catch (_) {
      return null;
    }
    if (url.protocol !== "https:" && url.protocol !== "http:") return null;
    if (url.username || url.password) return null;
    return origins.includes(url.origin) ? url : null;
  }

  // A call to the gate's own API; the buyer's token rides along unless `anonymous`.
  async function call(method, path, body, anonymous) {
    const headers = anonymous ? {} : { Authorization: "Bearer " + token };
    const init = { method, headers, cache: "no-store", credentials: "omit", referrerPolicy: "no-referrer" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    let data = null;
    try {
      data = await r.json();
    } catch (_) {
      data = null;
    }
    const after = Number(r.headers.get("Retry-After"));
    return { status: r.status, data, retryMs: after > 0 ? after * 1000 : 0 };
  }

  function later(step, ms) {
    if (stopped) return;
    setTimeout(() => run(step), Math.max(0, ms));
  }

  async function run(step) {
    if (stopped) return;
    try {
      await step();
      failures = 0;
    } catch (err) {
      if (stopped) return;
      // The network, not the gate: try again, less often each time.
      failures += 1;
      showError("err_retry");
      later(step, Math.min(RETRY_MAX_MS, RETRY_MS * 2 ** Math.min(failures, 4)));
    }
  }

  function onProblem(r, again) {
    const code = r.data && r.data.code;
    if (r.status === 401) return fail("err_auth");
    if (r.status === 404 && code !== "NO_TICKET") return fail("err_not_found");
    if (code === "NO_WAITING_ROOM") return fail("err_not_found");
    if (r.status === 429) return later(again, r.retryMs || RETRY_MS);
    if (r.status >= 500) {
      showError("err_retry");
      return later(again, r.retryMs || RETRY_MS);
    }
    return fail("err_other");
  }

  function solveInWorker(challenge, bits) {
    return new Promise((resolve, reject) => {
      const worker = new Worker("/room/static/pow.js");
      worker.onmessage = (event) => {
        worker.terminate();
        if (typeof event.data.nonce === "string") resolve(event.data.nonce);
        else reject(new Error(event.data.error || "no nonce"));
      };
      worker.onerror = (event) => {
        worker.terminate();
        reject(new Error(event.message || "worker failed"));
      };
      worker.postMessage({ challenge, bits });
    });
  }

  function askCode(key) {
    $("code-form").hidden = false;
    showError(key);
    $("code").focus();
  }

  function onTicket(ticket) {
    if (hasLeft) return;
    showError(null);
    $("code-form").hidden = true;
    showTicket(ticket);
    const poll = ticket.poll_after_ms;
    if (ticket.state === "admitted" && ticket.admission_token) {
      stopped = true;
      const target = new URL(returnUrl.href);
      target.hash = "admission_token=" + encodeURIComponent(ticket.admission_token);
      location.assign(target.href);
    } else if (ticket.state !== "closed") {
      later(read, poll);
    }
  }

  async function read() {
    const r = await call("GET", queuePath);
    if (r.status === 200) return onTicket(r.data);
    if (r.status === 404 && r.data && r.data.code === "NO_TICKET") return join();
    return onProblem(r, read);
  }

  async function join() {
    const body = {};
    if (accessCode) body.access_code = accessCode;
    // A buyer who left joins again without a code (theirs stays bound to them).
    else if (config.access === "codes" && !rejoining) return askCode("code_required");
    const c = await call("GET", queuePath + "/challenge");
    if (c.status === 200) {
      showState("solving");
      try {
        body.nonce = await solveInWorker(c.data.challenge, c.data.bits);
      } catch (_) {
        return fail("err_insecure");
      }
      body.challenge = c.data.challenge;
    } else if (!(c.status === 409 && c.data && c.data.code === "NO_CHALLENGE")) {
      return onProblem(c, join);
    }
    showState("joining");
    const r = await call("POST", queuePath, body);
    if (r.status === 200 || r.status === 201) return onTicket(r.data);
    const code = r.data && r.data.code;
    if (code === "ACCESS_CODE_REQUIRED") return askCode("code_required");
    if (code === "ACCESS_CODE_INVALID") return askCode("code_invalid");
    if (code === "ACCESS_CODE_USED") return askCode("code_used");
    if (code === "CHALLENGE_REQUIRED" || code === "CHALLENGE_INVALID") {
      // Expired while it was solved, or the room's challenge just changed.
      challengeTries += 1;
      return challengeTries > CHALLENGE_TRIES_MAX ? fail("err_other") : later(join, 0);
    }
    if (code === "NOT_ACTIVE") {
      showState("not_active");
      return later(join, NOT_ACTIVE_MS);
    }
    return onProblem(r, join);
  }

  function showLeft() {
    hasLeft = true;
    stopped = true;
    $("numbers").hidden = true;
    $("progress").hidden = true;
    $("leave-row").hidden = true;
    $("message").hidden = true;
    showError(null);
    showState("left");
    $("rejoin-row").hidden = false;
    $("rejoin").focus();
  }

  // Leave the line: the ticket and its place are given up (204, also when already
  // left). Anything else: back to reading the ticket, which shows what holds.
  async function leaveLine() {
    stopped = true;
    $("leave").disabled = true;
    let r = null;
    try {
      r = await call("DELETE", queuePath);
    } catch (_) {
      r = null;
    }
    $("leave").disabled = false;
    if (r && r.status === 204) return showLeft();
    stopped = false;
    if (r && r.status === 401) return fail("err_auth");
    if (!r || r.status === 429 || r.status >= 500) showError("err_retry");
    later(read, (r && r.retryMs) || RETRY_MS);
  }

  function rejoin() {
    $("rejoin-row").hidden = true;
    hasLeft = false;
    stopped = false;
    rejoining = true;
    firstPosition = 0;
    run(join);
  }

  // The shop's look (the room's page): its name as text, its accent colour (checked
  // by the gate for contrast against this page's light background, which a branded
  // page keeps), its logo as an image from a data: URL (the CSP's img-src), a help
  // link. Each shown only when it has the expected shape.
  const COLOR = /^#[0-9a-f]{6}$/;
  const LOGO = /^data:image\/(png|webp|svg\+xml);base64,[A-Za-z0-9+/]+={0,2}$/;
  function applyBrand(page) {
    if (!page) return;
    const root = document.documentElement;
    if (typeof page.accent_color === "string" && COLOR.test(page.accent_color)) {
      root.dataset.brand = "1";
      root.style.setProperty("--accent", page.accent_color);
      const onAccent = COLOR.test(String(page.accent_text)) ? page.accent_text : "#ffffff";
      root.style.setProperty("--accent-text", onAccent);
    }
    if (typeof page.shop_name === "string" && page.shop_name) {
      setText("shop-name", page.shop_name);
      $("shop-name").hidden = false;
      $("brand").hidden = false;
    }
    if (typeof page.logo === "string" && LOGO.test(page.logo)) {
      const img = $("logo");
      // The name is shown beside it; alone, the logo says whose page this is.
      img.alt = page.shop_name ? "" : text("logo_alt");
      img.src = page.logo;
      img.hidden = false;
      $("brand").hidden = false;
    }
    if (typeof page.help_url === "string" && page.help_url.startsWith("https://")) {
      $("help").href = page.help_url;
      $("help-row").hidden = false;
    }
  }

  async function start() {
    const r = await call("GET", `/room/${dealId}/config`, undefined, true);
    if (r.status !== 200) return onProblem(r, start);
    config = r.data;
    setText("deal-title", String(config.title || ""));
    applyBrand(config.page);
    returnUrl = allowedReturn(returnTo, config.return_origins);
    if (!returnUrl) return fail("err_return");
    return read();
  }

  applyLanguage();
  $("code-form").addEventListener("submit", (event) => {
    event.preventDefault();
    accessCode = $("code").value.trim();
    if (!accessCode) return;
    $("code-form").hidden = true;
    showError(null);
    run(join);
  });
  $("leave").addEventListener("click", () => {
    leaveLine();
  });
  $("rejoin").addEventListener("click", rejoin);
  if (!dealId) fail("err_not_found");
  else if (!token) fail("err_token");
  else run(start);
})();
