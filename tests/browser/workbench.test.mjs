// The Workbench in a real browser: a streamed run with every token coloured by its
// probability and its alternatives on hover, continuing from an alternative, the
// prompt's surprisal, saving a run, and a run the budget would clamp refused.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { join } from "node:path";
import { startGateway, visit, signIn, SCREENSHOTS } from "./harness.mjs";

let gateway;
before(async () => { gateway = await startGateway(); });
after(async () => { await gateway?.stop(); });

const PROMPT = "The old map showed a path through the forest, and";

async function runAndWait(page) {
  await page.click("#run");
  await page.waitForSelector("#stats b");
  await page.waitForFunction(() => !document.querySelector("#run").disabled);
}

test("run, see coloured tokens and their alternatives, continue from one, save", async () => {
  const { context, page, problems } = await visit(gateway);
  await signIn(gateway, page, "/workbench", gateway.keys.alice);
  assert.equal(await page.inputValue("#model"), "llama-8b", "the models come from /v1/models");
  assert.equal(await page.getAttribute("#temperature-slider", "max"), "5");
  assert.equal(await page.getAttribute("#temperature", "max"), "100");

  await page.fill("#prompt", PROMPT);
  await page.fill("#max_tokens", "24");
  await runAndWait(page);
  const tokens = page.locator("#outputs .tok");
  assert.equal(await tokens.count(), 24, "one span per generated token");
  for (const i of [0, 11, 23]) {
    const p = Number(await tokens.nth(i).getAttribute("data-p"));
    assert.ok(p > 0 && p <= 1, `token ${i} has a probability (${p})`);
  }
  assert.match(await page.textContent("#stats"), /24 completion tokens/);

  // Hover the fourth token: its alternatives. Click one that was not chosen.
  await tokens.nth(3).hover();
  await page.waitForSelector(".popover .alt:not(.chosen)");
  await page.screenshot({ path: join(SCREENSHOTS, "workbench.png") });
  const before = (await tokens.allTextContents()).slice(0, 3).join("");
  const alternative = page.locator(".popover .alt:not(.chosen)").first();
  const altText = JSON.parse(await alternative.locator("span").first().textContent());
  await alternative.click();
  assert.equal(await page.inputValue("#prompt"), PROMPT + before + altText, "the prompt continues from the alternative");
  await page.waitForFunction(() => !document.querySelector("#run").disabled && document.querySelectorAll("#outputs .tok").length === 24);
  assert.ok((await page.textContent("#outputs .prompt")).endsWith(altText));

  // The prompt's surprisal: each prompt token but the first scored.
  await page.click("#score");
  await page.waitForSelector("#surprisal .tok");
  assert.match(await page.textContent("#outputs .hint"), /bits over \d+ tokens/);
  assert.ok(await page.locator("#surprisal .tok[data-p]").count() >= 5);

  // The run is a checkpoint until saved; saved, it is listed as a run.
  await runAndWait(page);
  await page.waitForFunction(() => document.querySelector("#saved-note").textContent.includes("checkpoint"));
  assert.match(await page.textContent("#saved"), /checkpoint · 7 d left/);
  await page.fill("#title", "forest path");
  await page.click("#save");
  await page.waitForFunction(() => document.querySelector("#saved").textContent.includes("forest path"));
  assert.equal(await page.textContent("#saved-note"), "Saved.");
  assert.equal(await page.textContent("#saved li:first-child .tag"), "run×", "saved: no longer a checkpoint");
  // Saved items stay until deleted.
  const listed = await page.locator("#saved li").count();
  await page.click("#saved li:first-child .remove");
  await page.waitForFunction((n) => document.querySelectorAll("#saved li").length === n - 1, listed);
  assert.ok(!(await page.textContent("#saved")).includes("forest path"));
  await context.close();
  assert.deepEqual(problems, [], "no script errors");
});

test("a run the budget would clamp is refused with its message and request id", async () => {
  const { context, page } = await visit(gateway);
  await signIn(gateway, page, "/workbench", gateway.keys.frugal);
  await page.fill("#max_tokens", "500");
  await page.click("#run");
  await page.waitForSelector("#problem .error");
  const shown = await page.textContent("#problem .error");
  assert.match(shown, /^budget_exceeded: .*has 120 left.*this request needs/);
  assert.match(shown, /request id req_/);
  assert.equal(await page.locator("#outputs .tok").count(), 0);
  // An invalid value is the API's own 400, shown the same way.
  await page.fill("#max_tokens", "10");
  await page.fill("#temperature", "200");
  await page.click("#run");
  await page.waitForFunction(() => document.querySelector("#problem").textContent.startsWith("invalid_request"));
  assert.match(await page.textContent("#problem"), /temperature/);
  await context.close();
});
