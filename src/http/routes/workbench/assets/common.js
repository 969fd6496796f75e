// What the Workbench and Loom share: the key (asked for once, kept in this tab's session
// storage, sent only as `Authorization: Bearer`), calls to fleetgate's API with its error
// envelope, streamed completions, and tokens coloured by their probability with their
// alternatives on hover. Plain JavaScript, no build step, nothing from other origins.
"use strict";

const FG = (() => {
  const KEY = "fleetgate-key";

  /** An error answer of the API: its status, `error.code`, message and request id. */
  class ApiError extends Error {
    constructor(status, code, message, requestId) {
      super(message);
      this.status = status;
      this.code = code;
      this.requestId = requestId;
    }
  }

  function key() {
    return sessionStorage.getItem(KEY);
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (value !== false && value !== undefined && value !== null) node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  }

  /** The error of a failed response, from its envelope when it has one. */
  async function failure(response) {
    const requestId = response.headers.get("x-request-id") || "";
    try {
      const body = await response.json();
      return new ApiError(response.status, body.error.code, body.error.message, body.request_id || requestId);
    } catch {
      return new ApiError(response.status, "http_" + response.status, response.statusText, requestId);
    }
  }

  async function call(method, path, body, extraHeaders = {}) {
    const headers = { Authorization: "Bearer " + key(), ...extraHeaders };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) throw await failure(response);
    return response;
  }

  /** A JSON API call; throws an ApiError for an error answer. */
  async function api(method, path, body) {
    const response = await call(method, path, body);
    return response.status === 204 ? null : response.json();
  }

  /** Every entry of a paged list (`/v1/workbench/items`, `/trees`): metadata only, a
   *  page of 100 at a time, following `next_cursor` to the end. */
  async function listAll(path) {
    const entries = [];
    let cursor = null;
    do {
      const query = cursor === null ? "?limit=100" : `?limit=100&cursor=${encodeURIComponent(cursor)}`;
      const page = await api("GET", path + query);
      entries.push(...page.data);
      cursor = page.next_cursor;
    } while (cursor !== null);
    return entries;
  }

  /** Signs in: keeps the key when fleetgate accepts it. */
  async function signIn(secret) {
    sessionStorage.setItem(KEY, secret);
    try {
      return await api("GET", "/v1/usage");
    } catch (err) {
      sessionStorage.removeItem(KEY);
      throw err;
    }
  }

  function signOut() {
    sessionStorage.removeItem(KEY);
    location.reload();
  }

  /**
   * Runs a completion as the pages do: streamed, with `X-Acs-Budget-Clamp: refuse` (a run
   * the budget would shorten is refused, not clamped). `onToken(choice, token)` gets each
   * generated token `{t, lp, top}`; resolves to the usage.
   */
  async function complete(request, onToken) {
    const body = { ...request, stream: true, stream_options: { include_usage: true } };
    const response = await call("POST", "/v1/completions", body, {
      "X-Acs-Budget-Clamp": "refuse",
      "X-Acs-Workload": "interactive",
    });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const event = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return usage;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new ApiError(200, chunk.error.code, chunk.error.message, chunk.request_id || "");
          if (chunk.usage) usage = chunk.usage;
          for (const choice of chunk.choices || []) {
            for (const token of tokensOf(choice)) onToken(choice.index, token);
          }
        }
      }
    }
    return usage;
  }

  /** The tokens of one streamed or whole choice, with logprobs when it has them. */
  function tokensOf(choice) {
    const lp = choice.logprobs;
    if (!lp || !lp.tokens) return choice.text ? [{ t: choice.text, lp: null, top: null }] : [];
    return lp.tokens.map((t, i) => ({ t, lp: lp.token_logprobs[i], top: lp.top_logprobs ? lp.top_logprobs[i] : null }));
  }

  /** Probabilities at or below this are as red as it gets. */
  const FLOOR_BITS = 8;

  /**
   * The background of a token of probability `p`: red (unlikely) through yellow to green,
   * on a log scale from 2^-8 (0.4%) to 1, so that a 20% token and a 2% one look different.
   */
  function colour(p) {
    const bits = -Math.log2(Math.max(p, 2 ** -FLOOR_BITS));
    const hue = Math.round(120 * (1 - bits / FLOOR_BITS));
    return `hsl(${hue}, 75%, 82%)`;
  }

  function percent(lp) {
    const p = Math.exp(lp);
    return p >= 0.995 ? "100%" : p < 0.001 ? "<0.1%" : (100 * p).toFixed(1) + "%";
  }

  function shown(text) {
    return JSON.stringify(text).slice(1, -1);
  }

  // One popover for the page: a token's probability and its top alternatives.
  let popover = null;
  let popoverOwner = null;

  function hidePopover() {
    if (popover) popover.remove();
    popover = null;
    popoverOwner = null;
  }

  document.addEventListener("mouseover", (event) => {
    if (popover && !popover.contains(event.target) && !event.target.classList.contains("tok")) hidePopover();
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") hidePopover();
  });

  function showPopover(span, token, onPick) {
    if (popoverOwner === span) return;
    hidePopover();
    const alternatives = Object.entries(token.top || {}).sort((a, b) => b[1] - a[1]);
    if (!alternatives.some(([t]) => t === token.t)) alternatives.unshift([token.t, token.lp]);
    popover = el("div", { class: "popover", role: "dialog" },
      el("div", { class: "head", text: `"${shown(token.t)}"  ${percent(token.lp)}  (${(-token.lp / Math.LN2).toFixed(2)} bits)` }));
    for (const [t, lp] of alternatives) {
      const pick = el("button", {
        class: "alt" + (t === token.t ? " chosen" : ""),
        title: onPick ? "Continue from here with this token" : "",
        onclick: () => { hidePopover(); if (onPick) onPick(t); },
      }, el("span", { text: `"${shown(t)}"` }), el("span", { class: "p", text: percent(lp) }));
      popover.append(pick);
    }
    const box = span.getBoundingClientRect();
    popover.style.left = `${box.left + window.scrollX}px`;
    // Just under the token, no gap: the pointer reaches the alternatives without leaving.
    popover.style.top = `${box.bottom + window.scrollY - 1}px`;
    document.body.append(popover);
    popoverOwner = span;
  }

  /**
   * A span for one token, coloured by its probability; hovering shows the alternatives,
   * clicking one calls `onPick(alternative)`.
   */
  function tokenSpan(token, onPick) {
    const span = el("span", { class: "tok", text: token.t });
    if (token.lp === null || token.lp === undefined) return span;
    const p = Math.exp(token.lp);
    span.style.background = colour(p);
    span.dataset.p = p.toFixed(4);
    span.addEventListener("mouseenter", () => showPopover(span, token, onPick));
    return span;
  }

  /** An error as the pages show it: its code, message and request id. */
  function errorBox(err) {
    if (!(err instanceof ApiError)) return el("div", { class: "error", text: String(err) });
    return el("div", { class: "error", role: "alert" },
      el("code", { text: err.code }), `: ${err.message}`,
      el("div", { class: "hint", text: `request id ${err.requestId}` }));
  }

  function legend() {
    const scale = el("span", { class: "scale" });
    scale.style.background = `linear-gradient(to right, ${colour(0)}, ${colour(2 ** -4)}, ${colour(1)})`;
    return el("div", { class: "legend" }, "p ≤ 0.4%", scale, "p = 100% (log scale)");
  }

  /** The models of `/v1/models` into a select, the default one chosen. */
  async function fillModels(select) {
    const models = await api("GET", "/v1/models");
    select.replaceChildren(...models.data.map((m) =>
      el("option", { value: m.id, text: m.id, selected: m.default ? "selected" : false })));
    return models.data;
  }

  function usageLine(usage) {
    return `${usage.remaining.toLocaleString()} of ${usage.monthly_budget.toLocaleString()} tokens left in ${usage.month}`;
  }

  /**
   * The page frame: header with navigation, then either the sign-in form or, once a key
   * is accepted, `start(usage)`.
   */
  function frame(here, start) {
    const who = el("span", { class: "who" });
    const bar = el("header", { class: "bar" },
      el("span", { class: "brand", text: "fleetgate" }),
      el("nav", {},
        el("a", { href: "/workbench", class: here === "workbench" ? "here" : "", text: "Workbench" }),
        el("a", { href: "/loom", class: here === "loom" ? "here" : "", text: "Loom" })),
      who);
    document.body.prepend(bar);
    const main = document.getElementById("main");
    const begin = (usage) => {
      main.hidden = false;
      who.replaceChildren(`key ${usage.key_prefix}… · `, el("span", { id: "budget", text: usageLine(usage) }),
        el("button", { id: "sign-out", onclick: signOut, text: "Sign out" }));
      // Marks the page ready (models and saved work loaded), for people and tests alike.
      Promise.resolve(start(usage)).finally(() => { document.body.dataset.ready = "true"; });
    };
    if (key()) {
      api("GET", "/v1/usage").then(begin, () => { sessionStorage.removeItem(KEY); showSignIn(main, begin); });
    } else {
      showSignIn(main, begin);
    }
  }

  function showSignIn(main, begin) {
    const input = el("input", { id: "api-key", type: "password", autocomplete: "off", placeholder: "fg-…", "aria-label": "API key" });
    const problem = el("div");
    const form = el("form", { class: "panel signin", id: "sign-in" },
      el("h2", { text: "Sign in" }),
      el("p", { class: "hint", text: "Your API key stays in this tab (session storage) and goes only to this server, as a Bearer header." }),
      input, el("div", { class: "row" }, el("button", { class: "primary", type: "submit", text: "Sign in" })), problem);
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      try {
        const usage = await signIn(input.value.trim());
        form.remove();
        begin(usage);
      } catch (err) {
        problem.replaceChildren(errorBox(err));
      }
    });
    main.hidden = true;
    main.before(form);
    input.focus();
  }

  /** Refreshes the budget line in the header; returns the usage. */
  async function refreshBudget() {
    const usage = await api("GET", "/v1/usage");
    const line = document.getElementById("budget");
    if (line) line.textContent = usageLine(usage);
    return usage;
  }

  /**
   * A labelled number knob, with a slider over `slider` ([from, to]) when given: the
   * slider covers the common range, the box the documented bounds. `read()` gives the
   * number, or `undefined` when the box is empty and `optional`.
   */
  function knob({ id, label, min, max, step, value, slider, optional }) {
    const box = el("input", { id, type: "number", min, max, step, value: value ?? "", "aria-label": label });
    const row = el("div", { class: "row" });
    if (slider) {
      const range = el("input", { type: "range", min: slider[0], max: slider[1], step, value, "aria-label": label + " slider", id: id + "-slider" });
      range.addEventListener("input", () => { box.value = range.value; });
      box.addEventListener("input", () => { range.value = box.value; });
      row.append(range);
    }
    row.append(box);
    const read = () => {
      if (box.value.trim() === "") {
        if (optional) return undefined;
        throw new Error(`${label} needs a value`);
      }
      return Number(box.value);
    };
    return { element: el("div", {}, el("label", { for: id, text: label }), row), read };
  }

  /** Scores a prompt: each prompt token's logprob (echo + logprobs, max_tokens 1). */
  async function scorePrompt(model, prompt, alternatives) {
    const response = await call("POST", "/v1/completions",
      { model, prompt, max_tokens: 1, echo: true, logprobs: alternatives, temperature: 0 },
      { "X-Acs-Budget-Clamp": "refuse", "X-Acs-Workload": "interactive" });
    const body = await response.json();
    const tokens = tokensOf(body.choices[0]);
    // The last token is the one generated; the rest are the prompt's.
    return { tokens: tokens.slice(0, -1), usage: body.usage };
  }

  return { ApiError, api, listAll, complete, knob, scorePrompt, tokenSpan, errorBox, legend, fillModels, frame, refreshBudget, el, tokensOf, hidePopover };
})();
