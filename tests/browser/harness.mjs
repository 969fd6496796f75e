// Starts what the browser tests run against — mock-vllm and a real fleetgate (the built
// binaries, on port 0, their addresses read from what they print) with keys made by
// `fleetgate keys create` — and Debian's chromium through playwright-core (never a
// downloaded browser). Binaries come from BROWSER_BIN_DIR, else
// $CARGO_TARGET_DIR/debug, else target/debug.
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, writeFileSync, rmSync, mkdirSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
const BIN_DIR = process.env.BROWSER_BIN_DIR
  || join(process.env.CARGO_TARGET_DIR ? resolve(ROOT, process.env.CARGO_TARGET_DIR) : join(ROOT, "target"), "debug");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
/** Where the screenshots for the README go. */
export const SCREENSHOTS = join(ROOT, "docs", "screenshots");
const STARTUP_MS = 30_000;

/** Resolves with the first match of `pattern` in the lines `stream` prints. */
function waitForLine(stream, pattern, what) {
  return new Promise((resolveLine, reject) => {
    let buffered = "";
    const timer = setTimeout(() => reject(new Error(`${what} did not report its address`)), STARTUP_MS);
    stream.setEncoding("utf8");
    stream.on("data", (chunk) => {
      buffered += chunk;
      const match = buffered.match(pattern);
      if (match) {
        clearTimeout(timer);
        resolveLine(match);
      }
    });
  });
}

export async function startGateway() {
  for (const bin of ["mock-vllm", "fleetgate"]) {
    if (!existsSync(join(BIN_DIR, bin))) {
      throw new Error(`${join(BIN_DIR, bin)} is missing: run \`cargo build --bins\` first (BROWSER_BIN_DIR or CARGO_TARGET_DIR say where the binaries are)`);
    }
  }
  const dir = mkdtempSync(join(tmpdir(), "fleetgate-browser-"));
  const mock = spawn(join(BIN_DIR, "mock-vllm"), ["--listen", "127.0.0.1:0"], { stdio: ["ignore", "pipe", "inherit"] });
  const mockUrl = (await waitForLine(mock.stdout, /listening on (http:\/\/\S+)/, "mock-vllm"))[1];
  const config = join(dir, "fleetgate.toml");
  writeFileSync(config, [
    'listen = "127.0.0.1:0"',
    `database_url = "sqlite://${dir}/fleetgate.db"`,
    "[[models]]", 'id = "llama-8b"', "default = true",
    "[[models.upstreams]]", `url = "${mockUrl}"`, 'gpu = "gpu-a"', "",
  ].join("\n"));
  const fleetgate = join(BIN_DIR, "fleetgate");
  const createKey = (name, ...limits) => execFileSync(fleetgate, ["keys", "create", "--name", name, "--config", config, ...limits], { encoding: "utf8" })
    .trim().split("\n").pop();
  const keys = {
    alice: createKey("alice"),
    bob: createKey("bob"),
    carol: createKey("carol"),
    dave: createKey("dave"),
    // Enough for a short run, never for 4 × 100 tokens.
    frugal: createKey("frugal", "--monthly-budget", "120"),
  };
  const server = spawn(fleetgate, ["serve", "--config", config], { stdio: ["ignore", "ignore", "pipe"] });
  const address = (await waitForLine(server.stderr, /fleetgate listening.*?address=(\S+)/, "fleetgate"))[1];
  server.stderr.resume();
  const browser = await chromium.launch({ executablePath: CHROMIUM, args: ["--no-sandbox"] });
  mkdirSync(SCREENSHOTS, { recursive: true });
  return {
    url: `http://${address}`,
    keys,
    browser,
    async stop() {
      await browser.close();
      for (const proc of [server, mock]) {
        proc.kill("SIGTERM");
        await new Promise((done) => (proc.exitCode !== null ? done() : proc.once("exit", done)));
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A fresh browser context (no session or local storage: a new visit) and its page. */
export async function visit(gateway) {
  const context = await gateway.browser.newContext({ viewport: { width: 1360, height: 860 } });
  const page = await context.newPage();
  const problems = [];
  page.on("pageerror", (err) => problems.push(String(err)));
  page.on("console", (message) => { if (message.type() === "error") problems.push(message.text()); });
  return { context, page, problems };
}

/**
 * Opens `path` and signs in with `key`; resolves once the page shows the key's budget
 * and has loaded its models and saved work.
 */
export async function signIn(gateway, page, path, key) {
  await page.goto(gateway.url + path);
  await page.fill("#api-key", key);
  await page.click("#sign-in button[type=submit]");
  await page.waitForSelector("#budget");
  await page.waitForSelector("body[data-ready]", { state: "attached" });
}
