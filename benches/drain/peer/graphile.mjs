// The graphile-worker peer of the drain benchmark (benches/drain/peer.rs runs
// it). Each job makes the same instant call to the mock provider that a onejob
// attempt makes, and keeps the answer in a Postgres table, `peer_results`,
// which the benchmark reads. Tuned as graphile-worker's performance page
// advises: 24 concurrent jobs, a pool of 25, a local queue of 500, and job
// completions batched (delay 0).
//
//   node graphile.mjs migrate   install graphile-worker's schema
//   node graphile.mjs work      run the worker until SIGTERM
//
// DATABASE_URL names the database, PROVIDER_URL the provider's base URL.
import { run, runMigrations } from "graphile-worker";

const connectionString = process.env.DATABASE_URL;
const provider = process.env.PROVIDER_URL;
const preset = {
  worker: {
    connectionString,
    concurrentJobs: 24,
    maxPoolSize: 25,
    localQueue: { size: 500 },
    completeJobBatchDelay: 0,
    failJobBatchDelay: 0,
    pollInterval: 2000,
  },
};

async function call(payload, helpers) {
  const response = await fetch(`${provider}/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json", "idempotency-key": payload.key },
    body: JSON.stringify({
      model: "mock",
      messages: [{ role: "user", content: `Summarize: ${payload.text}` }],
    }),
  });
  if (!response.ok) {
    throw new Error(`provider answered HTTP ${response.status}`);
  }
  const answer = await response.json();
  await helpers.query(
    "INSERT INTO peer_results (key, result) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING",
    [payload.key, answer],
  );
}

const mode = process.argv[2];
if (mode === "migrate") {
  await runMigrations({ preset });
} else if (mode === "work") {
  const runner = await run({ preset, taskList: { call } });
  await runner.promise;
} else {
  console.error("usage: node graphile.mjs migrate|work");
  process.exit(2);
}
