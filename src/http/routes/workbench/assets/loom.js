// Loom: a tree of continuations per document. Select a node, sample n children, read the
// path from the root as one text, move with the arrow keys, bookmark, hoist, prune (with
// undo) and edit (an edit is a new sibling: history is never rewritten). Every node is
// saved on the server as it is made, so a reload, or a visit a day later, finds the tree.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const { el } = FG;
  const TREE = "fleetgate-loom-tree";
  const nodeKey = (treeId) => `fleetgate-loom-node-${treeId}`;

  const KNOBS = [
    { id: "n", label: "n (children per generation, 1–16)", min: 1, max: 16, step: 1, value: 3 },
    { id: "max_tokens", label: "max_tokens (1–32000 per child)", min: 1, max: 32000, step: 1, value: 16 },
    { id: "temperature", label: "temperature (0–100; slider 0–5)", min: 0, max: 100, step: 0.05, value: 1, slider: [0, 5] },
    { id: "top_p", label: "top_p (0 < p ≤ 1)", min: 0.01, max: 1, step: 0.01, value: 1, slider: [0.01, 1] },
    { id: "logprobs", label: "alternatives shown (logprobs)", min: 0, max: 20, step: 1, value: 5 },
  ];
  const knobs = {};

  // The open tree: its record, nodes by id, child ids by parent id.
  let tree = null;
  let nodes = new Map();
  let kids = new Map();
  let current = null;
  let hoist = null;
  let generating = false;
  const lastChild = new Map();
  const pruned = []; // node ids, most recent last: what "undo" restores

  function showProblem(err) {
    $("problem").replaceChildren(err ? FG.errorBox(err) : "");
  }

  function load(view) {
    tree = view.tree;
    nodes = new Map(view.nodes.map((n) => [n.id, n]));
    kids = new Map();
    for (const node of view.nodes) {
      if (node.parent_id === null) continue;
      if (!kids.has(node.parent_id)) kids.set(node.parent_id, []);
      kids.get(node.parent_id).push(node.id);
    }
  }

  function root() {
    return view().find((n) => n.parent_id === null);
  }

  function view() {
    return [...nodes.values()];
  }

  /** Children not pruned, oldest first. */
  function children(id) {
    return (kids.get(id) || []).filter((c) => !nodes.get(c).pruned);
  }

  function path(id) {
    const out = [];
    for (let node = nodes.get(id); node; node = nodes.get(node.parent_id)) out.unshift(node);
    return out;
  }

  function pathText(id) {
    return path(id).map((n) => n.text).join("");
  }

  function select(id) {
    if (!nodes.has(id)) return;
    current = id;
    const node = nodes.get(id);
    if (node.parent_id !== null) lastChild.set(node.parent_id, id);
    localStorage.setItem(nodeKey(tree.id), String(id));
    render();
  }

  // ---- rendering ------------------------------------------------------------------

  function render() {
    FG.hidePopover();
    renderStory();
    renderChildren();
    renderTree();
    renderBookmarks();
    const node = nodes.get(current);
    $("bookmark").textContent = "";
    $("bookmark").append(node.bookmarked ? "Unbookmark " : "Bookmark ", el("kbd", { text: "b" }));
    $("undo").disabled = pruned.length === 0;
    $("hoisted").textContent = hoist ? `Hoisted at “${excerpt(nodes.get(hoist).text)}” — h at it to unhoist` : "";
  }

  function excerpt(text) {
    const flat = text.replace(/\s+/g, " ").trim();
    return flat.length > 36 ? flat.slice(0, 36) + "…" : flat || "(empty)";
  }

  /** A node's text as tokens coloured by probability when it was generated. */
  function nodeText(node) {
    const seg = el("span", { class: "seg" + (node.id === current ? " current" : ""), "data-node": node.id });
    seg.addEventListener("click", () => select(node.id));
    const tokens = node.meta && node.meta.tokens;
    if (!tokens || !tokens.length) {
      seg.textContent = node.text;
      return seg;
    }
    tokens.forEach((token, at) => seg.append(FG.tokenSpan(token, (alt) => branchAt(node, at, alt))));
    return seg;
  }

  function renderStory() {
    $("story").replaceChildren(...path(current).map(nodeText));
  }

  function renderChildren() {
    const list = children(current).map((id) => {
      const child = nodes.get(id);
      const card = el("div", { class: "child" + (lastChild.get(current) === id ? " selected" : ""), "data-node": id, onclick: () => select(id) });
      card.append(...nodeText(child).childNodes);
      return card;
    });
    $("children").replaceChildren(...(list.length ? list : [el("div", { class: "hint", text: "No children yet: press g to generate some." })]));
  }

  function renderTree() {
    const top = hoist ?? root().id;
    const item = (id) => {
      const node = nodes.get(id);
      const onPath = path(current).some((n) => n.id === id);
      const label = el("span", {
        class: "node" + (id === current ? " current" : "") + (onPath ? " on-path" : ""),
        "data-node": id, onclick: () => select(id),
        text: (node.bookmarked ? "★ " : "") + excerpt(node.text),
      });
      const li = el("li", {}, label);
      const below = children(id);
      if (below.length) li.append(el("ul", {}, ...below.map(item)));
      return li;
    };
    $("tree").replaceChildren(item(top));
  }

  function renderBookmarks() {
    const marked = view().filter((n) => n.bookmarked && !hidden(n.id));
    $("bookmarks").replaceChildren(...(marked.length
      ? marked.map((n) => el("li", { "data-node": n.id, onclick: () => select(n.id), text: "★ " + excerpt(pathText(n.id).slice(-60)) }))
      : [el("li", { class: "hint", text: "None yet: b bookmarks the selected node." })]));
  }

  /** Whether a node or one of its ancestors is pruned. */
  function hidden(id) {
    return path(id).some((n) => n.pruned);
  }

  // ---- changes --------------------------------------------------------------------

  function replaceNode(node) {
    nodes.set(node.id, node);
  }

  /** Runs a change; a 409 (another tab changed it first) reloads the tree. */
  async function change(action) {
    showProblem(null);
    try {
      await action();
    } catch (err) {
      showProblem(err);
      if (err instanceof FG.ApiError && err.status === 409) await openTree(tree.id);
    }
    render();
  }

  async function setFlags(id, flags) {
    const node = nodes.get(id);
    replaceNode(await FG.api("PATCH", `/v1/workbench/trees/${tree.id}/nodes/${id}`, { version: node.version, ...flags }));
  }

  async function addNode(parent, text, meta) {
    const node = await FG.api("POST", `/v1/workbench/trees/${tree.id}/nodes`, { parent_id: parent, text, meta });
    replaceNode(node);
    if (!kids.has(parent)) kids.set(parent, []);
    kids.get(parent).push(node.id);
    return node;
  }

  function bookmark() {
    return change(() => setFlags(current, { bookmarked: !nodes.get(current).bookmarked }));
  }

  function prune() {
    const node = nodes.get(current);
    if (node.parent_id === null || current === hoist) {
      showProblem(new Error("The root (or the hoisted node) cannot be pruned."));
      return;
    }
    return change(async () => {
      await setFlags(node.id, { pruned: true });
      pruned.push(node.id);
      lastChild.delete(node.parent_id);
      current = node.parent_id;
    });
  }

  function undo() {
    const id = pruned.pop();
    if (id === undefined) return;
    return change(async () => {
      await setFlags(id, { pruned: false });
      current = id;
    });
  }

  function toggleHoist() {
    hoist = hoist === current || nodes.get(current).parent_id === null ? null : current;
    render();
  }

  /** A new sibling of `node` with `text`: an edit never rewrites what was there. */
  function branch(node, text, meta) {
    return change(async () => {
      const made = await addNode(node.parent_id, text, meta);
      current = made.id;
      lastChild.set(node.parent_id, made.id);
    });
  }

  /** The alternative `alt` at token `at` of a generated node, as a new sibling. */
  function branchAt(node, at, alt) {
    if (node.parent_id === null) return;
    const tokens = node.meta.tokens.slice(0, at);
    const picked = node.meta.tokens[at];
    tokens.push({ t: alt, lp: (picked.top || {})[alt] ?? null, top: picked.top });
    branch(node, tokens.map((t) => t.t).join(""), { ...node.meta, tokens });
  }

  function startEdit() {
    const node = nodes.get(current);
    if (node.parent_id === null) {
      showProblem(new Error("The root cannot be edited: start a new tree with the text you want."));
      return;
    }
    $("edit-text").value = node.text;
    $("editor").hidden = false;
    $("edit-text").focus();
  }

  function saveEdit() {
    $("editor").hidden = true;
    const node = nodes.get(current);
    if ($("edit-text").value !== node.text) branch(node, $("edit-text").value, { edited_from: node.id });
  }

  /** Samples n children of the selected node, streamed in, each saved as it finishes. */
  async function generate() {
    if (generating) return;
    showProblem(null);
    let request;
    try {
      request = { model: $("model").value, prompt: pathText(current) };
      for (const [name, knob] of Object.entries(knobs)) request[name] = knob.read();
    } catch (err) {
      showProblem(err);
      return;
    }
    const parent = current;
    const settings = { ...request };
    delete settings.prompt;
    const live = Array.from({ length: request.n }, () => ({ tokens: [], card: el("div", { class: "child live" }) }));
    $("children").prepend(...live.map((l) => l.card));
    generating = true;
    $("generate").disabled = true;
    try {
      await FG.complete(request, (index, token) => {
        live[index].tokens.push(token);
        live[index].card.append(FG.tokenSpan(token, null));
      });
      for (const { tokens } of live) {
        await addNode(parent, tokens.map((t) => t.t).join(""), { tokens, settings });
      }
      await FG.refreshBudget();
    } catch (err) {
      showProblem(err);
    } finally {
      generating = false;
      $("generate").disabled = false;
      render();
    }
  }

  // ---- keyboard -------------------------------------------------------------------

  function sibling(step) {
    const node = nodes.get(current);
    if (node.parent_id === null || current === hoist) return;
    const list = children(node.parent_id);
    const at = list.indexOf(current);
    const next = list[(at + step + list.length) % list.length];
    if (next !== undefined) select(next);
  }

  function child() {
    const list = children(current);
    const remembered = lastChild.get(current);
    const next = list.includes(remembered) ? remembered : list[0];
    if (next !== undefined) select(next);
  }

  function parent() {
    const node = nodes.get(current);
    if (node.parent_id !== null && current !== hoist) select(node.parent_id);
  }

  const KEYS = {
    ArrowLeft: parent, ArrowRight: child, ArrowUp: () => sibling(-1), ArrowDown: () => sibling(1),
    g: generate, b: bookmark, h: toggleHoist, e: startEdit, Delete: prune, x: prune, u: undo,
  };

  document.addEventListener("keydown", (event) => {
    const typing = event.target.closest && event.target.closest("input, textarea, select");
    if (typing || event.ctrlKey || event.metaKey || event.altKey) return;
    const action = KEYS[event.key];
    if (!action) return;
    event.preventDefault();
    whenOpen(action);
  });

  /** Runs a tree action, when a tree is open. */
  function whenOpen(action) {
    if (tree) action();
  }

  // ---- trees ----------------------------------------------------------------------

  async function openTree(id) {
    load(await FG.api("GET", `/v1/workbench/trees/${id}`));
    localStorage.setItem(TREE, String(id));
    const remembered = Number(localStorage.getItem(nodeKey(id)));
    current = nodes.has(remembered) && !hidden(remembered) ? remembered : root().id;
    hoist = null;
    pruned.length = 0;
    $("tree-select").value = String(id);
    render();
  }

  async function listTrees(selected) {
    const trees = await FG.listAll("/v1/workbench/trees");
    $("tree-select").replaceChildren(...trees.map((t) => el("option", { value: t.id, text: t.title || "(untitled)" })));
    const wanted = trees.find((t) => t.id === selected) || trees[0];
    if (wanted) {
      await openTree(wanted.id);
    } else {
      tree = null;
      $("story").replaceChildren(el("span", { class: "hint", text: "No trees yet. Start one with the text on the left." }));
      $("children").replaceChildren();
      $("tree").replaceChildren();
      $("bookmarks").replaceChildren();
    }
    return trees;
  }

  async function newTree() {
    const text = $("new-root").value;
    if (!text.trim()) {
      showProblem(new Error("Write the beginning of the document first."));
      return;
    }
    try {
      const title = text.trim().split("\n")[0].slice(0, 80);
      const made = await FG.api("POST", "/v1/workbench/trees", { title, root_text: text });
      $("new-root").value = "";
      await listTrees(made.tree.id);
    } catch (err) {
      showProblem(err);
    }
  }

  async function exportTree() {
    if (!tree) return;
    const data = await FG.api("GET", `/v1/workbench/trees/${tree.id}/export`);
    const link = el("a", {
      href: URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" })),
      download: `loom-${tree.id}.json`,
    });
    document.body.append(link);
    link.click();
    link.remove();
  }

  async function importTree(file) {
    try {
      const made = await FG.api("POST", "/v1/workbench/trees/import", JSON.parse(await file.text()));
      await listTrees(made.tree.id);
    } catch (err) {
      showProblem(err);
    }
  }

  function rename() {
    const title = prompt("Title of this tree", tree.title);
    if (title === null || title === tree.title) return;
    return change(async () => {
      tree = await FG.api("PATCH", `/v1/workbench/trees/${tree.id}`, { version: tree.version, title });
      const option = $("tree-select").querySelector(`option[value="${tree.id}"]`);
      if (option) option.textContent = title;
    });
  }

  async function deleteTree() {
    if (!tree || !confirm(`Delete the tree “${tree.title}” and all its nodes?`)) return;
    try {
      await FG.api("DELETE", `/v1/workbench/trees/${tree.id}`);
      localStorage.removeItem(TREE);
      await listTrees(null);
    } catch (err) {
      showProblem(err);
    }
  }

  FG.frame("loom", async () => {
    const panel = $("knobs");
    for (const def of KNOBS) {
      knobs[def.id] = FG.knob(def);
      panel.append(knobs[def.id].element);
    }
    $("legend").append(FG.legend());
    const buttons = { generate, bookmark, hoist: toggleHoist, prune, undo, edit: startEdit, rename };
    for (const [id, action] of Object.entries(buttons)) $(id).addEventListener("click", () => whenOpen(action));
    $("edit-save").addEventListener("click", saveEdit);
    $("edit-cancel").addEventListener("click", () => { $("editor").hidden = true; });
    $("new-tree").addEventListener("click", newTree);
    $("export").addEventListener("click", exportTree);
    $("delete-tree").addEventListener("click", deleteTree);
    $("import").addEventListener("change", (event) => { if (event.target.files[0]) importTree(event.target.files[0]); event.target.value = ""; });
    $("tree-select").addEventListener("change", (event) => openTree(Number(event.target.value)).catch(showProblem));
    try {
      await FG.fillModels($("model"));
      await listTrees(Number(localStorage.getItem(TREE)));
    } catch (err) {
      showProblem(err);
    }
  });
})();
