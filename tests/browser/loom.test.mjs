// Loom in a real browser: a person with only a key grows a tree of continuations with
// the keyboard, sees each token's probability, and finds the tree again after a reload
// and in a new visit; another key sees none of it; a run the budget would clamp is
// refused with its numbers.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { join } from "node:path";
import { startGateway, visit, signIn, SCREENSHOTS } from "./harness.mjs";

let gateway;
before(async () => { gateway = await startGateway(); });
after(async () => { await gateway?.stop(); });

/** The text of the selected node in the tree view. */
const currentNode = (page) => page.textContent("#tree .node.current");
/** The children cards of the selected node. */
const childCards = (page) => page.locator("#children .child[data-node]");

async function generate(page, expected) {
  await page.keyboard.press("g");
  await page.waitForFunction((n) => document.querySelectorAll("#children .child[data-node]").length === n
    && !document.querySelector("#children .child.live"), expected);
}

async function newTree(page, text) {
  await page.fill("#new-root", text);
  await page.click("#new-tree");
  await page.waitForFunction((t) => document.querySelector("#story")?.textContent === t, text);
  // Keys go to the page, not to the text box.
  await page.locator("#story").click();
}

test("grow a tree with the keyboard, bookmark, prune and undo, and find it again", async () => {
  const { context, page, problems } = await visit(gateway);
  await signIn(gateway, page, "/loom", gateway.keys.alice);
  assert.equal(await page.locator("#tree-select option").count(), 0, "a new key has no trees");

  await newTree(page, "The lighthouse keeper opened the logbook and wrote:");
  await generate(page, 3);

  // Every generated token is coloured by its probability and has its alternatives.
  const tokens = page.locator("#children .tok");
  assert.ok(await tokens.count() >= 3, "tokens shown");
  const first = tokens.first();
  const p = Number(await first.getAttribute("data-p"));
  assert.ok(p > 0 && p <= 1, `a probability (${p})`);
  assert.match(await first.evaluate((t) => getComputedStyle(t).backgroundColor), /^rgb/);
  await first.hover();
  await page.waitForSelector(".popover .alt");
  assert.ok(await page.locator(".popover .alt").count() >= 2, "the top alternatives");
  assert.match(await page.textContent(".popover .head"), /%/);
  await page.keyboard.press("Escape");

  // → goes to the first child, ↓ to its sibling, ← back to the root.
  const rootLabel = await currentNode(page);
  const firstChild = await childCards(page).nth(0).textContent();
  const secondChild = await childCards(page).nth(1).textContent();
  await page.keyboard.press("ArrowRight");
  assert.ok((await page.textContent("#story")).endsWith(firstChild), "the path reads root + first child");
  await page.keyboard.press("ArrowDown");
  assert.ok((await page.textContent("#story")).endsWith(secondChild), "the sibling is selected");
  await page.keyboard.press("ArrowUp");
  assert.ok((await page.textContent("#story")).endsWith(firstChild));

  // Grow a second level under the first child and bookmark one of its children.
  await generate(page, 3);
  await page.keyboard.press("ArrowRight");
  await page.keyboard.press("b");
  await page.waitForSelector("#bookmarks li[data-node]");
  const bookmarked = await page.textContent("#story");
  assert.match(await currentNode(page), /^★ /);

  // Back to the root; prune its second child, then undo.
  await page.keyboard.press("ArrowLeft");
  await page.keyboard.press("ArrowLeft");
  assert.equal(await currentNode(page), rootLabel);
  await page.keyboard.press("ArrowRight");
  await page.keyboard.press("ArrowDown");
  await page.keyboard.press("Delete");
  await page.waitForFunction(() => document.querySelectorAll("#children .child[data-node]").length === 2);
  assert.equal(await currentNode(page), rootLabel, "pruning selects the parent");
  assert.ok(!(await page.textContent("#children")).includes(secondChild), "the pruned child is hidden");
  await page.keyboard.press("u");
  await page.waitForFunction((t) => document.querySelector("#story").textContent.endsWith(t), secondChild);
  await page.keyboard.press("ArrowLeft");
  assert.equal(await childCards(page).count(), 3, "undo brings it back");

  // Hoist at the first child: the tree view starts there.
  await page.keyboard.press("ArrowRight");
  assert.ok((await page.textContent("#story")).endsWith(firstChild));
  await page.keyboard.press("h");
  assert.match(await page.textContent("#hoisted"), /Hoisted/);
  assert.ok(!(await page.textContent("#tree")).includes(rootLabel.slice(0, 20)), "the root is out of view");
  await page.keyboard.press("h");
  assert.equal(await page.textContent("#hoisted"), "");

  // Jump to the bookmark and take the screenshot for the README.
  await page.click("#bookmarks li[data-node]");
  assert.equal(await page.textContent("#story"), bookmarked);
  // The screenshot for the README: the bookmark's parent, its three children below.
  await page.keyboard.press("ArrowLeft");
  await page.locator("#story .tok").nth(4).hover();
  await page.waitForSelector(".popover .alt");
  await page.screenshot({ path: join(SCREENSHOTS, "loom.png") });
  await page.keyboard.press("Escape");
  await page.keyboard.press("ArrowRight");
  assert.equal(await page.textContent("#story"), bookmarked, "→ returns to the child last visited");

  // A reload finds the tree and the selected node.
  await page.reload();
  await page.waitForFunction((t) => document.querySelector("#story")?.textContent === t, bookmarked);
  assert.equal(await page.locator("#bookmarks li[data-node]").count(), 1);
  await context.close();

  // So does a new visit (a day later: no session or local storage), once signed in.
  const later = await visit(gateway);
  await signIn(gateway, later.page, "/loom", gateway.keys.alice);
  await later.page.waitForSelector("#tree .node");
  assert.equal(await later.page.locator("#tree .node").count(), 7, "root, 3 children, 3 grandchildren");
  assert.equal(await later.page.locator("#bookmarks li[data-node]").count(), 1);
  await later.context.close();
  assert.deepEqual([...problems, ...later.problems], [], "no script errors");
});

test("before a key is accepted, each page shows only the sign-in form", async () => {
  const { context, page, problems } = await visit(gateway);
  for (const path of ["/workbench", "/loom"]) {
    await page.goto(gateway.url + path);
    await page.waitForSelector("#sign-in");
    assert.ok(await page.isVisible("#sign-in"), `${path}: the sign-in form shows`);
    assert.ok(!(await page.isVisible("#main")), `${path}: the interface is hidden until sign-in`);
    const shown = await page.locator("#main button, #main textarea, #main select").evaluateAll(
      (controls) => controls.filter((c) => c.getClientRects().length > 0).length);
    assert.equal(shown, 0, `${path}: no control of the interface is laid out under the form`);
    await signIn(gateway, page, path, gateway.keys.bob);
    assert.ok(await page.isVisible("#main"), `${path}: the interface shows once signed in`);
    assert.equal(await page.locator("#sign-in").count(), 0, `${path}: the form is gone`);
    // Reloaded, the tab signs in with the key it kept: the interface shows at once.
    await page.reload();
    await page.waitForSelector("body[data-ready]", { state: "attached" });
    assert.ok(await page.isVisible("#main"), `${path}: the interface shows after a reload`);
    await page.evaluate(() => sessionStorage.clear());
  }
  await context.close();
  assert.deepEqual(problems, [], "no script errors");
});

test("a wrong key is refused at sign-in; another key sees none of it", async () => {
  const { context, page, problems } = await visit(gateway);
  await page.goto(gateway.url + "/loom");
  await page.fill("#api-key", "fg-not-a-key");
  await page.click("#sign-in button[type=submit]");
  await page.waitForSelector("#sign-in .error");
  assert.match(await page.textContent("#sign-in .error"), /^invalid_api_key: .*request id req_/);
  assert.equal(await page.evaluate(() => sessionStorage.length), 0, "a refused key is not kept");
  await signIn(gateway, page, "/loom", gateway.keys.bob);
  await page.waitForSelector("#story .hint");
  assert.equal(await page.locator("#tree-select option").count(), 0);
  assert.match(await page.textContent("#story"), /No trees yet/);
  await context.close();
  // The browser reports the refused sign-in's 401 itself; nothing else went wrong.
  assert.deepEqual(problems.filter((p) => !p.includes("status of 401")), []);
});

test("a run the budget would clamp is refused with what is left and needed", async () => {
  const { context, page } = await visit(gateway);
  await signIn(gateway, page, "/loom", gateway.keys.frugal);
  await newTree(page, "Short budget:");
  await page.fill("#n", "4");
  await page.fill("#max_tokens", "100");
  await page.locator("#story").click();
  await page.keyboard.press("g");
  await page.waitForSelector("#problem .error");
  const shown = await page.textContent("#problem .error");
  assert.match(shown, /^budget_exceeded: /);
  assert.match(shown, /has 120 left/);
  assert.match(shown, /this request needs/);
  assert.match(shown, /request id req_/);
  assert.equal(await childCards(page).count(), 0, "nothing was generated");
  await context.close();
});

test("an edit is a new branch, and a tree exports and imports whole", async () => {
  const { context, page, problems } = await visit(gateway);
  await signIn(gateway, page, "/loom", gateway.keys.carol);
  await newTree(page, "Dear diary,");
  await generate(page, 3);
  await page.keyboard.press("ArrowRight");
  const story = await page.textContent("#story");

  // Edit the selected child: the edit is saved as its sibling, the original stays.
  await page.keyboard.press("e");
  await page.fill("#edit-text", " today the sea was calm.");
  await page.click("#edit-save");
  await page.waitForFunction(() => document.querySelector("#story").textContent === "Dear diary, today the sea was calm.");
  await page.keyboard.press("ArrowLeft");
  assert.equal(await childCards(page).count(), 4, "three samples and the edit beside them");
  assert.ok((await page.textContent("#children")).includes(story.slice("Dear diary,".length)), "the original is kept");

  // Rename the tree (the browser's prompt dialog).
  page.once("dialog", (dialog) => dialog.accept("My diary"));
  await page.click("#rename");
  await page.waitForFunction(() => document.querySelector("#tree-select option:checked").textContent === "My diary");

  // Export, then import the file: a second tree with the same nodes.
  const [download] = await Promise.all([page.waitForEvent("download"), page.click("#export")]);
  await page.setInputFiles("#import", await download.path());
  await page.waitForFunction(() => document.querySelectorAll("#tree-select option").length === 2);
  assert.notEqual(await page.inputValue("#tree-select"), "", "the imported tree is open");
  assert.equal(await page.locator("#tree .node").count(), 5, "root, three children and the edit");
  assert.deepEqual(await page.locator("#tree-select option").allTextContents(), ["My diary", "My diary"]);
  await context.close();
  assert.deepEqual(problems, []);
});

test("two tabs growing one tree lose no node, and a stale change is refused", async () => {
  const { context, page: one, problems } = await visit(gateway);
  await signIn(gateway, one, "/loom", gateway.keys.dave);
  await newTree(one, "Two tabs:");
  // A second tab of the same browser opens the same tree.
  const two = await context.newPage();
  await signIn(gateway, two, "/loom", gateway.keys.dave);
  await two.waitForFunction(() => document.querySelector("#story")?.textContent === "Two tabs:");
  await two.locator("#story").click();

  await generate(one, 3);
  await generate(two, 3);
  for (const tab of [one, two]) {
    await tab.reload();
    await tab.waitForFunction(() => document.querySelectorAll("#children .child[data-node]").length === 6);
    await tab.locator("#story").click();
  }

  // Both select the first child; the first tab bookmarks it, then the second, which
  // still holds the old version, is refused and shows the tree as it is now.
  await one.keyboard.press("ArrowRight");
  await two.keyboard.press("ArrowRight");
  await one.keyboard.press("b");
  await one.waitForSelector("#bookmarks li[data-node]");
  await two.keyboard.press("b");
  await two.waitForSelector("#problem .error");
  assert.match(await two.textContent("#problem .error"), /^version_conflict: .*changed elsewhere/);
  await two.waitForFunction(() => document.querySelectorAll("#bookmarks li[data-node]").length === 1);
  assert.match(await two.textContent("#tree .node.current"), /^★ /, "the first tab's bookmark stands");
  await context.close();
  assert.deepEqual(problems, []);
});
