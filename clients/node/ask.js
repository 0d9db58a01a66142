#!/usr/bin/env node
// ragline-ask: asks the orchestrator a question, prints the answer as it streams, then the
// citations, the status and the budget used. On failure prints the error details as JSON
// on stderr (code, reason, field violations, retry delay) and exits 1.
//
//   node ask.js [--addr 127.0.0.1:50100] [--tenant default | --token JWT] \
//               [--deadline-ms 60000] [--json] "Which river flows through Warsaw?"
'use strict';

const { orchestrator, metadataFor, errorDetails } = require('./ragline');

function parse(argv) {
  const options = {
    addr: process.env.RAGLINE_ORCHESTRATOR_ADDR || '127.0.0.1:50100',
    tenant: 'default', token: process.env.RAGLINE_TOKEN || '', deadlineMs: 60000,
    json: false, question: null, maxTokens: 0,
  };
  for (let i = 0; i < argv.length; i += 1) {
    const arg = argv[i];
    if (arg === '--addr') options.addr = argv[++i];
    else if (arg === '--tenant') options.tenant = argv[++i];
    else if (arg === '--token') options.token = argv[++i];
    else if (arg === '--deadline-ms') options.deadlineMs = Number(argv[++i]);
    else if (arg === '--max-tokens') options.maxTokens = Number(argv[++i]);
    else if (arg === '--json') options.json = true;
    else options.question = arg;
  }
  return options;
}

function main() {
  const options = parse(process.argv.slice(2));
  if (options.question === null) {
    process.stderr.write('usage: ask.js [--addr HOST:PORT] [--tenant T | --token JWT] QUESTION\n');
    process.exit(2);
  }
  const client = orchestrator(options.addr);
  // Always a deadline: the server stops every step of the plan when it passes.
  const call = client.Ask(
    { question: options.question, max_tokens: options.maxTokens },
    metadataFor({ token: options.token, tenant: options.tenant }),
    { deadline: new Date(Date.now() + options.deadlineMs) },
  );
  let result = null;
  call.on('data', (message) => {
    if (message.event === 'delta' && !options.json) process.stdout.write(message.delta);
    if (message.event === 'result') result = message.result;
  });
  call.on('error', (error) => {
    process.stderr.write(`${JSON.stringify({ error: errorDetails(error) })}\n`);
    process.exitCode = 1;
  });
  call.on('end', () => {
    if (result === null) return;
    if (options.json) {
      process.stdout.write(`${JSON.stringify(result)}\n`);
      return;
    }
    process.stdout.write('\n\n');
    for (const citation of result.citations) {
      process.stdout.write(`[${citation.marker}] ${citation.document_id} ${citation.title}: `
        + `${citation.snippet}\n`);
    }
    const used = result.budget && result.budget.used ? result.budget.used : {};
    process.stdout.write(`\nstatus: ${result.status.state} ${result.status.reason}\n`);
    process.stdout.write(`budget used: ${JSON.stringify(used)}\n`);
  });
}

main();
