#!/usr/bin/env node
// Calls any unary ragline RPC with a JSON request and prints the reply, or the error's
// details (code, reason, field violations, retry delay) as JSON on stderr, exit 1.
//
//   node call.js --addr 127.0.0.1:50102 --tenant acme RetrievalService Search '{"query": "Warsaw", "k": 3}'
'use strict';

const { loadRagline, metadataFor, errorDetails, grpc } = require('./ragline');

const args = process.argv.slice(2);
const options = { addr: '127.0.0.1:50100', tenant: 'default', token: process.env.RAGLINE_TOKEN || '' };
const positional = [];
for (let i = 0; i < args.length; i += 1) {
  if (args[i] === '--addr') options.addr = args[++i];
  else if (args[i] === '--tenant') options.tenant = args[++i];
  else if (args[i] === '--token') options.token = args[++i];
  else positional.push(args[i]);
}
const [service, method, body = '{}'] = positional;
const v1 = loadRagline();
if (!v1[service]) {
  process.stderr.write(`unknown service ${service}\n`);
  process.exit(2);
}
const client = new v1[service](options.addr, grpc.credentials.createInsecure());
client[method](
  JSON.parse(body),
  metadataFor({ token: options.token, tenant: options.tenant }),
  { deadline: new Date(Date.now() + 30000) },
  (error, reply) => {
    if (error) {
      process.stderr.write(`${JSON.stringify({ error: errorDetails(error) })}\n`);
      process.exitCode = 1;
      return;
    }
    process.stdout.write(`${JSON.stringify(reply)}\n`);
  },
);
