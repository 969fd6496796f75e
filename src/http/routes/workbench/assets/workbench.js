// The Workbench: a prompt, the sampling knobs with the documented bounds, a streamed
// completion whose tokens are coloured by probability (alternatives on hover, click one
// to continue from it), the prompt's surprisal, and saved prompts and runs.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const { el } = FG;

  // The documented fields and bounds (API reference, "Request body").
  const KNOBS = [
    { id: "temperature", label: "temperature (0–100; slider 0–5)", min: 0, max: 100, step: 0.05, value: 1, slider: [0, 5] },
    { id: "max_tokens", label: "max_tokens (1–32000 per run)", min: 1, max: 32000, step: 1, value: 48 },
    { id: "n", label: "n (1–16 completions)", min: 1, max: 16, step: 1, value: 1 },
    { id: "top_p", label: "top_p (0 < p ≤ 1)", min: 0.01, max: 1, step: 0.01, value: 1, slider: [0.01, 1] },
    { id: "top_k", label: "top_k (−1 off, or ≥ 1)", min: -1, step: 1, value: -1 },
    { id: "min_p", label: "min_p (0–1)", min: 0, max: 1, step: 0.01, value: 0 },
    { id: "presence_penalty", label: "presence_penalty (−2–2)", min: -2, max: 2, step: 0.1, value: 0 },
    { id: "frequency_penalty", label: "frequency_penalty (−2–2)", min: -2, max: 2, step: 0.1, value: 0 },
    { id: "repetition_penalty", label: "repetition_penalty (0 < r ≤ 2)", min: 0.01, max: 2, step: 0.01, value: 1 },
    { id: "seed", label: "seed (0–2⁶³−1, empty: random)", min: 0, step: 1, optional: true },
    { id: "logprobs", label: "alternatives shown (logprobs, 0–model cap)", min: 0, max: 20, step: 1, value: 5 },
  ];

  const knobs = {};
  let run = null; // { prompt, settings, choices: [[token]], item }
  const totals = { prompt: 0, completion: 0 };

  function settings() {
    const out = { model: $("model").value };
    for (const [name, knob] of Object.entries(knobs)) {
      const value = knob.read();
      if (value !== undefined) out[name] = value;
    }
    const stops = $("stop-strings").value.split("\n").filter((s) => s !== "").map((s) => s.replaceAll("\\n", "\n"));
    if (stops.length) out.stop = stops;
    out.add_special_tokens = $("add-special-tokens").checked;
    return out;
  }

  function applySettings(saved) {
    for (const name of Object.keys(knobs)) {
      const box = $(name);
      box.value = saved[name] ?? "";
      const slider = $(name + "-slider");
      if (slider) slider.value = box.value;
    }
    if (saved.model) $("model").value = saved.model;
    $("stop-strings").value = (saved.stop || []).map((s) => s.replaceAll("\n", "\\n")).join("\n");
    $("add-special-tokens").checked = saved.add_special_tokens !== false;
  }

  function showProblem(err) {
    $("problem").replaceChildren(err ? FG.errorBox(err) : "");
  }

  /** Renders one choice: the prompt (grey), then each token, clickable alternatives. */
  function renderChoice(index, prompt, tokens) {
    const text = el("div", { class: "text", "data-choice": index }, el("span", { class: "prompt", text: prompt }));
    tokens.forEach((token, at) => text.append(FG.tokenSpan(token, (alt) => continueFrom(index, at, alt))));
    return el("div", { class: "choice" }, text);
  }

  function renderRun() {
    $("outputs").replaceChildren(...run.choices.map((tokens, i) => renderChoice(i, run.prompt, tokens)));
  }

  /** The prompt becomes everything before token `at` of choice `index`, then `alt`; runs. */
  function continueFrom(index, at, alt) {
    const before = run.choices[index].slice(0, at).map((t) => t.t).join("");
    $("prompt").value = run.prompt + before + alt;
    start();
  }

  async function start() {
    showProblem(null);
    FG.hidePopover();
    let request;
    try {
      request = { ...settings(), prompt: $("prompt").value };
    } catch (err) {
      showProblem(err);
      return;
    }
    const { prompt, ...saved } = request;
    run = { prompt, settings: saved, choices: Array.from({ length: request.n || 1 }, () => []), item: null };
    renderRun();
    $("run").disabled = true;
    $("saved-note").textContent = "";
    const outputs = [...$("outputs").querySelectorAll(".text")];
    try {
      const usage = await FG.complete(request, (index, token) => {
        const at = run.choices[index].length;
        run.choices[index].push(token);
        outputs[index].append(FG.tokenSpan(token, (alt) => continueFrom(index, at, alt)));
      });
      await finished(usage);
    } catch (err) {
      showProblem(err);
    } finally {
      $("run").disabled = false;
    }
  }

  async function finished(usage) {
    if (usage) {
      totals.prompt += usage.prompt_tokens;
      totals.completion += usage.completion_tokens;
    }
    const budget = await FG.refreshBudget();
    $("stats").replaceChildren(
      "This run: ", el("b", { text: String(usage ? usage.prompt_tokens : "?") }), " prompt + ",
      el("b", { text: String(usage ? usage.completion_tokens : "?") }), " completion tokens. This session: ",
      el("b", { id: "session-tokens", text: String(totals.prompt + totals.completion) }), " tokens. Budget: ",
      el("b", { text: budget.remaining.toLocaleString() }), ` of ${budget.monthly_budget.toLocaleString()} tokens left.`);
    // Kept as a recovery checkpoint until saved.
    run.item = await FG.api("POST", "/v1/workbench/items", {
      kind: "run", title: titleOf(run.prompt), content: runContent(), checkpoint: true,
    });
    $("saved-note").textContent = "Unsaved: kept as a recovery checkpoint for seven days.";
    await listSaved();
  }

  function runContent() {
    return { prompt: run.prompt, settings: run.settings, choices: run.choices };
  }

  function titleOf(prompt) {
    const line = prompt.trim().split("\n")[0];
    return line.length > 60 ? line.slice(0, 60) + "…" : line;
  }

  async function save() {
    showProblem(null);
    const title = $("title").value.trim() || titleOf($("prompt").value);
    try {
      if (run && run.item && run.item.expires_at !== null) {
        run.item = await FG.api("PATCH", `/v1/workbench/items/${run.item.id}`, { version: run.item.version, title, saved: true });
        $("saved-note").textContent = "Saved.";
      } else {
        const { model, ...rest } = settings();
        await FG.api("POST", "/v1/workbench/items", { kind: "prompt", title, content: { prompt: $("prompt").value, settings: { model, ...rest } } });
        $("saved-note").textContent = "Prompt saved.";
      }
      await listSaved();
    } catch (err) {
      showProblem(err);
    }
  }

  async function listSaved() {
    const items = await FG.listAll("/v1/workbench/items");
    $("saved").replaceChildren(...items.map((item) => {
      const tag = item.expires_at === null ? item.kind : `checkpoint · ${daysLeft(item.expires_at)}`;
      const remove = el("button", { class: "remove", title: "Delete", "aria-label": "Delete " + item.title, text: "×", onclick: (event) => {
        event.stopPropagation();
        forget(item);
      } });
      return el("li", { onclick: () => open(item) }, el("span", { text: item.title || "(untitled)" }),
        el("span", { class: "tag" }, tag, remove));
    }));
  }

  async function forget(item) {
    showProblem(null);
    try {
      await FG.api("DELETE", `/v1/workbench/items/${item.id}`);
      if (run && run.item && run.item.id === item.id) run.item = null;
      await listSaved();
    } catch (err) {
      showProblem(err);
    }
  }

  function daysLeft(expiresAt) {
    const days = Math.max(0, Math.ceil((expiresAt * 1000 - Date.now()) / 86400000));
    return `${days} d left`;
  }

  /** Opens a listed item: a list carries no content, so it is fetched here. */
  async function open(entry) {
    showProblem(null);
    let item;
    try {
      item = await FG.api("GET", `/v1/workbench/items/${entry.id}`);
    } catch (err) {
      showProblem(err);
      return;
    }
    $("prompt").value = item.content.prompt || "";
    $("title").value = item.title;
    applySettings(item.content.settings || {});
    if (item.kind === "run") {
      run = { prompt: item.content.prompt, settings: item.content.settings, choices: item.content.choices || [], item };
      renderRun();
      $("saved-note").textContent = item.expires_at === null ? "Saved." : "Unsaved: a recovery checkpoint.";
    } else {
      $("outputs").replaceChildren();
    }
  }

  /** The prompt's surprisal: each prompt token coloured by p, with −log₂ p on hover. */
  async function score() {
    showProblem(null);
    try {
      const prompt = $("prompt").value;
      const { tokens, usage } = await FG.scorePrompt($("model").value, prompt, knobs.logprobs.read());
      const scored = tokens.filter((t) => t.lp !== null);
      const bits = scored.reduce((sum, t) => sum - t.lp / Math.LN2, 0);
      const text = el("div", { class: "text", id: "surprisal" });
      for (const token of tokens) text.append(FG.tokenSpan(token, null));
      $("outputs").replaceChildren(el("div", { class: "choice" },
        el("div", { class: "hint", text: `Prompt surprisal: ${bits.toFixed(1)} bits over ${scored.length} tokens (${(bits / Math.max(1, scored.length)).toFixed(2)} bits/token; the first token has none).` }),
        text));
      totals.prompt += usage.prompt_tokens;
      totals.completion += usage.completion_tokens;
      await FG.refreshBudget();
    } catch (err) {
      showProblem(err);
    }
  }

  FG.frame("workbench", async () => {
    const panel = $("knobs");
    for (const def of KNOBS) {
      const knob = FG.knob(def);
      knobs[def.id] = knob;
      panel.append(knob.element);
    }
    panel.append(
      el("label", { for: "stop-strings", text: "stop (up to 4, one per line; \\n for a newline)" }),
      el("textarea", { id: "stop-strings", rows: 2, spellcheck: "false" }),
      el("label", {}, el("input", { type: "checkbox", id: "add-special-tokens", checked: "checked" }), " add_special_tokens (BOS)"));
    $("legend").append(FG.legend());
    try {
      const models = await FG.fillModels($("model"));
      const chosen = models.find((m) => m.default) || models[0];
      if (chosen) $("logprobs").max = chosen.capabilities.max_logprobs;
      await listSaved();
    } catch (err) {
      showProblem(err);
    }
    $("run").addEventListener("click", start);
    $("score").addEventListener("click", score);
    $("save").addEventListener("click", save);
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        start();
      }
    });
  });
})();
