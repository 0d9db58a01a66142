#!/usr/bin/env node
// ragline-ask-http: the same question over the gateway's OpenAI-compatible HTTP API, with
// nothing but Node's own fetch (no gRPC, no packages). Streams the answer's events, prints
// the answer (or why there is none), its sources and its state.
//
//   node ask-http.js [--url http://127.0.0.1:50180] [--tenant default | --token JWT] \
//                    [--timeout-s 60] "Which river flows through Warsaw?"
'use strict';

function parse(argv) {
  const options = {
    url: process.env.RAGLINE_GATEWAY_URL || 'http://127.0.0.1:50180',
    tenant: 'default', token: process.env.RAGLINE_TOKEN || '', timeoutS: 60, question: null,
  };
  for (let i = 0; i < argv.length; i += 1) {
    const arg = argv[i];
    if (arg === '--url') options.url = argv[++i];
    else if (arg === '--tenant') options.tenant = argv[++i];
    else if (arg === '--token') options.token = argv[++i];
    else if (arg === '--timeout-s') options.timeoutS = Number(argv[++i]);
    else options.question = arg;
  }
  return options;
}

// The data payloads of a server-sent event stream, as they arrive.
async function* events(body) {
  const decoder = new TextDecoder();
  let buffered = '';
  for await (const piece of body) {
    buffered += decoder.decode(piece, { stream: true });
    let end;
    while ((end = buffered.indexOf('\n\n')) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split('\n')) {
        if (line.startsWith('data: ')) yield line.slice(6);
      }
    }
  }
}

async function main() {
  const options = parse(process.argv.slice(2));
  if (!options.question) {
    console.error('usage: ask-http.js [--url URL] [--tenant T | --token JWT] "question"');
    process.exit(2);
  }
  const headers = {
    'Content-Type': 'application/json',
    'X-Ragline-Timeout': String(options.timeoutS),
    'X-Ragline-Tenant': options.tenant,
  };
  if (options.token) headers.Authorization = `Bearer ${options.token}`;
  const reply = await fetch(`${options.url}/v1/chat/completions`, {
    method: 'POST',
    headers,
    body: JSON.stringify({
      model: 'ragline',
      stream: true,
      messages: [{ role: 'user', content: options.question }],
    }),
    // The caller's own limit: a closed connection cancels the answer on the server.
    signal: AbortSignal.timeout(options.timeoutS * 1000 + 5000),
  });
  if (!reply.ok) {
    // OpenAI's error object, with ragline's reason as `code` (QUEUE_FULL, ...).
    console.error(JSON.stringify({ status: reply.status, ...(await reply.json()) }));
    process.exit(1);
  }
  let content = '';
  let refusal = '';
  let extension = null;
  for await (const data of events(reply.body)) {
    if (data === '[DONE]') break;
    const chunk = JSON.parse(data);
    if (chunk.error) {
      console.error(JSON.stringify(chunk));
      process.exit(1);
    }
    const delta = (chunk.choices[0] || {}).delta || {};
    content += delta.content || '';
    refusal += delta.refusal || '';
    if (chunk.ragline && chunk.ragline.state) extension = chunk.ragline;
  }
  console.log(content || `(no answer) ${refusal}`);
  console.log(`state: ${extension.state}${extension.reason ? ` (${extension.reason})` : ''}`);
  process.exit(content ? 0 : 3);
}

main().catch((error) => {
  console.error(String(error));
  process.exit(1);
});
